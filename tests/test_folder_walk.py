"""The README's image-folder layout, walked as a user would: every tool on one folder, unchanged."""

import json
import os
import stat
import subprocess
import sys

import numpy as np
from PIL import Image
import pytest

import forkserver
import trainer_runs

CLASSES = ("cat", "dog", "owl")


def _folder(root):
  """ROOT/{train,val}/CLASS/*.jpg: 3 classes of odd-sized RGB JPEGs (the README's layout)."""
  rng = np.random.default_rng(0)
  for split, n in (("train", 8), ("val", 3)):
    for k, c in enumerate(CLASSES):
      os.makedirs(os.path.join(root, split, c))
      for i in range(n):
        h, w = rng.integers(33, 71, size=2)
        # A class-coloured tint, so the classes differ.
        pixels = rng.integers(0, 120, (h, w, 3)) + 100 * np.eye(3)[k]
        Image.fromarray(pixels.astype(np.uint8)).save(
            os.path.join(root, split, c, f"{i}.jpg")
        )
  return root


def _run(data_dir, *args, umask=None):
  """`python -m ARGS` through the fork server; a real process where it sets a umask (a
  forked child has its zygote's)."""
  cmd = [sys.executable, "-m", *args]
  if umask is None:
    cmd = forkserver.command(cmd)
    preexec_fn = None
  else:
    preexec_fn = lambda: os.umask(umask)
  r = subprocess.run(
      cmd,
      env=trainer_runs.env_for(data_dir),
      cwd=trainer_runs.ROOT,
      capture_output=True,
      text=True,
      timeout=300,
      preexec_fn=preexec_fn,
  )
  assert r.returncode == 0, (args, r.stderr[-3000:])
  return r


@pytest.mark.slow
def test_readme_folder_layout_with_every_tool(tfds_data_dir, tmp_path):
  """Guards against a tool reading another split convention than the README's folder layout
  (train/ and val/: transfer, few-shot, linear probe and classify used to want test/), and
  against any step of a user's first day on their folder failing: train from scratch,
  fine-tune from that checkpoint, evaluate (classify), predict,
  export (readable by its owner's group as the umask says), report."""
  root = _folder(str(tmp_path / "my_images"))
  scratch, tuned = str(tmp_path / "scratch"), str(tmp_path / "tuned")
  _run(
      tfds_data_dir,
      "big_vit_lite.train",
      f"--config=configs/vit_b16.py:data=folder:{root},classes=3,runlocal",
      f"--workdir={scratch}",
  )
  rows = [json.loads(l) for l in open(os.path.join(scratch, "metrics.jsonl"))]
  assert any("minival/prec@1" in r for r in rows)  # Evaluated on ROOT/val.
  _run(
      tfds_data_dir,
      "big_vit_lite.train",
      f"--config=configs/transfer.py:init={scratch},folder={root},runlocal",
      f"--workdir={tuned}",
  )
  rows = [json.loads(l) for l in open(os.path.join(tuned, "metrics.jsonl"))]
  assert any("val/prec@1" in r for r in rows)
  # (configs/fewshot.py and linear_probe.py on this layout: test_split_convention.py.)
  r = _run(
      tfds_data_dir,
      "big_vit_lite.evaluate",
      f"--config=configs/classify.py:folder={root},res=32,channels=3",
      f"--workdir={tmp_path / 'classify'}",
      f"--config.model_init={tuned}",
  )
  classify_metrics = tmp_path / "classify" / "metrics.jsonl"
  rows = [json.loads(l) for l in open(classify_metrics)]
  assert any("classify/prec@1" in r for r in rows), r.stdout[-2000:]
  r = _run(
      tfds_data_dir,
      "big_vit_lite.predict",
      f"--model={tuned}",
      f"--images={root}/val",
      "--top_k=2",
  )
  predictions = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
  assert len(predictions) == 3 * len(CLASSES)
  assert {p["label"] for row in predictions for p in row["predictions"]} <= set(
      CLASSES
  )
  out = tmp_path / "my_vit.safetensors"
  _run(
      tfds_data_dir,
      "big_vit_lite.export",
      f"--src={tuned}",
      f"--out={out}",
      umask=0o022,
  )
  assert stat.S_IMODE(os.stat(out).st_mode) == 0o644
  _run(tfds_data_dir, "big_vit_lite.report", tuned)
  assert os.path.exists(os.path.join(tuned, "report", "report.html"))
