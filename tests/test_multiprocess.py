"""Multi-process training on one machine: real processes, jax.distributed over loopback, gloo.

Every multi-host code path (per-process input shards, global arrays, collective checkpoints,
the hang guard) runs here with `launch/local.sh NPROC -- python -m big_vit_lite.train ...`.
The training runs use configs/demo.py:runlocal (width 32, depth 2, 28x28 Fashion-MNIST, batch
32) with input.num_shards=2, so that every process layout sees the same global batches.
Each test has a timeout so that a deadlock fails fast instead of hanging CI.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from big_vit_lite.runtime import distributed
from big_vit_lite.trainer import checkpoint
import forkserver
import trainer_runs
import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_SH = os.path.join(REPO, "launch", "local.sh")
DEMO_CONFIG = os.path.join(REPO, "configs", "demo.py")

# demo:runlocal, no evals (not what these tests are about), every step logged, a
# non-zero head init so that the first losses already depend on the data, FSDP
# over all devices.
CONFIG_TEMPLATE = """
import importlib.util
import ml_collections

def get_config(arg=None):
  spec = importlib.util.spec_from_file_location("demo_config", {demo!r})
  demo = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(demo)
  config = demo.get_config("runlocal")
  config.evals = ml_collections.ConfigDict()
  config.input.num_shards = 2
  config.mesh = [("fsdp", -1)]
  config.model.head_zeroinit = False
  config.log_training_steps = 1
  config.hang_timeout_s = 0  # Tests that want the guard set $BVL_HANG_TIMEOUT_S.
  return config
"""


@pytest.fixture(scope="module")
def mp_env(tfds_data_dir, tmp_path_factory):
  """(config path, base environment) for the training runs."""
  root = tmp_path_factory.mktemp("mp")
  config = root / "mp_config.py"
  config.write_text(CONFIG_TEMPLATE.format(demo=DEMO_CONFIG))
  env = dict(os.environ)
  env.update(
      TFDS_DATA_DIR=tfds_data_dir,
      JAX_PLATFORMS="cpu",
      LOCAL_PREFIX_OUTPUT="0",
      # After a peer dies the survivors cannot save or finish (they hang in a collective or
      # at exit): local.sh's SIGTERM-to-SIGKILL grace is idle time (5 s each killed run).
      KILL_GRACE_S="1",
      PYTHONUNBUFFERED="1",
      # Without a user's device count (local.sh adds its own), compiled fast.
      XLA_FLAGS=xla_flags.for_run(None),
  )
  for k in (
      "JAX_COORDINATOR_ADDRESS",
      "JAX_NUM_PROCESSES",
      "JAX_PROCESS_ID",
      "BVL_HANG_TIMEOUT_S",
      "BVL_DISTRIBUTED",
  ):
    env.pop(k, None)
  return str(config), env


def _train_cmd(config, workdir, *overrides):
  return [
      sys.executable,
      "-m",
      "big_vit_lite.train",
      f"--config={config}",
      f"--workdir={workdir}",
      *overrides,
  ]


def _launch(nproc, devices, cmd, env, log_dir):
  """local.sh in a session of its own, so that _kill_all can end it and every process it started."""
  env = dict(env, DEVICES_PER_PROCESS=str(devices), LOG_DIR=str(log_dir))
  return subprocess.Popen(
      ["bash", LOCAL_SH, str(nproc), "--", *cmd],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      start_new_session=True,
  )


def _kill_all(proc):
  """SIGKILL local.sh's process group (itself and the training processes, orphaned or not)."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  if proc.poll() is None:
    proc.wait()


def _run_local(nproc, devices, cmd, env, log_dir, timeout):
  proc = _launch(nproc, devices, cmd, env, log_dir)
  try:
    out, _ = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    _kill_all(proc)
    out = proc.stdout.read() if proc.stdout else ""
    pytest.fail(
        f"local.sh {nproc} timed out after {timeout}s:\n{out[-3000:]}\n{_logs(log_dir)}"
    )
  finally:
    _kill_all(proc)
  return proc.returncode, out


def _run_single(devices, cmd, env, timeout):
  """One process, forked by the fork server: trainer_runs.env_for's environment (the zygote the
  suite's single-process runs share) on env's data."""
  env = trainer_runs.env_for(env["TFDS_DATA_DIR"], devices)
  for k in ("BVL_HANG_TIMEOUT_S", "BVL_DISTRIBUTED"):
    env.pop(k, None)
  proc = subprocess.run(
      forkserver.command(cmd),
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def _logs(log_dir):
  out = []
  for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
    with open(os.path.join(log_dir, name), errors="replace") as f:
      out.append(f"--- {name} (tail)\n" + "".join(f.readlines()[-25:]))
  return "\n".join(out)


def _training_metrics(workdir):
  rows = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      d = json.loads(line)
      if "training_loss" in d:
        rows[d["step"]] = (d["training_loss"], d["grad_norm"])
  return rows


def _children_by_process_id(launcher_pid):
  """{JAX_PROCESS_ID: pid} of the processes local.sh started."""
  out = subprocess.run(
      ["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True
  ).stdout
  found = {}
  for pid in map(int, out.split()):
    try:
      with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(
            kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv
        )
    except OSError:
      continue
    if b"JAX_PROCESS_ID" in env:
      found[int(env[b"JAX_PROCESS_ID"])] = pid
  return found


def _wait_for(predicate, timeout, what, proc=None):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    if proc is not None and proc.poll() is not None:
      pytest.fail(
          f"launcher exited ({proc.returncode}) while waiting for {what}"
      )
    time.sleep(0.2)
  pytest.fail(f"timed out after {timeout}s waiting for {what}")


def _checkpoint_steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  return (
      sorted(int(n) for n in os.listdir(d) if n.isdigit())
      if os.path.isdir(d)
      else []
  )


# -----------------------------------------------------------------------------
# environment


def test_describe_environment():
  from big_vit_lite.runtime import distributed

  describe = distributed.describe_environment
  assert describe({}) is None  # Plain single process.
  local = {
      "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234",
      "JAX_NUM_PROCESSES": "2",
      "JAX_PROCESS_ID": "1",
  }
  assert describe(local) == dict(
      coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1
  )
  assert (
      describe(dict(local, JAX_NUM_PROCESSES="1", JAX_PROCESS_ID="0")) is None
  )
  assert describe(dict(local, BVL_DISTRIBUTED="off")) is None
  slurm = {
      "SLURM_JOB_ID": "7",
      "SLURM_STEP_NODELIST": "n[1-2]",
      "SLURM_NTASKS": "16",
      "SLURM_PROCID": "3",
      "SLURM_LOCALID": "3",
  }
  assert describe(slurm) == {}  # jax's own SLURM detection.
  assert describe(dict(slurm, SLURM_NTASKS="1")) is None
  assert describe({"BVL_DISTRIBUTED": "auto"}) == {}
  for bad, msg in (
      (dict(local, JAX_PROCESS_ID="2"), "JAX_PROCESS_ID < JAX_NUM_PROCESSES"),
      ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "needs all of"),
      ({"BVL_DISTRIBUTED": "yes"}, "BVL_DISTRIBUTED"),
  ):
    with pytest.raises(ValueError, match=msg):
      describe(bad)


def test_hang_guard_disabled_costs_nothing_and_ticks():
  from big_vit_lite.runtime import distributed

  guard = distributed.HangGuard(None)
  assert not guard.enabled
  guard.tick(3)
  guard.stop()
  # Enabled: a watcher thread, stopped on exit.
  with distributed.HangGuard(3600) as guard:
    assert guard.enabled
    guard.tick(1)
  assert not guard.enabled


# -----------------------------------------------------------------------------
# local.sh itself


@pytest.mark.timeout(60)
def test_local_sh_sets_environment_and_logs(tmp_path):
  script = (
      "import os; print('ENV', os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'], "
      "os.environ['JAX_COORDINATOR_ADDRESS'], os.environ['XLA_FLAGS'])"
  )
  env = dict(os.environ, LOCAL_PREFIX_OUTPUT="1")
  rc, out = _run_local(
      3, 2, [sys.executable, "-c", script], env, tmp_path / "logs", timeout=50
  )
  assert rc == 0, out
  lines = sorted(l for l in out.splitlines() if " ENV " in l)
  assert len(lines) == 3, out
  addrs = set()
  for i, line in enumerate(lines):
    prefix, _, pid, num, addr, flags = line.split(" ", 5)
    assert prefix == f"[p{i}]" and pid == str(i) and num == "3", line
    assert (
        addr.startswith("127.0.0.1:")
        and "--xla_force_host_platform_device_count=2" in flags
    )
    addrs.add(addr)
    assert f"ENV {i} 3" in (tmp_path / "logs" / f"proc{i}.log").read_text()
  assert len(addrs) == 1  # One coordinator for all.


@pytest.mark.timeout(60)
def test_local_sh_kills_all_when_one_fails(tmp_path):
  # Process 1 fails at once; process 0 would sleep for 5 minutes unless it is
  # stopped.
  script = (
      "import os, sys, time\n"
      "if os.environ['JAX_PROCESS_ID'] == '1': sys.exit(7)\n"
      "time.sleep(300)\n"
  )
  t0 = time.time()
  rc, out = _run_local(
      2,
      1,
      [sys.executable, "-c", script],
      dict(os.environ, KILL_GRACE_S="5"),
      tmp_path / "logs",
      timeout=50,
  )
  assert rc == 7, out
  assert time.time() - t0 < 30
  assert "process 1" in out and "exited with status 7" in out


@pytest.mark.timeout(30)
def test_local_sh_rejects_bad_arguments(tmp_path):
  for args in (["x", "--", "true"], ["2", "true"], ["0", "--", "true"]):
    proc = subprocess.run(
        ["bash", LOCAL_SH, *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, LOG_DIR=str(tmp_path)),
        check=False,
    )
    assert proc.returncode == 2, (args, proc.stderr)


# -----------------------------------------------------------------------------
# hang guard

HANG_SCRIPT = textwrap.dedent("""
    import sys, time
    from big_vit_lite.runtime import distributed
    distributed.initialize()
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    guard = distributed.HangGuard.from_env()
    total = jax.jit(jnp.sum)
    for step in range(100000):  # A cross-process all-reduce per step, like a training step.
      x = jax.make_array_from_process_local_data(
          NamedSharding(mesh, P("data")), np.full((jax.local_device_count(), 4), step, np.float32))
      assert float(total(x)) == 4 * step * jax.device_count()
      print("step", step, flush=True)
      guard.tick(step)
      time.sleep(0.05)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("detector", ["hang_guard", "heartbeat"])
def test_stopped_peer_ends_the_run(tmp_path, detector):
  """SIGSTOP one of two processes: the other exits non-zero, with a message, within the limit.

  hang_guard: distributed.HangGuard (no step progress for BVL_HANG_TIMEOUT_S);
  heartbeat: jax's coordination service (no heartbeat for BVL_HEARTBEAT_TIMEOUT_S), which is
  on even when the guard is off.
  """
  script = tmp_path / "allreduce_loop.py"
  script.write_text(HANG_SCRIPT)
  log_dir = tmp_path / "logs"
  limit_s = 6
  env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      LOCAL_PREFIX_OUTPUT="0",
      KILL_GRACE_S="1",  # (the stopped process is only ended: nothing to wait for)
      PYTHONUNBUFFERED="1",
  )
  if detector == "hang_guard":  # Keep the heartbeat out of the way.
    env.update(BVL_HANG_TIMEOUT_S=str(limit_s), BVL_HEARTBEAT_TIMEOUT_S="300")
  else:
    env.update(BVL_HANG_TIMEOUT_S="0", BVL_HEARTBEAT_TIMEOUT_S=str(limit_s))
  proc = _launch(2, 1, [sys.executable, str(script)], env, log_dir)
  try:
    _wait_for(
        lambda: "step 5\n" in _read(log_dir / "proc0.log"), 90, "5 steps", proc
    )
    pids = _children_by_process_id(proc.pid)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGSTOP)
    t_stop = time.time()
    out, _ = proc.communicate(timeout=limit_s + 40)
    elapsed = time.time() - t_stop
  finally:
    _kill_all(proc)
  log0 = _read(log_dir / "proc0.log")
  assert proc.returncode != 0, out
  if detector == "hang_guard":
    assert "HangGuard: process 0 of 2 made no progress" in log0, log0[-2000:]
    # HANG_EXIT_CODE
    assert "local.sh: process 0 (pid" in out and "exited with status 75" in out
  else:
    assert "stopped sending heartbeats" in log0, log0[-2000:]
  assert limit_s - 1 <= elapsed < limit_s + 30, elapsed


def _read(path):
  try:
    with open(path, errors="replace") as f:
      return f.read()
  except FileNotFoundError:
    return ""


# -----------------------------------------------------------------------------
# training


@pytest.fixture(scope="module")
def run_2x2(mp_env, tmp_path_factory):
  """The demo trained by 2 processes x 2 CPU devices (FSDP over 4): (workdir, seconds)."""
  config, env = mp_env
  root = tmp_path_factory.mktemp("run_2x2")
  workdir = root / "wd"
  t0 = time.time()
  rc, out = _run_local(
      2, 2, _train_cmd(config, workdir), env, root / "logs", timeout=280
  )
  assert rc == 0, out[-3000:] + _logs(root / "logs")
  return str(workdir), time.time() - t0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_same_losses_2x2_1x4_1x1(mp_env, run_2x2, tmp_path):
  """Same global batches (num_shards=2) -> same losses, whatever the process/device layout."""
  config, env = mp_env
  workdir_2x2, _ = run_2x2
  ref = _training_metrics(workdir_2x2)
  assert sorted(ref) == [1, 2, 3, 4, 5, 6]
  for devices in (4, 1):
    workdir = tmp_path / f"wd_1x{devices}"
    _run_single(devices, _train_cmd(config, workdir), env, timeout=240)
    got = _training_metrics(workdir)
    assert sorted(got) == sorted(ref)
    for step in ref:
      np.testing.assert_allclose(
          got[step],
          ref[step],
          rtol=1e-4,
          atol=1e-4,
          err_msg=f"1 process x {devices} devices, step {step}",
      )
  # The losses move: a test on constant numbers could not tell layouts apart.
  assert len({round(v[0], 4) for v in ref.values()}) > 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_from_2_processes_restores_in_1(mp_env, run_2x2, tmp_path):
  """The 2-process checkpoint is read by one process: load_params, then resume training."""
  config, env = mp_env
  workdir = tmp_path / "wd"
  shutil.copytree(run_2x2[0], workdir)
  # 1 process x 1 device resumes from the last step (6) and trains on to 8.
  proc = _run_single(
      1, _train_cmd(config, workdir, "--config.total_steps=8"), env, timeout=240
  )
  assert (
      "Resuming from" in proc.stderr
      and "/6" in proc.stderr.split("Resuming from", 1)[1][:300]
  )
  got = _training_metrics(workdir)
  assert sorted(got) == [1, 2, 3, 4, 5, 6, 7, 8]
  assert _checkpoint_steps(workdir)[-1] == 8
  # And the params load whole in a plain process (this one: no mesh, no
  # distributed runtime).
  params, cfg = checkpoint.load_params(run_2x2[0])
  leaves = jax.tree.leaves(params)
  assert leaves and all(isinstance(l, np.ndarray) for l in leaves)
  assert all(np.isfinite(l).all() for l in leaves)
  assert cfg.model.width == 32


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_one_process_then_restart_resumes(mp_env, tmp_path):
  """SIGKILL to one of 2 processes stops the run (non-zero); a restart resumes from the last
  checkpoint and finishes."""
  config, env = mp_env
  workdir = tmp_path / "wd"
  total = 30
  cmd = _train_cmd(
      config,
      workdir,
      f"--config.total_steps={total}",
      "--config.ckpt_steps=5",
      "--config.log_training_steps=5",
  )
  proc = _launch(2, 1, cmd, env, tmp_path / "logs1")
  try:
    _wait_for(
        lambda: _checkpoint_steps(workdir), 400, "the first checkpoint", proc
    )
    # Freeze both at once, so that the kill lands mid-run however fast the steps
    # are.
    pids = _children_by_process_id(proc.pid)
    for pid in pids.values():
      os.kill(pid, signal.SIGSTOP)
    os.kill(pids[1], signal.SIGKILL)
    os.kill(pids[0], signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
  finally:
    _kill_all(proc)
  assert proc.returncode != 0, out
  # 128 + SIGKILL
  assert (
      "local.sh: process 1 (pid" in out and "exited with status 137" in out
  ), out
  saved = _checkpoint_steps(workdir)
  assert saved and saved[-1] < total, saved
  last = saved[-1]

  rc, out = _run_local(2, 1, cmd, env, tmp_path / "logs2", timeout=450)
  assert rc == 0, out[-3000:] + _logs(tmp_path / "logs2")
  for i in (0, 1):
    log = _read(tmp_path / "logs2" / f"proc{i}.log")
    assert (
        f"Resuming from {os.path.abspath(workdir)}/checkpoints/{last}" in log
    ), log[-3000:]
  steps = sorted(_training_metrics(workdir))
  assert steps[-1] == total
  assert _checkpoint_steps(workdir)[-1] == total


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_to_one_process_saves_the_same_step_everywhere(
    mp_env, tmp_path
):
  """Preemption notice (SIGTERM) to one of 2 processes: both checkpoint the same step, exit 0."""
  config, env = mp_env
  workdir = tmp_path / "wd"
  # Never reached: the preemption ends the run (a failure here shows as a
  # timeout).
  total = 2000
  cmd = _train_cmd(
      config,
      workdir,
      f"--config.total_steps={total}",
      "--config.ckpt_steps=5000",
      "--config.log_training_steps=5",
  )
  log_dir = tmp_path / "logs"
  proc = _launch(2, 1, cmd, env, log_dir)
  try:
    _wait_for(
        lambda: "[10/" in _read(log_dir / "proc0.log"), 400, "step 10", proc
    )
    os.kill(_children_by_process_id(proc.pid)[1], signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    _kill_all(proc)
  assert proc.returncode == 0, out + _logs(log_dir)
  saved = []
  for i in (0, 1):
    log = _read(log_dir / f"proc{i}.log")
    assert "Preempted: saved step" in log, log[-3000:]
    saved.append(int(log.split("Preempted: saved step", 1)[1].split()[0]))
  assert saved[0] == saved[1] and 10 <= saved[0] < total, saved
  assert _checkpoint_steps(workdir) == [saved[0]]


# -------------------------------------------------------------------
# coordinator and peers


def test_coordinator_port_in_use_is_one_line(monkeypatch):
  """jax 0.10 logs 'Failed to add port to server' and then dies of SIGSEGV."""
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    for k, v in dict(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES="2",
        JAX_PROCESS_ID="0",
    ).items():
      monkeypatch.setenv(k, v)
    with pytest.raises(
        ValueError, match=f"process 0 cannot serve on port {port} of this host"
    ):
      distributed.initialize()


@pytest.mark.timeout(60)
def test_missing_peer_ends_with_one_line_after_the_join_timeout():
  """JAX_NUM_PROCESSES=2 but only process 0 started: jax waited 300 s, then aborted with a C++
  stack trace."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
      JAX_NUM_PROCESSES="2",
      JAX_PROCESS_ID="0",
      BVL_INIT_TIMEOUT_S="1",
  )
  r = subprocess.run(
      [
          sys.executable,
          "-c",
          "from big_vit_lite.runtime import distributed; "
          "distributed.initialize(); print('joined')",
      ],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=50,
  )
  assert r.returncode == 1 and "joined" not in r.stdout
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith(
      "jax.distributed: process 0 of 2 waited 1 s for all processes to join"
  ), r.stderr[-2000:]
  assert "$BVL_INIT_TIMEOUT_S" in last


@pytest.mark.timeout(60)
def test_hang_guard_startup_limit_zero_means_none():
  """BVL_HANG_STARTUP_TIMEOUT_S=0 (0 turns BVL_HANG_TIMEOUT_S off) killed the job at once."""
  script = (
      "import sys, time\nfrom big_vit_lite.runtime import distributed\n"
      "guard = distributed.HangGuard(0.3, startup_timeout_s=0, stream=sys.stdout)\n"
      "time.sleep(0.8)\nprint('alive')\nguard.tick(1)\ntime.sleep(1.0)\nprint('still')\n"
  )
  r = subprocess.run(
      [sys.executable, "-c", script],
      cwd=REPO,
      capture_output=True,
      text=True,
      timeout=50,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  # No limit before the first tick; after it, the guard's own 0.3 s.
  assert "alive" in r.stdout and "still" not in r.stdout, (
      r.stdout[-2000:] + r.stderr[-2000:]
  )
  assert r.returncode == distributed.HANG_EXIT_CODE
