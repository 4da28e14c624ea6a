"""summary.json and the log's summary block: a finished, a preempted + resumed and a failed run."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from big_vit_lite.config import config_loading
from big_vit_lite.logs import metrics
from big_vit_lite.logs import summary
import forkserver
import trainer_runs


def _summary(workdir):
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def test_stats_are_the_final_and_best_values_of_what_was_logged(tmp_path):
  t = lambda step, loss, up, **kw: dict(
      step=step, training_loss=loss, uptime_hours=up, **kw
  )
  rows = [
      t(1, 2.0, 0.1, **{"img/sec": 10.0, "mfu": 0.1, "mfu_xla": 0.2}),
      t(2, 1.5, 0.2, **{"img/sec": 30.0, "mfu": 0.3, "mfu_xla": 0.4}),
      {"step": 2, "val/prec@1": 0.5, "val/loss": 1.2},
      # A resumed attempt: uptime starts again.
      t(3, 1.7, 0.05, **{"img/sec": 20.0}),
      {"step": 4, "val/prec@1": 0.4, "val/loss": 1.0},
  ]
  with open(tmp_path / "metrics.jsonl", "w") as f:
    # torn
    f.write(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "training_lo'
    )
  read = metrics.read_metrics(tmp_path)
  assert read == rows
  s = summary.stats(read)
  assert (
      s["step"] == 3
      and s["final"]["val/prec@1"] == 0.4
      and s["final"]["training_loss"] == 1.7
  )
  # Accuracies at their highest, losses at their lowest.
  assert s["best"]["val/prec@1"] == dict(value=0.5, step=2)
  assert s["best"]["val/loss"] == dict(value=1.0, step=4)
  assert s["best"]["training_loss"] == dict(value=1.5, step=2)
  assert s["hours"] == pytest.approx(0.2 + 0.05)  # The attempts back to back.
  assert s["img_per_sec"] == 20.0
  # Any mfu* key.
  assert s["mfu"] == {"mfu": pytest.approx(0.2), "mfu_xla": pytest.approx(0.3)}
  assert summary.split_keys(read)[1] == ["val/prec@1", "val/loss"]


def test_an_evaluate_run_keeps_the_training_summary(tmp_path):
  """--workdir of evaluate = a training workdir: its results go beside the trainer's summary."""
  (tmp_path / "summary.json").write_text(
      json.dumps(dict(kind="train", status="finished"))
  )
  kw = dict(
      source=tmp_path / "checkpoints" / "4",
      step=4,
      results={"val": {"prec@1": 0.5}},
      seconds=1.0,
  )
  summary.write_evaluate(tmp_path, **kw)
  assert _summary(tmp_path) == dict(kind="train", status="finished")
  with open(tmp_path / summary.EVAL_FILE) as f:
    assert json.load(f)["final"] == {"val/prec@1": 0.5}
  # Its own workdir: summary.json, as before.
  summary.write_evaluate(tmp_path / "eval", **kw)
  assert _summary(tmp_path / "eval")["kind"] == "evaluate"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_preempted_then_resumed_run(tfds_data_dir, tmp_path):
  """The summaries of a run stopped by SIGTERM and of its resumed end (trainer_runs.
  tiny_preempted, shared with test_train.py: 300 steps, an eval every 100), and the
  evaluate command the finished run's summary gives."""
  workdir, first, resumed = trainer_runs.tiny_preempted(tfds_data_dir)
  config = trainer_runs.PREEMPTED_CONFIG
  args = trainer_runs.PREEMPTED_ARGS
  log = first["log"]
  assert first["returncode"] == 0, log[-3000:]
  s = first["summary"]
  step = s["step"]
  assert s["status"] == "preempted" and 20 <= step < 300, s
  assert s["checkpoint"] == os.path.join(workdir, "checkpoints", str(step))
  assert os.path.isdir(s["checkpoint"])
  assert [(a["start_step"], a["status"]) for a in s["attempts"]] == [
      (0, "preempted")
  ]
  # The command that resumes it is the one that ran (as a user would type it).
  cmd = trainer_runs.train_cmd(workdir, config, *args)
  assert s["commands"]["resume"] == shlex.join(
      ["python", "-m", "big_vit_lite.train", *cmd[3:]]
  )
  assert f"==== Summary: train preempted at step {step}/300" in log
  assert f"  resume: {s['commands']['resume']}" in log

  assert resumed["returncode"] == 0, resumed["log"][-3000:]
  s = _summary(workdir)
  assert s["status"] == "finished" and s["step"] == 300 and s["error"] is None
  assert [(a["start_step"], a["status"]) for a in s["attempts"]] == [
      (0, "preempted"),
      (step, "finished"),
  ]
  assert s["commands"]["resume"] is None and s["checkpoint"].endswith(
      "/checkpoints/300"
  )
  rows = metrics.read_metrics(workdir)
  evals = [r for r in rows if "val/prec@1" in r]
  assert [r["step"] for r in evals] == [100, 200, 300]
  best = max(evals, key=lambda r: r["val/prec@1"])
  assert s["best"]["val/prec@1"] == dict(
      value=best["val/prec@1"], step=best["step"]
  )
  assert (
      s["final"]["training_loss"]
      == [r for r in rows if "training_loss" in r][-1]["training_loss"]
  )
  assert s["device"] == dict(
      platform="cpu", device_kind="cpu", devices=1, processes=1
  )
  assert s["img_per_sec"] > 0 and s["hours"] > 0 and s["core_hours"] > 0
  assert "==== Summary: train finished at step 300/300" in resumed["log"]
  assert "2 attempts" in resumed["log"] and "val/prec@1" in resumed["log"]

  # The evaluate command it gives runs (here with one seed and shot, for time,
  # and its --workdir moved out of the shared run, which no test writes in).
  assert s["commands"]["evaluate"].endswith(
      f"--workdir={os.path.join(workdir, 'eval')} --config.model_init={workdir}"
  )
  args = shlex.split(s["commands"]["evaluate"])[1:]
  out = str(tmp_path / "eval")
  p = subprocess.run(
      forkserver.command(
          [
              sys.executable,
              *args,
              "--config.evals.fewshot.num_seeds=1",
              "--config.evals.fewshot.shots=(1,)",
              f"--workdir={out}",
          ]
      ),
      env=trainer_runs.env_for(tfds_data_dir),
      cwd=trainer_runs.ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  e = _summary(out)
  assert (
      e["kind"] == "evaluate" and e["status"] == "finished" and e["step"] == 300
  )
  assert set(e["final"]) == {
      "fewshot/mnist10k_1shot",
      "fewshot/animal_mnist_1shot",
  }
  assert "==== Summary: evaluate finished (checkpoint step 300)" in p.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_failed_run_says_why(tfds_data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  # NaN at step 2.
  p = trainer_runs.run_train(tfds_data_dir, workdir, "--config.lr=1e300")
  assert p.returncode == 1
  s = _summary(workdir)
  assert s["status"] == "failed" and s["error"].startswith(
      "Non-finite training loss (nan) at step"
  )
  # Nothing to evaluate.
  assert s["checkpoint"] is None and s["commands"]["evaluate"] is None
  assert s["commands"]["resume"] is not None
  assert "==== Summary: train failed at step 1/12" in p.stderr
  # The error once: the last line, not in the block too.
  assert p.stderr.count(s["error"]) == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_attempt_stopped_before_its_first_logged_step_is_counted(
    tfds_data_dir, tmp_path
):
  """Guards against losing an attempt's time, core-hours and steps when Ctrl-C stops it
  before its first progress line: the interrupted summary held "final": {} and null hours,
  and the resumed run's summary counted only the second attempt."""
  workdir = str(tmp_path / "run")
  # No logged step before the end: log_training_steps > total_steps.
  args = (
      "--config.log_training_steps=100000",
      "--config.ckpt_steps=100000",
  )
  proc = trainer_runs.start_train(
      tfds_data_dir, workdir, "--config.total_steps=100000", *args
  )
  try:
    for line in proc.stderr:  # Compiled: the loop starts next.
      if "Train step: " in line:
        break
    time.sleep(3.0)  # Some steps (milliseconds each).
    proc.send_signal(signal.SIGINT)
    _, log = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 130, log[-3000:]
  first = _summary(workdir)
  step = first["step"]
  assert first["status"] == "interrupted" and 0 < step < 100000, first
  assert first["final"]["training_loss"] > 0, first
  assert first["hours"] > 0 and first["core_hours"] > 0, first
  assert first["attempts"][0]["end_step"] == step

  # Resumed to a few more steps (the final step is logged).
  p = trainer_runs.run_train(
      tfds_data_dir, workdir, f"--config.total_steps={step + 5}", *args
  )
  assert p.returncode == 0, p.stderr[-3000:]
  s = _summary(workdir)
  assert s["status"] == "finished" and s["step"] == step + 5, s
  assert [(a["start_step"], a.get("end_step")) for a in s["attempts"]] == [
      (0, step),
      (step, step + 5),
  ]
  rows = [r for r in metrics.read_metrics(workdir) if "training_loss" in r]
  assert [r["step"] for r in rows] == [step, step + 5]
  # Both attempts: the first's own figures plus the second's.
  assert s["hours"] == pytest.approx(first["hours"] + rows[-1]["uptime_hours"])
  assert s["core_hours"] > first["core_hours"]


def test_the_evaluate_command_reads_the_runs_own_few_shot_features():
  """Guards: the summary's evaluate command reading the pre-logits while the
  run's few-shot eval read other features (the demo's block01, flattened):
  the user's rerun would print other numbers than the run logged."""
  demo = config_loading.config_module(
      os.path.join(trainer_runs.ROOT, "configs", "demo.py")
  ).get_config()
  assert summary.fewshot_args(demo.evals) == ["layer=block01", "pool=flatten"]
  # The evaluator's defaults add nothing; an entry is found by its type too.
  assert summary.fewshot_args({"fewshot": {"shots": (10,)}}) == []
  assert summary.fewshot_args(
      {
          "val": {"type": "classification"},
          "fs": {"type": "fewshot", "token_pool": "flatten"},
      }
  ) == ["pool=flatten"]
  assert summary.fewshot_args({}) == []
  # A `type` placeholder left None: the entry's name, as the trainer reads it.
  assert summary.fewshot_args(
      {"fewshot": {"type": None, "representation_layer": "encoded"}}
  ) == ["layer=encoded"]
