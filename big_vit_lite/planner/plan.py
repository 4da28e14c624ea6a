"""Memory and FLOPs per device for a training config on a mesh, without allocating the model.

  python -m big_vit_lite.plan --config=configs/vit_l16.py --mesh=data:64,fsdp:4 --device=tpu_v4
  python -m big_vit_lite.plan --config=configs/demo.py --mesh=data:2,fsdp:2 --compile --json

Parameter, optimizer-state and EMA (config.ema_decay) shapes come from `jax.eval_shape` of the
real model init and optimizer (`optim.make`), sharded by the trainer's rules on the requested
mesh: exact. Gradients are the size of the sharded f32 params; activations and FLOPs are
analytic, fitted to XLA's compiled memory analysis. With config.grad_accum_steps = k the
activations are those of a microbatch (local_batch / k), plus a float32 gradient accumulator
when k > 1; the gradient reductions happen once per microbatch.

--compile also compiles the trainer's step (train_step.py) against abstract inputs on
simulated CPU devices in a subprocess (planner/cpu.py) (any mesh size works on one machine) and adds XLA's
memory analysis and FLOPs (compiled_* fields), what tests/test_plan.py checks the formulas
against.

--topology=SLICE (v5p-256, v4-32, v5litepod-16, v5p:8x8x8) plans for a TPU slice: its chips'
HBM and peak, a -1 mesh axis sized to its devices, "auto" model settings as a TPU takes them
(vit.Model: bfloat16 matmuls and residual stream, XLA attention). With --compile
the TPU compiler (libtpu, the [tpu] extra) compiles the trainer's step for the slice on this
CPU machine and adds its figures (tpu_* fields: memory per device, fits, the cost model's step
time, img/s per chip and MFU, collectives): planner/tpu.py, docs/tpu.md.

  python -m big_vit_lite.plan --config=configs/vit_l16.py --topology=v5p-256 --compile

With --json the last line is the plan as one JSON object (its keys: `plan`'s dict, and
cpu.compiled_stats'). How the formulas were fitted, and their known gaps: benchmarks/NOTES.md,
section "Plan, bench, FLOPs, metrics".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags

from big_vit_lite.config import config_loading
from big_vit_lite.logs import console
from big_vit_lite.runtime import sharding
from big_vit_lite.data import pp as pp_lib
from big_vit_lite.runtime.devices import DEVICES
from big_vit_lite.planner import assemble
from big_vit_lite.planner import cpu
from big_vit_lite.planner import formulas
from big_vit_lite.planner import gpu
from big_vit_lite.planner import report
from big_vit_lite.planner import tpu

# Image side used when input.pp names none (datasets decoded at their native
# size).
_NATIVE_RES = {
    "fashion_mnist": 28,
    "mnist": 28,
    "mnist10k": 28,
    "animal_mnist": 28,
    "cifar10": 32,
    "cifar100": 32,
}


def parse_mesh(spec) -> dict:
  """--mesh 'data:64,fsdp:4' or config.mesh [("data", 64), ("fsdp", 4)] -> {'data': 64, ...}."""
  if isinstance(spec, str):
    pairs = sharding.parse_mesh(spec)
  else:
    pairs = [tuple(a) for a in spec]
  mesh = dict(pairs)
  if (
      len(mesh) != len(pairs)
      or not set(mesh) <= set(sharding.MESH_AXES)
      or not all(isinstance(size, int) and size >= 1 for size in mesh.values())
  ):
    raise ValueError(
        f"mesh {spec!r}: the planner needs distinct {'/'.join(sharding.MESH_AXES)} "
        "axes with positive sizes (it cannot count devices for -1): pass e.g. "
        "--mesh=data:64,fsdp:4"
    )
  return mesh


def image_res(config, override: int | None = None) -> int:
  """The training image side: --res, else what input.pp gives "image", else the dataset's."""
  if override is not None:
    return int(override)
  pp = str(config.input.get("pp", ""))
  hw = None
  if pp.strip():
    hw = pp_lib.output_hw(pp, channels=assemble.image_channels(config))
  if hw and hw[0] != hw[1]:
    raise ValueError(
        f"input.pp={pp!r} gives {hw[0]}x{hw[1]} images; the planner models "
        "square ones: pass --res=N"
    )
  name = str(config.input.data.get("name", "")).split(":")[0].split("/")[0]
  if not hw and name not in _NATIVE_RES:
    raise ValueError(
        f"cannot tell the training image size from input.pp={pp!r}; pass --res=N"
    )
  if hw:
    return hw[0]
  return _NATIVE_RES[name]


def _abstract_mesh(mesh: dict):
  return jax.sharding.AbstractMesh(tuple(mesh.values()), tuple(mesh))


def _axes_size(axes, mesh: dict) -> int:
  return math.prod(mesh[a] for a in sharding.as_axes(axes))


def _block_params(params) -> int:
  """How many of the params are the encoder blocks' (looped or not)."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  return sum(
      math.prod(x.shape)
      for path, x in leaves
      if "encoderblock" in jax.tree_util.keystr(path)
  )


def resolve_device(device: str) -> str:
  """--device as people write it ('H100', 'v5e', 'TPU-v4') -> its key in devices.DEVICES."""
  name = device.lower().replace("-", "_")
  for key in (name, f"tpu_{name}"):
    if key in DEVICES:
      return key
  raise ValueError(
      f"--device={device!r}: known devices are {', '.join(DEVICES)}"
  )


def _state_bytes(layout):
  """Per-device bytes of params, optimizer state, gradients and EMA (train_state.Layout's)."""
  params_b = sharding.describe(layout.params_sh, layout.params_abstract)
  grads = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32),
      layout.params_abstract,
  )
  # The EMA of the weights (ema.py) is a copy of the params, sharded like them.
  ema_b = 0
  if layout.ema:
    ema_b = params_b
  return dict(
      params=params_b,
      opt=sharding.describe(layout.opt_sh, layout.opt_abstract),
      grad=sharding.describe(layout.params_sh, grads),
      ema=ema_b,
  )


# Each compiler's formulas: (activation bytes, gathered weight bytes).
_COMPILER_FORMULAS = {
    "tpu": (formulas.tpu_activation_bytes, formulas.tpu_weight_bytes),
    "gpu": (formulas.gpu_activation_bytes, formulas.gpu_weight_bytes),
}


def _formulas(model, platform, key, arch, params, tp, fsdp, act_kw):
  """The platform's formulas: ((remat, scan) -> activation bytes, remat -> FSDP's
  gathered weight bytes), the TPU or GPU compiler's (the GPU's fitted per GPU: key,
  its devices.DEVICES key), or for the CPU the ones fitted to XLA:CPU (no scan term).
  scan: the blocks under nn.scan (default: the model's).
  """
  if platform in _COMPILER_FORMULAS:
    activation_bytes, weight_bytes = _COMPILER_FORMULAS[platform]
    if platform == "gpu":
      activation_bytes = functools.partial(activation_bytes, gpu=key)
    opts = dict(
        dataclasses.asdict(model.block_options()),
        attention=model.resolved_attention(platform),
        dtype_act=model.resolved_dtype_act(platform),
        remat_policy=model.remat_policy,
    )

    def act(remat, scan=model.scan):
      with_scan = dict(opts, scan=scan)
      return activation_bytes(arch, remat=remat, opts=with_scan, **act_kw)

    gather = functools.partial(
        weight_bytes,
        _block_params(params),
        arch["depth"],
        tp,
        fsdp,
        mm_bytes=act_kw["mm_bytes"],
    )
  else:

    def act(remat, scan=model.scan):
      del scan  # (XLA:CPU's formula has no term for it)
      return formulas.activation_bytes(arch, remat=remat, **act_kw)

    gather = functools.partial(
        formulas.gather_bytes, sum_params(params), arch["depth"], tp, fsdp
    )
  return act, gather


def sum_params(params) -> int:
  """How many numbers the params hold."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def plan(
    config,
    mesh: dict,
    device: str,
    res: int | None = None,
    *,
    platform: str | None = None,
    built=None,
) -> dict:
  """The analytic plan as a dict: sizes, *_bytes_per_device, fits, FLOPs and step time.

  flops_per_step: model FLOPs (the matmuls of forward and backward on the global batch, as MFU
  counts them); hw_flops_per_step adds remat's recomputation. fits_with_remat: None where it
  fits or remat is on, else whether remat_policy='nothing_saveable' would fit (on a GPU with
  the blocks under scan; total_bytes_with_remat: its total). ignored_px: the
  image rows/columns the patchify drops; unsplit_params: param dims the mesh axes do not divide.
  platform: whose "auto" model settings (vit.Model: matmul and residual dtypes, attention)
  and whose compiler's activations the plan follows: "tpu" (tpu_activation_bytes: the TPU's
  tiled residuals), "gpu" (gpu_activation_bytes: XLA:GPU's residuals, cuDNN's
  attention) or "cpu" (activation_bytes, fitted to XLA:CPU; what plan --compile
  without a target compiles); default: the device's, "tpu" or "gpu".
  built: assemble.assemble's for this mesh, if already made.
  """
  key = resolve_device(device)
  spec = DEVICES[key]
  if platform is None and key.startswith("tpu_"):
    platform = "tpu"
  elif platform is None:
    platform = "gpu"
  res = image_res(config, res)
  n_dev = math.prod(mesh.values())
  if built is None:
    built = assemble.assemble(config, _abstract_mesh(mesh), res, platform)
  model = built.model.module
  params = built.layout.params_abstract
  batch, accum = built.batch_size, built.accum_steps
  local_batch = batch // sharding.batch_devices(built.mesh)
  arch = dict(model.arch(), mlp=model.mlp)  # (SwiGLU's third MLP matmul counts)
  num_classes = int(config.model.get("num_classes", 0) or 0)
  # From the model object, so that the model's own defaults count for keys the
  # config omits.
  tokens = (
      (res // arch["patch_size"]) ** 2
      + int(model.pool_type == "tok")
      + int(model.distill_token)
      + model.reg_tokens
  )
  remat = model.remat_policy not in (None, "none")
  mm_bytes = jnp.dtype(model.resolved_dtype_mm(platform)).itemsize
  channels = assemble.image_channels(config)
  rules = dict(built.rules)
  tp = _axes_size(rules.get("mlp"), mesh)
  fsdp = _axes_size(rules.get("embed"), mesh)
  # Weights it does not divide stay whole.
  if arch["width"] % fsdp:
    fsdp = 1
  n_params = sum_params(params)
  state_b = _state_bytes(built.layout)
  # One microbatch's activations alive at a time (grad_accum's lax.scan), and a
  # float32 running sum of the gradients sharded like the params.
  act_kw = dict(
      local_batch=local_batch // accum,
      tokens=tokens,
      mm_bytes=mm_bytes,
      tp=tp,
      num_classes=num_classes,
      image_numel=res * res * channels,
      dropout=model.dropout > 0,
  )
  act, gather = _formulas(model, platform, key, arch, params, tp, fsdp, act_kw)
  act_b = act(remat=remat)
  accum_b = 0
  if accum > 1:
    accum_b = state_b["grad"]
  batch_b = local_batch * (res * res * channels + num_classes) * 4
  gathered_b = gather(remat)
  total_b = sum(state_b.values()) + accum_b + act_b + batch_b + gathered_b
  usable = formulas.USABLE_FRACTION * spec.hbm_bytes
  # Without remat and too big: what remat (nothing_saveable) would need, on a
  # GPU with the blocks under scan, as the report then advises (docs/gpu.md:
  # unrolled, XLA:GPU may keep every block's recomputed activations).
  remat_total_b = None
  fits_with_remat = None
  if not remat and total_b > usable:
    scan_with_remat = model.scan or platform == "gpu"
    remat_act_b = act(remat=True, scan=scan_with_remat)
    remat_total_b = total_b - act_b + remat_act_b - gathered_b + gather(True)
    fits_with_remat = bool(remat_total_b <= usable)
  model_flops, hw_flops = formulas.train_flops(
      arch,
      batch=batch,
      res=res,
      num_classes=num_classes,
      tokens=tokens,
      remat=remat,
      channels=channels,
      remat_policy=model.remat_policy,
  )
  peak = spec.f32_flops
  if mm_bytes == 2:
    peak = spec.bf16_flops
  compute_s, comm_s = formulas.step_time(
      spec, peak, hw_flops, n_dev, n_params, mesh, tp, fsdp, accum
  )
  step_s = max(compute_s, comm_s)  # XLA overlaps the collectives with compute.
  return dict(
      variant=config.model.get("variant"),
      arch=dict(arch),
      res=res,
      tokens=tokens,
      mesh=mesh,
      devices=n_dev,
      device=spec.name,
      global_batch=batch,
      local_batch=local_batch,
      grad_accum_steps=accum,
      micro_batch=local_batch // accum,
      remat=remat,
      scan=bool(model.scan),
      platform=platform,
      dtype_mm=str(model.resolved_dtype_mm(platform)),
      dtype_act=str(model.resolved_dtype_act(platform)),
      attention=model.resolved_attention(platform),
      num_params=int(n_params),
      **{f"{k}_bytes_per_device": int(b) for k, b in state_b.items()},
      grad_accum_bytes_per_device=int(accum_b),
      act_bytes_per_device=int(act_b),
      batch_bytes_per_device=int(batch_b),
      fsdp_gather_bytes_per_device=int(gathered_b),
      total_bytes_per_device=int(total_b),
      hbm_bytes=int(spec.hbm_bytes),
      fits=bool(total_b <= usable),
      fits_with_remat=fits_with_remat,
      total_bytes_with_remat=remat_total_b,
      flops_per_step=model_flops,
      hw_flops_per_step=hw_flops,
      compute_time_s=compute_s,
      comm_time_s=comm_s,
      step_time_s=step_s,
      mfu_bound=model_flops / n_dev / peak / step_s,
      unsplit_params=built.unsplit,
      # The patchify (a VALID strided conv, as in big_vision) ignores the last
      # res % patch px.
      ignored_px=res % arch["patch_size"],
  )


def _plan_on_devices(config, mesh_spec, n_devices, device_key, what, res):
  """plan() for a target of n_devices (a TPU slice, GPU hosts: `what`, as its flags name
  it): the mesh's -1 axis sized to them."""
  pairs = mesh_spec
  if isinstance(mesh_spec, str):
    pairs = sharding.parse_mesh(mesh_spec)
  sizes = assemble.resolve_mesh(pairs, n_devices, what)
  return plan(config, parse_mesh(list(sizes.items())), device_key, res)


def plan_on_slice(
    config,
    mesh_spec,
    topology: str,
    res: int | None = None,
    compile_step: bool = False,
    time_by_depth: bool = False,
) -> dict:
  """plan() for a TPU slice (`plan --topology=SLICE [--compile]`): its chips, a -1 mesh axis
  sized to its devices, "auto" model settings as on a TPU (dtype_mm and dtype_act bfloat16,
  attention "xla"); with compile_step, the TPU compiler's
  figures for the trainer's step (tpu.compiled_stats: the tpu_* fields); with
  time_by_depth too, the step time is step_time_by_depth's.
  """
  tpu_slice = tpu.parse_slice(topology)
  # The model runs on the TPU, not on this host: plan() decides its "auto"
  # settings for the TPU (train_setup.make_model's target).
  p = _plan_on_devices(
      config,
      mesh_spec,
      tpu_slice.devices,
      tpu_slice.device_key,
      f"--topology={topology}",
      res,
  )
  if compile_step:
    p.update(tpu.compiled_stats(config, p["mesh"], p["res"], tpu_slice))
  if compile_step and time_by_depth and p["tpu_fits"]:
    times = step_time_by_depth(config, mesh_spec, topology, res)
    step_s = None
    if all(times):
      step_s = times[0] + (p["arch"]["depth"] - 1) * (times[1] - times[0])
    p.update(
        tpu.estimates(
            step_s,
            p["global_batch"],
            p["tpu_model_flops"],
            tpu_slice,
        ),
        tpu_est_by_depth=times,
    )
  return p


def plan_on_gpus(
    config,
    mesh_spec,
    gpu_host: str,
    hosts: int = 1,
    res: int | None = None,
    compile_step: bool = False,
) -> dict:
  """plan() for GPU hosts (`plan --gpu=h100x8 [--hosts=N] [--compile]`): a -1 mesh axis
  sized to their GPUs, "auto" model settings as on a GPU; with compile_step, XLA's GPU
  compiler's figures for the trainer's step (gpu.compiled_stats: the gpu_* fields).
  """
  host = gpu.parse_host(gpu_host, hosts)
  p = _plan_on_devices(
      config,
      mesh_spec,
      host.devices,
      gpu.GPUS[host.gpu].device_key,
      f"--gpu={gpu_host} --hosts={hosts}",
      res,
  )
  if compile_step:
    p.update(gpu.compiled_stats(config, p["mesh"], p["res"], host))
  return p


def step_time_by_depth(config, mesh_spec, topology, res=None) -> tuple:
  """The TPU cost model's step times (seconds; None: no estimate) of the config's
  step unrolled at depth 1 and at depth 2.

  Why: under nn.scan the cost analysis holds the layer loop's body once, and
  compiled_stats scales the time by FLOPs, which scales the work outside the
  loop too (for a data-parallel L/16 on v5p-256, the update of 304M replicated
  params: 202 ms scaled, 72 ms this way); a full unrolled L/16 compiles for
  over 25 minutes on a 2-core host. The blocks are identical, so the time is
  affine in the depth: t(depth) = t(1) + (depth - 1) * (t(2) - t(1)); for
  S/16 that came within 2% of the full unrolled compile's (benchmarks/NOTES.md).
  A grad_accum loop stays scaled.
  """
  times = []
  for depth in (1, 2):
    shallow = config.copy_and_resolve_references()
    with shallow.unlocked():  # (a config of one's own may lack the keys)
      shallow.model.scan = False
      shallow.model.depth = depth
    p = plan_on_slice(shallow, mesh_spec, topology, res, compile_step=True)
    times.append(p["tpu_est_step_s"])
  return tuple(times)


def define_flags():
  config_loading.define_config_flag()
  flags.DEFINE_string(
      "mesh",
      None,
      "Mesh as axis:size pairs, e.g. data:64,fsdp:4 (default: config.mesh).",
  )
  flags.DEFINE_string(
      "device",
      "tpu_v4",
      f"Device kind for peak FLOP/s and memory: {', '.join(DEVICES)}.",
  )
  flags.DEFINE_integer(
      "res", None, "Training image side (default: from input.pp)."
  )
  flags.DEFINE_bool(
      "json", False, "Print the plan as one JSON object on the last line."
  )
  flags.DEFINE_string(
      "topology",
      None,
      "A TPU slice (v5p-256, v4-32, v5litepod-16, "
      "v5p:8x8x8): plan for its chips; with --compile, the TPU compiler's figures.",
  )
  flags.DEFINE_string(
      "gpu",
      None,
      f"A GPU host ({', '.join(f'{g}x8' for g in gpu.GPUS)}): plan for its "
      "GPUs; with --compile, XLA's GPU compiler's figures (docs/gpu.md).",
  )
  flags.DEFINE_integer("hosts", 1, "With --gpu: how many such hosts.")
  flags.DEFINE_bool(
      "compile",
      False,
      "Also AOT-compile the trainer's step (on simulated CPU "
      "devices, or for --topology with the TPU compiler) and report the compiler's "
      "memory analysis (slow for big models).",
  )
  flags.DEFINE_bool(
      "time_by_depth",
      False,
      "With --topology and --compile: the estimated step time from the step "
      "unrolled at depth 1 and 2, extrapolated (two more, quick compiles; "
      "better than the FLOPs-scaled time of a scanned model).",
  )
  flags.DEFINE_bool(
      "compiled_only",
      False,
      "Internal: print only the compiled stats (subprocess).",
  )


def main(argv):
  del argv
  # Other libraries' INFO lines (libtpu, orbax) only with --verbosity=1.
  console.keep_log_readable()
  f = flags.FLAGS
  if f.gpu and f.compile:
    # Before jax starts a backend.
    gpu.prepare_environment()
  try:
    config = config_loading.loaded(f.config)
    if config is None:
      raise app.UsageError("--config=configs/FILE.py[:arg] is required")
    mesh_spec = f.mesh or config.get("mesh") or [("data", 1)]
    if f.time_by_depth and not (f.topology and f.compile):
      raise ValueError(
          "--time_by_depth estimates with the TPU compiler: add --topology=SLICE"
          " and --compile"
      )
    if f.topology and f.gpu:
      raise ValueError("--topology and --gpu: plan for one target at a time")
    if f.gpu:
      p = plan_on_gpus(
          config, mesh_spec, f.gpu, f.hosts, f.res, compile_step=f.compile
      )
    elif f.topology:
      p = plan_on_slice(
          config,
          mesh_spec,
          f.topology,
          f.res,
          compile_step=f.compile,
          time_by_depth=f.time_by_depth,
      )
    else:
      mesh = parse_mesh(mesh_spec)
      if f.compiled_only:
        print(
            json.dumps(
                cpu.compiled_stats(config, mesh, image_res(config, f.res))
            )
        )
        return
      # With --compile the plan is checked against XLA:CPU's memory analysis.
      platform = None
      if f.compile:
        platform = "cpu"
      p = plan(config, mesh, f.device, f.res, platform=platform)
      if f.compile:
        overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
        p.update(
            cpu.compiled_stats_subprocess(
                config_flags.get_config_filename(f["config"]),
                overrides,
                mesh,
                p["res"],
            )
        )
  except ValueError as e:
    sys.exit(f"plan: {e}")
  print(report.format_report(p))
  if f.json:
    print(json.dumps(p))


def run():
  """The command line: `python -m big_vit_lite.plan ...` (big_vit_lite/plan.py)."""
  define_flags()
  app.run(
      main,
      flags_parser=functools.partial(config_loading.parse_flags, prog="plan"),
  )


if __name__ == "__main__":
  run()
