"""Throughput / MFU benchmark of the ViT training and inference steps.

  python -m big_vit_lite.bench --variant=Ti/16 --batch=32 --res=224
  python -m big_vit_lite.bench --variant=Ti/16,S/16 --batch=8,32 --dtype=bfloat16

Prints one JSON line per case (the cartesian product of --variant, --batch
and --remat). Times are medians (with min/max) over --steps repeated steps
after --warmup steps.

`step_flops` are the step's model FLOPs (its matmuls, from the jaxpr: flops.py),
`hw_step_flops` add remat's recomputation, `xla_step_flops` are XLA's count. `mfu` is
against the devices' datasheet peak (devices.py, or --peak_tflops), or where none is known
(CPU) against a square matmul of the same dtype timed right before the case
(`calib_gflops`); `mfu_basis` says which. `mfu_calib` is always against the timed matmul,
`mfu_xla` uses XLA's FLOPs. The training step is the real thing minus the input pipeline:
forward, softmax cross-entropy, backward, AdamW, with the train state donated: the trainer's
own state layout and jitted step (train_state.lay_out, train_state.jit_step, as train and
plan build them) with a fixed AdamW, on a one-device mesh where --mesh is empty.
"""

# First, before jax and TF load: once more with huge pages.
if __name__ == "__main__":
  from big_vit_lite.runtime import hostmem  # pylint: disable=g-import-not-at-top

  hostmem.use_huge_pages(__file__)

import contextlib
import itertools
import json
import resource
import statistics
import sys
import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from big_vit_lite.logs import console
from big_vit_lite.runtime import devices
from big_vit_lite.runtime import distributed
from big_vit_lite.runtime import flops as flops_lib
from big_vit_lite.trainer import grad_accum
from big_vit_lite.runtime import hostmem
from big_vit_lite.trainer import losses
from big_vit_lite.logs import metrics
from big_vit_lite.runtime import oom
from big_vit_lite.runtime import sharding
from big_vit_lite.trainer import train_state  # Defined when run as a command, not on import: plan imports this module and has


# flags of the same names (--mesh, --res).
def _define_flags():
  flags.DEFINE_list("variant", ["Ti/16"], "ViT variant(s), e.g. Ti/16,S/16.")
  flags.DEFINE_list("batch", ["32"], "Global batch size(s).")
  flags.DEFINE_integer("res", 224, "Image resolution (square).")
  flags.DEFINE_integer("num_classes", 1000, "Classifier head size.")
  flags.DEFINE_enum(
      "dtype",
      "float32",
      ["float32", "bfloat16"],
      "Matmul dtype (Model dtype_mm); params stay float32.",
  )
  flags.DEFINE_list(
      "remat",
      ["none"],
      "Model remat_policy(s): 'none' or jax.checkpoint_policies "
      "names, e.g. none,nothing_saveable to report both.",
  )
  flags.DEFINE_bool("scan", False, "Run the encoder blocks under nn.scan.")
  flags.DEFINE_string(
      "model_kw",
      "{}",
      'JSON dict of extra vit.Model kwargs, e.g. \'{"gelu": "tanh"}\'.',
  )
  flags.DEFINE_string(
      "mesh",
      "",
      "Mesh as axis:size pairs, e.g. 'data:-1' or 'data:2,fsdp:4' "
      "(-1 = the remaining devices). Empty: one device.",
  )
  flags.DEFINE_integer(
      "grad_accum",
      1,
      "Training step as this many sequential microbatches "
      "(config.grad_accum_steps).",
  )
  flags.DEFINE_list("mode", ["train", "infer"], "Which steps to time.")
  flags.DEFINE_integer("steps", 5, "Timed steps per measurement.")
  flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.")
  flags.DEFINE_integer(
      "calib_n", 2048, "Side of the square calibration matmul."
  )
  flags.DEFINE_float(
      "peak_tflops",
      None,
      "Datasheet peak of one device for --dtype (else looked up).",
  )
  flags.DEFINE_integer(
      "num_cpu_devices",
      None,
      "Split the CPU into this many JAX devices (as the "
      "trainer's config.num_cpu_devices); use with --mesh=data:-1.",
  )


def time_calls(fn, warmup, steps):
  """Runs fn() warmup+steps times (fn must block); returns the timed calls' (wall, CPU) seconds.

  On a shared, oversubscribed CPU the wall time mostly measures the neighbours; the process's
  CPU seconds per step track the program's own cost far more stably.
  """
  for _ in range(warmup):
    fn()
  wall, cpu = [], []
  for _ in range(steps):
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  return wall, cpu


def calibrate_matmul(n=2048, dtype="float32", reps=5):
  """GFLOP/s of an n x n x n matmul in `dtype` (f32 accumulation), the best of `reps` calls.

  On device 0; on CPU the faster of device 0 alone and every local device at once, i.e. the
  whole machine's rate, as the trainer's peak (metrics.cpu_machine_flops).
  """
  device_sets = [jax.devices()[:1]]
  if jax.devices()[0].platform == "cpu":
    device_sets.append(jax.local_devices())
  return (
      max(
          max(metrics.matmul_rates(n, dtype, reps, devs))
          for devs in device_sets
      )
      / 1e9
  )


def _compile(fn, *args):
  t0 = time.perf_counter()
  traced, compiled = train_state.compile_step(fn, args)
  return traced, compiled, time.perf_counter() - t0


def _results(prefix, timing, *, batch, n_dev, peak, calib_gflops):
  """The JSON keys of one timed step: times, FLOPs (the whole step, all devices) and MFUs."""
  traced, compiled, compile_s, times, cpu_times = timing
  med = statistics.median(times)
  # args + outputs + temps - aliased (None where the backend does not say).
  memory = flops_lib.program_memory(compiled)
  program_bytes = None
  if memory:
    program_bytes = memory["peak"]
  model, hw = flops_lib.matmul_flops(traced.jaxpr)
  # XLA: one device's share of a partitioned program, loops counted in full.
  xla_per_device = flops_lib.step_flops(traced, compiled, num_devices=n_dev)
  xla = float("nan")
  if xla_per_device is not None:
    xla = xla_per_device * n_dev
  out = {
      "cpu_s": statistics.median(cpu_times),
      "compile_s": compile_s,
      "step_s": med,
      "step_s_min": min(times),
      "step_s_max": max(times),
      "img_per_s": batch / med,
      "step_flops": float(model),
      "hw_step_flops": float(hw),
      "xla_step_flops": xla,
      "achieved_gflops": model / med / 1e9,
      "program_bytes": program_bytes,
  }
  if peak:
    # XLA's figure only where it is sane (on GPU it misses the cuBLAS/cuDNN
    # calls).
    sane = flops_lib.sane_xla_flops(xla, model)
    mfu_xla = None
    if sane:
      mfu_xla = sane / med / peak
    out.update(mfu=model / med / peak, mfu_hw=hw / med / peak, mfu_xla=mfu_xla)
  if calib_gflops:
    out["mfu_calib"] = model / med / 1e9 / calib_gflops
  return {f"{prefix}_{k}": v for k, v in out.items()}


class _AdamW:
  """A fixed AdamW with optim.make's interface (tx, apply, lr_fn): the timed step's."""

  def __init__(self, lr=1e-3, weight_decay=1e-4):
    self.lr = lr
    self.tx = optax.adamw(lr, weight_decay=weight_decay)

  def apply(self, params, grads, opt_state):
    updates, opt_state = self.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def lr_fn(self, step):
    del step
    return jnp.float32(self.lr)


def trainer_model(module, batch_spec) -> train_state.Model:
  """The trainer's Model (train_setup.py) of a flax module: softmax cross-entropy, no
  mixup, on-device augmentation or teacher; params initialised on one image."""

  def init_params(rng):
    image = batch_spec["image"]
    return module.init(rng, jnp.zeros((1,) + image.shape[1:], image.dtype))[
        "params"
    ]

  return train_state.Model(
      model_mod=None,
      model_kw=None,
      module=module,
      loss_fn=losses.softmax_xent,
      init_head_bias=None,
      mixup_fn=None,
      device_aug_fn=None,
      batch_spec=batch_spec,
      image_shape=batch_spec["image"].shape[1:],
      init_params=init_params,
      distill=None,
  )


def _time_train(
    model, layout, params, batch, *, accum, mesh, warmup, steps, trace_dir
):
  """Times the trainer's jitted step (train_state.jit_step) on `batch`; returns (timing
  for _results, the params it trained)."""
  step = train_state.jit_step(
      model=model, layout=layout, mesh=mesh, accum_steps=accum
  )
  state = dict(
      params=params,
      opt_state=jax.jit(layout.opt.tx.init, out_shardings=layout.opt_sh)(
          params
      ),
      step=jnp.zeros([], jnp.int32),
      rng=layout.rng_train,
  )
  traced, compiled, compile_s = _compile(step, state, batch)

  def run():
    nonlocal state
    state, measurements = compiled(state, batch)
    measurements["training_loss"].block_until_ready()

  time_calls(run, warmup, 0)
  profiler = contextlib.nullcontext()
  if trace_dir:
    profiler = jax.profiler.trace(trace_dir, create_perfetto_trace=True)
  with profiler:
    times = time_calls(run, 0, steps)
  return (traced, compiled, compile_s, *times), state["params"]


def bench_model(
    model,
    *,
    batch,
    res,
    num_classes,
    mode=("train", "infer"),
    mesh=None,
    steps=5,
    warmup=2,
    calib_gflops=None,
    peak_flops=None,
    grad_accum_steps=1,
    trace_dir=None,
):
  """Times one model's train and/or inference step; returns the JSON-able result dict.

  model: a flax module whose apply(..., train=) returns (logits, out).
  mesh: the Mesh to run on (None: a one-device mesh); the state laid out and the step
  jitted on it by train_state, as the trainer's.
  calib_gflops: in-process matmul rate of all devices together (None: no mfu_calib).
  peak_flops: datasheet peak of all devices together; `mfu` is against it, else against
  calib_gflops (neither: mfu None).
  grad_accum_steps: the training step's microbatches (big_vit_lite.trainer.grad_accum); the batch must
  split into them on every device (check_args).
  trace_dir: if set, the timed training steps run under jax.profiler.trace (Perfetto JSON too).
  FLOPs and achieved FLOP/s are of the whole step, summed over the mesh's devices.
  """
  rng = jax.random.PRNGKey(0)
  x = jax.random.normal(rng, (batch, res, res, 3), jnp.float32)
  labels = jax.nn.one_hot(jnp.arange(batch) % num_classes, num_classes)
  if mesh is None:
    mesh = sharding.make_mesh([("data", 1)], jax.devices()[:1])
  rules = sharding.make_rules(None, mesh)
  x, labels = jax.device_put((x, labels), sharding.batch_sharding(mesh))
  images = {"image": x, "labels": labels}
  batch_spec = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in images.items()
  }
  trained = trainer_model(model, batch_spec)
  # The datasheet's peak; else the measured matmul rate.
  peak = peak_flops
  if not peak and calib_gflops:
    peak = calib_gflops * 1e9
  kw = dict(batch=batch, n_dev=mesh.size, calib_gflops=calib_gflops, peak=peak)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    layout = train_state.lay_out(
        model=trained,
        mesh=mesh,
        rules=rules,
        seed=0,
        make_opt=lambda params: _AdamW(),
    )
    # Born sharded, as the trainer's params.
    params = jax.jit(
        lambda r: sharding.unbox(trained.init_params(r)),
        out_shardings=layout.params_sh,
    )(layout.rng_init)
    out = dict(
        batch=batch,
        res=res,
        params=int(sum(p.size for p in jax.tree.leaves(params))),
    )
    if "train" in mode:
      timing, params = _time_train(
          trained,
          layout,
          params,
          images,
          accum=grad_accum_steps,
          mesh=mesh,
          warmup=warmup,
          steps=steps,
          trace_dir=trace_dir,
      )
      out.update(_results("train", timing, **kw))
    if "infer" in mode:
      predict = jax.jit(
          lambda p, x: model.apply({"params": p}, x, train=False)[0]
      )
      traced, compiled, compile_s = _compile(predict, params, x)
      times = time_calls(
          lambda: compiled(params, x).block_until_ready(), warmup, steps
      )
      out.update(_results("infer", (traced, compiled, compile_s, *times), **kw))
  # Contract keys: step_flops / mfu refer to the training step when timed.
  main = "infer"
  if "train" in mode:
    main = "train"
  for key in (
      "step_flops",
      "xla_step_flops",
      "achieved_gflops",
      "mfu",
      "mfu_xla",
  ):
    out[key] = out.get(f"{main}_{key}")
  # What the MFU figures divide by: the datasheet's peak, or a measured one.
  out["mfu_basis"] = None
  if peak_flops:
    out["mfu_basis"] = "datasheet"
  elif calib_gflops:
    out["mfu_basis"] = "calib"
  return out


def peak_memory():
  """Peak device bytes (where the backend reports it) and peak host RSS."""
  stats = jax.devices()[0].memory_stats() or {}
  # KiB on Linux
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return dict(
      peak_device_bytes=stats.get("peak_bytes_in_use"), peak_host_rss_bytes=rss
  )


def build_model(variant, num_classes, dtype, remat, scan, model_kw):
  """vit.Model for the flags: remat 'none' (no remat) or a policy name."""
  # imported late: bench flags parse without it
  from big_vit_lite.models import vit

  return vit.Model(
      **{
          "num_classes": num_classes,
          "variant": variant,
          "dtype_mm": dtype,
          "remat_policy": None if remat == "none" else remat,
          "scan": scan,
          **model_kw,
      }
  )


def check_args(
    variants,
    batches,
    remats,
    model_kw,
    *,
    res,
    mesh=None,
    accum=1,
    num_classes=10,
    dtype="float32",
    scan=False,
):
  """One-line ValueErrors for flags that could only fail later, mid-run: a batch the mesh and
  --grad_accum cannot split, a model the flags cannot build (its init traced, not run).
  """
  for batch in batches:
    try:
      grad_accum.check(accum, batch, sharding.batch_devices(mesh))
    except ValueError as e:
      raise ValueError(f"--batch={batch} --grad_accum={accum}: {e}") from None
  for variant, remat in itertools.product(variants, remats):
    try:
      model = build_model(variant, num_classes, dtype, remat, scan, model_kw)
      jax.eval_shape(
          model.init,
          jax.random.PRNGKey(0),
          jax.ShapeDtypeStruct((1, res, res, 3), jnp.float32),
      )
    except (ValueError, TypeError) as e:
      raise ValueError(f"{variant}: {e}") from None


def main(argv):
  del argv
  # Other libraries' INFO lines (orbax, tfds) only with --verbosity=1.
  console.keep_log_readable()
  f = flags.FLAGS
  try:
    distributed.set_cpu_devices(f.num_cpu_devices)
    try:
      model_kw = dict(json.loads(f.model_kw))
      batches = [int(b) for b in f.batch]
    except (ValueError, TypeError) as e:
      raise ValueError(
          f"--model_kw must be a JSON dict and --batch integers ({e})"
      ) from None
    mesh = sharding.make_mesh(sharding.parse_mesh(f.mesh)) if f.mesh else None
    check_args(
        f.variant,
        batches,
        f.remat,
        model_kw,
        res=f.res,
        mesh=mesh,
        accum=f.grad_accum,
        num_classes=f.num_classes,
        dtype=f.dtype,
        scan=f.scan,
    )
  except ValueError as e:
    sys.exit(f"bench: {e}")
  dev = jax.devices()[0]
  if f.peak_tflops:
    peak = f.peak_tflops * 1e12
  else:
    peak = devices.datasheet_peak(dev, f.dtype)
  n_dev = 1
  if mesh is not None:
    n_dev = mesh.size
  calib_devices = n_dev
  if dev.platform == "cpu":
    calib_devices = 1
  peak_all = None
  datasheet_peak_tflops = None
  if peak:
    peak_all = peak * n_dev
    datasheet_peak_tflops = peak / 1e12

  for variant, batch, remat in itertools.product(f.variant, batches, f.remat):
    model = build_model(
        variant, f.num_classes, f.dtype, remat, f.scan, model_kw
    )
    # Device 0's matmul rate times the device count; CPU devices share the
    # cores, and one device's matmul already uses them all: there it is the
    # whole machine's.
    calib_before = calibrate_matmul(f.calib_n, f.dtype)
    try:
      res = bench_model(
          model,
          batch=batch,
          res=f.res,
          num_classes=f.num_classes,
          mode=tuple(f.mode),
          mesh=mesh,
          steps=f.steps,
          warmup=f.warmup,
          calib_gflops=calib_before * calib_devices,
          peak_flops=peak_all,
          grad_accum_steps=f.grad_accum,
      )
    except jax.errors.JaxRuntimeError as e:
      if not oom.is_oom(e):
        raise
      sys.exit(
          f"bench: {variant}: "
          + oom.message(
              e,
              what="the benchmark",
              batch_size=batch,
              devices=sharding.batch_devices(mesh),
              grad_accum_steps=f.grad_accum,
          )
      )
    line = dict(
        variant=variant,
        dtype=f.dtype,
        remat=remat,
        attention=model.resolved_attention(),
        scan=f.scan,
        grad_accum_steps=f.grad_accum,
        mesh=f.mesh or None,
        model_kw=model_kw,
        host_malloc=hostmem.status(),
        device_kind=dev.device_kind,
        num_devices=n_dev,
        jax_version=jax.__version__,
        calib_gflops=calib_before,
        calib_gflops_after=calibrate_matmul(f.calib_n, f.dtype),
        datasheet_peak_tflops=datasheet_peak_tflops,
        **res,
        **peak_memory(),
    )
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
