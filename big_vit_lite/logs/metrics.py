"""Metric logging: metrics.jsonl + TensorBoard (tf.summary), throughput, ETA and MFU.

`MetricWriter(workdir).write(step, {...})` appends one JSON line
`{"step": step, ...}` to `workdir/metrics.jsonl` and the scalars to a
TensorBoard event file. Only process 0 writes, so every process may call it.

`mfu` = model FLOPs of the step (its matmuls counted from the jaxpr, remat's
recomputation not included: `flops.matmul_flops`) / step time / peak FLOP/s;
`mfu_xla` uses XLA's FLOPs (`flops.step_flops`) where they are sane. The peak
is the datasheet figure of devices.py for accelerators, and for CPUs the machine's best
matmul rate (on one device and on all at once), measured once per machine and kept in
~/.cache/big_vit_lite/cpu_peak.json, divided among the devices (see
benchmarks/NOTES.md, section "Plan, bench, FLOPs, metrics").
"""

import json
import os
import platform
import socket
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from big_vit_lite.runtime import devices
from big_vit_lite.runtime import paths


def matmul_rates(n, dtype="float32", reps=5, devs=None):
  """FLOP/s of each of `reps` timed calls of an n x n x n matmul in `dtype`, one per device of
  `devs` (default: all local devices) at the same time, after one untimed call.
  """
  devs = devs or jax.local_devices()
  mesh = jax.sharding.Mesh(np.array(devs), ("d",))
  x = (
      np.random.default_rng(0)
      .standard_normal((len(devs), n, n))
      .astype(jnp.dtype(dtype))
  )
  # This process's devices only, also inside a multi-process run's global mesh.
  with jax.set_mesh(mesh):
    x = jax.device_put(
        x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    )
    mm = jax.jit(lambda a: jnp.matmul(a, a, preferred_element_type=jnp.float32))
    mm(x).block_until_ready()
    rates = []
    for _ in range(reps):
      t0 = time.perf_counter()
      mm(x).block_until_ready()
      rates.append(2 * n**3 * len(devs) / (time.perf_counter() - t0))
  return rates


def cpu_machine_flops(dtype="float32", sizes=(256, 512, 1024), reps=5):
  """The best matmul FLOP/s of this process's CPU devices together, in `dtype` (f32 too).

  The best of a matmul on device 0 alone and one on every local device at once (sharded),
  over `sizes` and `reps`: a shared machine only ever makes a call slower. Simulated CPU
  devices share the cores and XLA's thread pool, so one device alone may already use every
  core, or the devices at once may reach more; each way alone read low on some hosts (the
  demo then logged MFU over 100%: benchmarks/NOTES.md, "CPU peak for MFU").
  """
  dtypes = {"float32", dtype}  # A bf16 model's f32 matmuls may run faster.
  device_sets = [jax.local_devices()[:1], jax.local_devices()]
  rates = [
      max(matmul_rates(n, d, reps, devs))
      for d in dtypes
      for n in sizes
      for devs in device_sets
  ]
  return max(rates)


# Where the CPU peak is kept between runs (one entry per machine set-up):
# $BVL_CPU_PEAK_FILE, else this file.
CPU_PEAK_FILE = "~/.cache/big_vit_lite/cpu_peak.json"
# The calibration behind it: once per machine, so more calls than a run could
# afford at each start (the best of them: a shared machine only ever makes a
# call slower).
CPU_PEAK_REPS = 10


def cpu_peak_file():
  return os.path.expanduser(os.environ.get("BVL_CPU_PEAK_FILE", CPU_PEAK_FILE))


def cpu_peak_key(dtype):
  """What the CPU peak depends on: the host, its CPU, cores, local devices, jax, dtype."""
  model = platform.processor() or platform.machine()
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      names = [
          l.split(":", 1)[1].strip() for l in f if l.startswith("model name")
      ]
    model = names[0] if names else model
  return (
      f"{socket.gethostname()}|{model}|{os.cpu_count()} cores|"
      f"{jax.local_device_count()} devices|jax {jax.__version__}|{dtype}"
  )


def cached_cpu_peak(dtype, measure=None):
  """The whole machine's CPU matmul FLOP/s in `dtype`, measured once per machine and kept.

  The first run on a machine (per cpu_peak_key) measures it with `measure` (default
  cpu_machine_flops with CPU_PEAK_REPS calls) and writes it to cpu_peak_file(); later runs
  read it, so that the same job on the same machine divides by the same figure whatever
  the load at its start. Delete the file (its path is logged) to measure again.
  """
  path, key = cpu_peak_file(), cpu_peak_key(dtype)
  try:
    with open(path) as f:
      known = json.load(f)
  except (OSError, ValueError):
    known = {}
  if isinstance(known.get(key), dict) and known[key].get("flops", 0) > 0:
    return float(known[key]["flops"])
  if measure is None:
    measure = lambda: cpu_machine_flops(dtype, reps=CPU_PEAK_REPS)
  flops = float(measure())
  known[key] = dict(flops=flops, measured=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
  try:  # Through a rename: another run may read it meanwhile.
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      json.dump(known, f, indent=1)
    os.replace(tmp, path)
    where = f"kept in {path} for the next runs (delete it to measure again)"
  except OSError as e:
    where = f"not kept ({e})"
  logging.info(
      "This machine's CPU matmul peak: %.4g GFLOP/s (%s, all local devices); %s.",
      flops / 1e9,
      dtype,
      where,
  )
  return flops


def peak_flops_per_device(dtype="bfloat16"):
  """Peak FLOP/s of one device for matmuls in `dtype`, or None when its kind is unknown.

  CPU: the whole machine's best matmul rate, measured once per machine (cached_cpu_peak),
  divided among the local devices, which run their shares of a step side by side on the
  same cores.
  """
  device = jax.local_devices()[0]
  dtype = "float32" if str(jnp.dtype(dtype)) == "float32" else "bfloat16"
  if device.platform == "cpu":
    return cached_cpu_peak(dtype) / jax.local_device_count()
  # bf16: the usual MFU denominator; f32 runs at JAX's default precision (TF32
  # on GPUs).
  return devices.datasheet_peak(device, dtype)


class MetricWriter:
  """Writes scalars to `workdir/metrics.jsonl` and TensorBoard (process 0 only).

  `workdir` may be local or a bucket (gs://...): all I/O goes through epath and
  tf.io.gfile. (On a bucket every append rewrites the object; metrics.jsonl
  stays small, a few lines per logged step.)
  """

  def __init__(self, workdir, *, tensorboard=True):
    self.workdir = paths.resolve(workdir)
    self.path = self.workdir / "metrics.jsonl"
    self._active = jax.process_index() == 0
    self._tensorboard = tensorboard
    # TensorBoard writer, created at the first write (see start_run).
    self._tb = None
    # More writers of the same rows: write(step, row) (wandb_writer.Writer).
    self.also = []
    if self._active:
      self.workdir.mkdir(parents=True, exist_ok=True)

  def write(self, step, metrics):
    if not self._active:
      return
    row = {"step": int(step), **{k: _to_python(v) for k, v in metrics.items()}}
    with self.path.open("a") as f:
      f.write(json.dumps(row) + "\n")
    scalars = {
        k: v
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float))
    }
    if scalars and self._tensorboard:
      # TensorFlow's summary writer, as clu's SummaryWriter wraps it: clu's
      # module also imports TensorBoard's hparams plugin and, through it, all of
      # Keras and scikit-learn (~1.5 s of CPU a process).
      import tensorflow as tf  # pylint: disable=g-import-not-at-top

      # Created at the first write: after start_run's event file.
      if self._tb is None:
        self._tb = tf.summary.create_file_writer(str(self.workdir))
      with self._tb.as_default():
        for key, value in scalars.items():
          tf.summary.scalar(key, value, step=int(step))
    for writer in self.also:
      writer.write(step, row)

  def _rows(self):
    if not self._active:
      return []
    return read_metrics(self.workdir)

  def logged_keys(self, step):
    """The keys metrics.jsonl holds for `step` (empty on processes other than 0)."""
    return {
        k for r in self._rows() if r["step"] == step for k in r if k != "step"
    }

  def last_value(self, key):
    """`key`'s value in the last line of metrics.jsonl that has it (None: none, or process > 0)."""
    return next((r[key] for r in reversed(self._rows()) if key in r), None)

  def start_run(self, resumed_step=None):
    """Marks where this run starts: fresh (None) or from the checkpoint at `resumed_step`.

    Call it before the first `write`. So that steps a killed run did after its last checkpoint
    do not show twice, metrics.jsonl loses the lines after `resumed_step` (all for a fresh
    start; rewritten via a rename, kill-safe), and a new TensorBoard event file gets a
    `SessionLog(START)` at the first step this run logs: TensorBoard then drops the earlier
    files' events from that step on. Every run writes one: TensorBoard takes only a second
    START in a directory as a restart.
    """
    if not self._active:
      return
    keep_through = -1 if resumed_step is None else int(resumed_step)
    # (read_metrics skips a torn last line from a kill mid-write.)
    if self.path.exists():
      rewrite_metrics(
          self.workdir,
          [r for r in read_metrics(self.workdir) if r["step"] <= keep_through],
      )
    if self._tensorboard:
      _write_tensorboard_start(
          self.workdir,
          keep_through + 1,
          after_second=max(_event_file_seconds(self.workdir), default=0),
      )

  def close(self):
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def _event_file_seconds(workdir):
  """The creation times (whole seconds) in the names of `workdir`'s event files."""
  # Names: events.out.tfevents.<seconds>.<host>.<pid>...
  fields = [p.name.split(".")[3] for p in workdir.glob("events.out.tfevents.*")]
  return [int(f) for f in fields if f.isdigit()]


def _wait_past(second):
  while int(time.time()) <= second:
    time.sleep(0.05)


def _write_tensorboard_start(workdir, step, after_second):
  """A new event file holding only `SessionLog(START)` at `step`.

  TensorBoard reads a directory's event files in name order, and the names
  start with a creation time in whole seconds. This file is named one second
  back from now, once that second is past the earlier runs' files
  (`after_second`): it sorts after them and before the file the TensorBoard
  writer creates next (named with its own creation time, now or later). It
  waits only when the earlier files are that recent (before, every run's start
  waited for a new second after writing it: ~0.5 s).
  """
  from tensorboard.compat.proto import event_pb2  # pylint: disable=g-import-not-at-top
  from tensorboard.summary.writer import record_writer  # pylint: disable=g-import-not-at-top

  _wait_past(after_second + 1)
  second = int(time.time()) - 1
  # (event_file_writer's name, with the second chosen here)
  name = (
      f"events.out.tfevents.{second:010d}.{socket.gethostname()}."
      f"{os.getpid()}.start"
  )
  events = (
      event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"),
      event_pb2.Event(
          wall_time=time.time(),
          step=int(step),
          session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START),
      ),
  )
  with (workdir / name).open("wb") as f:
    writer = record_writer.RecordWriter(f)
    for event in events:
      writer.write(event.SerializeToString())


def read_metrics(workdir):
  """metrics.jsonl's rows ([] without one); a torn last line (a run in progress) is skipped."""
  path = paths.resolve(workdir) / "metrics.jsonl"
  rows = []
  if not path.exists():
    return rows
  for line in path.read_text().splitlines():
    try:
      row = json.loads(line)
    except ValueError:
      continue
    if isinstance(row, dict) and isinstance(row.get("step"), int):
      rows.append(row)
  return rows


def rewrite_metrics(workdir, rows):
  """Replaces metrics.jsonl with `rows` through a rename: a kill leaves the old or the new file."""
  tmp = paths.resolve(workdir) / "metrics.jsonl.tmp"
  tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
  tmp.replace(tmp.parent / "metrics.jsonl")


def _to_python(v):
  if isinstance(v, (jax.Array, np.ndarray, np.generic)):
    v = np.asarray(v)
    return v.item() if v.size == 1 else v.tolist()
  return v


class Chrono:
  """Step timing, throughput, ETA, core-hours and MFU for the progress line.

  Evaluation and checkpointing are paused out, so that img/s measures training only.
  `core_hours_before`: what the earlier attempts of a resumed run used. `step_flops`: model
  FLOPs of a step (`mfu`), `xla_step_flops`: XLA's count (`mfu_xla`), both per device like
  `peak_flops_total`.
  """

  def __init__(
      self,
      *,
      total_steps,
      global_batch,
      step_flops=None,
      peak_flops_total=None,
      core_hours_before=0.0,
      xla_step_flops=None,
  ):
    self.total_steps, self.global_batch = total_steps, global_batch
    self.core_hours_before = float(core_hours_before or 0.0)
    self.flops = {"mfu": step_flops, "mfu_xla": xla_step_flops}
    self.peak_flops_total = peak_flops_total
    self.start = time.perf_counter()
    self._last = None  # (time, step) of the previous tick.
    self._paused = 0.0
    self._pause_start = None
    self.train_seconds = 0.0
    self.num_devices = jax.device_count()
    # Cores a run occupies, for core-hours: devices, or CPU cores on CPU.
    self.num_cores = self.num_devices
    if jax.devices()[0].platform == "cpu":
      self.num_cores = (os.cpu_count() or 1) * jax.process_count()

  def pause(self):
    self._pause_start = time.perf_counter()

  def resume(self):
    if self._pause_start is not None:
      self._paused += time.perf_counter() - self._pause_start
      self._pause_start = None

  def tick(self, step):
    """Returns the timing metrics since the previous tick (empty on the first)."""
    now = time.perf_counter()
    last = self._last
    dt = now - last[0] - self._paused if last else 0.0
    self._last, self._paused = (now, step), 0.0
    # The first tick (compilation included) starts.
    if not last or step <= last[1] or dt <= 0:
      return {}
    self.train_seconds += dt
    step_time = dt / (step - last[1])
    img_s = self.global_batch / step_time
    out = {
        "step_time": step_time,
        "img/sec": img_s,
        "img/sec/device": img_s / self.num_devices,
        "eta_hours": (self.total_steps - step) * step_time / 3600,
        "core_hours": (
            self.core_hours_before + self.train_seconds * self.num_cores / 3600
        ),
        "uptime_hours": (now - self.start) / 3600,
    }
    if self.peak_flops_total:
      out.update(
          {
              k: f / step_time / self.peak_flops_total
              for k, f in self.flops.items()
              if f
          }
      )
    return out


def progress_line(step, total_steps, m):
  """One human-readable line from the training metrics of a step."""
  fmts = (
      ("training_loss_avg", "loss_avg={:.4f}".format),
      ("training_loss", "loss={:.4f}".format),
      ("learning_rate", "lr={:.3g}".format),
      ("grad_norm", "gnorm={:.3g}".format),
      ("img/sec", "{:.1f} img/s".format),
      ("step_time", lambda v: f"{v * 1000:.0f} ms/step"),
      ("mfu", lambda v: f"MFU={100 * v:.1f}%"),
      ("eta_hours", lambda v: f"ETA {_hms(v * 3600)}"),
  )
  return " ".join(
      [f"[{step}/{total_steps}]"] + [fmt(m[k]) for k, fmt in fmts if k in m]
  )


def _hms(seconds):
  seconds = int(seconds)
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def parameter_overview(params):
  """(parameter count, a table of names, shapes and counts) of `params` (boxed params ok)."""
  from clu import parameter_overview  # pylint: disable=g-import-not-at-top
  from big_vit_lite.runtime import sharding  # pylint: disable=g-import-not-at-top

  params = sharding.unbox(params)
  # Without stats only shapes are read: works on sharded arrays and
  # ShapeDtypeStructs alike, and never gathers values to the host.
  text = parameter_overview.get_parameter_overview(params, include_stats=False)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  return n, text
