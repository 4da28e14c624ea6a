"""Memory and FLOPs per device for a training config on a mesh, without allocating the model.

  python -m big_vit_lite.plan --config=configs/vit_l16.py --mesh=data:64,fsdp:4 --device=tpu_v4
  python -m big_vit_lite.plan --config=configs/demo.py --mesh=data:2,fsdp:2 --compile --json

Parameter and optimizer-state shapes come from `jax.eval_shape` of the real model init and the
real optimizer (`optim.make`), sharded with the config's logical-axis rules on the requested mesh:
those figures are exact. Gradients are the size of the (sharded) f32 params. Activations and
FLOPs are analytic (formulas below, calibrated against XLA's compiled memory analysis).

config.grad_accum_steps = k (default 1; see big_vit_lite/grad_accum.py) runs each device's batch
as k microbatches in sequence: activations are those of local_batch / k, plus a float32 gradient
accumulator the size of the gradients when k > 1; FLOPs per step are unchanged, the gradient
reductions across devices happen once per microbatch (step_time_s counts k of them). k must
divide the per-device batch (the same check as the trainer's).

--compile additionally lowers and compiles the train step (forward, softmax cross-entropy,
backward, optimizer update, state donated) against abstract inputs on simulated CPU devices in a
subprocess (so any mesh size works on one machine) and prints XLA's memory analysis and FLOPs
next to the analytic ones. That is what tests/test_plan.py checks the formulas against. It takes
seconds for small models and minutes for ViT-g; the compiled CPU program is a proxy for the
accelerator's (other fusion and scheduling), good to ~10-20%. One known gap: XLA's CPU
scheduler hoists remat's recomputation, so with remat on, the CPU-compiled temporaries are
those of a run without remat (the analytic figure is what a TPU/GPU scheduler achieves).

With --json the last line is one JSON object: params_bytes_per_device, opt_bytes_per_device,
grad_bytes_per_device, act_bytes_per_device, total_bytes_per_device, hbm_bytes, fits,
flops_per_step (model FLOPs: the matmuls of fwd+bwd, whole global batch, as bench and the
trainer count them for MFU), hw_flops_per_step (+ remat recomputation), fits_with_remat (None
where it fits or remat is on; else whether remat_policy='nothing_saveable' would fit, and
total_bytes_with_remat), step_time_s, mfu_bound, grad_accum_steps, micro_batch (per device),
grad_accum_bytes_per_device, arch (width, depth, mlp_dim, num_heads, patch_size), ignored_px
(image rows/columns the patchify drops: res % patch), unsplit_params (param dims the mesh axes
do not divide: kept whole, or FSDP moved to another dim, exactly as the trainer shards them;
also a `note:` line of the report), and, with --compile, compiled_* fields
(compiled_flops_per_device: XLA's count, scanned loops counted once per iteration;
compiled_model_flops: the jaxpr's matmul count, the one flops_per_step predicts: big_vit_lite/flops.py).
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys

from absl import app
from absl import flags

from big_vit_lite.devices import DEVICES, GIB

# XLA needs room beyond live buffers (fragmentation, collective and conv scratch, program):
# a plan "fits" if its peak is under this fraction of the device memory.
USABLE_FRACTION = 0.9

_MESH_AXES = ("data", "fsdp", "model")
# Image side used when input.pp names none (datasets decoded at their native size).
_NATIVE_RES = {"fashion_mnist": 28, "mnist": 28, "mnist10k": 28, "animal_mnist": 28,
               "cifar10": 32, "cifar100": 32}


def parse_mesh(spec: str) -> dict:
  """'data:64,fsdp:4' -> {'data': 64, 'fsdp': 4} (order kept; -1 is not allowed here)."""
  from big_vit_lite import sharding
  mesh = {}
  for part in spec.split(","):
    name, sep, size = part.strip().partition(":")
    if not sep or name not in _MESH_AXES or not size.isdigit() or int(size) < 1 or name in mesh:
      raise ValueError(f"--mesh={spec!r}: expected distinct axis:size pairs with axes "
                       f"{'/'.join(_MESH_AXES)} and positive sizes, e.g. 'data:64,fsdp:4'"
                       f"{sharding._axis_hint(name)}")  # pylint: disable=protected-access
    mesh[name] = int(size)
  return mesh


def mesh_from_config(mesh_cfg) -> dict:
  """config.mesh ([("data", 8), ("fsdp", -1)]) -> dict; -1 axes need --mesh instead."""
  if isinstance(mesh_cfg, str):
    return parse_mesh(mesh_cfg)
  for name, size in mesh_cfg:
    if size == -1:
      raise ValueError(f"config.mesh has {name}:-1 (fill all devices): the planner does not know "
                       "the device count; pass --mesh=data:N,fsdp:M")
  try:
    return parse_mesh(",".join(f"{name}:{size}" for name, size in mesh_cfg))
  except ValueError:
    raise ValueError(f"config.mesh={tuple(tuple(a) for a in mesh_cfg)}: use distinct "
                     f"{'/'.join(_MESH_AXES)} axes with positive integer sizes, or pass "
                     "--mesh=data:N,fsdp:M") from None


def image_res(config, override: int | None = None) -> int:
  """The training image side: --res, else what input.pp gives "image", else the dataset's."""
  if override is not None:
    if int(override) < 1:
      raise ValueError(f"--res={override}: use a positive image side, or leave it out to take "
                       "the size input.pp gives")
    return int(override)
  pp = str(config.input.get("pp", ""))
  if pp.strip():
    from big_vit_lite.data import pp as pp_lib
    hw = pp_lib.output_hw(pp, channels=image_channels(config))
    if hw and hw[0] != hw[1]:
      raise ValueError(f"input.pp={pp!r} gives {hw[0]}x{hw[1]} images; the planner models "
                       "square ones: pass --res=N")
    if hw:
      return hw[0]
  name = str(config.input.data.get("name", "")).split(":")[0].split("/")[0]
  if name in _NATIVE_RES:
    return _NATIVE_RES[name]
  raise ValueError(f"cannot tell the training image size from input.pp={pp!r}; pass --res=N")


def image_channels(config) -> int:
  """Channels of the training images: `channels=N` of a decode op in input.pp, else 3."""
  found = re.findall(r"channels\s*=\s*(\d+)", str(config.input.get("pp", "")))
  return int(found[-1]) if found else 3


def _abstract_mesh(mesh: dict):
  import jax
  return jax.sharding.AbstractMesh(tuple(mesh.values()), tuple(mesh))


def _rules(config, mesh: dict):
  """The trainer's logical-axis rules (config.sharding_rules or its defaults) for this mesh."""
  from big_vit_lite import sharding
  return sharding.make_rules(config.get("sharding_rules"), _abstract_mesh(mesh))


def state_shardings(boxed, params, opt_state, mesh, rules, unsplit=None):
  """(param shardings, opt-state shardings) exactly as the trainer makes them (sharding.py).

  `mesh` is a jax Mesh or AbstractMesh: the planner needs no devices for the shapes.
  """
  from big_vit_lite import sharding
  param_sh = sharding.logical_shardings(boxed, mesh, rules, unsplit=unsplit)
  return param_sh, sharding.like_params_shardings(opt_state, params, param_sh, mesh)


def _axes_size(axes, mesh: dict) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh[a] for a in axes)


def _model_kwargs(config) -> dict:
  return config.model.to_dict() if hasattr(config.model, "to_dict") else dict(config.model)


def abstract_state(config, res: int):
  """(boxed abstract params, abstract opt state, arch dict) via eval_shape: nothing allocated."""
  import jax
  import jax.numpy as jnp
  from big_vit_lite import optim
  from big_vit_lite.models import vit
  model = vit.Model(**_model_kwargs(config))
  images = jax.ShapeDtypeStruct((1, res, res, image_channels(config)), jnp.float32)
  boxed = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x)["params"], images)
  params = _unbox(boxed)
  # The schedule does not change any shape; epoch-based configs (total_steps None) get a
  # stand-in step count long enough for any warmup.
  total = config.get("total_steps") or 10**9
  opt = optim.make(config, params, total_steps=int(total), steps_per_epoch=10**6,
                   batch_size=config.input.batch_size)
  opt_state = jax.eval_shape(opt.tx.init, params)
  return model, boxed, params, opt, opt_state


def _unbox(tree):
  import flax.linen as nn
  return nn.meta.unbox(tree)


def activation_bytes(arch: dict, *, local_batch: int, tokens: int, remat: bool, mm_bytes: int,
                     tp: int = 1, num_classes: int = 0, image_numel: int = 0,
                     dropout: bool = False) -> int:
  """Peak bytes of activations kept for the backward pass on one device.

  Per block and example, with T tokens, width D, MLP width M and H heads (M and H divided by the
  tensor-parallel degree tp), the backward pass reads about
      T*D * (3.4 x 4 B + 2 x mm B)      LayerNorm in/outs, residuals; q/k/v/attention output
    + T*M * (1.9 x 4 B + 1.85 x mm B)   MLP hidden before/after GELU and GELU's intermediates
    + H*T^2 * 1.85 x 4 B                attention logits and probabilities (f32)
  (mm B = bytes of the matmul dtype), and with dropout another 8 B per element of the three
  dropped tensors (MLP hidden, attention and MLP outputs: random bits and the mask).
  The coefficients are fitted to XLA's compiled memory
  analysis without remat (tests/test_plan.py checks them to 10%); a by-hand count of the tensors
  backward needs gives 6/4, 2, 1 copies, so they are in the right place.
  With remat (a policy that saves nothing inside a block, e.g. nothing_saveable) only each
  block's input (T*D f32) is kept, plus one block recomputed at a time during backward. XLA's
  CPU scheduler does not honour remat boundaries (it hoists the recomputation), so the CPU
  compile cannot check this case; TPU/GPU schedulers do.
  """
  t, d = tokens, arch["width"]
  # A tensor-parallel degree that does not divide the MLP width / heads leaves them whole
  # (sharding.fit_spec).
  m = arch["mlp_dim"] / tp if arch["mlp_dim"] % tp == 0 else arch["mlp_dim"]
  h = arch["num_heads"] // tp if arch["num_heads"] % tp == 0 else arch["num_heads"]
  per_block = (t * d * (3.4 * 4 + 2 * mm_bytes) + t * m * (1.9 * 4 + 1.85 * mm_bytes)
               + 1.85 * 4 * h * t * t)
  if dropout:
    per_block += 8 * (t * m + 2 * t * d)
  if remat:
    per_example = arch["depth"] * t * d * 4 + per_block
  else:
    per_example = arch["depth"] * per_block
  # Outside the blocks: the patchified image, embeddings (+ posemb), final LayerNorm, logits.
  per_example += image_numel * 4 + 6 * t * d * 4 + num_classes * 4 * 2
  return int(local_batch * per_example)


def train_flops(arch: dict, *, batch: int, res: int, num_classes: int, tokens: int,
                remat: bool, channels: int = 3) -> tuple[float, float]:
  """(model FLOPs, hardware FLOPs) of one train step on the global batch.

  Model FLOPs: the matmuls of forward + backward (flops.vit_train_flops: 3x the forward less
  the image's gradient), the figure bench and the trainer count from the step's jaxpr for
  MFU. Hardware: plus remat's recomputation of the blocks' forward.
  """
  from big_vit_lite import flops as flops_lib
  kw = dict(tokens=tokens, patches=(res // arch["patch_size"]) ** 2, channels=channels,
            num_classes=num_classes)
  model = flops_lib.vit_train_flops(arch, batch=batch, **kw)
  blocks = flops_lib.vit_forward_flops(arch, **kw)["blocks"]
  return float(model), float(model + (blocks * batch if remat else 0))


def resolve_device(device: str) -> str:
  """--device as people write it ('H100', 'v5e', 'TPU-v4') -> its key in devices.DEVICES."""
  name = device.lower().replace("-", "_")
  for key in (name, f"tpu_{name}"):
    if key in DEVICES:
      return key
  raise ValueError(f"--device={device!r}: known devices are {', '.join(DEVICES)}")


def plan(config, mesh: dict, device: str, res: int | None = None) -> dict:
  """The analytic plan (see module docstring) as a dict."""
  import jax
  import jax.numpy as jnp
  from big_vit_lite import grad_accum
  from big_vit_lite import sharding
  spec = DEVICES[resolve_device(device)]
  res = image_res(config, res)
  n_dev = math.prod(mesh.values())
  rules = _rules(config, mesh)
  batch = int(config.input.batch_size)
  # The trainer splits its input batch over the mesh's data and fsdp axes (sharding.py).
  dp = sharding.batch_devices(_abstract_mesh(mesh))
  if batch >= 1 and batch % dp:
    raise ValueError(f"input.batch_size={batch} is not divisible by the {dp} data-parallel "
                     f"devices of mesh {mesh}; change the batch size or the mesh")
  accum = grad_accum.check(config.get("grad_accum_steps", 1), batch, dp)
  local_batch = batch // dp
  micro_batch = local_batch // accum
  model, boxed, params, _, opt_state = abstract_state(config, res)
  arch = model.arch()
  num_classes = int(config.model.get("num_classes", 0) or 0)
  # From the model object, so that the model's own defaults count for keys the config omits.
  tokens = (res // arch["patch_size"]) ** 2 + (1 if model.pool_type == "tok" else 0)
  remat = model.remat_policy not in (None, "none")
  mm_bytes = jnp.dtype(model.dtype_mm).itemsize
  channels = image_channels(config)
  tp = _axes_size(dict(rules).get("mlp"), mesh)

  # The trainer's own shardings: a dim its mesh axes do not divide stays whole.
  unsplit = []
  param_sh, opt_sh = state_shardings(boxed, params, opt_state, _abstract_mesh(mesh), rules,
                                     unsplit)
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  params_b = sharding.describe(param_sh, params)
  grads_b = sharding.describe(param_sh, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params))
  opt_b = sharding.describe(opt_sh, opt_state)
  # With accumulation one microbatch's activations are alive at a time (grad_accum's lax.scan);
  # the gradients of the microbatch in flight are grads_b as before, and their running sum is
  # a float32 carry sharded like the params. The step's input is still the whole local batch.
  act_b = activation_bytes(arch, local_batch=micro_batch, tokens=tokens, remat=remat,
                           mm_bytes=mm_bytes, tp=tp, num_classes=num_classes,
                           image_numel=res * res * channels, dropout=model.dropout > 0)
  accum_b = grads_b if accum > 1 else 0
  batch_b = local_batch * (res * res * channels + num_classes) * 4
  # FSDP: weights are all-gathered (full size / tp) before use. Without remat XLA keeps the
  # gathered copies of all blocks alive from forward to backward (it reuses them rather than
  # gathering twice): a whole unsharded param set. With remat the gather is part of each
  # recomputed block: about two blocks' worth (one in use, the next one prefetched).
  fsdp = _axes_size(dict(rules).get("embed"), mesh)
  if arch["width"] % fsdp:  # The weights stay whole (sharding.fit_spec): nothing to gather.
    fsdp = 1
  if fsdp == 1:
    gathered_b = 0
  elif remat:
    gathered_b = int(2 * n_params / max(1, arch["depth"]) * 4 / tp)
  else:
    gathered_b = int(n_params * 4 / tp)
  total_b = params_b + opt_b + grads_b + accum_b + act_b + batch_b + gathered_b
  usable = USABLE_FRACTION * spec.hbm_bytes
  remat_total_b = None  # Without remat and too big: what remat (nothing_saveable) would need.
  if not remat and total_b > usable:
    remat_act = activation_bytes(arch, local_batch=micro_batch, tokens=tokens, remat=True,
                                 mm_bytes=mm_bytes, tp=tp, num_classes=num_classes,
                                 image_numel=res * res * channels, dropout=model.dropout > 0)
    gathered_remat = int(2 * n_params / max(1, arch["depth"]) * 4 / tp) if fsdp > 1 else 0
    remat_total_b = total_b - act_b + remat_act - gathered_b + gathered_remat

  # Accumulation does not change the FLOPs of a step: the same examples go forward and backward,
  # in k pieces (the k-1 extra gradient additions are elementwise, not counted here).
  model_flops, hw_flops = train_flops(arch, batch=batch, res=res, num_classes=num_classes,
                                      tokens=tokens, remat=remat, channels=channels)
  peak = spec.bf16_flops if mm_bytes == 2 else spec.f32_flops
  compute_s = hw_flops / n_dev / peak
  # Per step, with FSDP: params all-gathered for forward and again for backward, grads
  # reduce-scattered (3 x full f32 param bytes / tp, times (f-1)/f); over the data axis the
  # grad shards are all-reduced (2 x shard bytes x (d-1)/d). Assumes no overlap with compute
  # would give their sum; XLA overlaps them, so the bound is the larger of the two.
  # With k microbatches the gradient reductions happen once per microbatch (the accumulator is
  # sharded like the params, so each microbatch's gradients are reduced before being added;
  # seen in the compiled HLO: the all-reduces sit in the scan's body), while the weight gathers
  # are loop-invariant and XLA hoists them out of the loop: once per step.
  full_param_b = n_params * 4 / tp
  comm_b = (2 + accum) * full_param_b * (fsdp - 1) / fsdp
  data = mesh.get("data", 1)
  comm_b += accum * 2 * (full_param_b / fsdp) * (data - 1) / data
  comm_s = comm_b / spec.link_bytes_per_s
  step_s = max(compute_s, comm_s)
  out = dict(
      variant=config.model.get("variant"), arch=dict(arch), res=res, tokens=tokens, mesh=mesh,
      devices=n_dev,
      device=spec.name, global_batch=batch, local_batch=local_batch, grad_accum_steps=accum,
      micro_batch=micro_batch, remat=remat,
      dtype_mm=str(model.dtype_mm), num_params=int(n_params),
      params_bytes_per_device=int(params_b), opt_bytes_per_device=int(opt_b),
      grad_bytes_per_device=int(grads_b), grad_accum_bytes_per_device=int(accum_b),
      act_bytes_per_device=int(act_b),
      batch_bytes_per_device=int(batch_b), fsdp_gather_bytes_per_device=int(gathered_b),
      total_bytes_per_device=int(total_b), hbm_bytes=int(spec.hbm_bytes),
      fits=bool(total_b <= usable),
      # Only set where it does not fit without remat: would remat_policy='nothing_saveable'?
      fits_with_remat=None if remat_total_b is None else bool(remat_total_b <= usable),
      total_bytes_with_remat=remat_total_b,
      flops_per_step=model_flops, hw_flops_per_step=hw_flops,
      compute_time_s=compute_s, comm_time_s=comm_s, step_time_s=step_s,
      mfu_bound=model_flops / n_dev / peak / step_s,
      unsplit_params=unsplit,
      # The patchify (a VALID strided conv, as in big_vision) ignores the last res % patch px.
      ignored_px=res % arch["patch_size"],
  )
  return out


# --------------------------------------------------------------------------------------------
# Compiled cross-check: runs in a subprocess with N simulated CPU devices.

def compiled_stats(config, mesh: dict, res: int) -> dict:
  """XLA memory analysis + FLOPs of the train step compiled for `mesh` (in this process)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from big_vit_lite import flops as flops_lib
  from big_vit_lite import grad_accum
  from big_vit_lite import sharding

  n_dev = math.prod(mesh.values())
  if jax.device_count() < n_dev:
    raise ValueError(f"mesh {mesh} needs {n_dev} devices, this process has {jax.device_count()}")
  devices = np.array(jax.devices()[:n_dev]).reshape(tuple(mesh.values()))
  jmesh = jax.sharding.Mesh(devices, tuple(mesh), axis_types=(jax.sharding.AxisType.Auto,) * len(mesh))
  rules = _rules(config, mesh)
  model, boxed, params, opt, opt_state = abstract_state(config, res)
  param_sh, opt_sh = state_shardings(boxed, params, opt_state, jmesh, rules, unsplit=[])
  replicated = sharding.replicated(jmesh)
  batch = int(config.input.batch_size)
  num_classes = int(config.model.get("num_classes", 0) or 0)
  batch_sh = sharding.batch_sharding(jmesh)
  accum = grad_accum.check(config.get("grad_accum_steps", 1), batch,
                           sharding.batch_devices(jmesh))
  images = jax.ShapeDtypeStruct((batch, res, res, image_channels(config)), jnp.float32,
                                sharding=batch_sh)
  labels = jax.ShapeDtypeStruct((batch, num_classes), jnp.float32, sharding=batch_sh)
  state = (jax.tree.map(lambda l, s: jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=s), params, param_sh),
           jax.tree.map(lambda l, s: jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=s), opt_state, opt_sh))

  def step(state, images, labels):
    params, opt_state = state

    def loss_fn(p, b, rng):
      logits, _ = model.apply({"params": p}, b["image"], train=True, rngs={"dropout": rng})
      return optax.softmax_cross_entropy(logits, b["labels"]).mean()

    # The trainer's gradient computation, so that k > 1 compiles to its microbatch scan. A fixed
    # key: dropout/drop-path only need *a* key for the shapes to be right.
    loss, grads = grad_accum.value_and_grad(
        loss_fn, params, {"image": images, "labels": labels}, jax.random.PRNGKey(0), accum,
        batch_sharding=batch_sh, param_shardings=param_sh)
    params, opt_state = opt.apply(params, grads, opt_state)
    return (params, opt_state), loss

  with jax.set_mesh(jmesh), nn.logical_axis_rules(rules):
    jitted = jax.jit(step, in_shardings=((param_sh, opt_sh), batch_sh, batch_sh),
                     out_shardings=((param_sh, opt_sh), replicated), donate_argnums=(0,))
    traced = jitted.trace(state, images, labels)
    compiled = traced.lower().compile()
  mem = compiled.memory_analysis()
  # XLA's cost analysis counts a loop body once; step_flops adds the other iterations of the
  # model's layer scan (scan=True) and of the microbatch scan (k > 1).
  step_flops = flops_lib.step_flops(traced, compiled, num_devices=n_dev)
  return dict(
      compiled_model_flops=float(flops_lib.model_flops(traced)),
      compiled_argument_bytes=int(mem.argument_size_in_bytes),
      compiled_output_bytes=int(mem.output_size_in_bytes),
      compiled_alias_bytes=int(mem.alias_size_in_bytes),
      compiled_temp_bytes=int(mem.temp_size_in_bytes),
      compiled_peak_bytes=int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                              - mem.alias_size_in_bytes + mem.temp_size_in_bytes),
      compiled_flops_per_device=float(step_flops or 0.0),
  )


def compiled_stats_subprocess(config_arg: str, overrides: list[str], mesh: dict, res: int,
                              timeout_s: float = 1800) -> dict:
  """compiled_stats in a fresh python with prod(mesh) simulated CPU devices."""
  n_dev = math.prod(mesh.values())
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  # The memory-minimising scheduler (not the default concurrency-optimised one) is what
  # accelerator backends approximate; its peak is the meaningful one to compare with.
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_dev}"
                      " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()
  mesh_str = ",".join(f"{k}:{v}" for k, v in mesh.items())
  cmd = [sys.executable, "-m", "big_vit_lite.plan", f"--config={config_arg}", *overrides,
         f"--mesh={mesh_str}", f"--res={res}", "--compiled_only", "--json"]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
  if proc.returncode != 0:
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    errors = [l for l in lines if "Error" in l or l.startswith("plan:")] or lines[-1:] or ["?"]
    raise ValueError(f"compiling the step on {n_dev} simulated CPU devices failed: {errors[-1]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# CLI.

def _fmt_bytes(b: float) -> str:
  return f"{b / GIB:8.2f} GiB"


def format_report(p: dict) -> str:
  mesh = ",".join(f"{k}:{v}" for k, v in p["mesh"].items())
  accum = (f" in {p['grad_accum_steps']} microbatches of {p['micro_batch']}"
           if p["grad_accum_steps"] > 1 else "")
  arch = p.get("arch") or {}
  shape = (f" (width {arch['width']}, depth {arch['depth']}, MLP {arch['mlp_dim']}, "
           f"{arch['num_heads']} heads, patch {arch['patch_size']})" if arch else "")
  lines = [
      f"ViT {p['variant'] or 'custom'}{shape} @ {p['res']}px ({p['tokens']} tokens), "
      f"{p['num_params'] / 1e6:.1f}M params, "
      f"global batch {p['global_batch']} ({p['local_batch']}/device{accum}), remat={p['remat']}, "
      f"matmuls in {p['dtype_mm']}",
      f"mesh {mesh} = {p['devices']} x {p['device']} ({p['hbm_bytes'] / GIB:.0f} GiB each)",
      "per device:",
      f"  params          {_fmt_bytes(p['params_bytes_per_device'])}",
      f"  optimizer state {_fmt_bytes(p['opt_bytes_per_device'])}",
      f"  gradients       {_fmt_bytes(p['grad_bytes_per_device'])}",
      *([f"  accumulator     {_fmt_bytes(p['grad_accum_bytes_per_device'])}  (f32 gradient sum "
         f"over the {p['grad_accum_steps']} microbatches)"] if p["grad_accum_steps"] > 1 else []),
      f"  activations     {_fmt_bytes(p['act_bytes_per_device'])}  (peak, kept for backward"
      + (f", per microbatch of {p['micro_batch']})" if p["grad_accum_steps"] > 1 else ")"),
      f"  input batch     {_fmt_bytes(p['batch_bytes_per_device'])}",
      f"  fsdp gathers    {_fmt_bytes(p['fsdp_gather_bytes_per_device'])}  (unsharded weights in use)",
      f"  total           {_fmt_bytes(p['total_bytes_per_device'])}  -> fits: "
      f"{'yes' if p['fits'] else 'NO'} (limit {USABLE_FRACTION:.0%} of HBM)",
      *([f"  with remat      {_fmt_bytes(p['total_bytes_with_remat'])}  -> "
         + ("fits with --config.model.remat_policy=nothing_saveable (each block's forward "
            "recomputed: ~1/3 more block FLOPs)" if p["fits_with_remat"] else
            "does not fit with remat either")] if p.get("fits_with_remat") is not None else []),
      f"FLOPs per step: {p['flops_per_step']:.3e} model (matmuls, as MFU counts them), "
      f"{p['hw_flops_per_step']:.3e} with remat's recomputation",
      f"step time >= {p['step_time_s'] * 1e3:.1f} ms (compute at peak {p['compute_time_s'] * 1e3:.1f} ms, "
      f"collectives {p['comm_time_s'] * 1e3:.1f} ms); MFU bound {p['mfu_bound']:.2f}",
  ]
  if p.get("ignored_px"):
    lines.append(f"note: {p['res']} px is not a multiple of the patch size "
                 f"{p['arch']['patch_size']}: the patchify ignores the last {p['ignored_px']} "
                 "px rows and columns of every image")
  if p.get("unsplit_params"):
    lines.append(f"note: param dims not divisible by their mesh axes (split as in training): "
                 f"{'; '.join(p['unsplit_params'])}")
  if "compiled_temp_bytes" in p:
    lines.append(
        f"compiled on {p['devices']} simulated CPU devices: arguments "
        f"{_fmt_bytes(p['compiled_argument_bytes'])}, temporaries {_fmt_bytes(p['compiled_temp_bytes'])}, "
        f"peak {_fmt_bytes(p['compiled_peak_bytes'])}; FLOPs/device {p['compiled_flops_per_device']:.3e} "
        f"(XLA), model FLOPs/step {p['compiled_model_flops']:.3e} (jaxpr)")
  return "\n".join(lines)


def _define_flags():
  from big_vit_lite import config_loading
  config_loading.define_config_flag()
  flags.DEFINE_string("mesh", None, "Mesh as axis:size pairs, e.g. data:64,fsdp:4 (default: config.mesh).")
  flags.DEFINE_string("device", "tpu_v4", f"Device kind for peak FLOP/s and memory: {', '.join(DEVICES)}.")
  flags.DEFINE_integer("res", None, "Training image side (default: from input.pp).")
  flags.DEFINE_bool("json", False, "Print the plan as one JSON object on the last line.")
  flags.DEFINE_bool("compile", False, "Also AOT-compile the step on simulated CPU devices and "
                    "report XLA's memory analysis (slow for big models).")
  flags.DEFINE_bool("compiled_only", False, "Internal: print only the compiled stats (subprocess).")


def main(argv):
  del argv
  f = flags.FLAGS
  from big_vit_lite import config_loading  # pylint: disable=g-import-not-at-top
  config = config_loading.loaded(f.config)
  if config is None:
    raise app.UsageError("--config=configs/FILE.py[:arg] is required")
  mesh = parse_mesh(f.mesh) if f.mesh else mesh_from_config(config.get("mesh") or [("data", 1)])
  if f.compiled_only:
    print(json.dumps(compiled_stats(config, mesh, image_res(config, f.res))))
    return
  p = plan(config, mesh, f.device, f.res)
  if f.compile:
    overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
    p.update(compiled_stats_subprocess(_config_arg(), overrides, mesh, p["res"]))
  print(format_report(p))
  if f.json:
    print(json.dumps(p))


def _config_arg() -> str:
  for i, a in enumerate(sys.argv[1:], 1):
    if a.startswith("--config="):
      return a.split("=", 1)[1]
    if a == "--config" and i + 1 < len(sys.argv):
      return sys.argv[i + 1]
  raise app.UsageError("--config=... is required")


def run():
  _define_flags()

  def _main(argv):
    try:
      main(argv)
    except ValueError as e:
      print(f"plan: {e}", file=sys.stderr)
      sys.exit(1)

  from big_vit_lite import config_loading  # pylint: disable=g-import-not-at-top
  app.run(_main, flags_parser=functools.partial(config_loading.parse_flags, prog="plan"))


if __name__ == "__main__":
  run()
