"""Real timm (PyTorch, CPU) as a test oracle for our timm exports; shared by the test files.

    import timm_reference
    logits = timm_reference.logits(path, images_nhwc)  # timm's VisionTransformer, strict load

scripts/setup.sh installs torch and timm in the test venv at the versions of
requirements/lock.txt (requirements/timm.txt says how). Where they are missing, a test
that asks for them is skipped, except in CI (CI=true), where it fails: there the parity
tests must run. timm imports torchvision, which a ViT never uses and whose PyPI wheels do
not load beside the CPU torch: benchmarks/timm_standin/ stands in where none is installed.
"""

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDIN = os.path.join(ROOT, "benchmarks", "timm_standin")


def require():
  """(timm, torch), imported; skips the test where they are missing (fails it in CI)."""
  missing = [
      name
      for name in ("torch", "timm")
      if importlib.util.find_spec(name) is None
  ]
  if missing:
    why = (
        f"{' and '.join(missing)} not installed in this venv: scripts/setup.sh installs "
        "them (requirements/timm.txt)"
    )
    if os.environ.get("CI", "").lower() == "true":
      pytest.fail(f"CI=true: {why}")
    pytest.skip(why)
  if (
      importlib.util.find_spec("torchvision") is None
      and STANDIN not in sys.path
  ):
    sys.path.append(STANDIN)
  import timm  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel

  return timm, torch


def load(path, timm_name=None):
  """timm's model for our export at `path`, its weights loaded with strict=True, in eval mode.

  The model is timm.create_model(timm_name) when given, else VisionTransformer built from the
  file's "timm_kwargs" metadata (what write_timm stores).
  """
  timm, _ = require()
  import safetensors  # pylint: disable=import-outside-toplevel
  import safetensors.torch  # pylint: disable=import-outside-toplevel

  with safetensors.safe_open(str(path), "np") as f:
    kwargs = json.loads(f.metadata()["timm_kwargs"])
  if timm_name:
    model = timm.create_model(
        timm_name, pretrained=False, num_classes=kwargs["num_classes"]
    )
  else:
    model = timm.models.vision_transformer.VisionTransformer(**kwargs)
  model.load_state_dict(safetensors.torch.load_file(str(path)), strict=True)
  return model.eval()


def logits(path, images, timm_name=None):
  """timm's logits (float32 numpy) for NHWC `images` (numpy or jax) through load(path)."""
  _, torch = require()
  model = load(path, timm_name)
  nchw = np.ascontiguousarray(
      np.asarray(images, np.float32).transpose(0, 3, 1, 2)
  )
  with torch.no_grad():
    return model(torch.from_numpy(nchw)).numpy()
