"""Helpers for the trainer's end-to-end tests: run `python -m big_vit_lite.train` as a subprocess."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from big_vit_lite.logs import summary
from big_vit_lite.trainer import checkpoint
import forkserver
import shared_dirs
import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "train_config_tiny.py")


def env_for(data_dir, devices=1):
  env = dict(
      os.environ,
      TFDS_DATA_DIR=data_dir,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=xla_flags.with_devices(devices),
      TF_CPP_MIN_LOG_LEVEL="2",
      PYTHONPATH=ROOT,
  )
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)
  return env


def train_cmd(workdir, config=TINY, *overrides):
  return [
      sys.executable,
      "-m",
      "big_vit_lite.train",
      f"--config={config}",
      f"--workdir={workdir}",
      *overrides,
  ]


def run_train(
    data_dir, workdir, *overrides, config=TINY, devices=1, timeout=300
):
  return subprocess.run(
      forkserver.command(train_cmd(workdir, config, *overrides)),
      env=env_for(data_dir, devices),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def tiny_run(data_dir):
  """(workdir, its log: stderr + stdout) of a real run of the tiny config as it is (12 steps):
  made once per pytest run and shared by the tests that read one, which write nothing in it.
  """

  def build(folder):
    workdir = os.path.join(folder, "workdir")
    r = run_train(data_dir, workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(folder, "log.txt"), "w") as f:
      f.write(r.stderr + r.stdout)

  folder = shared_dirs.built_once("tiny_run", build)
  with open(os.path.join(folder, "log.txt")) as f:
    return os.path.join(folder, "workdir"), f.read()


# The tiny config's kill/resume runs (tiny_kill_reference, tiny_killed_twice): long enough (a
# few seconds of steps) to kill mid-run, a checkpoint every 40 steps, and 2 microbatches a step
# (the accumulated step's resume: test_grad_accum.py; other kill tests resume whole batches);
# killed after the steps KILLED_AFTER.
KILL_ARGS = (
    "--config.grad_accum_steps=2",
    "--config.total_steps=300",
    "--config.ckpt_steps=40",
)
KILLED_AFTER = (100, 161)


def tiny_kill_reference(data_dir):
  """(workdir, {step: loss}) of the KILL_ARGS run uninterrupted: made once per pytest run for
  the tests that compare a killed and resumed run with it, which write nothing in it.
  """

  def build(folder):
    r = run_train(data_dir, folder, *KILL_ARGS)
    assert r.returncode == 0, r.stderr[-3000:]

  workdir = shared_dirs.built_once("tiny_kill_reference", build)
  return workdir, read_losses(workdir)


def tiny_killed_twice(data_dir):
  """(workdir, resumed_from, log) of the tiny config's KILL_ARGS run SIGKILLed twice, after
  the steps KILLED_AFTER (mid-interval, and right after a checkpoint step, when an async save
  is likely in flight; start_train_to_kill), then run to the end: made once per pytest run for the
  tests that read one (test_train.py's bit-exact resume, test_tensorboard_resume.py's
  orphaned steps), which write nothing in it. `resumed_from`: the checkpoint step each restart
  resumed from; `log`: the last run's stderr.
  """

  def build(folder):
    workdir = os.path.join(folder, "workdir")
    resumed_from = []
    for kill_after in KILLED_AFTER:
      proc, pid = start_train_to_kill(data_dir, workdir, *KILL_ARGS)
      wait_for_step(proc, workdir, kill_after)
      os.kill(pid, signal.SIGKILL)
      _, err = proc.communicate(timeout=30)
      assert proc.returncode == -signal.SIGKILL, err[-3000:]
      resumed_from += _resumed_from(err)
    r = run_train(data_dir, workdir, *KILL_ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed_from += _resumed_from(r.stderr)
    with open(os.path.join(folder, "run.json"), "w") as f:
      json.dump(dict(resumed_from=resumed_from, log=r.stderr), f)

  folder = shared_dirs.built_once("tiny_killed_twice", build)
  with open(os.path.join(folder, "run.json")) as f:
    run = json.load(f)
  return os.path.join(folder, "workdir"), run["resumed_from"], run["log"]


# The tiny config's preempted run (tiny_preempted): KILL_ARGS with the classification eval
# every 100 steps and no periodic saves (the preemption's save is the only one before the
# end), sent SIGTERM after the step PREEMPTED_AFTER.
PREEMPTED_CONFIG = TINY + ":evals"
PREEMPTED_ARGS = (
    *KILL_ARGS,
    "--config.ckpt_steps=1000",
    "--config.evals.val.log_steps=100",
)
PREEMPTED_AFTER = 60


def tiny_preempted(data_dir):
  """(workdir, first, resumed) of the PREEMPTED_ARGS run stopped by SIGTERM after the step
  PREEMPTED_AFTER (a real process: it saves and exits through Python's own ending), then
  run again to the end with the same command: made once per pytest run for the tests that
  read one (test_train.py's exact resume, test_summary.py's summaries), which write nothing
  in it. `first`: the stopped run's returncode, log (stderr), summary.json ({} if none),
  complete checkpoint steps and last logged step, read before the second run; `resumed`: the
  second run's returncode and log.
  """

  def build(folder):
    workdir = os.path.join(folder, "workdir")
    proc = start_train(
        data_dir, workdir, *PREEMPTED_ARGS, config=PREEMPTED_CONFIG
    )
    wait_for_step(proc, workdir, PREEMPTED_AFTER)
    proc.send_signal(signal.SIGTERM)
    _, log = proc.communicate(timeout=120)
    first = dict(
        returncode=proc.returncode,
        log=log,
        summary=summary.read(workdir),
        saved=checkpoint.complete_steps(workdir),
        last_logged=last_logged_step(workdir),
    )
    r = run_train(data_dir, workdir, *PREEMPTED_ARGS, config=PREEMPTED_CONFIG)
    resumed = dict(returncode=r.returncode, log=r.stderr)
    with open(os.path.join(folder, "run.json"), "w") as f:
      json.dump(dict(first=first, resumed=resumed), f)

  folder = shared_dirs.built_once("tiny_preempted", build)
  with open(os.path.join(folder, "run.json")) as f:
    run = json.load(f)
  return os.path.join(folder, "workdir"), run["first"], run["resumed"]


def _resumed_from(log):
  """[the checkpoint step] a run's log says it resumed from, or []."""
  return [int(s) for s in re.findall(r"Resuming from \S+/(\d+)", log)]


# The README's `python -m big_vit_lite.train --config=demo:runlocal --workdir=...`: the run
# demo_runlocal makes (test_docs_commands.py checks that command by it).
DEMO_RUNLOCAL = "demo:runlocal"


def demo_runlocal(data_dir):
  """(workdir, newest checkpoint step) of a real `--config=demo:runlocal` run: made once per
  pytest run and shared by the tests that read one (test_docs_commands.py's `workdirs/NAME`
  and its row of that very command, test_configs.py, test_evaluate_cli.py), which write
  nothing in it."""

  def build(folder):
    r = run_train(data_dir, folder, config=DEMO_RUNLOCAL, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]

  workdir = shared_dirs.built_once("demo_runlocal", build)
  steps = [
      int(d)
      for d in os.listdir(os.path.join(workdir, "checkpoints"))
      if d.isdigit()
  ]
  return workdir, max(steps)


def read_losses(workdir):
  rows = [
      json.loads(l)
      for l in open(os.path.join(workdir, "metrics.jsonl"))
      if l.strip()
  ]
  return {r["step"]: r["training_loss"] for r in rows if "training_loss" in r}


def last_logged_step(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  steps = [
      json.loads(l)["step"]
      for l in open(path).read().splitlines()[-3:]
      if l.endswith("}")
  ]
  return max(steps, default=0)


def start_train(data_dir, workdir, *overrides, config=TINY):
  """The trainer started in the background (its stderr a pipe), for a test to stop: a real
  process, not the fork server's, so that its ending (SIGTERM's save, Ctrl-C's) is Python's own.
  A test that SIGKILLs the trainer: start_train_to_kill.
  """
  return subprocess.Popen(
      train_cmd(workdir, config, *overrides),
      env=env_for(data_dir),
      cwd=ROOT,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
  )


def start_train_to_kill(data_dir, workdir, *overrides, config=TINY):
  """(client, pid): the trainer started in the background like start_train, but forked by the
  fork server, for a test that SIGKILLs it (or SIGSTOPs it) and starts another on its workdir.

  `pid` is the trainer's own process (the zygote's child): the signal goes to it, as to a
  real trainer, and `client` (the Popen) then ends of the same signal once the trainer is
  dead and reaped, so that nothing of it runs when the test goes on. A kill ends no Python:
  the process's start (imports forked, not run) is all that differs from a real one. The
  tests of a trainer's own ending (SIGTERM, Ctrl-C) keep start_train.
  """
  folder = tempfile.mkdtemp(dir=os.environ.get("BVL_TEST_BUILT_DIR"))
  pid_file = os.path.join(folder, "pid")
  env = dict(env_for(data_dir), **{forkserver.PID_FILE: pid_file})
  cmd = train_cmd(workdir, config, *overrides)
  client_cmd = forkserver.command(cmd)
  client = subprocess.Popen(
      client_cmd,
      env=env,
      cwd=ROOT,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
  )
  if client_cmd == cmd:  # no fork server: a real process
    return client, client.pid
  t0 = time.time()
  while not os.path.exists(pid_file):
    assert client.poll() is None, client.stderr.read()[-2000:]
    assert time.time() - t0 < 240, "the fork server started no trainer"
    time.sleep(0.02)
  with open(pid_file) as f:
    return client, int(f.read())


def wait_for_step(proc, workdir, step, timeout=240):
  t0 = time.time()
  while last_logged_step(workdir) < step:
    assert (
        proc.poll() is None
    ), f"trainer exited early: {proc.stderr.read()[-2000:]}"
    assert time.time() - t0 < timeout, "trainer made no progress"
    time.sleep(0.05)


def assert_same_params(a, b):
  pa, _ = checkpoint.load_params(a)
  pb, _ = checkpoint.load_params(b)
  flat_a = dict(flatten(pa))
  flat_b = dict(flatten(pb))
  assert flat_a.keys() == flat_b.keys()
  for k in flat_a:
    np.testing.assert_array_equal(flat_a[k], flat_b[k], err_msg=k)


def flatten(tree, prefix=""):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from flatten(v, f"{prefix}{k}/")
    else:
      yield prefix + k, v
