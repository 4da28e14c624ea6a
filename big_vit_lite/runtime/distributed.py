"""Joining a multi-process JAX job, and not hanging forever when a peer dies.

Two calls for the trainer (and any other multi-process CLI):

    distributed.initialize()              # first thing in main(), before any JAX computation
    guard = distributed.HangGuard.from_env(timeout_s=config.get("hang_timeout_s"))
    for step in ...:
        ... train step, evals, checkpoint ...
        guard.tick(step)                  # "this process made progress"
    guard.stop()

A SIGKILLed peer closes its connections and the others fail in their next collective; a
*stopped* one (SIGSTOP, a wedged host, a stuck NFS read) keeps them open and the others block
in a collective with no timeout. Two detectors turn that into a bounded, non-zero exit:
  * jax's coordination service: a process that misses `heartbeat_timeout_s` of heartbeats is
    declared dead and all others abort. `initialize()` sets it.
  * HangGuard: a watchdog thread per process; if the loop does not `tick()` for `timeout_s`
    seconds it prints the step it was stuck after and every thread's stack, and exits the
    process with HANG_EXIT_CODE.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time

from absl import logging
import jax

# EX_TEMPFAIL from sysexits.h: "temporary failure, retrying may help" (restart
# resumes).
HANG_EXIT_CODE = 75

# Environment read by initialize(); launch/local.sh and the launch scripts set
# them.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# "auto": let jax detect the cluster (Cloud TPU VM pods, SLURM, Open MPI, k8s);
# "off": never join.
ENV_MODE = "BVL_DISTRIBUTED"
ENV_HEARTBEAT = "BVL_HEARTBEAT_TIMEOUT_S"
ENV_HANG_TIMEOUT = "BVL_HANG_TIMEOUT_S"
ENV_HANG_STARTUP = "BVL_HANG_STARTUP_TIMEOUT_S"
ENV_INIT_TIMEOUT = "BVL_INIT_TIMEOUT_S"
# How long initialize() waits for every process to join (jax's own default).
DEFAULT_INIT_TIMEOUT_S = 300.0

_SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)


def _env_number(name: str, env, kind=float, default=None):
  """$name as `kind` (int or float); `default` when unset or empty."""
  value = env.get(name)
  if value in (None, ""):
    return default
  return kind(value)


def describe_environment(env=None) -> dict | None:
  """What initialize() would do: None (single process) or the kwargs for jax.distributed.initialize.

  Pure function of the environment, so it can be tested without starting processes.
  """
  if env is None:
    env = os.environ
  mode = env.get(ENV_MODE, "").lower()
  if mode == "off":
    return None
  if mode not in ("", "auto"):
    raise ValueError(
        f"{ENV_MODE}={env[ENV_MODE]!r}: expected 'auto', 'off' or unset"
    )
  num = _env_number(ENV_NUM_PROCESSES, env, int)
  pid = _env_number(ENV_PROCESS_ID, env, int)
  if num is not None or pid is not None:
    coord = env.get(ENV_COORDINATOR)
    if num is None or pid is None or not coord:
      raise ValueError(
          f"multi-process run needs all of {ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and "
          f"{ENV_PROCESS_ID}; got {ENV_COORDINATOR}={coord!r}, "
          f"{ENV_NUM_PROCESSES}={num}, {ENV_PROCESS_ID}={pid}"
      )
    if num < 1 or not 0 <= pid < num:
      raise ValueError(
          f"need 0 <= {ENV_PROCESS_ID} < {ENV_NUM_PROCESSES}; got {pid} and {num}"
      )
    if num == 1:
      return None
    return dict(coordinator_address=coord, num_processes=num, process_id=pid)
  # {}: jax detects the rest: SLURM (coordinator = first node of the step), or
  # with BVL_DISTRIBUTED=auto a Cloud TPU pod / Open MPI / k8s (one host: a
  # 1-process job).
  if (
      all(v in env for v in _SLURM_VARS)
      and (_env_number("SLURM_NTASKS", env, int) or 1) > 1
  ):
    return {}
  if mode == "auto":
    return {}
  return None


def set_cpu_devices(n) -> None:
  """Splits the CPU backend into `n` JAX devices (config.num_cpu_devices); None: leave as is.

  On CPU, data parallel over a few devices beats one device for small models (see
  benchmarks/NOTES.md, section "Config, optimizer, sharding, distributed"). Only the CPU
  backend changes; a GPU or TPU stays the default. Must run before the first JAX computation.
  """
  if n is None:
    return
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(
        f"num_cpu_devices={n!r}: use a positive integer, or leave it unset."
    )
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    raise ValueError(
        f"num_cpu_devices={n} cannot take effect: JAX already started its CPU "
        f"backend with {jax.local_device_count('cpu')} device(s). Run the job "
        "in a fresh process."
    ) from None


def initialize(*, heartbeat_timeout_s: float | None = None) -> bool:
  """Joins the multi-process job described by the environment; returns True if it did.

  Call it before anything that touches a JAX backend (jax.devices(), jit, device_put).
  Order of precedence:
    1. JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID (launch/local.sh,
       plain multi-GPU);
    2. SLURM (srun with more than one task): jax reads SLURM_* itself;
    3. BVL_DISTRIBUTED=auto (TPU VM pods via launch/tpu_vm.sh): jax asks the TPU metadata server;
    otherwise a single process, nothing to do.
  heartbeat_timeout_s (or $BVL_HEARTBEAT_TIMEOUT_S; jax's default 100): after this many seconds
  without a heartbeat from a process the coordination service declares it dead and the others exit.
  """
  # gloo for CPU collectives: jax 0.10's default already; explicit so that
  # another default ("none") never means no CPU collectives across processes.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = describe_environment()
  if kwargs is None:
    return False
  heartbeat = _env_number(
      ENV_HEARTBEAT, os.environ, default=heartbeat_timeout_s
  )
  if heartbeat is not None:
    kwargs["heartbeat_timeout_seconds"] = max(1, int(round(heartbeat)))
  if jax.distributed.is_initialized():
    return True
  if kwargs.get("process_id") == 0:
    _check_port_free(kwargs["coordinator_address"])
  timeout = _env_number(
      ENV_INIT_TIMEOUT, os.environ, default=DEFAULT_INIT_TIMEOUT_S
  )
  # jax's own limit a little later than ours: past it, its coordination client
  # aborts the process with a C++ stack trace; ours says in one line what to
  # check.
  kwargs["initialization_timeout"] = int(timeout) + 30
  joined = threading.Event()
  threading.Thread(
      target=_join_watchdog,
      args=(joined, timeout, kwargs),
      name="JoinWatchdog",
      daemon=True,
  ).start()
  try:
    jax.distributed.initialize(**kwargs)
  except jax.errors.JaxRuntimeError as e:
    where = kwargs.get("coordinator_address", "the detected coordinator")
    first = (str(e).strip().splitlines() or ["?"])[0]
    raise ValueError(
        f"jax.distributed could not start or reach the coordinator at {where} "
        f"({first}); check {ENV_COORDINATOR} (is the port free on process 0's "
        "host?)"
    ) from None
  finally:
    joined.set()
  logging.info(
      "jax.distributed: process %d of %d, %d local / %d global devices",
      jax.process_index(),
      jax.process_count(),
      jax.local_device_count(),
      jax.device_count(),
  )
  return True


def _check_port_free(coord: str) -> None:
  """Process 0 serves the coordinator on the port of `coord`: one line if it is taken.

  (jax 0.10 logs "Failed to add port to server" and then crashes with SIGSEGV.)
  """
  port = int(coord.rpartition(":")[2])
  for family, any_host in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
    try:
      sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # e.g. IPv6 disabled on this host
      continue
    with sock:
      # as gRPC: TIME_WAIT is fine
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      try:
        sock.bind((any_host, port))
      except OSError as e:
        raise ValueError(
            f"{ENV_COORDINATOR}={coord}: process 0 cannot serve on port {port} of "
            f"this host ({e.strerror}); another job or a leftover process holds "
            "it: pick another port for every process"
        ) from None
    return


def _join_watchdog(
    joined: threading.Event, timeout: float, kwargs: dict
) -> None:
  """Ends the process with one line if jax.distributed.initialize has not returned in time."""
  if joined.wait(timeout):
    return
  num, pid = kwargs.get("num_processes"), kwargs.get("process_id")
  coord = kwargs.get("coordinator_address", "the detected coordinator")
  who = f"process {pid} of {num}" if num else "this process"
  sys.stderr.write(
      f"\njax.distributed: {who} waited {timeout:.0f} s for all processes to join at {coord}; "
      f"check that every one of them was started with the same {ENV_COORDINATOR} and "
      f"{ENV_NUM_PROCESSES}, each with its own {ENV_PROCESS_ID}, and that process 0's host is "
      f"reachable on that port (limit: ${ENV_INIT_TIMEOUT}).\n"
  )
  sys.stderr.flush()
  # The main thread is blocked in jax's C++ client: nothing else unwinds it.
  os._exit(1)


class HangGuard:
  """Exits the process if the loop stops making progress for `timeout_s` seconds.

  `tick(step)` after every training step (and after evals/checkpoints, which are collective too).
  Before the first tick the limit is `startup_timeout_s` (compilation of the first step can take
  minutes on a pod; <= 0: no limit before the first tick). A disabled guard (timeout_s None or
  <= 0) costs nothing and does nothing.
  """

  def __init__(
      self,
      timeout_s: float | None,
      *,
      startup_timeout_s: float | None = None,
      exit_code: int = HANG_EXIT_CODE,
      stream=None,
  ):
    if not timeout_s or timeout_s <= 0:  # 0 or less turns the guard off
      timeout_s = None
    self.timeout_s = timeout_s
    if self.timeout_s is not None and startup_timeout_s is None:
      startup_timeout_s = max(self.timeout_s, 900.0)
    if startup_timeout_s is not None and startup_timeout_s <= 0:
      # 0 turns the startup limit off, as 0 does the guard.
      startup_timeout_s = float("inf")
    self.startup_timeout_s, self.exit_code = startup_timeout_s, exit_code
    self._stream = stream or sys.stderr
    self._last, self._step, self._started = time.monotonic(), None, False
    self._stop, self._thread = threading.Event(), None
    if self.timeout_s is not None:
      self._thread = threading.Thread(
          target=self._watch, name="HangGuard", daemon=True
      )
      self._thread.start()

  @classmethod
  def from_env(
      cls,
      timeout_s: float | None = None,
      *,
      multi_process_only: bool = True,
      **kwargs,
  ) -> "HangGuard":
    """$BVL_HANG_TIMEOUT_S (0 disables) overrides `timeout_s`; $BVL_HANG_STARTUP_TIMEOUT_S the
    startup limit. With multi_process_only, a single-process run gets a disabled guard: it has no
    peer to wait for."""
    timeout_s = _env_number(ENV_HANG_TIMEOUT, os.environ, default=timeout_s)
    kwargs["startup_timeout_s"] = _env_number(
        ENV_HANG_STARTUP, os.environ, default=kwargs.get("startup_timeout_s")
    )
    if multi_process_only and jax.process_count() == 1:
      timeout_s = None
    return cls(timeout_s, **kwargs)

  @property
  def enabled(self) -> bool:
    return self._thread is not None

  def tick(self, step: int | None = None) -> None:
    if step is not None:
      self._step = step
    self._last, self._started = time.monotonic(), True

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()

  def _watch(self) -> None:
    poll = min(5.0, max(0.1, self.timeout_s / 10))
    while not self._stop.wait(poll):
      idle = time.monotonic() - self._last
      limit = self.timeout_s if self._started else self.startup_timeout_s
      if idle <= limit:
        continue
      where = "before the first step"
      if self._step is not None:
        where = f"after step {self._step}"
      try:
        proc = f"process {jax.process_index()} of {jax.process_count()}"
      except Exception:  # pylint: disable=broad-except  (never let the message itself hang/fail)
        proc = "this process"
      self._stream.write(
          f"\nHangGuard: {proc} made no progress for {idle:.0f} s (limit {limit:.0f} s) {where}; "
          f"a peer process is probably dead or stopped, or this one is stuck (stacks below). "
          f"Exiting with status {self.exit_code}; restart the job to resume from the last "
          f"checkpoint (limit: ${ENV_HANG_TIMEOUT} or config.hang_timeout_s).\n"
      )
      self._stream.flush()
      try:
        faulthandler.dump_traceback(file=self._stream, all_threads=True)
      except Exception:  # pylint: disable=broad-except  (e.g. a stream without fileno)
        pass
      self._stream.flush()
      # os._exit: the main thread is blocked inside a C++ collective, so an
      # exception or sys.exit() from here could never unwind it, and atexit
      # hooks (jax.distributed.shutdown) would wait for the dead peer.
      os._exit(self.exit_code)
