"""The training job checked whole before its first step (job_check.py), and `train --check`."""

import os
import subprocess
import sys

import numpy as np
from PIL import Image
import pytest

from big_vit_lite.trainer import job_check
from big_vit_lite.models import vit

import trainer_runs


def test_eval_images_against_the_model_name_the_keys_to_change():
  """Guards against an eval whose images differ from the model's input passing (the size
  or the channels) and against a message that does not name both pp keys."""
  job_check.check_eval_images("val", "x", (28, 28, 1), (28, 28, 1))
  with pytest.raises(ValueError) as e:
    job_check.check_eval_images("fewshot", "mnist10k", (28, 28, 1), (56, 56, 1))
  msg = str(e.value)
  assert "28x28x1" in msg and "56x56x1" in msg and "\n" not in msg
  assert "resize(56) in config.evals.fewshot.pp" in msg
  assert "resize(28) in config.input.pp" in msg
  with pytest.raises(
      ValueError, match=r"decode\(channels=3\) in config.evals.v.pp"
  ):
    job_check.check_eval_images("v", "x", (32, 32, 1), (32, 32, 3))


def test_head_bias_without_a_head_and_images_below_one_patch():
  """Guards against init_head_bias on a model with no head (a KeyError 'head' at init) and a
  train image smaller than one patch (no tokens) being accepted."""
  headless = vit.Model(num_classes=0, variant="mu/16")
  with pytest.raises(ValueError, match="init_head_bias=-10.0 .* no head"):
    job_check.check_head_bias(-10.0, headless)
  job_check.check_head_bias(None, headless)
  job_check.check_head_bias(-10.0, vit.Model(num_classes=3, variant="mu/16"))
  with pytest.raises(ValueError, match=r"5x5x3 images, smaller than one 7x7"):
    job_check.check_train_images((5, 5, 3), 7)
  job_check.check_train_images((7, 7, 3), 7)


def _folder(root, size, per_class):
  rng = np.random.default_rng(0)
  for split, n in (("train", per_class), ("val", 3)):
    for c in ("cat", "dog", "owl"):
      os.makedirs(os.path.join(root, split, c))
      for i in range(n):
        pixels = rng.integers(0, 255, (size, size), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, split, c, f"{i}.png"))
  return root


def _demo_on_folder(root):
  return [
      "--config.input.data.name=imagefolder",
      f"--config.input.data.data_dir={root}",
      "--config.evals.val.data.name=imagefolder",
      f"--config.evals.val.data.data_dir={root}",
      "--config.evals.val.data.split=val",
      "--config.input.batch_size=8",
      "--config.evals.val.batch_size=8",
  ]


@pytest.mark.slow
def test_demo_on_56px_folder_stops_before_training_in_one_line(
    tfds_data_dir, tmp_path
):
  """The issue's case: the demo config on a folder of 56-px images (its pp does not resize)
  against its 28-px few-shot evals. Guards against the mismatch being found only in the
  eval after training (a 40-line ScopeParamShapeError) instead of before the first step.
  """
  root = _folder(str(tmp_path / "f56"), 56, 12)
  workdir = tmp_path / "wd"
  r = trainer_runs.run_train(
      tfds_data_dir,
      str(workdir),
      *_demo_on_folder(root),
      config="configs/demo.py:runlocal",
  )
  assert r.returncode == 1, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith(
      "big_vit_lite.train: error: config.evals.fewshot ("
  ), last
  assert "resize(56) in config.evals.fewshot.pp" in last
  assert "Traceback" not in r.stderr
  # Before the first step: nothing trained, nothing saved.
  assert not (workdir / "metrics.jsonl").exists() or not any(
      '"training_loss"' in l for l in open(workdir / "metrics.jsonl")
  )
  assert not [p for p in os.listdir(workdir) if p.isdigit()]


@pytest.mark.slow
def test_check_flag_compiles_and_says_ok_without_training(
    tfds_data_dir, tmp_path
):
  """`train --check`: guards against the flag training or saving (no workdir is given: a
  throwaway one), or skipping the compile."""
  env = trainer_runs.env_for(tfds_data_dir)
  cmd = [
      sys.executable,
      "-m",
      "big_vit_lite.train",
      "--config=configs/demo.py:runlocal",
      "--check",
  ]
  r = subprocess.run(
      cmd,
      env=env,
      cwd=trainer_runs.ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  ok = r.stdout.strip().splitlines()[-1]
  assert ok.startswith(
      "ok: train batch 32 x 28x28x1 images, 10 classes, 6 steps"
  )
  assert "fewshot 28x28x1" in ok and "val 28x28x1" in ok
  assert "Train step:" in r.stderr  # The compile ran.
