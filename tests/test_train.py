"""End-to-end trainer behaviour: exact resume after SIGKILL, SIGTERM, NaN guard, config errors.

Real subprocesses of `python -m big_vit_lite.train` on a tiny ViT
(tests/train_config_tiny.py) over the offline Fashion-MNIST; in process (`train.train`): a
resume with grad_clip_norm switched off then on, and config errors found before the compile.
"""

import logging
import os
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite.config import config_loading
from big_vit_lite.logs import metrics
from big_vit_lite import train
from trainer_runs import (
    KILLED_AFTER,
    PREEMPTED_AFTER,
    TINY,
    assert_same_params,
    read_losses,
    run_train,
    tiny_kill_reference,
    tiny_killed_twice,
    tiny_preempted,
)

import checks
import train_config_tiny

STEPS = 300  # Long enough (a few seconds of steps) to interrupt mid-run.


@pytest.fixture(scope="module")
def reference_run(tfds_data_dir):
  """An uninterrupted run of trainer_runs.KILL_ARGS (STEPS steps; shared with
  test_grad_accum.py)."""
  workdir, losses = tiny_kill_reference(tfds_data_dir)
  assert sorted(losses) == list(range(1, STEPS + 1))
  return workdir, losses


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_anywhere_then_restart_is_bit_identical(
    reference_run, tfds_data_dir
):
  """Killed twice (trainer_runs.tiny_killed_twice: mid-interval, and right after a checkpoint
  step, when an async save is likely in flight), then let finish: the same losses, each step
  logged once, and the same params as the uninterrupted run."""
  ref_dir, ref_losses = reference_run
  workdir, resumed_from, log = tiny_killed_twice(tfds_data_dir)
  assert len(resumed_from) == len(KILLED_AFTER) and "Resuming from" in log
  losses = read_losses(workdir)
  # Each step logged exactly once (read_losses' dict would hide a repeat).
  logged = [
      r["step"] for r in metrics.read_metrics(workdir) if "training_loss" in r
  ]
  assert logged == sorted(ref_losses)
  assert losses == ref_losses  # Bit for bit (JSON floats round-trip exactly).
  assert_same_params(ref_dir, workdir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_saves_and_exits_zero_then_resumes(
    reference_run, tfds_data_dir
):
  """SIGTERM (trainer_runs.tiny_preempted: the KILL_ARGS run with no periodic saves and an
  eval every 100 steps, shared with test_summary.py) saves the step it reached, exits 0, and
  the same command resumes it to the uninterrupted run's losses and params, bit for bit (the
  eval changes no training bits)."""
  ref_dir, ref_losses = reference_run
  workdir, first, resumed = tiny_preempted(tfds_data_dir)
  assert first["returncode"] == 0, first["log"][-3000:]
  saved = first["saved"]
  assert len(saved) == 1 and PREEMPTED_AFTER <= saved[0] < STEPS, saved
  assert first["last_logged"] == saved[0]
  assert resumed["returncode"] == 0, resumed["log"][-3000:]
  assert read_losses(workdir) == ref_losses
  assert_same_params(ref_dir, workdir)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_nonfinite_loss_stops_with_message_and_keeps_good_checkpoint(
    tfds_data_dir, tmp_path
):
  workdir = str(tmp_path / "nan")
  # An absurd learning rate blows the params up after the first update.
  r = run_train(
      tfds_data_dir,
      workdir,
      "--config.lr=3e38",
      "--config.grad_clip_norm=0",
      "--config.ckpt_steps=1",
      "--config.total_steps=30",
  )
  assert r.returncode == 1
  last = r.stderr.strip().splitlines()[-1]
  assert "Non-finite training loss" in last and "at step" in last, last
  bad_step = int(last.split("at step ")[1].split(";")[0])
  steps = checkpoint.complete_steps(workdir)
  assert steps and max(steps) < bad_step
  # The last good checkpoint is readable.
  params, config = checkpoint.load_params(workdir)
  assert config.total_steps == 30 and "head" in params


@pytest.mark.timeout(300)
def test_unread_config_key_is_a_one_line_error(tfds_data_dir, tmp_path):
  """In process: the command line prints a ValueError of train() as its last line
  (test_console.py's test_an_error_is_said_once)."""
  config = _config(tfds_data_dir)
  config.schedule.warmup_step = 5  # typo of warmup_steps
  with pytest.raises(ValueError) as e:
    train.train(config, str(tmp_path / "w"))
  message = str(e.value)
  assert "\n" not in message, message
  assert "'schedule.warmup_step'" in message, message
  assert "nothing reads it" in message, message
  assert "did you mean 'schedule.warmup_steps'?" in message, message
  assert not os.path.exists(tmp_path / "w" / "checkpoints" / "12")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_model_init_from_another_run_with_dont_load(
    reference_run, tfds_data_dir, tmp_path
):
  ref_dir, _ = reference_run
  workdir = str(tmp_path / "init")
  # lr=0 and wd=0: the final params are exactly the initial ones.
  r = run_train(
      tfds_data_dir,
      workdir,
      "--config.lr=0",
      "--config.wd=0",
      "--config.total_steps=2",
      config=f"{TINY}:init={ref_dir}",
  )
  assert r.returncode == 0, r.stderr[-3000:]
  src, _ = checkpoint.load_params(ref_dir)
  got, _ = checkpoint.load_params(workdir)
  np.testing.assert_array_equal(
      got["embedding"]["kernel"], src["embedding"]["kernel"]
  )
  np.testing.assert_array_equal(
      got["Transformer"]["encoder_norm"]["scale"],
      src["Transformer"]["encoder_norm"]["scale"],
  )
  # dont_load=["head/.*"]: the head keeps its (zero) init instead of the trained
  # values.
  assert not np.array_equal(got["head"]["kernel"], src["head"]["kernel"])
  np.testing.assert_array_equal(got["head"]["kernel"], 0.0)


_tiny_params = checks.tiny_train_params


def _config(data_dir, arg=None, **overrides):
  config = train_config_tiny.get_config(arg)
  config.input.data.data_dir = data_dir
  # (A smaller step compiles faster.)
  config.device_aug, config.model.dropout = None, 0.0
  return checks.set_dotted(config, overrides)


def _saved_opt_state(workdir, step):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # orbax: "Sharding info not provided".
    return ocp.PyTreeCheckpointer().restore(
        os.path.join(workdir, "checkpoints", str(step), "state")
    )["opt_state"]


@pytest.mark.timeout(300)
def test_grad_clip_norm_switched_off_and_on_between_resumes(
    tfds_data_dir, tmp_path, caplog, monkeypatch
):
  caplog.set_level(logging.INFO, logger="absl")
  # The eval data has no data_dir of its own.
  monkeypatch.setenv("TFDS_DATA_DIR", tfds_data_dir)
  workdir = str(tmp_path / "run")
  # Clipped at 1.0, no evals: the files a run killed during its eval at step 2
  # leaves.
  train.train(_config(tfds_data_dir, total_steps=2, ckpt_steps=0), workdir)
  # Off, with a model_init that would fail if it were read: a resume does not
  # read it.
  caplog.clear()
  missing = str(tmp_path / "no_such_run")
  train.train(
      _config(
          tfds_data_dir,
          "evals",
          total_steps=4,
          ckpt_steps=0,
          grad_clip_norm=0.0,
          model_init=missing,
          **{"evals.val.log_steps": 2},
      ),
      workdir,
  )
  resumed = [
      r.getMessage()
      for r in caplog.records
      if "Resuming from" in r.getMessage()
  ]
  assert resumed == [
      f"Resuming from {workdir}/checkpoints/2; config.model_init={missing} is not "
      "read again (it only initialises a fresh run)"
  ], resumed
  assert any(
      "saved with gradient clipping; this run does not clip" in r.getMessage()
      for r in caplog.records
  )
  # The eval due at the resumed step, which the stopped run did not log, ran
  # first.
  assert [
      r["step"] for r in metrics.read_metrics(workdir) if "val/prec@1" in r
  ] == [2, 4]
  # core_hours counts the first attempt's too (it started from 0 again).
  rows = {
      r["step"]: r for r in metrics.read_metrics(workdir) if "core_hours" in r
  }
  assert rows[3]["core_hours"] - rows[2]["core_hours"] == pytest.approx(
      rows[3]["step_time"] * os.cpu_count() / 3600, rel=1e-6
  )
  opt_state = _saved_opt_state(workdir, 4)
  # (adam, schedule): written without the clip's place.
  assert len(opt_state) == 2
  # Adam's moments carried over.
  assert int(opt_state[0]["inner_state"]["count"]) == 4
  # On again: restores (a finished run's rerun, so no compile) and ends at step
  # 4.
  caplog.clear()
  params = train.train(
      _config(tfds_data_dir, "evals", total_steps=4, ckpt_steps=0), workdir
  )
  assert any(
      "saved without gradient clipping; this run clips" in r.getMessage()
      for r in caplog.records
  )
  assert jax.tree.structure(params) == jax.tree.structure(_tiny_params())
  # After the resumes, metrics.jsonl has each step once, in order (the evals at
  # 4 ran once).
  steps = [
      r["step"] for r in metrics.read_metrics(workdir) if "training_loss" in r
  ]
  assert steps == [1, 2, 3, 4]
  assert [
      r["step"] for r in metrics.read_metrics(workdir) if "val/prec@1" in r
  ] == [2, 4]


def _stop_after_validation(monkeypatch):
  """train.train raises 'validated' once the config passed every check (before the compile)."""
  check = config_loading.TrackedConfig.check_all_read

  def check_then_stop(self):
    check(self)
    raise RuntimeError("validated")

  monkeypatch.setattr(
      config_loading.TrackedConfig, "check_all_read", check_then_stop
  )


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            dict(total_steps=None, total_epochs=0.0),
            r"^config.total_steps must be a positive number of steps, got 0.$",
        ),
        (
            dict(
                total_steps=None,
                total_epochs=1.0,
                **{"schedule.warmup_steps": -10},
            ),
            r"^The schedule's warmup is -10 steps: it must be >= 0",
        ),
    ],
)
def test_durations_are_checked_in_the_unit_given(
    tfds_data_dir, tmp_path, monkeypatch, overrides, match
):
  _stop_after_validation(monkeypatch)
  with pytest.raises(ValueError, match=match):
    train.train(_config(tfds_data_dir, **overrides), str(tmp_path / "w"))
