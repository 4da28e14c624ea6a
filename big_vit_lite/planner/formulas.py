"""plan's analytic formulas: activation bytes, FLOPs, FSDP's gathered weights and a
step's time at peak, each a function of the model's sizes and the mesh only (no jax).
plan.py puts them together with the exact state shapes; how the coefficients were
fitted: benchmarks/NOTES.md, section "Plan, bench, FLOPs, metrics"; the TPU's
count (tpu_activation_bytes): section "Plan vs the TPU compiler"; the GPU's
(gpu_activation_bytes): section "Plan vs the GPU compiler, fitted".
"""

from collections.abc import Callable
import dataclasses
import math

from big_vit_lite.models import ops
from big_vit_lite.runtime import flops as flops_lib

# XLA needs room beyond live buffers (fragmentation, collective and conv
# scratch, program): a plan "fits" if its peak is under this fraction of the
# device memory.
USABLE_FRACTION = 0.9


def _split_by_tp(arch: dict, tp: int) -> tuple[int, int]:
  """(MLP width, heads) per device: divided by the tensor-parallel degree where
  it divides them, else whole."""
  m, h = arch["mlp_dim"], arch["num_heads"]
  return (m // tp if m % tp == 0 else m), (h // tp if h % tp == 0 else h)


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
  m, h = _split_by_tp(arch, tp)
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


def _tiled(rows: int, cols: int, nbytes: int) -> int:
  """Bytes of a (rows, cols) array in TPU memory: tiles of 128 lanes by 32 bytes' rows.

  The TPU lays an array's two minor dims out in (8, 128) tiles of 32-bit words
  (bf16 packs 16 rows, bool 32): 197 tokens take 208 bf16 rows, or 256 lanes.
  """
  sublanes = 32 // nbytes
  return (
      nbytes
      * math.ceil(rows / sublanes)
      * sublanes
      * math.ceil(cols / 128)
      * 128
  )


def tpu_block_bytes(
    arch: dict,
    *,
    tokens: int,
    mm_bytes: int,
    tp: int = 1,
    dropout: bool = False,
    opts: dict | None = None,
) -> int:
  """Bytes one block keeps for its backward pass, per example, as the TPU compiler stores them.

  Counted from the stacked residuals of the layer loop in the compiled TPU
  program (benchmarks/NOTES.md, "Plan vs the TPU compiler"), each tiled
  (_tiled; the layouts the compiler picks: tokens minor in the per-head
  arrays): the block input and the residual stream after attention (f32,
  T x D), the two LayerNorm outputs (matmul dtype) and statistics, q, k, v and
  the attention output per head (D/H x T), the probabilities per head (T x T),
  the MLP's pre-activation and activation (T x M); with dropout, a bool mask
  per dropped tensor. opts, the block options, as jax's list of the block's
  residuals has them: SwiGLU keeps six T x M arrays (value, gate, its sigmoid
  and silu, their product, the dropped product), qk_norm q and k before their
  norm and its statistics (both measured together: L/16 +2.3%), parallel_block
  one LayerNorm and no mid-block stream (not compiled). opts may also name the
  model's resolved `attention` and `dtype_act`: XLA's attention keeps the
  exponentiated logits per head in f32 (T x T) and the softmax's sums besides
  the bf16 probabilities (L/16: +2.2 GiB per chip at 32 images); a bf16 residual
  stream stores the block input and mid-block stream in bf16; splash attention
  (models/splash.py) no probabilities but q, k, v and its output again, in its
  kernels' layout (the compiled L/16 on v5p-128: plan +0.2%).
  """
  opts = opts or {}
  t, d = tokens, arch["width"]
  m, h = _split_by_tp(arch, tp)
  head_dim, mm = arch["width"] // arch["num_heads"], mm_bytes
  streams = 1 if opts.get("parallel_block") else 2
  qk_norm_arrays = 2 * bool(opts.get("qk_norm"))
  per_head = (4 + qk_norm_arrays) * _tiled(head_dim, t, mm)
  probs = _tiled(t, t, mm)
  if opts.get("attention") == "splash":
    # The kernels keep q, k, v and their output in their own layout (the
    # tokens padded to 128s, D/H minor) and the softmax's log-sum-exp; the
    # probabilities never reach memory.
    padded = 128 * math.ceil(t / 128)
    per_head = (1 + qk_norm_arrays) * _tiled(head_dim, t, mm) + 4 * _tiled(
        padded, head_dim, mm
    )
    probs = _tiled(1, padded, 4)
  mlp = (6 if opts.get("mlp") == "swiglu" else 2) * _tiled(t, m, mm)
  # qk_norm's mean and 1/std of q and of k, per head and token.
  qk_stats = 4 * _tiled(h, t, 4) if opts.get("qk_norm") else 0
  # Each LayerNorm also keeps its mean and 1/std (f32, tokens minor).
  norm_stats = 2 * 4 * 128 * math.ceil(t / 128)
  act_bytes = 2 if opts.get("dtype_act") == "bfloat16" else 4
  # XLA's softmax: exp(logits) in f32 per head, and its sums (two per head and
  # token).
  softmax_f32 = (
      h * _tiled(t, t, 4) + 2 * _tiled(h, t, 4)
      if opts.get("attention") == "xla"
      else 0
  )
  total = (
      streams * (_tiled(t, d, act_bytes) + _tiled(t, d, mm) + norm_stats)
      + h * (per_head + probs)
      + softmax_f32
      + mlp
      + qk_stats
  )
  if dropout:
    total += 2 * _tiled(t, d, 1) + _tiled(t, m, 1)
  return total


def tpu_activation_bytes(arch: dict, **kw) -> int:
  """compiled_activation_bytes for the TPU compiler (TPU_KEEPS): the blocks' residuals
  as it tiles them.

  Without remat every block's residuals (tpu_block_bytes) stay for the backward
  pass, and one block's worth more is live while a block's backward runs; with
  remat each block's input (in the residual stream's dtype, tiled) and what the
  policy saves, and the recomputed residuals with the backward's temporaries:
  three blocks' worth with the custom attention (fitted to the compiled L/16,
  H/14, g/14 at 32 and L/16 at 256 images per chip), 1.6 with XLA's (L/16 at 256
  per chip; it reads 8-9% high at 32 per chip, benchmarks/NOTES.md).
  """
  return compiled_activation_bytes(TPU_KEEPS, arch, **kw)


# jax.checkpoint_policies names that save matmul outputs, by what they save (their
# aliases too); any other policy is counted as nothing_saveable.
_SAVED_DOTS = {
    "dots_with_no_batch_dims_saveable": "weights",
    "checkpoint_dots_with_no_batch_dims": "weights",
    "dots_saveable": "all",
    "checkpoint_dots": "all",
}


def _remat_saved_bytes(arch, *, tokens, mm_bytes, tp, policy) -> int:
  """Bytes per block and example that a remat policy saves besides the block input.

  "dots_with_no_batch_dims_saveable": the outputs of the matmuls with weights
  (q, k, v, the out projection, the MLP's two; untiled, the compiled L/16 at 256
  images per chip kept 5% less); "dots_saveable" also the attention logits (f32,
  T x T per head, tiled; +3% on the same run). Measured: benchmarks/NOTES.md.
  """
  saves = _SAVED_DOTS.get(policy)
  if saves is None:
    return 0
  t, d = tokens, arch["width"]
  m, h = _split_by_tp(arch, tp)
  weights = (3 * t * d // tp + 2 * t * d + t * m) * mm_bytes
  if saves == "weights":
    return weights
  return weights + h * _tiled(t, t, 4)


def tpu_weight_bytes(block_params, depth, tp, fsdp, remat, *, mm_bytes):
  """The blocks' weights in the matmul dtype that the TPU program keeps, per device.

  Sharded by FSDP: two blocks' gathered weights at a time. Replicated, with matmuls
  narrower than the f32 params: the converted copies of every block's weights,
  twice (the forward and the backward layer loop each hold one; with remat too).
  """
  del remat  # (the same either way: measured)
  per_block = block_params / max(1, depth) * mm_bytes / tp
  if fsdp > 1:
    return int(2 * per_block)
  return 0 if mm_bytes >= 4 else int(2 * depth * per_block)


# XLA:GPU puts a step's temporaries in one buffer, at offsets its heap simulator
# picks: without remat the compiled peak at full depth holds about 1.13x the
# residuals (fitted to B/16, L/16, H/14 at 512 images per GPU: H100 1.13, H200
# 1.12; benchmarks/NOTES.md, "Full depth").
GPU_HEAP_PACKING = 1.13
# With remat: blocks' worth of residuals (gpu_block_bytes) live besides every
# block's input at the peak, in the recomputed block's backward (the same full-depth
# compiles, an H100's and an H200's).
GPU_REMAT_LIVE_BLOCKS = 1.4
# With remat under nn.scan (config.model.scan): the backward loop's body holds one
# recomputed block at a time, and the four GPUs' programs agree within 2.5% (B/16,
# L/16, H/14 at 512 images per GPU, S/16 at 128; benchmarks/NOTES.md, "Remat under
# scan"). Unrolled, XLA:GPU may run every block's input gradients first and their
# weight gradients last, keeping the recomputed activations of many blocks between
# (the B200's B/16: 15.2 GiB against 9.0 under scan), which GPU_FITS' constants fit
# per GPU.
GPU_SCAN_REMAT_LIVE_BLOCKS = 0.9


def gpu_block_bytes(
    arch: dict,
    *,
    tokens: int,
    mm_bytes: int,
    tp: int = 1,
    dropout: bool = False,
    opts: dict | None = None,
) -> int:
  """Bytes one block keeps for its backward pass, per example, as XLA's GPU compiler stores them.

  Read from the compiled B/16 step's live buffers at its peak, depth 5 less depth 4
  (benchmarks/NOTES.md, "Plan vs the GPU compiler, fitted"): the two LayerNorms'
  inputs in the residual stream's dtype (the block input and the stream after
  attention, T x D each: their backward recomputes the normalised values from them)
  and their outputs in the matmul dtype (the inputs of the q/k/v and first MLP
  matmuls, for the weight gradients); the MLP's pre-activation (the GELU's
  backward) and its activation (the second matmul's input), T x M each in the
  matmul dtype; cuDNN's attention (opts["attention"] "cudnn") keeps q, k, v and
  its output with the tokens padded to ops.CUDNN_SEQ_MULTIPLE, in the matmul
  dtype, and its softmax's log-sum-exp (f32, per head and token), no tokens x
  tokens matrix. XLA's and the custom attention keep q, k, v, the output and the
  probabilities (tokens x tokens per head) in the matmul dtype: the compiled B/16
  per block, plan -4% (custom) and -6% (XLA's; unlike the TPU's, no f32 logits
  kept). With dropout, a byte mask per dropped tensor: the attention's output and
  the MLP's (T x D), the MLP's activation (T x M). Not compiled for a GPU here, and
  counted as tpu_block_bytes counts them, untiled: SwiGLU (six T x M arrays),
  qk_norm (q and k before their norm), parallel_block (one LayerNorm).
  """
  opts = opts or {}
  t, d = tokens, arch["width"]
  m, h = _split_by_tp(arch, tp)
  act_bytes = 2 if opts.get("dtype_act") == "bfloat16" else 4
  layer_norms = 1 if opts.get("parallel_block") else 2
  norms = layer_norms * t * d * (act_bytes + mm_bytes)
  mlp_arrays = 6 if opts.get("mlp") == "swiglu" else 2
  mlp = mlp_arrays * t * m * mm_bytes
  per_head_arrays = 4 + 2 * bool(opts.get("qk_norm"))
  if opts.get("attention") == "cudnn":
    padded = ops.CUDNN_SEQ_MULTIPLE * math.ceil(t / ops.CUDNN_SEQ_MULTIPLE)
    attention = per_head_arrays * padded * d // tp * mm_bytes + 4 * h * padded
  else:
    attention = (per_head_arrays * t * d // tp + h * t * t) * mm_bytes
  total = norms + mlp + attention
  if dropout:
    total += 2 * t * d + t * m
  return total


def gpu_activation_bytes(arch: dict, *, gpu: str = "h100", **kw) -> int:
  """compiled_activation_bytes for XLA's GPU compiler compiling for `gpu` (a
  devices.DEVICES key; GPU_KEEPS): its peak, in the last block's backward.

  Without remat every block's residuals (gpu_block_bytes), times the heap packing
  (GPU_HEAP_PACKING on an H100; GPU_FITS);
  the last block's gradients and temporaries fit in what its backward has freed.
  With remat each block's input (in the residual stream's dtype) and what the
  policy saves, and the recomputed block's residuals with the backward's
  temporaries (dropout's random bits among them, 32 bits per element of the MLP's
  activation): GPU_REMAT_LIVE_BLOCKS blocks' worth on an H100, and
  GPU_SCAN_REMAT_LIVE_BLOCKS on every GPU for the blocks under nn.scan. Fitted to
  the compiled B/16, L/16 and H/14 (cuDNN attention, dropout 0.1, bf16 matmuls, 512
  images per GPU).
  """
  keeps = GPU_KEEPS.get(gpu, GPU_KEEPS["h100"])
  return compiled_activation_bytes(keeps, arch, **kw)


def _untiled(rows: int, cols: int, nbytes: int) -> int:
  """Bytes of a (rows, cols) array stored as it is (no tiles: XLA:GPU's buffers)."""
  return rows * cols * nbytes


@dataclasses.dataclass(frozen=True)
class Keeps:
  """How one compiler keeps a step's activations: compiled_activation_bytes' constants."""

  # Bytes one block keeps for its backward pass, per example (tpu_block_bytes).
  block_bytes: Callable[..., int]
  # Bytes of a (rows, cols) array of nbytes elements in the device's memory.
  array_bytes: Callable[[int, int, int], int]
  # Without remat: blocks' worth live besides every block's residuals (the
  # running block backward's), and the compiled peak's growth over the blocks'
  # residuals (its heap's packing).
  extra_blocks: int
  packing: float
  # With remat: blocks' worth of residuals live besides every block's input, by
  # the model's resolved attention (any other: "default").
  remat_live_blocks: dict
  # The same for the blocks under nn.scan (opts["scan"]); None: as unrolled.
  scan_remat_live_blocks: float | None = None


TPU_KEEPS = Keeps(
    block_bytes=tpu_block_bytes,
    array_bytes=_tiled,
    extra_blocks=1,
    packing=1.0,
    remat_live_blocks={"xla": 1.6, "default": 3},
)
# XLA:GPU lays the unrolled blocks' buffers out differently for each GPU it
# compiles for: (heap packing without remat, live blocks with remat) per
# devices.DEVICES key, fitted to the full-depth compiles of B/16, L/16 and H/14 at
# 512 images per GPU on 8 GPUs (benchmarks/NOTES.md, "Full depth"). The A100 packs
# tighter; the H200's and the B200's programs fit the H100's constants (any other
# GPU takes them too), but for the B200's B/16 with remat unrolled (plan -32%;
# under scan the four GPUs share GPU_SCAN_REMAT_LIVE_BLOCKS).
GPU_FITS = {
    "h100": (GPU_HEAP_PACKING, GPU_REMAT_LIVE_BLOCKS),
    "a100": (0.95, 1.05),
}
GPU_KEEPS = {
    gpu: Keeps(
        block_bytes=gpu_block_bytes,
        array_bytes=_untiled,
        extra_blocks=0,
        packing=packing,
        remat_live_blocks={"default": live_blocks},
        scan_remat_live_blocks=GPU_SCAN_REMAT_LIVE_BLOCKS,
    )
    for gpu, (packing, live_blocks) in GPU_FITS.items()
}


def compiled_activation_bytes(
    keeps: Keeps,
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
    opts: dict | None = None,
) -> int:
  """activation_bytes as a compiler (keeps: TPU_KEEPS, GPU_KEEPS) keeps them.

  Without remat every block's residuals (keeps.block_bytes) and keeps.extra_blocks
  more, times keeps.packing. With remat each block's input (in the residual
  stream's dtype, as keeps.array_bytes stores it) and what the policy
  (opts["remat_policy"], _remat_saved_bytes) saves, and keeps.remat_live_blocks
  blocks' worth of residuals and temporaries while the recomputed block's backward
  runs (keeps.scan_remat_live_blocks for the blocks under nn.scan, opts["scan"],
  where the compiler has its own). Outside the blocks as activation_bytes counts it.
  """
  opts = opts or {}
  block = keeps.block_bytes(
      arch,
      tokens=tokens,
      mm_bytes=mm_bytes,
      tp=tp,
      dropout=dropout,
      opts=opts,
  )
  depth, t, d = arch["depth"], tokens, arch["width"]
  if remat:
    act_bytes = 2 if opts.get("dtype_act") == "bfloat16" else 4
    saved = _remat_saved_bytes(
        arch,
        tokens=tokens,
        mm_bytes=mm_bytes,
        tp=tp,
        policy=opts.get("remat_policy"),
    )
    block_input = keeps.array_bytes(t, d, act_bytes)
    live = keeps.remat_live_blocks.get(
        opts.get("attention"), keeps.remat_live_blocks["default"]
    )
    if opts.get("scan") and keeps.scan_remat_live_blocks is not None:
      live = keeps.scan_remat_live_blocks
    kept = depth * (block_input + saved) + live * block
  else:
    kept = keeps.packing * (depth + keeps.extra_blocks) * block
  outside = image_numel * 4 + 6 * t * d * 4 + num_classes * 4 * 2
  return int(local_batch * (kept + outside))


def gpu_weight_bytes(block_params, depth, tp, fsdp, remat, *, mm_bytes):
  """FSDP's all-gathered block weights in the matmul dtype that the GPU program keeps,
  per device: every block's from its forward to its backward without remat (the
  compiled B/16: each block adds its q, k, v, out and MLP kernels in bf16); with
  remat one block's at the compiled B/16's peak, counted two (the next block's
  gather may be in flight). Without FSDP the converted copies of every block's
  weights when the matmuls are narrower than the f32 params (data:8, B/16 at
  depths 4 and 6: plan +0.8% and +1.2%).
  """
  per_block = block_params / max(1, depth) * mm_bytes / tp
  if fsdp > 1 and remat:
    return int(2 * per_block)
  if fsdp > 1 or mm_bytes < 4:
    return int(depth * per_block)
  return 0


def train_flops(
    arch: dict,
    *,
    batch: int,
    res: int,
    num_classes: int,
    tokens: int,
    remat: bool,
    channels: int = 3,
    remat_policy: str | None = None,
) -> tuple[float, float]:
  """(model FLOPs, hardware FLOPs) of one train step on the global batch.

  Model FLOPs: the matmuls of forward + backward (flops.vit_train_flops), what bench and the
  trainer count from the step's jaxpr for MFU. Hardware: plus remat's recomputation of the
  matmuls the policy does not save: all of the blocks' forward (nothing_saveable and any
  other policy), the attention's two batched ones (dots_with_no_batch_dims_saveable), none
  (dots_saveable).
  """
  kw = dict(
      tokens=tokens,
      patches=(res // arch["patch_size"]) ** 2,
      channels=channels,
      num_classes=num_classes,
  )
  model = flops_lib.vit_train_flops(arch, batch=batch, **kw)
  blocks = flops_lib.vit_forward_flops(arch, **kw)["blocks"]
  recomputed = 0
  if remat:
    saves = _SAVED_DOTS.get(remat_policy)
    attention = arch["depth"] * 2 * 2 * tokens * tokens * arch["width"]
    recomputed = {None: blocks, "weights": attention, "all": 0}[saves]
  return float(model), float(model + recomputed * batch)


def gather_bytes(n_params, depth, tp, fsdp, remat):
  """FSDP's all-gathered (unsharded / tp) weights alive at once: all of them without remat
  (XLA keeps them from forward to backward), about two blocks' worth with remat.
  """
  if fsdp == 1:
    return 0
  return int((2 * n_params / max(1, depth) if remat else n_params) * 4 / tp)


def step_time(spec, peak, hw_flops, n_dev, n_params, mesh, tp, fsdp, accum):
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
