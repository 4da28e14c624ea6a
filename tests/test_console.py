"""The trainer's console log, read from a real trainer process: each line once, no noise."""

import json
import os
import re

import numpy as np
import pytest

from big_vit_lite.logs import console
import trainer_runs

# What the log must not show: TensorFlow's C++ start-up lines, clu's raw writer
# line, other libraries' INFO lines.
NOISE = (
    "oneDNN",
    "absl::InitializeLog",
    "DT_UINT8",
    "logging_writer.py",
    "dataset_info.py",
    "xla_bridge.py",
    "| Name",
)


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_progress_averages_the_losses_of_the_interval():
  progress = console.Progress(every_s=0.0)
  assert not progress.due()  # Nothing before the first step.
  losses = [2.0, 1.0, 4.0, 3.0, 5.0]
  for loss in losses[:2]:
    progress.add(np.float32(loss))
  assert progress.due()
  assert progress.line_mean() == pytest.approx(np.mean(losses[:2]))
  for loss in losses[2:]:
    progress.add(np.float32(loss))
  # The logged mean covers the whole interval, the printed line's part included.
  assert progress.logged_mean() == pytest.approx(np.mean(losses))
  progress.add(np.float32(7.0))
  # (And starts again after a logged step.)
  assert progress.logged_mean() == 7.0


def test_progress_is_not_due_before_its_time():
  progress = console.Progress(every_s=3600.0)
  progress.add(np.float32(1.0))
  assert not progress.due()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_log_shows_each_line_once_and_no_noise(tfds_data_dir, tmp_path):
  every, log = trainer_runs.tiny_run(tfds_data_dir)
  for noise in NOISE:
    assert noise not in log, noise
  assert "==== big_vit_lite.train: " in log and f"workdir: {every}" in log
  assert "params: " in log and os.path.exists(
      os.path.join(every, console.PARAMS_FILE)
  )
  # log_training_steps=1: every step once, clu's line gone.
  for step in range(1, 13):
    assert len(re.findall(rf"\[{step}/12\] loss_avg=", log)) == 1, step
    # (clu's LoggingWriter wrote "[step] key=value".)
    assert f"] {step} " not in log
  saved = sorted(
      int(s)
      for s in os.listdir(os.path.join(every, "checkpoints"))
      if s.isdigit()
  )
  # ckpt_steps=4; keep_ckpts may have deleted some since.
  for step in (4, 8, 12):
    assert len(re.findall(rf"Saved checkpoint step {step}: ", log)) == 1, step
  assert saved and saved[-1] == 12
  assert log.count("==== Summary: train finished") == 1
  # training_loss_avg over an interval of 4 steps: the mean of the 4 per-step
  # losses.
  sparse = str(tmp_path / "sparse")
  p = trainer_runs.run_train(
      tfds_data_dir, sparse, "--config.log_training_steps=4"
  )
  assert p.returncode == 0, p.stderr[-3000:]
  per_step = trainer_runs.read_losses(every)
  avg = {
      r["step"]: r["training_loss_avg"]
      for r in _rows(sparse)
      if "training_loss_avg" in r
  }
  assert sorted(avg) == [4, 8, 12]
  for step, value in avg.items():
    expected = np.mean(
        [per_step[s] for s in range(step - 3, step + 1)], dtype=np.float64
    )
    assert value == pytest.approx(expected, rel=1e-6), step
  assert all(
      r["training_loss"] == per_step[r["step"]]
      for r in _rows(sparse)
      if "training_loss" in r
  )  # The existing key keeps its value.


@pytest.mark.timeout(300)
def test_an_error_is_said_once(tfds_data_dir, tmp_path):
  p = trainer_runs.run_train(
      tfds_data_dir, str(tmp_path / "w"), "--config.loss=nope"
  )
  assert p.returncode == 1
  assert p.stderr.count("Unknown loss 'nope'") == 1, p.stderr[-3000:]
  assert (
      p.stderr.strip()
      .splitlines()[-1]
      .startswith("big_vit_lite.train: error: Unknown loss")
  )
