"""plan's analytic formulas: activation bytes, FLOPs, FSDP's gathered weights and a
step's time at peak, each a function of the model's sizes and the mesh only (no jax).
plan.py puts them together with the exact state shapes; how the coefficients were
fitted: benchmarks/NOTES.md, section "Plan, bench, FLOPs, metrics".
"""

from big_vit_lite import flops as flops_lib

# XLA needs room beyond live buffers (fragmentation, collective and conv
# scratch, program): a plan "fits" if its peak is under this fraction of the
# device memory.
USABLE_FRACTION = 0.9


def activation_bytes(
    arch: dict,
    *,
    local_batch: int,
    tokens: int,
    remat: bool,
    mm_bytes: int,
    tp: int = 1,
    num_classes: int = 0,
    image_numel: int = 0,
    dropout: bool = False,
) -> int:
  """Peak bytes of activations kept for the backward pass on one device.

  Per block and example, with T tokens, width D, MLP width M and H heads (M and H divided by
  the tensor-parallel degree tp where it divides them) and mm B the matmul dtype's bytes:
      T*D * (3.4 x 4 B + 2 x mm B) + T*M * (1.9 x 4 B + 1.85 x mm B) + H*T^2 * 1.85 x 4 B,
  plus 8 B per element of the three dropped tensors with dropout. With remat only each block's
  input (T*D f32) is kept, plus one block recomputed at a time. The coefficients are fitted to
  XLA's compiled memory analysis (see benchmarks/NOTES.md, section "Plan, bench, FLOPs,
  metrics").
  """
  t, d = tokens, arch["width"]
  m = arch["mlp_dim"] / tp if arch["mlp_dim"] % tp == 0 else arch["mlp_dim"]
  h = (
      arch["num_heads"] // tp
      if arch["num_heads"] % tp == 0
      else arch["num_heads"]
  )
  per_block = (
      t * d * (3.4 * 4 + 2 * mm_bytes)
      + t * m * (1.9 * 4 + 1.85 * mm_bytes)
      + 1.85 * 4 * h * t * t
  )
  if dropout:
    per_block += 8 * (t * m + 2 * t * d)
  per_example = (
      arch["depth"] * t * d * 4 + per_block
      if remat
      else arch["depth"] * per_block
  )
  # Outside the blocks: the patchified image, embeddings (+ posemb), final
  # LayerNorm, logits.
  per_example += image_numel * 4 + 6 * t * d * 4 + num_classes * 4 * 2
  return int(local_batch * per_example)


def train_flops(
    arch: dict,
    *,
    batch: int,
    res: int,
    num_classes: int,
    tokens: int,
    remat: bool,
    channels: int = 3,
) -> tuple[float, float]:
  """(model FLOPs, hardware FLOPs) of one train step on the global batch.

  Model FLOPs: the matmuls of forward + backward (flops.vit_train_flops), what bench and the
  trainer count from the step's jaxpr for MFU. Hardware: plus remat's recomputation.
  """
  kw = dict(
      tokens=tokens,
      patches=(res // arch["patch_size"]) ** 2,
      channels=channels,
      num_classes=num_classes,
  )
  model = flops_lib.vit_train_flops(arch, batch=batch, **kw)
  blocks = flops_lib.vit_forward_flops(arch, **kw)["blocks"]
  return float(model), float(model + (blocks * batch if remat else 0))


def _gather_bytes(n_params, depth, tp, fsdp, remat):
  """FSDP's all-gathered (unsharded / tp) weights alive at once: all of them without remat
  (XLA keeps them from forward to backward), about two blocks' worth with remat.
  """
  if fsdp == 1:
    return 0
  return int((2 * n_params / max(1, depth) if remat else n_params) * 4 / tp)


def _step_time(spec, peak, hw_flops, n_dev, n_params, mesh, tp, fsdp, accum):
  """(compute s, collectives s) of a step at peak FLOP/s and link bandwidth.

  With FSDP the params are all-gathered for forward and backward (once per step: XLA hoists
  them out of the microbatch loop) and the grads reduce-scattered, over the data axis the
  grad shards all-reduced; the gradient reductions happen once per microbatch.
  """
  full_param_b = n_params * 4 / tp
  comm_b = (2 + accum) * full_param_b * (fsdp - 1) / fsdp
  data = mesh.get("data", 1)
  comm_b += accum * 2 * (full_param_b / fsdp) * (data - 1) / data
  return hw_flops / n_dev / peak, comm_b / spec.link_bytes_per_s
