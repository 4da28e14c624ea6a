"""End-to-end trainer behaviour: exact resume after SIGKILL, SIGTERM, NaN guard, config errors.

Real subprocesses of `python -m big_vit_lite.train` on a tiny ViT
(tests/train_config_tiny.py) over the offline Fashion-MNIST.
"""
import os
import signal

import numpy as np
import pytest

from big_vit_lite import checkpoint
from trainer_runs import (TINY, assert_same_params, last_logged_step, read_losses,
                          run_train, start_train, wait_for_step)

STEPS = 300  # Long enough (a few seconds of steps) to interrupt mid-run.


@pytest.fixture(scope="module")
def reference_run(tfds_data_dir, tmp_path_factory):
  """An uninterrupted run of STEPS steps."""
  workdir = str(tmp_path_factory.mktemp("reference"))
  r = run_train(tfds_data_dir, workdir, f"--config.total_steps={STEPS}", "--config.ckpt_steps=40")
  assert r.returncode == 0, r.stderr[-3000:]
  losses = read_losses(workdir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  return workdir, losses


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_anywhere_then_restart_is_bit_identical(reference_run, tfds_data_dir, tmp_path):
  ref_dir, ref_losses = reference_run
  workdir = str(tmp_path / "killed")
  args = (f"--config.total_steps={STEPS}", "--config.ckpt_steps=40")
  # Kill twice at different points (mid-interval, and right after a checkpoint
  # step, when an async save is likely in flight), then let it finish.
  for kill_after in (100, 161):
    proc = start_train(tfds_data_dir, workdir, *args)
    wait_for_step(proc, workdir, kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
  r = run_train(tfds_data_dir, workdir, *args)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Resuming from" in r.stderr
  losses = read_losses(workdir)
  assert sorted(losses) == sorted(ref_losses)  # Each step logged exactly once.
  assert losses == ref_losses  # Bit for bit (JSON floats round-trip exactly).
  assert_same_params(ref_dir, workdir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_saves_and_exits_zero_then_resumes(reference_run, tfds_data_dir, tmp_path):
  ref_dir, ref_losses = reference_run
  workdir = str(tmp_path / "preempted")
  args = (f"--config.total_steps={STEPS}", "--config.ckpt_steps=1000")  # No periodic saves.
  proc = start_train(tfds_data_dir, workdir, *args)
  wait_for_step(proc, workdir, 60)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  saved = checkpoint.Checkpointer(workdir).all_steps()
  assert len(saved) == 1 and 60 <= saved[0] < STEPS, saved
  assert last_logged_step(workdir) == saved[0]
  r = run_train(tfds_data_dir, workdir, *args)
  assert r.returncode == 0, r.stderr[-3000:]
  assert read_losses(workdir) == ref_losses
  assert_same_params(ref_dir, workdir)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nonfinite_loss_stops_with_message_and_keeps_good_checkpoint(tfds_data_dir, tmp_path):
  workdir = str(tmp_path / "nan")
  # An absurd learning rate blows the params up after the first update.
  r = run_train(tfds_data_dir, workdir, "--config.lr=3e38", "--config.grad_clip_norm=0",
           "--config.ckpt_steps=1", "--config.total_steps=30")
  assert r.returncode == 1
  last = r.stderr.strip().splitlines()[-1]
  assert "Non-finite training loss" in last and "at step" in last, last
  bad_step = int(last.split("at step ")[1].split(";")[0])
  steps = checkpoint.Checkpointer(workdir).all_steps()
  assert steps and max(steps) < bad_step
  params, config = checkpoint.load_params(workdir)  # The last good checkpoint is readable.
  assert config.total_steps == 30 and "head" in params


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_unread_config_key_is_a_one_line_error(tfds_data_dir, tmp_path):
  cfg_file = tmp_path / "typo_config.py"
  cfg_file.write_text(
      "import importlib.util, sys\n"
      f"spec = importlib.util.spec_from_file_location('tiny', {TINY!r})\n"
      "tiny = importlib.util.module_from_spec(spec); spec.loader.exec_module(tiny)\n"
      "def get_config(arg=None):\n"
      "  c = tiny.get_config(arg)\n"
      "  c.schedule.warmup_step = 5  # typo of warmup_steps\n"
      "  return c\n")
  r = run_train(tfds_data_dir, str(tmp_path / "w"), config=str(cfg_file))
  assert r.returncode == 1
  last = r.stderr.strip().splitlines()[-1]
  assert "'schedule.warmup_step'" in last and "nothing reads it" in last, last
  assert "did you mean 'schedule.warmup_steps'?" in last, last
  assert not os.path.exists(tmp_path / "w" / "checkpoints" / "12")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_model_init_from_another_run_with_dont_load(reference_run, tfds_data_dir, tmp_path):
  ref_dir, _ = reference_run
  workdir = str(tmp_path / "init")
  # lr=0 and wd=0: the final params are exactly the initial ones.
  r = run_train(tfds_data_dir, workdir, "--config.lr=0", "--config.wd=0", "--config.total_steps=2",
                config=f"{TINY}:init={ref_dir}")
  assert r.returncode == 0, r.stderr[-3000:]
  src, _ = checkpoint.load_params(ref_dir)
  got, _ = checkpoint.load_params(workdir)
  np.testing.assert_array_equal(got["embedding"]["kernel"], src["embedding"]["kernel"])
  np.testing.assert_array_equal(got["Transformer"]["encoder_norm"]["scale"],
                                src["Transformer"]["encoder_norm"]["scale"])
  # dont_load=["head/.*"]: the head keeps its (zero) init instead of the trained values.
  assert not np.array_equal(got["head"]["kernel"], src["head"]["kernel"])
  np.testing.assert_array_equal(got["head"]["kernel"], 0.0)
