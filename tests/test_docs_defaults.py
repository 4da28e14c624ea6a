"""What the docs say about defaults (remat, attention, MFU on GPU and CPU) is what the code does."""

import ast
import dataclasses
import os
import re

import pytest

from big_vit_lite.runtime import flops
from big_vit_lite.logs import metrics
from big_vit_lite.models import ops
from big_vit_lite.models import vit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _doc(name):
  with open(os.path.join(ROOT, name)) as f:
    return " ".join(f.read().split())  # Lines joined: statements wrap.


def _default(field):
  return {f.name: f.default for f in dataclasses.fields(vit.Model)}[field]


# (file, its statement about the remat default, the default captured)
REMAT_STATEMENTS = (
    ("docs/models.md", r"`remat_policy`: `(\w+)` \(default"),
    ("docs/gpu.md", r"Remat is off by default \(`remat_policy=(\w+)`\)"),
    ("docs/performance.md", r"off by default \(`remat_policy=(\w+)`\)"),
)


@pytest.mark.parametrize("doc,pattern", REMAT_STATEMENTS)
def test_docs_name_the_remat_default_of_the_code(doc, pattern):
  """Guards against a doc that names another remat default than vit.Model's (docs/gpu.md
  said `nothing_saveable` while the code and docs/models.md said None)."""
  said = re.findall(pattern, _doc(doc))
  assert said, f"{doc} no longer says the remat default: update this test"
  assert set(said) == {str(_default("remat_policy"))}, (doc, said)
  # No doc calls another policy the default.
  for name in ("docs/models.md", "docs/gpu.md", "docs/performance.md"):
    assert not re.search(r"default remat \(`nothing_saveable`", _doc(name))


def test_docs_describe_the_attention_default_of_the_code():
  """Guards against docs that say cuDNN refuses ViT's 197 tokens, or name another attention
  default, while "auto" runs cuDNN with the tokens padded on an NVIDIA GPU."""
  models, gpu = _doc("docs/models.md"), _doc("docs/gpu.md")
  assert '`attention`: `"auto"` (default)' in models
  assert _default("attention") == "auto"
  b16 = vit.Model(variant="B/16", num_classes=10, dtype_mm="bfloat16")
  # "auto": cuDNN on an NVIDIA GPU with bf16 matmuls, xla on a TPU, custom on CPU.
  assert "runs cuDNN flash attention on an NVIDIA GPU with bf16/fp16" in models
  assert b16.resolved_attention("gpu") == "cudnn"
  assert '`"xla"` on a TPU' in models and b16.resolved_attention("tpu") == "xla"
  assert '`"custom"` elsewhere' in models
  assert b16.resolved_attention("cpu") == "custom"
  # 197 tokens padded to the next multiple the code pads to.
  padded = 197 + (-197 % ops.CUDNN_SEQ_MULTIPLE)
  assert (
      f"padded to a multiple of {ops.CUDNN_SEQ_MULTIPLE} (197 -> {padded}"
      in (models)
  )
  assert f"197 tokens padded to {padded}" in gpu
  assert '`attention="auto"` (the default) runs cuDNN' in gpu
  assert "refuses ViT's 197 tokens" not in gpu


def test_docs_say_which_mfu_a_gpu_run_logs():
  """Guards against docs that call the 0.018 GPU reading the trainer's `mfu`: it was XLA's
  cost analysis (`mfu_xla`), which the trainer drops where it is below the model FLOPs.
  """
  gpu, perf = _doc("docs/gpu.md"), _doc("docs/performance.md")
  # The B/16 reading: 0.018 from XLA's count against 0.256 from the model's.
  assert "it read 0.018 for B/16" in gpu and "logs no `mfu_xla` on a GPU" in gpu
  assert "it read 0.018 for a true 0.256" in perf
  assert "a GPU run logs `mfu` only" in perf
  model = 1e12
  assert flops.sane_xla_flops(model * 0.018 / 0.256, model) is None
  # Where XLA counts the matmuls (CPU, TPU) it is kept.
  assert flops.sane_xla_flops(1.05 * model, model) == 1.05 * model
  assert (
      "The `mfu` that the trainer and bench log on a GPU reads low" not in gpu
  )


def test_docs_say_where_the_cpu_peak_is_kept():
  """Guards against docs describing the CPU peak as timed at each start (it is kept)."""
  perf = _doc("docs/performance.md")
  assert f"`{metrics.CPU_PEAK_FILE}`" in perf and "`$BVL_CPU_PEAK_FILE`" in perf
  assert f"{metrics.CPU_PEAK_REPS} calls each" in perf
  assert "timed when each attempt starts" not in _doc("README.md")
  assert "measured when each attempt starts" not in perf


def _extra(name):
  """The requirement names of setup.py's extra `name` (read without running setup.py)."""
  tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
  lists = {}
  for node in tree.body:
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
      lists[node.targets[0].id] = node.value

  def names(node):
    if isinstance(node, ast.BinOp):
      return names(node.left) + names(node.right)
    if isinstance(node, ast.Name):
      return names(lists[node.id])
    if isinstance(node, ast.Dict):
      return names(dict(zip([k.value for k in node.keys], node.values))[name])
    return [re.split(r"[\[<>=]", e.value)[0] for e in node.elts]

  return names(lists["EXTRAS"])


def test_readme_says_what_the_test_extra_installs():
  """Guards against the README listing packages under the test extra that only setup.sh
  installs (it said the extra adds torch and timm)."""
  readme = _doc("README.md")
  said = re.search(
      r"the test extra adds (.+?); `setup.sh` also installs", readme
  )
  assert said, "the README no longer says what the test extra adds"
  extra = set(_extra("test"))
  for package in ("pytest", "scikit-learn", "pyink", "matplotlib", "wandb"):
    assert package in said.group(1) and package in extra, package
  assert "libtpu" in said.group(1) and "jax" in extra  # jax[tpu]
  for package in ("torch", "timm"):
    assert package not in said.group(1) and package not in extra, package
