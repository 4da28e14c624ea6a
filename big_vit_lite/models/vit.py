"""Vision Transformer (Dosovitskiy et al., ICLR 2021) in Flax linen.

The parameter tree (names and shapes) is that of the AugReg-era
google-research/vision_transformer `.npz` checkpoints, so those files load
without renaming:

  embedding/{kernel (P,P,C,D), bias}
  cls (1,1,D)                                        pool_type="tok" only
  Transformer/posembed_input/pos_embedding (1,T,D)   posemb="learn"; T counts the cls entry
  Transformer/encoderblock_{i}/LayerNorm_0, LayerNorm_1,
      MultiHeadDotProductAttention_0/{query,key,value}/{kernel (D,H,D/H), bias (H,D/H)},
      MultiHeadDotProductAttention_0/out/{kernel (H,D/H,D), bias (D)},
      MlpBlock_0/Dense_0, MlpBlock_0/Dense_1
  Transformer/encoder_norm
  MAPHead_0/{probe, MultiHeadDotProductAttention_0, LayerNorm_0, MlpBlock_0}   pool_type="map"
  pre_logits/{kernel,bias}                           rep_size only
  head/{kernel,bias}                                 num_classes > 0 only

With `scan=True` the blocks live under `Transformer/encoderblock/...` with a
leading "layers" axis of length depth (big_vision's scan layout); `load` and
`save_npz` convert between the two.

Attention is written with explicit `self.param` kernels and `jnp.einsum`
rather than `nn.MultiHeadDotProductAttention`: Flax's DenseGeneral reshapes
partitioned (boxed) kernels and crashes under `jax.set_mesh` (Flax issue
3676). Every param carries logical axis names (`nn.with_logical_partitioning`)
and activations carry `nn.with_logical_constraint`, so the trainer's rules
pick data parallel, FSDP or tensor parallel without touching this file.

Attention (`attention=`): "custom" is `dot_product_attention` below (hand-written
backward, the fastest on CPU and +1.4% over "xla" on an H200); "xla" is
`jax.nn.dot_product_attention(implementation="xla")`; "cudnn" is cuDNN flash
attention (bf16/fp16 matmuls on an NVIDIA GPU), with the tokens padded to a
multiple of CUDNN_SEQ_MULTIPLE and the padded keys masked; "auto" (default)
takes cudnn on a CUDA GPU where the shapes allow it and custom elsewhere.
All four give the same function (to rounding) and the same params.

GELU defaults to the exact (erf) form, as timm and PyTorch use, so exported
models give the same logits in timm. The original vision_transformer and
big_vision code used the tanh approximation (`gelu="tanh"`); the two differ
by ~1e-3 in activations, which does not matter for fine-tuning.
"""
import functools
from typing import Any, Optional, Sequence, Union

import flax.linen as nn
import jax
from jax.extend import backend as jex_backend
import jax.numpy as jnp
import numpy as np

from big_vit_lite.models.posemb import sincos_2d as posemb_sincos_2d
from big_vit_lite.models.variants import VARIANTS, decode_variant  # noqa: F401  (vit.VARIANTS)

POSEMB_TYPES = ("learn", "sincos2d")
POOL_TYPES = ("tok", "gap", "map")
GELU_TYPES = ("exact", "tanh")


def drop_path_rates(depth: int, drop_path: float) -> np.ndarray:
  """Stochastic-depth rate of each block: linear from 0 (first) to drop_path (last)."""
  return np.linspace(0.0, drop_path, depth, dtype=np.float32)


def _partitioned(init, names):
  return nn.with_logical_partitioning(init, names)


def _reshaped_init(init, flat_shape):
  """Initialises as the 2D matrix the kernel really is, so fan-in/out are right."""
  def fn(key, shape, dtype=jnp.float32):
    return init(key, flat_shape, dtype).reshape(shape)
  return fn


_SQRT_HALF = np.sqrt(0.5)
_INV_SQRT_2PI = 1 / np.sqrt(2 * np.pi)


def _normal_cdf(x):
  return 0.5 + 0.5 * jax.lax.erf(x * np.asarray(_SQRT_HALF, x.dtype))


@jax.custom_vjp
def gelu_exact(x):
  """Exact GELU, x * Phi(x), written with erf and a hand-written derivative.

  Same function as `nn.gelu(x, approximate=False)` (which goes through erfc;
  the two agree to float32 rounding), but cheaper on CPU: XLA expands erfc
  into two branches selected per element, and autodiff of it recomputes them
  in several passes; erf is one polynomial and the derivative
  Phi(x) + x * phi(x) one more exp. Measured: ~5% of a ViT-Ti/16 training step.

  The backward pass keeps only x and recomputes erf from it. The optimization
  barrier stops XLA from merging that erf with the forward one, which would
  make the forward pass write erf(x) out in full (an extra (tokens, mlp_dim)
  array per block) and read it back, one memory pass more than it saves on a
  memory-bound CPU. Measured (MLP block of ViT-Ti/16, fwd+bwd, CPU): 5% faster.
  """
  return x * _normal_cdf(x)


def _gelu_exact_fwd(x):
  return gelu_exact(x), x


def _gelu_exact_bwd(x, g):
  x = jax.lax.optimization_barrier(x)
  cdf = _normal_cdf(x)
  pdf = jnp.exp(-0.5 * x * x) * np.asarray(_INV_SQRT_2PI, x.dtype)
  return (g * (cdf + x * pdf),)


gelu_exact.defvjp(_gelu_exact_fwd, _gelu_exact_bwd)


def _gelu(kind: str):
  if kind == "exact":
    return gelu_exact
  return lambda x: nn.gelu(x, approximate=True)


def dot_product_attention(q, k, v):
  """softmax(q k^T / sqrt(D/H)) v on (batch, seq, heads, D/H) arrays.

  The same computation as `jax.nn.dot_product_attention`'s XLA path (logits
  and softmax in float32, probabilities cast back to v's dtype), written with
  the heads moved next to the batch first: the two batched matmuls then run
  on contiguous (seq, D/H) tiles per (batch, head), where jax's version
  reshapes through a grouped 5-D layout that costs XLA CPU extra copies.
  Measured: ~10-15% of a ViT-Ti/16 training step on CPU.

  The backward pass is written by hand (`_attention_core`, a custom_vjp) only
  to give dv = P^T dout and dk = dS^T q a transposed copy of P and dS: as
  autodiff writes them, their left operand contracts over its major dim and
  XLA CPU runs them as plain dots instead of YNNPACK matmuls. Same math, same
  residuals. Measured (benchmarks/ab_vit.py, CPU-seconds): attention core
  fwd+bwd at ViT-Ti/16 shapes 0.070 -> 0.051 s; whole training step
  1.016x (Ti/16) and 1.014x (S/16) faster.
  """
  q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))  # (batch, heads, seq, D/H)
  return jnp.swapaxes(_attention_core(q, k, v), 1, 2)


def _head_scale(q):
  return np.asarray(1.0 / np.sqrt(q.shape[-1]), q.dtype)  # 1/sqrt(D/H)


def _attention_fwd_math(q, k, v):
  # The scale goes on q (seq x D/H) rather than on the logits (seq x seq): a
  # smaller tensor, and XLA CPU otherwise materializes the scalar as a full
  # logits-sized operand of the fused dot+softmax. Exact for power-of-two D/H.
  # Measured with layer_norm's backward (benchmarks/ab_vit.py, whole training
  # step, CPU): ViT-Ti/16 1.03x wall / 1.05x CPU-s, ViT-S/16 1.16x / 1.18x.
  q = q * _head_scale(q)
  logits = jnp.einsum("bnqh,bnkh->bnqk", q, k, preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum("bnqk,bnkh->bnqh", probs, v), (q, probs)


@jax.custom_vjp
def _attention_core(q, k, v):
  return _attention_fwd_math(q, k, v)[0]  # (batch, heads, seq, D/H)


def _transposed_copy(x):
  # A real (seq_k, seq_q) copy: without the barrier XLA folds the transpose
  # into the dot's dimension numbers, and a dot whose LHS contracts over its
  # major dim misses the fast CPU matmul kernels.
  return jax.lax.optimization_barrier(jnp.swapaxes(x, -1, -2))


def _attention_core_fwd(q, k, v):
  out, (q_scaled, probs) = _attention_fwd_math(q, k, v)
  return out, (q_scaled, k, v, probs)


def _attention_core_bwd(res, dout):
  q_scaled, k, v, probs = res
  scale = _head_scale(q_scaled)
  dv = jnp.einsum("bnkq,bnqh->bnkh", _transposed_copy(probs), dout.astype(probs.dtype))
  dp = jnp.einsum("bnqh,bnkh->bnqk", dout, v, preferred_element_type=jnp.float32)
  p32 = probs.astype(jnp.float32)
  ds = p32 * (dp - jnp.sum(dp * p32, axis=-1, keepdims=True))  # d(logits)
  dq = jnp.einsum("bnqk,bnkh->bnqh", ds.astype(k.dtype), k) * scale
  dk = jnp.einsum("bnkq,bnqh->bnkh", _transposed_copy(ds.astype(q_scaled.dtype)), q_scaled)
  return dq.astype(q_scaled.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


ATTENTION_TYPES = ("auto", "custom", "xla", "cudnn")
# Tokens are padded to a multiple of this for cuDNN. jax's check (jax/_src/cudnn/
# fused_attention_stablehlo.py, check_is_flash_attention, 0.10-0.11) wants bf16/fp16, a head
# dim that is a multiple of 8 and <= 256 on Hopper (128 before), and, in training with a bias
# or boolean mask, even sequence lengths: ViT's 197 tokens were refused so. The padded keys
# here are masked with key_value_seq_lengths (cuDNN's padding mask, no bias). 8 keeps the
# padded work small (197 -> 200 tokens: +0.1% of a B/16 step, counted in its model FLOPs);
# benchmarks/gpu_bench.py falls back to 64 (the kernel's tile) if a GPU refuses 8.
CUDNN_SEQ_MULTIPLE = 8


def _on_cuda() -> bool:
  try:
    return (jax.default_backend() == "gpu"
            and "cuda" in jex_backend.get_backend().platform_version.lower())
  except Exception:  # pylint: disable=broad-except  # no GPU backend at all
    return False


def cudnn_refusal(dtype, head_dim) -> Optional[str]:
  """Why cuDNN flash attention cannot take these inputs (None: it can), as jax checks it."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN attention needs bfloat16/float16 matmuls, not dtype_mm={jnp.dtype(dtype).name}"
  if head_dim % 8 or head_dim > 256:
    return f"cuDNN attention needs a head dim that is a multiple of 8 and <= 256, not {head_dim}"
  return None


def padded_attention(q, k, v, implementation="cudnn", multiple=None):
  """jax.nn.dot_product_attention on (batch, seq, heads, D/H) with the seq padded.

  q and k/v are zero-padded to a multiple of `multiple` (default CUDNN_SEQ_MULTIPLE) tokens;
  the padded keys are masked (key_value_seq_lengths) and the padded query rows dropped, so
  the result is that of the unpadded attention.
  """
  multiple = multiple or CUDNN_SEQ_MULTIPLE
  (b, t), s = q.shape[:2], k.shape[1]
  pad_t, pad_s = -t % multiple, -s % multiple
  pad = lambda a, n: jnp.pad(a, ((0, 0), (0, n), (0, 0), (0, 0))) if n else a
  lengths = jnp.full((b,), s, jnp.int32) if pad_s else None
  out = jax.nn.dot_product_attention(pad(q, pad_t), pad(k, pad_s), pad(v, pad_s),
                                     key_value_seq_lengths=lengths, implementation=implementation)
  return out[:, :t]


def attention_fn(kind: str):
  """The (batch, seq, heads, D/H) attention function of a resolved kind: custom | xla | cudnn."""
  if kind == "custom":
    return dot_product_attention
  if kind == "xla":
    return functools.partial(jax.nn.dot_product_attention, implementation="xla")
  return functools.partial(padded_attention, implementation="cudnn")


class _HeadsIn(nn.Module):
  """Projection (..., D) -> (..., H, D/H): the query/key/value params of one attention."""
  num_heads: int
  dtype_mm: Any

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    hd = d // self.num_heads
    kernel = self.param(
        "kernel", _partitioned(_reshaped_init(nn.initializers.xavier_uniform(), (d, d)),
                               ("embed", "heads", "kv")), (d, self.num_heads, hd), jnp.float32)
    bias = self.param("bias", _partitioned(nn.initializers.zeros, ("heads", "kv")),
                      (self.num_heads, hd), jnp.float32)
    x, kernel, bias = (a.astype(self.dtype_mm) for a in (x, kernel, bias))
    return jnp.einsum("btd,dnh->btnh", x, kernel) + bias


class _HeadsOut(nn.Module):
  """Projection (..., H, D/H) -> (..., D): the `out` params of one attention."""
  dtype_mm: Any

  @nn.compact
  def __call__(self, x):
    n, hd = x.shape[-2:]
    d = n * hd
    kernel = self.param(
        "kernel", _partitioned(_reshaped_init(nn.initializers.xavier_uniform(), (d, d)),
                               ("heads", "kv", "embed")), (n, hd, d), jnp.float32)
    bias = self.param("bias", _partitioned(nn.initializers.zeros, ("embed",)), (d,), jnp.float32)
    x, kernel, bias = (a.astype(self.dtype_mm) for a in (x, kernel, bias))
    return jnp.einsum("btnh,nhd->btd", x, kernel) + bias


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head attention with vision_transformer's param names and shapes."""
  num_heads: int
  dtype_mm: Any = jnp.float32
  attention: str = "custom"  # resolved: custom | xla | cudnn (see Model.attention)

  @nn.compact
  def __call__(self, x_q, x_kv):
    if x_q.shape[-1] % self.num_heads:
      raise ValueError(f"Width {x_q.shape[-1]} is not divisible by num_heads={self.num_heads}.")
    names = ("batch", "seq", "heads", "kv")
    q = nn.with_logical_constraint(_HeadsIn(self.num_heads, self.dtype_mm, name="query")(x_q), names)
    k = nn.with_logical_constraint(_HeadsIn(self.num_heads, self.dtype_mm, name="key")(x_kv), names)
    v = nn.with_logical_constraint(_HeadsIn(self.num_heads, self.dtype_mm, name="value")(x_kv), names)
    # Scale 1/sqrt(D/H), softmax in f32 even for bf16 inputs (as jax's XLA path).
    y = attention_fn(self.attention)(q, k, v)
    y = nn.with_logical_constraint(y, names)
    return _HeadsOut(self.dtype_mm, name="out")(y)


class MlpBlock(nn.Module):
  """Dense -> GELU -> dropout -> Dense -> dropout (vision_transformer's MlpBlock)."""
  mlp_dim: int
  dropout: float = 0.0
  dtype_mm: Any = jnp.float32
  gelu: str = "exact"

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    d = x.shape[-1]
    x = nn.Dense(self.mlp_dim, dtype=self.dtype_mm,
                 kernel_init=_partitioned(nn.initializers.xavier_uniform(), ("embed", "mlp")),
                 bias_init=_partitioned(nn.initializers.normal(stddev=1e-6), ("mlp",)))(x)
    x = nn.with_logical_constraint(_gelu(self.gelu)(x), ("batch", "seq", "mlp"))
    x = nn.Dropout(rate=self.dropout)(x, deterministic)
    x = nn.Dense(d, dtype=self.dtype_mm,
                 kernel_init=_partitioned(nn.initializers.xavier_uniform(), ("mlp", "embed")),
                 bias_init=_partitioned(nn.initializers.normal(stddev=1e-6), ("embed",)))(x)
    return nn.Dropout(rate=self.dropout)(x, deterministic)


def _ln_stats(x, eps):
  # One pass over x: mean and mean of squares (flax's use_fast_variance formula).
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.maximum(jnp.mean(jnp.square(x), axis=-1, keepdims=True) - jnp.square(mean), 0.0)
  return mean, jax.lax.rsqrt(var + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, scale, bias, eps=1e-6):
  """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, in float32 or wider.

  The same function as `flax.linen.LayerNorm` (its default fast-variance
  formula, so the forward pass matches it to rounding), with the textbook
  backward pass written out: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
  g = dy * scale, from x and the two per-token statistics. Autodiff of the
  generic version leaves XLA CPU several broadcasts of the statistics to
  materialize at full size and more passes over the activations. Measured on
  the (32, 197, 192) activations of ViT-Ti/16 (fwd+bwd, CPU): 2.7 -> 2.0 ms.
  """
  return _layer_norm_fwd(x, scale, bias, eps)[0]


def _layer_norm_fwd(x, scale, bias, eps):
  x_in, dtype = x, jnp.promote_types(x.dtype, jnp.float32)
  x = x.astype(dtype)
  mean, rstd = _ln_stats(x, eps)
  return (x - mean) * rstd * scale.astype(dtype) + bias.astype(dtype), (x_in, mean, rstd, scale)


def _layer_norm_bwd(eps, res, dy):
  del eps
  x_in, mean, rstd, scale = res
  x = x_in.astype(mean.dtype)
  xhat = (x - mean) * rstd
  g = dy * scale.astype(dy.dtype)
  dx = rstd * (g - jnp.mean(g, axis=-1, keepdims=True)
               - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
  rows = tuple(range(x.ndim - 1))
  dscale = jnp.sum(dy * xhat, axis=rows).astype(scale.dtype)
  dbias = jnp.sum(dy, axis=rows).astype(scale.dtype)
  return dx.astype(x_in.dtype), dscale, dbias


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class LayerNorm(nn.Module):
  """flax.linen.LayerNorm's params (`scale`, `bias`) and math, with `layer_norm`'s backward pass."""
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    scale = self.param("scale", _partitioned(nn.initializers.ones, ("embed",)), (d,), jnp.float32)
    bias = self.param("bias", _partitioned(nn.initializers.zeros, ("embed",)), (d,), jnp.float32)
    return layer_norm(x, scale, bias, self.epsilon)


def _layer_norm(name):
  return LayerNorm(epsilon=1e-6, name=name)


class Encoder1DBlock(nn.Module):
  """Pre-LN transformer block. Returns (x, x) so that it can be the body of nn.scan."""
  mlp_dim: int
  num_heads: int
  dropout: float = 0.0
  drop_path: bool = False   # whether stochastic depth is on at all (rate comes per call)
  deterministic: bool = True
  dtype_mm: Any = jnp.float32
  gelu: str = "exact"
  attention: str = "custom"

  def _drop_path(self, y, rate):
    if self.deterministic or not self.drop_path:
      return y
    # One keep/drop decision per example: the branch is skipped for the whole image.
    keep = 1.0 - rate
    mask = jax.random.bernoulli(self.make_rng("dropout"), keep, (y.shape[0],) + (1,) * (y.ndim - 1))
    return jnp.where(mask, y / keep, 0).astype(y.dtype)

  @nn.compact
  def __call__(self, x, drop_path_rate):
    y = _layer_norm("LayerNorm_0")(x)
    y = MultiHeadDotProductAttention(self.num_heads, self.dtype_mm, self.attention,
                                     name="MultiHeadDotProductAttention_0")(y, y)
    y = nn.Dropout(rate=self.dropout)(y, self.deterministic)
    x = x + self._drop_path(y, drop_path_rate).astype(x.dtype)
    y = _layer_norm("LayerNorm_1")(x)
    y = MlpBlock(self.mlp_dim, self.dropout, self.dtype_mm, self.gelu,
                 name="MlpBlock_0")(y, self.deterministic)
    x = x + self._drop_path(y, drop_path_rate).astype(x.dtype)
    x = nn.with_logical_constraint(x, ("batch", "seq", "embed"))
    return x, x


class AddPositionEmbs(nn.Module):
  """Learned position embedding, one row per token (the cls token's first)."""

  @nn.compact
  def __call__(self, x):
    pe = self.param("pos_embedding",
                    _partitioned(nn.initializers.normal(stddev=0.02), (None, None, "embed")),
                    (1,) + x.shape[1:], jnp.float32)
    return x + pe


class Encoder(nn.Module):
  """Position embedding, dropout, `depth` blocks, final LayerNorm (param scope `Transformer`)."""
  depth: int
  mlp_dim: int
  num_heads: int
  posemb: str = "learn"
  dropout: float = 0.0
  drop_path: float = 0.0
  remat_policy: Optional[str] = None
  scan: bool = False
  dtype_mm: Any = jnp.float32
  gelu: str = "exact"
  attention: str = "custom"
  dtype_act: Any = jnp.float32

  @nn.compact
  def __call__(self, x, grid_hw, num_prefix: int, train: bool):
    out = {}
    if self.posemb == "learn":
      x = AddPositionEmbs(name="posembed_input")(x)
    else:  # sincos2d: fixed; the prefix (cls) token gets none, as in big_vision.
      pe = posemb_sincos_2d(*grid_hw, x.shape[-1])
      pe = np.concatenate([np.zeros((1, num_prefix, x.shape[-1]), pe.dtype), pe], axis=1)
      x = x + pe
    x = nn.with_logical_constraint(x.astype(self.dtype_act), ("batch", "seq", "embed"))
    out["with_posemb"] = x
    x = nn.Dropout(rate=self.dropout)(x, not train)

    block_cls = Encoder1DBlock
    if self.remat_policy not in (None, "none"):
      policy = getattr(jax.checkpoint_policies, self.remat_policy)
      # prevent_cse is only needed outside scan (scan already stops CSE).
      block_cls = nn.remat(block_cls, prevent_cse=not self.scan, policy=policy)
    block_kw = dict(mlp_dim=self.mlp_dim, num_heads=self.num_heads, dropout=self.dropout,
                    drop_path=self.drop_path > 0, deterministic=not train,
                    dtype_mm=self.dtype_mm, gelu=self.gelu, attention=self.attention)
    rates = drop_path_rates(self.depth, self.drop_path)
    if self.scan:
      stack = nn.scan(block_cls, variable_axes={"params": 0},
                      split_rngs={"params": True, "dropout": True}, in_axes=0,
                      length=self.depth, metadata_params={nn.PARTITION_NAME: "layers"})
      x, per_block = stack(name="encoderblock", **block_kw)(x, jnp.asarray(rates))
      for i in range(self.depth):
        out[f"block{i:02d}"] = per_block[i]
    else:
      for i in range(self.depth):
        x, out[f"block{i:02d}"] = block_cls(name=f"encoderblock_{i}", **block_kw)(x, float(rates[i]))
    x = _layer_norm("encoder_norm")(x)
    return x, out


class MAPHead(nn.Module):
  """Multihead attention pooling: one learned probe attends over all tokens (big_vision)."""
  mlp_dim: int
  num_heads: int
  dtype_mm: Any = jnp.float32
  gelu: str = "exact"
  attention: str = "custom"

  @nn.compact
  def __call__(self, x):
    n, _, d = x.shape
    probe = self.param("probe", _partitioned(nn.initializers.xavier_uniform(), (None, None, "embed")),
                       (1, 1, d), jnp.float32)
    probe = jnp.broadcast_to(probe, (n, 1, d))
    x = MultiHeadDotProductAttention(self.num_heads, self.dtype_mm, self.attention,
                                     name="MultiHeadDotProductAttention_0")(probe, x)
    y = _layer_norm("LayerNorm_0")(x)
    x = x + MlpBlock(self.mlp_dim, 0.0, self.dtype_mm, self.gelu, name="MlpBlock_0")(y)
    return x[:, 0]


class Model(nn.Module):
  """ViT classifier. `apply({"params": p}, images_nhwc, train=False) -> (logits, out)`.

  `variant` ("B/16", ...) sets width/depth/mlp_dim/num_heads/patch_size; any of
  those given explicitly overrides it (tiny test models: variant=None plus all
  five). `num_classes=0` builds no head and returns the pre-logits as logits.
  `rep_size`: False, True (= width) or an int: a Dense+tanh "pre_logits" layer.
  `drop_path`: stochastic-depth rate of the last block, linear from 0 in depth.
  `remat_policy`: a `jax.checkpoint_policies` name (e.g. "nothing_saveable": each block's
  forward is recomputed in the backward pass, activations ~1/depth), or None (default): no
  remat, the fastest where memory allows (it cost 21% of a B/16 step on an H200, where 27 of
  141 GB were in use); `python -m big_vit_lite.plan` says when a config needs it.
  `attention`: "auto" | "custom" | "xla" | "cudnn" (module docstring); "auto" is cudnn on a
  CUDA GPU with bf16/fp16 matmuls, custom otherwise.
  `dtype_act`: dtype of the residual stream between blocks (default float32). "bfloat16"
  halves its memory traffic; LayerNorm statistics stay float32. Changes numerics (~1e-2).
  `dtype_mm`: dtype of matmul inputs ("bfloat16" for fast matmuls); params and
  LayerNorm/softmax stay float32.
  `stem_channels`: () for the paper's plain patchify. Otherwise a convolutional
  stem before it: one 3x3 stride-1 conv + GELU per entry (its output channels),
  so each patch embeds local features instead of raw pixels ("Early
  convolutions help transformers see better", Xiao et al. 2021; the ViT
  paper's hybrids use a ResNet here). It learns more per step on small data
  (demo model on Fashion-MNIST: 0.871 vs 0.862 test accuracy after 3,000
  steps with one 16-channel conv) but each CPU step costs 15% more, which
  evened out over a 15-minute run. Such models do not export to timm.

  `out` holds "stem" (patch embeddings), "with_posemb", "block00".."blockNN"
  (each block's output), "encoded" (all tokens after the final LayerNorm),
  "head_input" (pooled), "pre_logits" (after rep_size) and "logits".
  """
  num_classes: int
  variant: Optional[str] = "B/16"
  width: Optional[int] = None
  depth: Optional[int] = None
  mlp_dim: Optional[int] = None
  num_heads: Optional[int] = None
  patch_size: Optional[int] = None
  posemb: str = "learn"
  pool_type: str = "tok"
  rep_size: Union[int, bool] = False
  head_zeroinit: bool = True
  dropout: float = 0.0
  drop_path: float = 0.0
  remat_policy: Optional[str] = None
  scan: bool = False
  dtype_mm: str = "float32"
  gelu: str = "exact"
  stem_channels: Sequence[int] = ()
  attention: str = "auto"
  dtype_act: str = "float32"

  def resolved_attention(self) -> str:
    """The attention kind this model runs here: custom | xla | cudnn ("auto" decided)."""
    head_dim = self.arch()["width"] // self.arch()["num_heads"]
    refusal = cudnn_refusal(self.dtype_mm, head_dim)
    if self.attention == "auto":
      return "cudnn" if refusal is None and _on_cuda() else "custom"
    if self.attention == "cudnn" and (refusal or not _on_cuda()):
      refusal = refusal or f"it needs an NVIDIA GPU, this backend is {jax.default_backend()}"
      raise ValueError(f"attention='cudnn': {refusal}; use attention='auto' or 'xla'.")
    return self.attention

  def arch(self) -> dict:
    """The resolved width/depth/mlp_dim/num_heads/patch_size of this model."""
    arch = decode_variant(self.variant) if self.variant else {}
    for k in ("width", "depth", "mlp_dim", "num_heads", "patch_size"):
      if getattr(self, k) is not None:
        arch[k] = getattr(self, k)
    if len(arch) < 5:
      raise ValueError("ViT needs a variant (e.g. 'B/16') or all of width, depth, mlp_dim, "
                       "num_heads and patch_size.")
    for k, v in arch.items():
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"ViT {k}={v!r}: use a positive integer.")
    return arch

  def _check(self):
    for name, value, allowed in (("posemb", self.posemb, POSEMB_TYPES),
                                 ("pool_type", self.pool_type, POOL_TYPES),
                                 ("gelu", self.gelu, GELU_TYPES),
                                 ("attention", self.attention, ATTENTION_TYPES)):
      if value not in allowed:
        raise ValueError(f"Unknown ViT {name}={value!r}: use one of {', '.join(allowed)}.")
    if self.remat_policy not in (None, "none") and not hasattr(jax.checkpoint_policies,
                                                               str(self.remat_policy)):
      raise ValueError(f"Unknown remat_policy={self.remat_policy!r}: use None or a "
                       "jax.checkpoint_policies name such as 'nothing_saveable'.")
    try:
      floating = jnp.issubdtype(jnp.dtype(self.dtype_mm), jnp.floating)
    except TypeError:
      floating = False
    if not floating:
      raise ValueError(f"Unknown dtype_mm={self.dtype_mm!r}: use 'float32' or 'bfloat16' "
                       "(or another float type).")
    if self.dtype_act not in ("float32", "bfloat16"):
      raise ValueError(f"Unknown dtype_act={self.dtype_act!r}: use 'float32' or 'bfloat16'.")
    counts = (("num_classes", self.num_classes, 0),
              ("rep_size", int(self.rep_size) if isinstance(self.rep_size, bool)
               else self.rep_size, 0),
              *((f"stem_channels[{i}]", c, 1) for i, c in enumerate(self.stem_channels)))
    for name, value, least in counts:
      if not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"ViT {name}={value!r}: use an integer >= {least}.")
    for name in ("dropout", "drop_path"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"ViT {name}={getattr(self, name)!r}: use a rate in [0, 1).")

  def _check_params_fit(self, h, w, c, tokens):
    """One line instead of flax's ScopeParamShapeError when applied params do not fit the images."""
    params = nn.meta.unbox(self.variables.get("params", {}))
    first = (params.get("stem", {}).get("conv_0") if self.stem_channels else None) or (
        params.get("embedding", {}))
    want = first["kernel"].shape[2] if "kernel" in first else c
    if want != c:
      raise ValueError(f"The params take {want}-channel images, these have {c}: decode them "
                       f"with channels={want}.")
    pe = params.get("Transformer", {}).get("posembed_input", {}).get("pos_embedding")
    if pe is not None and pe.shape[1] != tokens:
      raise ValueError(f"{h}x{w} images give {tokens} tokens but the params' position embedding "
                       f"has {pe.shape[1]}: feed images of the size the params were made for, or "
                       "vit.load them into a model initialised at this size (which resamples "
                       "the position embedding).")

  @nn.compact
  def __call__(self, image, *, train: bool = False):
    self._check()
    a = self.arch()
    attention = self.resolved_attention()
    dtype_mm = jnp.dtype(self.dtype_mm)
    out = {}
    b, h, w, c = image.shape
    p, d = a["patch_size"], a["width"]
    gh, gw = h // p, w // p
    if gh < 1 or gw < 1:
      raise ValueError(f"Image {h}x{w} is smaller than the patch size {p}.")
    self._check_params_fit(h, w, c, gh * gw + (self.pool_type == "tok"))

    x = image
    if self.stem_channels:
      x = _ConvStem(tuple(self.stem_channels), dtype_mm, self.gelu, name="stem")(x)
    x = _Embedding(p, d, dtype_mm, name="embedding")(x)
    x = jnp.reshape(x, (b, gh * gw, d))
    out["stem"] = x

    num_prefix = 0
    if self.pool_type == "tok":
      cls = self.param("cls", _partitioned(nn.initializers.zeros, (None, None, "embed")),
                       (1, 1, d), jnp.float32)
      x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, d)).astype(x.dtype), x], axis=1)
      num_prefix = 1

    x, enc_out = Encoder(depth=a["depth"], mlp_dim=a["mlp_dim"], num_heads=a["num_heads"],
                         posemb=self.posemb, dropout=self.dropout, drop_path=self.drop_path,
                         remat_policy=self.remat_policy, scan=self.scan, dtype_mm=dtype_mm,
                         gelu=self.gelu, attention=attention, dtype_act=jnp.dtype(self.dtype_act),
                         name="Transformer")(x, (gh, gw), num_prefix, train)
    out.update(enc_out)
    out["encoded"] = x

    if self.pool_type == "tok":
      x = x[:, 0]
    elif self.pool_type == "gap":
      x = jnp.mean(x, axis=1)
    else:
      # One query: cuDNN's padding would be all waste, so the probe takes the custom path.
      x = MAPHead(mlp_dim=a["mlp_dim"], num_heads=a["num_heads"], dtype_mm=dtype_mm,
                  gelu=self.gelu, attention="custom" if attention == "cudnn" else attention,
                  name="MAPHead_0")(x)
    out["head_input"] = x

    if self.rep_size:
      rep = d if self.rep_size is True else int(self.rep_size)
      x = nn.Dense(rep, dtype=dtype_mm, name="pre_logits",
                   kernel_init=_partitioned(nn.initializers.lecun_normal(), ("embed", "mlp")),
                   bias_init=_partitioned(nn.initializers.zeros, ("mlp",)))(x)
      x = jnp.tanh(x)
    out["pre_logits"] = x

    if self.num_classes:
      kinit = nn.initializers.zeros if self.head_zeroinit else nn.initializers.lecun_normal()
      x = nn.Dense(self.num_classes, dtype=dtype_mm, name="head",
                   kernel_init=_partitioned(kinit, ("embed", "classes")),
                   bias_init=_partitioned(nn.initializers.zeros, ("classes",)))(x)
    out["logits"] = x
    return x, out


class _ConvStem(nn.Module):
  """3x3 stride-1 convs with GELU (param scope `stem/conv_{i}`); keeps H and W."""
  channels: Sequence[int]
  dtype_mm: Any = jnp.float32
  gelu: str = "exact"

  @nn.compact
  def __call__(self, x):
    for i, ch in enumerate(self.channels):
      x = nn.Conv(ch, (3, 3), padding="SAME", dtype=self.dtype_mm, name=f"conv_{i}",
                  kernel_init=_partitioned(nn.initializers.lecun_normal(),
                                           (None, None, None, None)),
                  bias_init=_partitioned(nn.initializers.zeros, (None,)))(x)
      x = _gelu(self.gelu)(x)
    return nn.with_logical_constraint(x, ("batch", None, None, None))


class _Embedding(nn.Module):
  """Patch embedding with a conv kernel (P,P,C,D) and bias (D) (param scope `embedding`)."""
  patch_size: int
  width: int
  dtype_mm: Any = jnp.float32

  @nn.compact
  def __call__(self, image):
    b, h, w, c = image.shape
    p, d = self.patch_size, self.width
    gh, gw = h // p, w // p
    kernel = self.param("kernel", _partitioned(nn.initializers.lecun_normal(),
                                               (None, None, None, "embed")), (p, p, c, d), jnp.float32)
    bias = self.param("bias", _partitioned(nn.initializers.zeros, ("embed",)), (d,), jnp.float32)
    # Pixels past the last whole patch are dropped, as a VALID conv does.
    x = image[:, :gh * p, :gw * p].reshape(b, gh, p, gw, p, c)
    x, kernel, bias = (a.astype(self.dtype_mm) for a in (x, kernel, bias))
    x = jnp.einsum("bhpwqc,pqcd->bhwd", x, kernel) + bias
    return nn.with_logical_constraint(x, ("batch", None, None, "embed"))


def load(init_params, path, model_cfg=None, dont_load: Sequence[str] = (), grid_hw=None):
  """Loads a checkpoint (.npz, timm .safetensors, training dir) into `init_params`' structure.

  See `formats.load` for the arguments and errors.
  """
  # Imported here: the model itself needs none of the file readers (orbax, ml_collections,
  # etils), so a bare jax/flax box (benchmarks/gpu_bench.py) can build and run it.
  from big_vit_lite.models import formats  # pylint: disable=g-import-not-at-top
  return formats.load(init_params, path, model_cfg, dont_load, grid_hw)


def save_npz(params, path):
  """Saves params (boxed or plain, scan or loop) as a vision_transformer-layout .npz."""
  from big_vit_lite.models import npz  # pylint: disable=g-import-not-at-top
  return npz.save_npz(params, path)
