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
forward, softmax cross-entropy, backward, AdamW, with the train state donated.
"""
if __name__ == "__main__":  # First, before jax and TF load: once more with huge pages.
  from big_vit_lite import hostmem  # pylint: disable=g-import-not-at-top
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
import jax
import jax.numpy as jnp
import optax

from big_vit_lite import devices
from big_vit_lite import distributed
from big_vit_lite import flops as flops_lib
from big_vit_lite import grad_accum
from big_vit_lite import hostmem
from big_vit_lite import losses
from big_vit_lite import metrics
from big_vit_lite import oom
from big_vit_lite import sharding
from big_vit_lite import xla_cpu_flags

_VARIANT = flags.DEFINE_list("variant", ["Ti/16"], "ViT variant(s), e.g. Ti/16,S/16.")
_BATCH = flags.DEFINE_list("batch", ["32"], "Global batch size(s).")
_RES = flags.DEFINE_integer("res", 224, "Image resolution (square).")
_NUM_CLASSES = flags.DEFINE_integer("num_classes", 1000, "Classifier head size.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Matmul dtype (Model dtype_mm); params stay float32.")
_REMAT = flags.DEFINE_list("remat", ["none"],
                           "Model remat_policy(s): 'none' or jax.checkpoint_policies names, e.g. "
                           "none,nothing_saveable to report both.")
_SCAN = flags.DEFINE_bool("scan", False, "Run the encoder blocks under nn.scan.")
_MODEL_KW = flags.DEFINE_string("model_kw", "{}",
                                "JSON dict of extra vit.Model kwargs, e.g. '{\"gelu\": \"tanh\"}'.")
_MESH = flags.DEFINE_string("mesh", "",
                            "Mesh as axis:size pairs, e.g. 'data:-1' or 'data:2,fsdp:4' "
                            "(-1 = the remaining devices). Empty: one device, plain jit.")
_GRAD_ACCUM = flags.DEFINE_integer("grad_accum", 1,
                                   "Training step as this many sequential microbatches "
                                   "(config.grad_accum_steps).")
_MODE = flags.DEFINE_list("mode", ["train", "infer"], "Which steps to time.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per measurement.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.")
_CALIB_N = flags.DEFINE_integer("calib_n", 2048, "Side of the square calibration matmul.")
_PEAK_TFLOPS = flags.DEFINE_float("peak_tflops", None,
                                  "Datasheet peak of one device for --dtype (else looked up).")
_CPU_FLAGS = flags.DEFINE_enum("cpu_flags", "default", list(xla_cpu_flags.PRESETS),
                               "XLA CPU flag preset (see big_vit_lite/xla_cpu_flags.py); "
                               "must be applied before JAX starts, so only via this flag.")
_NUM_CPU_DEVICES = flags.DEFINE_integer(
    "num_cpu_devices", None, "Split the CPU into this many JAX devices (as the trainer's "
    "config.num_cpu_devices); use with --mesh=data:-1.")

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
  """GFLOP/s of an n x n x n matmul in `dtype` (f32 accumulation) on device 0, median of reps."""
  return statistics.median(metrics.matmul_rates(n, dtype, reps, jax.devices()[:1])) / 1e9


def parse_mesh(spec):
  """'data:2,fsdp:-1' -> sharding.make_mesh([("data", 2), ("fsdp", -1)]); '' -> None."""
  if not spec:
    return None
  try:
    cfg = sharding.parse_mesh(spec)
  except ValueError:
    raise ValueError(f"--mesh={spec!r}: expected axis:size pairs, e.g. 'data:-1' or "
                     "'data:2,fsdp:-1'") from None
  return sharding.make_mesh(cfg)


def _program_bytes(compiled):
  """Peak bytes the compiled program needs: args + outputs + temps - aliased."""
  try:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes
               + m.temp_size_in_bytes - m.alias_size_in_bytes)
  except Exception:  # pylint: disable=broad-except  # not every backend implements it
    return None


def _shardings(model, mesh, x):
  """Param and batch shardings from the model's logical axis names (None: no mesh)."""
  if mesh is None:
    return None, None
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x))["params"]
  rules = sharding.make_rules(None, mesh)
  return sharding.logical_shardings(abstract, mesh, rules), sharding.batch_sharding(mesh)


def _compile(fn, *args):
  t0 = time.perf_counter()
  traced = fn.trace(*args)
  compiled = traced.lower().compile()
  return traced, compiled, time.perf_counter() - t0


def _results(prefix, timing, *, batch, n_dev, peak, calib_gflops):
  """The JSON keys of one timed step: times, FLOPs (the whole step, all devices) and MFUs."""
  traced, compiled, compile_s, times, cpu_times = timing
  med = statistics.median(times)
  model, hw = flops_lib.matmul_flops(traced.jaxpr)
  # XLA: one device's share of a partitioned program, loops counted in full.
  xla = flops_lib.step_flops(traced, compiled, num_devices=n_dev)
  xla = float("nan") if xla is None else xla * n_dev
  out = {
      "cpu_s": statistics.median(cpu_times), "compile_s": compile_s, "step_s": med,
      "step_s_min": min(times), "step_s_max": max(times), "img_per_s": batch / med,
      "step_flops": float(model), "hw_step_flops": float(hw), "xla_step_flops": xla,
      "achieved_gflops": model / med / 1e9, "program_bytes": _program_bytes(compiled)}
  if peak:
    # XLA's figure only where it is sane (on GPU it misses the cuBLAS/cuDNN calls).
    sane = flops_lib.sane_xla_flops(xla, model)
    out.update(mfu=model / med / peak, mfu_hw=hw / med / peak,
               mfu_xla=sane / med / peak if sane else None)
  if calib_gflops:
    out["mfu_calib"] = model / med / 1e9 / calib_gflops
  return {f"{prefix}_{k}": v for k, v in out.items()}


def _time_train(model, params, x, labels, *, accum, batch_sh, params_sh, warmup, steps,
                trace_dir):
  """Times the training step (AdamW); returns (timing for _results, the params it trained)."""
  tx = optax.adamw(1e-3, weight_decay=1e-4)
  rng = jax.random.PRNGKey(0)

  def train_step(state, x, labels):
    params, opt_state = state

    def loss_fn(p, b, rng):
      logits, _ = model.apply({"params": p}, b["x"], train=True, rngs={"dropout": rng})
      return losses.softmax_xent(logits, b["labels"])

    loss, grads = grad_accum.value_and_grad(
        loss_fn, params, {"x": x, "labels": labels}, rng, accum,
        batch_sharding=batch_sh, param_shardings=params_sh)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  state = (params, jax.jit(tx.init)(params))
  traced, compiled, compile_s = _compile(jax.jit(train_step, donate_argnums=0), state, x, labels)

  def run():
    nonlocal state
    state, loss = compiled(state, x, labels)
    loss.block_until_ready()

  time_calls(run, warmup, 0)
  with (jax.profiler.trace(trace_dir, create_perfetto_trace=True) if trace_dir
        else contextlib.nullcontext()):
    times = time_calls(run, 0, steps)
  return (traced, compiled, compile_s, *times), state[0]


def bench_model(model, *, batch, res, num_classes, mode=("train", "infer"), mesh=None,
                steps=5, warmup=2, calib_gflops=None, peak_flops=None, grad_accum_steps=1,
                trace_dir=None):
  """Times one model's train and/or inference step; returns the JSON-able result dict.

  model: a flax module whose apply(..., train=) returns (logits, out).
  calib_gflops: in-process matmul rate of all devices together (None: no mfu_calib).
  peak_flops: datasheet peak of all devices together; `mfu` is against it, else against
  calib_gflops (neither: mfu None).
  grad_accum_steps: the training step's microbatches (big_vit_lite.grad_accum).
  trace_dir: if set, the timed training steps run under jax.profiler.trace (Perfetto JSON too).
  FLOPs and achieved FLOP/s are of the whole step, summed over the mesh's devices.
  """
  grad_accum.check(grad_accum_steps, batch, sharding.batch_devices(mesh))
  rng = jax.random.PRNGKey(0)
  x = jax.random.normal(rng, (batch, res, res, 3), jnp.float32)
  labels = jax.nn.one_hot(jnp.arange(batch) % num_classes, num_classes)
  params_sh, batch_sh = _shardings(model, mesh, x)
  if batch_sh is not None:
    x, labels = jax.device_put((x, labels), batch_sh)
  params = jax.jit(lambda r, x: sharding.unbox(model.init(r, x)["params"]),
                   out_shardings=params_sh)(rng, x)
  out = dict(batch=batch, res=res, params=int(sum(p.size for p in jax.tree.leaves(params))))
  kw = dict(batch=batch, n_dev=mesh.size if mesh is not None else 1, calib_gflops=calib_gflops,
            peak=peak_flops or (calib_gflops * 1e9 if calib_gflops else None))
  if "train" in mode:
    timing, params = _time_train(model, params, x, labels, accum=grad_accum_steps,
                                 batch_sh=batch_sh, params_sh=params_sh, warmup=warmup,
                                 steps=steps, trace_dir=trace_dir)
    out.update(_results("train", timing, **kw))
  if "infer" in mode:
    predict = jax.jit(lambda p, x: model.apply({"params": p}, x, train=False)[0])
    traced, compiled, compile_s = _compile(predict, params, x)
    times = time_calls(lambda: compiled(params, x).block_until_ready(), warmup, steps)
    out.update(_results("infer", (traced, compiled, compile_s, *times), **kw))
  # Contract keys: step_flops / mfu refer to the training step when timed.
  main = "train" if "train" in mode else "infer"
  for key in ("step_flops", "xla_step_flops", "achieved_gflops", "mfu", "mfu_xla"):
    out[key] = out.get(f"{main}_{key}")
  out["mfu_basis"] = "datasheet" if peak_flops else "calib" if calib_gflops else None
  return out


def peak_memory():
  """Peak device bytes (where the backend reports it) and peak host RSS."""
  stats = jax.devices()[0].memory_stats() or {}
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
  return dict(peak_device_bytes=stats.get("peak_bytes_in_use"), peak_host_rss_bytes=rss)


def check_args(variants, batches, model_kw, *, res, steps, warmup, mode=("train", "infer"),
               calib_n=1, num_classes=1, peak_tflops=None):
  """Raises ValueError (one line) for flags that could only fail later, mid-run."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from big_vit_lite.models import vit  # pylint: disable=g-import-not-at-top
  if not variants or not batches:
    raise ValueError("--variant and --batch need at least one value each")
  for variant in variants:
    if res < vit.decode_variant(variant)["patch_size"]:
      raise ValueError(f"--res={res} is smaller than the patch size of {variant!r}")
  for name, value, low in (("batch", min(batches), 1), ("res", res, 1), ("steps", steps, 1),
                           ("warmup", warmup, 0), ("calib_n", calib_n, 1),
                           ("num_classes", num_classes, 1)):
    if value < low:
      raise ValueError(f"--{name}={value}: must be at least {low}")
  if not mode or set(mode) - {"train", "infer"}:
    raise ValueError(f"--mode={','.join(mode)}: use train and/or infer, e.g. --mode=train,infer")
  if peak_tflops is not None and not peak_tflops > 0:
    raise ValueError(f"--peak_tflops={peak_tflops}: use the device's positive datasheet peak, "
                     "or leave it out")
  if not isinstance(model_kw, dict):
    raise ValueError(f"--model_kw must be a JSON dict, got {model_kw!r}")
  own_flag = {"variant": "--variant", "num_classes": "--num_classes", "dtype_mm": "--dtype",
              "remat_policy": "--remat", "scan": "--scan"}
  clash = sorted(set(model_kw) & set(own_flag))  # The JSON line would say the flag's value.
  if clash:
    raise ValueError(f"--model_kw sets {clash[0]!r}: use {own_flag[clash[0]]} instead")
  known = {f.name for f in dataclasses.fields(vit.Model)} - {"parent", "name"}
  unknown = sorted(set(model_kw) - known)
  if unknown:
    raise ValueError(f"--model_kw: unknown vit.Model argument(s) {unknown}; "
                     f"known: {', '.join(sorted(known))}")


def check_mesh_args(mesh, batches, accum, mesh_flag, num_cpu_devices):
  """One-line ValueErrors for a batch the mesh cannot split and for an unused CPU split."""
  if mesh is None and (num_cpu_devices or 1) > 1:
    raise ValueError(f"--num_cpu_devices={num_cpu_devices} without --mesh times one device: "
                     "add --mesh=data:-1")
  n = sharding.batch_devices(mesh)
  for batch in batches:
    if batch % n:
      raise ValueError(f"--batch={batch} is not divisible by the {n} devices of "
                       f"--mesh={mesh_flag} that split the batch (data and fsdp axes)")
    try:
      grad_accum.check(accum, batch, n)
    except ValueError as e:
      raise ValueError(f"--grad_accum={accum}: {e}") from None


def check_model(model, res, variant):
  """Traces the model's init (nothing is computed): a bad --model_kw / --remat raises here."""
  try:
    jax.eval_shape(model.init, jax.random.PRNGKey(0), jax.ShapeDtypeStruct((1, res, res, 3),
                                                                           jnp.float32))
  except (ValueError, TypeError) as e:
    raise ValueError(f"{variant}: {e}") from None


def build_model(variant, num_classes, dtype, remat, scan, model_kw):
  """vit.Model for the flags: remat 'none' (no remat) or a policy name."""
  from big_vit_lite.models import vit  # imported late: bench flags parse without it
  return vit.Model(**{"num_classes": num_classes, "variant": variant, "dtype_mm": dtype,
                      "remat_policy": None if remat == "none" else remat, "scan": scan,
                      **model_kw})


def main(argv):
  del argv
  try:
    distributed.set_cpu_devices(_NUM_CPU_DEVICES.value)
    try:
      model_kw = json.loads(_MODEL_KW.value)
      batches = [int(b) for b in _BATCH.value]
    except ValueError as e:
      raise ValueError(f"--model_kw must be a JSON dict and --batch integers ({e})") from None
    check_args(_VARIANT.value, batches, model_kw, res=_RES.value, steps=_STEPS.value,
               warmup=_WARMUP.value, mode=_MODE.value, calib_n=_CALIB_N.value,
               num_classes=_NUM_CLASSES.value, peak_tflops=_PEAK_TFLOPS.value)
    mesh = parse_mesh(_MESH.value)
    check_mesh_args(mesh, batches, _GRAD_ACCUM.value, _MESH.value, _NUM_CPU_DEVICES.value)
    for variant in _VARIANT.value:  # A model the flags cannot build fails here, in one line.
      for remat in _REMAT.value:
        check_model(build_model(variant, _NUM_CLASSES.value, _DTYPE.value, remat,
                                _SCAN.value, model_kw), _RES.value, variant)
  except ValueError as e:
    sys.exit(f"bench: {e}")
  dev = jax.devices()[0]
  peak = (_PEAK_TFLOPS.value * 1e12 if _PEAK_TFLOPS.value
          else devices.datasheet_peak(dev, _DTYPE.value))
  n_dev = mesh.size if mesh is not None else 1

  for variant, batch, remat in itertools.product(_VARIANT.value, batches, _REMAT.value):
    model = build_model(variant, _NUM_CLASSES.value, _DTYPE.value, remat,
                        _SCAN.value, model_kw)
    # Device 0's matmul rate times the device count; CPU devices share the cores, and one
    # device's matmul already uses them all: there it is the whole machine's.
    calib_before = calibrate_matmul(_CALIB_N.value, _DTYPE.value)
    calib_devices = 1 if dev.platform == "cpu" else n_dev
    try:
      with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        res = bench_model(model, batch=batch, res=_RES.value,
                          num_classes=_NUM_CLASSES.value, mode=tuple(_MODE.value),
                          mesh=mesh, steps=_STEPS.value, warmup=_WARMUP.value,
                          calib_gflops=calib_before * calib_devices,
                          peak_flops=peak * n_dev if peak else None,
                          grad_accum_steps=_GRAD_ACCUM.value)
    except jax.errors.JaxRuntimeError as e:
      if not oom.is_oom(e):
        raise
      sys.exit(f"bench: {variant}: " + oom.message(
          e, what="the benchmark", batch_size=batch, devices=sharding.batch_devices(mesh),
          grad_accum_steps=_GRAD_ACCUM.value))
    calib_after = calibrate_matmul(_CALIB_N.value, _DTYPE.value)
    line = dict(variant=variant, dtype=_DTYPE.value, remat=remat,
                attention=model.resolved_attention(), scan=_SCAN.value,
                grad_accum_steps=_GRAD_ACCUM.value, mesh=_MESH.value or None, model_kw=model_kw,
                cpu_flags=_CPU_FLAGS.value, host_malloc=hostmem.status(),
                device_kind=dev.device_kind, num_devices=n_dev, jax_version=jax.__version__,
                calib_gflops=calib_before, calib_gflops_after=calib_after,
                datasheet_peak_tflops=peak / 1e12 if peak else None, **res, **peak_memory())
    print(json.dumps(line), flush=True)


def _apply_cpu_flags_from_argv():
  # XLA reads XLA_FLAGS once, when the backend starts; absl parses flags
  # later than that would allow, so peek at argv here, before any jax call.
  for arg in sys.argv[1:]:
    if arg.startswith("--cpu_flags="):
      xla_cpu_flags.apply(arg.split("=", 1)[1])


if __name__ == "__main__":
  _apply_cpu_flags_from_argv()
  app.run(main)
