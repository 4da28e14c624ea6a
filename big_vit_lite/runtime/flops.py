"""FLOPs of a step: model FLOPs from its jaxpr (for MFU), and XLA's hardware count.

Model FLOPs (`matmul_flops`, `model_flops`): the matmuls and convolutions the
step's jaxpr asks for, counted exactly (2 x multiply-adds), every `scan` body
times its length, cuDNN attention calls by their shapes; elementwise work is
not counted (the usual MFU convention: the peak is a matmul rate). Forward
work that `jax.checkpoint` (remat) recomputes in the backward pass counts as
hardware FLOPs, not model FLOPs, so MFU does not change with the remat policy.
The count is the same on every backend.

`step_flops` is XLA's cost analysis (elementwise work included), which counts
a while loop's body once (a scanned ViT read 8.5x too low) and on GPU misses
the cuBLAS/cuDNN calls: it adds what the scans miss, found by counting the
jaxpr the way XLA does (matmuls exactly, one FLOP per element of elementwise
arithmetic) with every scan body once per iteration and as XLA's loop program
holds it. A program without scans gets exactly XLA's figure; `while` loops
with a data-dependent trip count stay at one iteration, as in XLA.
Measurements: benchmarks/NOTES.md, section "Plan, bench, FLOPs, metrics".
"""

from __future__ import annotations

import math
import re

import jax
from jax.extend import core as jex_core


def _dot_flops(eqn):
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs_shape = eqn.invars[0].aval.shape
  return (
      2
      * math.prod(eqn.outvars[0].aval.shape)
      * math.prod(lhs_shape[d] for d in lhs_contract)
  )


def _valid_taps(in_size, out_size, k, stride, pad_lo, lhs_dil, rhs_dil):
  """Kernel taps that land inside the (dilated) input, summed over one dim's output positions."""
  last = (in_size - 1) * lhs_dil
  taps = 0
  for o in range(out_size):
    for j in range(k):
      i = o * stride - pad_lo + j * rhs_dil
      if 0 <= i <= last and i % lhs_dil == 0:
        taps += 1
  return taps


def _conv_flops(eqn):
  """2 x multiply-adds over the taps inside the input, as XLA counts (padding taps are free)."""
  lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval  # input, kernel
  out = eqn.outvars[0].aval
  p = eqn.params
  dn = p["dimension_numbers"]
  spatial = len(dn.lhs_spec) - 2
  lhs_dil = p.get("lhs_dilation") or (1,) * spatial
  rhs_dil = p.get("rhs_dilation") or (1,) * spatial
  taps = math.prod(
      _valid_taps(
          lhs.shape[dn.lhs_spec[2 + d]],
          out.shape[dn.out_spec[2 + d]],
          rhs.shape[dn.rhs_spec[2 + d]],
          p["window_strides"][d],
          p["padding"][d][0],
          lhs_dil[d],
          rhs_dil[d],
      )
      for d in range(spatial)
  )
  out_spatial = math.prod(out.shape[dn.out_spec[2 + d]] for d in range(spatial))
  # x in-features/group
  per_tap = math.prod(out.shape) // out_spatial * rhs.shape[dn.rhs_spec[1]]
  return 2 * per_tap * taps


_MATMULS = {"dot_general": _dot_flops, "conv_general_dilated": _conv_flops}


# Arithmetic XLA's cost analysis counts as one FLOP per output element (per
# input element for reductions). Transcendentals (exp, tanh, rsqrt, ...) it
# reports apart, not as FLOPs.
_ELEMENTWISE = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "max",
        "min",
        "neg",
        "abs",
        "square",
        "integer_pow",
        "select_n",
        "clamp",
        "sign",
    }
)
_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"}
)


def _scan_copies(length, unroll, all_iterations):
  """Copies of a scan body: all `length` iterations, or those XLA's loop program holds."""
  length = int(length)
  if all_iterations or unroll is True or int(unroll) >= length:
    return length
  unroll = max(1, int(unroll))
  # the unrolled loop body plus the remainder outside it
  return unroll + length % unroll


# cuDNN fused attention (jax.nn.dot_product_attention(implementation="cudnn")):
# one primitive per direction, no dot_general inside. Forward: Q K^T and P V;
# backward: dP, dS, dQ, dK, dV, 4 matmuls of model work plus Q K^T recomputed
# (flash attention keeps no probabilities).
_CUDNN_ATTENTION = {
    "dot_product_attention_fwd_wrapper": (2, 0),
    "dot_product_attention_bwd_wrapper": (4, 1),
    "dot_product_attention_fwd": (2, 0),
    "dot_product_attention_bwd": (4, 1),
}
_REMAT = ("remat2", "checkpoint", "remat")


def _attention_flops(eqn):
  """(model, recomputed) FLOPs of a cuDNN attention call, from q's and k's shapes."""
  matmuls, recomputed = _CUDNN_ATTENTION[eqn.primitive.name]
  q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  # q: (batch, heads, T, head dim) in layout 1 (BNTH), else BTNH; S (keys) where
  # T is in q.
  one = 2 * math.prod(q) * k[2 if eqn.params.get("layout", 0) == 1 else 1]
  return matmuls * one, recomputed * one


# Splash attention's kernels (models/splash.py), by the name of their
# pallas_call: the share of their matmuls that is model work. The forward's two
# (Q K^T, P V) are; the backward's dkv kernel recomputes Q K^T besides dV, dP
# and dK, the dq kernel Q K^T and dP besides dQ: 4 of the backward's 7 matmuls
# are the model's (dV, dP, dK, dQ), as in _CUDNN_ATTENTION.
_SPLASH_MODEL_SHARES = (("_dkv", 3 / 4), ("_dq", 1 / 3))


def _splash_model_share(kernel_name: str) -> float:
  if kernel_name.startswith("splash_"):
    for part, share in _SPLASH_MODEL_SHARES:
      if part in kernel_name:
        return share
  return 1.0


def _distinct_shards(mesh, out_specs) -> int:
  """How many devices of a shard_map do distinct work: the sizes of the mesh
  axes its outputs are split over (over the other axes they compute copies).
  """
  axes = set()
  for spec in out_specs:
    for entry in spec:
      if entry is None:
        continue
      if isinstance(entry, str):
        entry = (entry,)
      axes.update(entry)
  return math.prod(mesh.shape[axis] for axis in axes)


def _recompute_mask(jaxpr):
  """Per eqn of a differentiated remat body: True where it recomputes forward work.

  The body jax builds to transpose a remat takes (consts, primal residuals, cotangents) in
  that order and returns cotangents. Forward recomputation is what does not depend on the
  cotangent inputs: the last K invars for the smallest K that every output depends on.
  """
  deps = {v: 1 << i for i, v in enumerate(jaxpr.invars)}
  eqn_deps = []
  for eqn in jaxpr.eqns:
    d = 0
    for v in eqn.invars:
      d |= deps.get(v, 0) if not isinstance(v, jex_core.Literal) else 0
    eqn_deps.append(d)
    deps.update(dict.fromkeys(eqn.outvars, d))
  outs = [
      deps.get(v, 0)
      for v in jaxpr.outvars
      if not isinstance(v, jex_core.Literal)
  ]
  n = len(jaxpr.invars)
  ct = 0
  for k in range(1, n + 1):
    ct = ((1 << k) - 1) << (n - k)
    if all(d & ct for d in outs if d):
      break
  return [not d & ct for d in eqn_deps]


def _eqn_flops(eqn, xla, all_iterations):
  """(all, recomputed) FLOPs of one eqn, sub-jaxprs and loops included (see _count)."""
  name = eqn.primitive.name
  if name in _MATMULS:
    return _MATMULS[name](eqn), 0
  if xla and name in _ELEMENTWISE:
    return math.prod(eqn.outvars[0].aval.shape), 0
  if xla and name in _REDUCTIONS:
    return math.prod(eqn.invars[0].aval.shape), 0
  if not xla and name in _CUDNN_ATTENTION:
    model, recomputed = _attention_flops(eqn)
    return model + recomputed, recomputed
  # A kernel (splash attention): its body runs once per grid cell.
  if name == "pallas_call":
    total, recomputed = _count(eqn.params["jaxpr"], xla, all_iterations)
    cells = math.prod(eqn.params["grid_mapping"].grid)
    total, recomputed = total * cells, recomputed * cells
    model_share = _splash_model_share(eqn.params["name"])
    return total, recomputed + (total - recomputed) * (1 - model_share)
  # The body runs on every device, on its shard.
  if name == "shard_map":
    total, recomputed = _count(eqn.params["jaxpr"], xla, all_iterations)
    shards = _distinct_shards(eqn.params["mesh"], eqn.params["out_specs"])
    return total * shards, recomputed * shards
  if name == "cond":  # one branch runs: the costliest
    return max(
        (_count(b, xla, all_iterations) for b in eqn.params["branches"]),
        default=(0, 0),
    )
  total = recomputed = 0
  for j in jex_core.jaxprs_in_params(eqn.params):
    if name in _REMAT and eqn.params.get("differentiated"):
      for e, again in zip(j.eqns, _recompute_mask(j)):
        t, r = _eqn_flops(e, xla, all_iterations)
        total, recomputed = total + t, recomputed + (t if again else r)
    else:
      t, r = _count(j, xla, all_iterations)
      total, recomputed = total + t, recomputed + r
  if name == "scan":
    n = _scan_copies(
        eqn.params["length"], eqn.params.get("unroll", 1), all_iterations
    )
    total, recomputed = total * n, recomputed * n
  return total, recomputed


def _count(jaxpr, xla=False, all_iterations=True):
  """(all, recomputed) FLOPs of a jaxpr. Model count (xla False): matmuls, cuDNN attention.
  XLA's count (xla True): matmuls and convolutions exactly, elementwise arithmetic and
  reductions one FLOP per element. Every scan body times its length, or (all_iterations
  False) the bodies XLA's loop program holds: one, or `unroll` (plus the remainder) for a
  partly unrolled scan. `while` bodies count once (their trip count is data); `cond` its
  costliest branch."""
  counts = [
      _eqn_flops(eqn, xla, all_iterations)
      for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns
  ]
  return sum(t for t, _ in counts), sum(r for _, r in counts)


def matmul_flops(jaxpr) -> tuple[int, int]:
  """(model FLOPs, hardware matmul FLOPs) of a jaxpr: matmuls without / with remat's recompute.

  Every scan body counts times its length, `cond` its costliest branch, a `while` body once
  (its trip count is data), a Pallas kernel's body once per grid cell (splash attention:
  the padded tokens' work too, 197 -> 256, +2% of L/16's model FLOPs). For a step traced
  under jit on a mesh: the global figure (a shard_map body times the devices its outputs
  are split over).
  """
  total, recomputed = _count(jaxpr)
  return total - recomputed, total


def model_flops(traced: jax.stages.Traced) -> int:
  """Model FLOPs of one call of a traced step (`jax.jit(f).trace(...)`), all devices together."""
  return matmul_flops(traced.jaxpr)[0]


def vit_forward_flops(
    arch: dict,
    *,
    tokens: int,
    patches: int,
    channels: int = 3,
    num_classes: int = 0,
) -> dict:
  """Analytic matmul FLOPs of one image's forward pass through a ViT, by part.

  Per block: q/k/v/out projections 4 T D^2 and MLP 2 T D M multiply-adds, attention scores and
  weighted sum 2 T^2 D; patch embedding P^2 C D per patch; head D K. FLOPs = 2 x multiply-adds.
  A training step is 3x the forward (backward = 2x) less `embed` once: the image needs no
  gradient. (Class-token pooling; MAP heads and rep_size layers are not included.)
  Block options: arch["mlp"] = "swiglu" makes the MLP 3 T D M (gate, value, out); register
  tokens count in `tokens`; qk_norm, LayerScale, RMSNorm, parallel blocks and biases add no
  matmul.
  """
  t, d, m, p = tokens, arch["width"], arch["mlp_dim"], arch["patch_size"]
  mlp_matmuls = 3 if arch.get("mlp") == "swiglu" else 2
  blocks = (
      arch["depth"]
      * 2
      * (4 * t * d * d + mlp_matmuls * t * d * m + 2 * t * t * d)
  )
  return dict(
      blocks=blocks,
      embed=2 * patches * p * p * channels * d,
      head=2 * d * num_classes,
  )


def vit_train_flops(arch: dict, *, batch: int, **kw) -> int:
  """Analytic model FLOPs of a ViT training step on `batch` images (see vit_forward_flops)."""
  f = vit_forward_flops(arch, **kw)
  return batch * (3 * (f["blocks"] + f["embed"] + f["head"]) - f["embed"])


def sane_xla_flops(xla, model):
  """XLA's count where it is a plausible hardware figure (>= 90% of the model FLOPs), else None.

  XLA counts matmuls and elementwise work, so it reads more than the model FLOPs, except where
  the matmuls run in library calls it does not look into (cuBLAS, cuDNN on GPU).
  """
  return xla if xla and model and xla >= 0.9 * model else None


def step_flops(
    traced: jax.stages.Traced,
    compiled: jax.stages.Compiled,
    num_devices: int = 1,
) -> float | None:
  """XLA's FLOPs of one call of `compiled` on one device (its SPMD view), loops counted in full.

  The hardware figure XLA reports (elementwise work included, remat's recomputation too);
  on GPU it misses the library calls (cuBLAS, cuDNN). MFU uses `model_flops` instead.

  traced: `jax.jit(f).trace(...)`, the trace `compiled` was lowered from.
  num_devices: devices the program is partitioned over; the jaxpr counts the
  global work, XLA one device's share.
  """
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  # not every backend implements it
    return None
  if not cost or "flops" not in cost:
    return None
  missed = (
      _count(traced.jaxpr, xla=True, all_iterations=True)[0]
      - _count(traced.jaxpr, xla=True, all_iterations=False)[0]
  )
  return float(cost["flops"]) + missed / max(1, num_devices)


def program_memory(compiled) -> dict | None:
  """A compiled program's bytes per device: argument, output, alias, temp and peak.

  peak = argument + output + temp - alias (donated inputs reused as outputs). None where
  the backend does not report a memory analysis.
  """
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  # not every backend implements it
    return None
  if analysis is None:
    return None
  out = {
      k: int(getattr(analysis, f"{k}_size_in_bytes"))
      for k in ("argument", "output", "alias", "temp")
  }
  out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  return out


_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}
COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
)


def collectives(hlo_text: str) -> dict:
  """{op: {"count", "bytes"}} of the collectives in a compiled program's HLO text.

  Counted as written in the program: an op inside a loop body (the layer scan, the microbatch
  loop) counts once. Bytes: the op's result (for an async start, its largest buffer).
  """
  found = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
  ops = "|".join(COLLECTIVES)
  for line in hlo_text.splitlines():
    match = re.search(rf"=\s*(.*?)\s+({ops})(-start)?\(", line)
    if not match:
      continue
    shapes = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", match.group(1))
    sizes = [
        _DTYPE_BYTES.get(dt, 4)
        * math.prod(int(d) for d in dims.split(",") if d)
        for dt, dims in shapes
    ]
    is_pair = match.group(3) and match.group(2) in (
        "all-gather",
        "collective-permute",
    )
    found[match.group(2)]["count"] += 1
    found[match.group(2)]["bytes"] += (
        max(sizes, default=0) if is_pair else sum(sizes)
    )
  return found
