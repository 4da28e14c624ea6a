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

Attention uses explicit `self.param` kernels and `jnp.einsum` (flax's
DenseGeneral breaks on boxed kernels under `jax.set_mesh`). Every param carries
logical axis names and activations carry logical constraints, so the trainer's
rules pick data parallel, FSDP or tensor parallel without touching this file.

Attention (`attention=`): "custom" is `dot_product_attention` below; "xla" is
`jax.nn.dot_product_attention(implementation="xla")`; "cudnn" is cuDNN flash
attention (bf16/fp16 matmuls on an NVIDIA GPU) with the tokens padded to a
multiple of CUDNN_SEQ_MULTIPLE and the padded keys masked; "auto" (default)
takes cudnn on a CUDA GPU where the shapes allow it and custom elsewhere. All
give the same function (to rounding) and the same params. GELU is exact (erf),
as in timm; `gelu="tanh"` is the original code's approximation.
Attention, LayerNorm and GELU are hand-written in `ops` (why, with
measurements: benchmarks/NOTES.md, section "Model (models/)").
"""
import dataclasses
import functools
from typing import Any, Optional, Sequence, Union

import flax.linen as nn
import jax
from jax.extend import backend as jex_backend
import jax.numpy as jnp
import numpy as np

from big_vit_lite.models.ops import (  # noqa: F401  (re-exported: vit.dot_product_attention, ...)
    CUDNN_SEQ_MULTIPLE, attention_fn, dot_product_attention, gelu_exact, layer_norm,
    padded_attention, rms_norm)
from big_vit_lite.models.posemb import sincos_2d as posemb_sincos_2d
from big_vit_lite.models.variants import VARIANTS, decode_variant  # noqa: F401  (vit.VARIANTS)

_partitioned = nn.with_logical_partitioning


def _gelu(kind: str):
  return gelu_exact if kind == "exact" else lambda x: nn.gelu(x, approximate=True)


def _on_cuda() -> bool:
  return (jax.default_backend() == "gpu"
          and "cuda" in jex_backend.get_backend().platform_version.lower())


def resolve_dtype_mm(dtype_mm, platform=None) -> str:
  """dtype_mm="auto" -> "float32" on the CPU, "bfloat16" on accelerators (GPU, TPU); else as is.

  platform: the backend the model will run on (default: jax's default backend).
  """
  if dtype_mm != "auto":
    return dtype_mm
  return "float32" if (platform or jax.default_backend()) == "cpu" else "bfloat16"


@dataclasses.dataclass(frozen=True)
class BlockOptions:
  """The block options of `Model` (see its docstring), handed down as one hashable value."""
  qk_norm: bool = False
  layerscale_init: Optional[float] = None
  mlp: str = "gelu"
  norm: str = "layernorm"
  parallel_block: bool = False
  use_bias: bool = True


class _Heads(nn.Module):
  """One attention projection: (..., D) -> (..., H, D/H) (query/key/value) or back (`out`)."""
  num_heads: int
  dtype_mm: Any
  out: bool = False
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    n = self.num_heads
    d = x.shape[-1] * n if self.out else x.shape[-1]
    shape, names = ((n, d // n, d), ("heads", "kv", "embed")) if self.out else (
        (d, n, d // n), ("embed", "heads", "kv"))
    def init(key, shape, dtype):  # as the (d, d) matrix the kernel really is: right fan-in/out
      return nn.initializers.xavier_uniform()(key, (d, d), dtype).reshape(shape)
    kernel = self.param("kernel", _partitioned(init, names), shape, jnp.float32)
    x, kernel = x.astype(self.dtype_mm), kernel.astype(self.dtype_mm)
    y = jnp.einsum("btnh,nhd->btd" if self.out else "btd,dnh->btnh", x, kernel)
    if not self.use_bias:
      return y
    cut = 2 if self.out else 1  # The bias has the output's axes.
    bias = self.param("bias", _partitioned(nn.initializers.zeros, names[cut:]), shape[cut:],
                      jnp.float32)
    return y + bias.astype(self.dtype_mm)


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head attention with vision_transformer's param names and shapes."""
  num_heads: int
  dtype_mm: Any = jnp.float32
  attention: str = "custom"  # resolved: custom | xla | cudnn (see Model.attention)
  opts: BlockOptions = BlockOptions()

  @nn.compact
  def __call__(self, x_q, x_kv):
    if x_q.shape[-1] % self.num_heads:
      raise ValueError(f"Width {x_q.shape[-1]} is not divisible by num_heads={self.num_heads}.")
    names = ("batch", "seq", "heads", "kv")
    heads = functools.partial(_Heads, self.num_heads, self.dtype_mm, use_bias=self.opts.use_bias)
    q, k, v = (nn.with_logical_constraint(heads(name=n)(x), names)
               for n, x in (("query", x_q), ("key", x_kv), ("value", x_kv)))
    if self.opts.qk_norm:  # Each head's q and k normalised over its D/H features (ViT-22B).
      q, k = (LayerNorm(kind=self.opts.norm, axis_name="kv", name=f"{n}_norm")(a).astype(a.dtype)
              for n, a in (("query", q), ("key", k)))
    y = nn.with_logical_constraint(attention_fn(self.attention)(q, k, v), names)
    return heads(out=True, name="out")(y)


class MlpBlock(nn.Module):
  """Dense -> GELU -> dropout -> Dense -> dropout (vision_transformer's MlpBlock).

  mlp="swiglu": Dense_1(silu(Dense_gate(x)) * Dense_0(x)), both of width mlp_dim (timm's
  SwiGLU with hidden_features=mlp_dim).
  """
  mlp_dim: int
  dropout: float = 0.0
  dtype_mm: Any = jnp.float32
  gelu: str = "exact"
  mlp: str = "gelu"
  use_bias: bool = True

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    def dense(features, names, name):
      return nn.Dense(features, dtype=self.dtype_mm, use_bias=self.use_bias, name=name,
                      kernel_init=_partitioned(nn.initializers.xavier_uniform(), names),
                      bias_init=_partitioned(nn.initializers.normal(stddev=1e-6), names[1:]))
    d = x.shape[-1]
    hidden = dense(self.mlp_dim, ("embed", "mlp"), "Dense_0")(x)
    if self.mlp == "swiglu":
      hidden = nn.silu(dense(self.mlp_dim, ("embed", "mlp"), "Dense_gate")(x)) * hidden
    else:
      hidden = _gelu(self.gelu)(hidden)
    x = nn.with_logical_constraint(hidden, ("batch", "seq", "mlp"))
    x = nn.Dropout(rate=self.dropout)(x, deterministic)
    return nn.Dropout(rate=self.dropout)(dense(d, ("mlp", "embed"), "Dense_1")(x), deterministic)


class LayerNorm(nn.Module):
  """flax.linen.LayerNorm's params (`scale`, `bias`) and math, with `layer_norm`'s backward pass.

  kind="rmsnorm": `scale` only, x / rms(x) * scale (timm's RmsNorm).
  """
  epsilon: float = 1e-6
  kind: str = "layernorm"
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x):
    d, names = x.shape[-1], (self.axis_name,)
    scale = self.param("scale", _partitioned(nn.initializers.ones, names), (d,), jnp.float32)
    if self.kind == "rmsnorm":
      return rms_norm(x, scale, self.epsilon)
    bias = self.param("bias", _partitioned(nn.initializers.zeros, names), (d,), jnp.float32)
    return layer_norm(x, scale, bias, self.epsilon)


class LayerScale(nn.Module):
  """y * scale, one learned factor per channel, all `init` at first (CaiT; timm's LayerScale)."""
  init: float

  @nn.compact
  def __call__(self, y):
    scale = self.param("scale", _partitioned(nn.initializers.constant(self.init), ("embed",)),
                       (y.shape[-1],), jnp.float32)
    return y * scale.astype(y.dtype)


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
  opts: BlockOptions = BlockOptions()

  def _drop_path(self, y, rate, layer_scale: str):
    if self.opts.layerscale_init is not None:
      y = LayerScale(self.opts.layerscale_init, name=layer_scale)(y)
    if self.deterministic or not self.drop_path:
      return y
    # One keep/drop decision per example: the branch is skipped for the whole image.
    keep = 1.0 - rate
    mask = jax.random.bernoulli(self.make_rng("dropout"), keep, (y.shape[0],) + (1,) * (y.ndim - 1))
    return jnp.where(mask, y / keep, 0).astype(y.dtype)

  @nn.compact
  def __call__(self, x, drop_path_rate):
    norm = self.opts.norm
    y = LayerNorm(kind=norm, name="LayerNorm_0")(x)
    mlp = MlpBlock(self.mlp_dim, self.dropout, self.dtype_mm, self.gelu, self.opts.mlp,
                   self.opts.use_bias, name="MlpBlock_0")
    y_attn = MultiHeadDotProductAttention(self.num_heads, self.dtype_mm, self.attention,
                                          self.opts, name="MultiHeadDotProductAttention_0")(y, y)
    y_attn = nn.Dropout(rate=self.dropout)(y_attn, self.deterministic)
    if self.opts.parallel_block:  # ViT-22B: x + attn(norm(x)) + mlp(norm(x)), one LayerScale.
      y = y_attn + mlp(y, self.deterministic)
      x = x + self._drop_path(y, drop_path_rate, "LayerScale_0").astype(x.dtype)
    else:
      x = x + self._drop_path(y_attn, drop_path_rate, "LayerScale_0").astype(x.dtype)
      y = mlp(LayerNorm(kind=norm, name="LayerNorm_1")(x), self.deterministic)
      x = x + self._drop_path(y, drop_path_rate, "LayerScale_1").astype(x.dtype)
    x = nn.with_logical_constraint(x, ("batch", "seq", "embed"))
    return x, x


class AddPositionEmbs(nn.Module):
  """Learned position embedding, one row per token (the cls token's first)."""

  @nn.compact
  def __call__(self, x):
    return x + self.param("pos_embedding", _partitioned(nn.initializers.normal(stddev=0.02),
                                                        (None, None, "embed")),
                          (1,) + x.shape[1:], jnp.float32)


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
  opts: BlockOptions = BlockOptions()

  @nn.compact
  def __call__(self, x, grid_hw, num_prefix: int, train: bool, registers=None):
    if self.posemb == "learn":
      x = AddPositionEmbs(name="posembed_input")(x)
    else:  # sincos2d: fixed; the prefix (cls) token gets none, as in big_vision.
      x = x + posemb_sincos_2d(*grid_hw, x.shape[-1], num_prefix=num_prefix)
    if registers is not None:  # After the prefix (cls) token, with no posemb (timm's order).
      registers = jnp.broadcast_to(registers, (x.shape[0],) + registers.shape[1:]).astype(x.dtype)
      x = jnp.concatenate([x[:, :num_prefix], registers, x[:, num_prefix:]], axis=1)
    x = nn.with_logical_constraint(x.astype(self.dtype_act), ("batch", "seq", "embed"))
    out = {"with_posemb": x}
    x = nn.Dropout(rate=self.dropout)(x, not train)

    block_cls = Encoder1DBlock
    if self.remat_policy not in (None, "none"):
      # prevent_cse is only needed outside scan (scan already stops CSE).
      block_cls = nn.remat(block_cls, prevent_cse=not self.scan,
                           policy=getattr(jax.checkpoint_policies, self.remat_policy))
    block_kw = dict(mlp_dim=self.mlp_dim, num_heads=self.num_heads, dropout=self.dropout,
                    drop_path=self.drop_path > 0, deterministic=not train,
                    dtype_mm=self.dtype_mm, gelu=self.gelu, attention=self.attention,
                    opts=self.opts)
    # Stochastic-depth rate of each block: linear from 0 (first) to drop_path (last).
    rates = np.linspace(0.0, self.drop_path, self.depth, dtype=np.float32)
    if self.scan:
      stack = nn.scan(block_cls, variable_axes={"params": 0},
                      split_rngs={"params": True, "dropout": True}, in_axes=0,
                      length=self.depth, metadata_params={nn.PARTITION_NAME: "layers"})
      x, per_block = stack(name="encoderblock", **block_kw)(x, jnp.asarray(rates))
      out.update({f"block{i:02d}": per_block[i] for i in range(self.depth)})
    else:
      for i in range(self.depth):
        block = block_cls(name=f"encoderblock_{i}", **block_kw)
        x, out[f"block{i:02d}"] = block(x, float(rates[i]))
    return LayerNorm(kind=self.opts.norm, name="encoder_norm")(x), out


class MAPHead(nn.Module):
  """Multihead attention pooling: one learned probe attends over all tokens (big_vision)."""
  mlp_dim: int
  num_heads: int
  dtype_mm: Any = jnp.float32
  gelu: str = "exact"
  attention: str = "custom"
  norm: str = "layernorm"

  @nn.compact
  def __call__(self, x):
    n, _, d = x.shape
    probe = self.param("probe", _partitioned(nn.initializers.xavier_uniform(),
                                             (None, None, "embed")), (1, 1, d), jnp.float32)
    x = MultiHeadDotProductAttention(self.num_heads, self.dtype_mm, self.attention,
                                     name="MultiHeadDotProductAttention_0")(
                                         jnp.broadcast_to(probe, (n, 1, d)), x)
    y = LayerNorm(kind=self.norm, name="LayerNorm_0")(x)
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
  remat, the fastest where memory allows; `python -m big_vit_lite.plan` says when a config
  needs it.
  `attention`: "auto" | "custom" | "xla" | "cudnn" (module docstring).
  `dtype_act`: dtype of the residual stream between blocks (default float32). "bfloat16"
  halves its memory traffic; LayerNorm statistics stay float32. Changes numerics (~1e-2).
  `dtype_mm`: dtype of matmul inputs ("bfloat16" for fast matmuls; "auto": float32 on the
  CPU, bfloat16 on accelerators, see resolve_dtype_mm); params and LayerNorm/softmax stay
  float32.
  `stem_channels`: () for the paper's plain patchify; else a convolutional stem
  before it, one 3x3 stride-1 conv + GELU per entry (its output channels). Such
  models do not export to timm.

  `out` holds "stem" (patch embeddings), "with_posemb", "block00".."blockNN"
  (each block's output), "encoded" (all tokens after the final LayerNorm),
  "head_input" (pooled), "pre_logits" (after rep_size) and "logits".

  Block options (all off by default; docs/vit_options.md): `reg_tokens` N learned register
  tokens after the class token, without posemb, dropped after the encoder ("encoded" and
  pooling never see them); `qk_norm` normalises each head's q and k; `layerscale_init`: a
  per-channel scale on each residual branch, initialised to this value (None: none);
  `mlp`: "gelu" | "swiglu"; `norm`: "layernorm" | "rmsnorm" (every norm of the model);
  `parallel_block`: x + attn(norm(x)) + mlp(norm(x)), ViT-22B's block; `use_bias`: False
  drops the biases of the blocks' q/k/v/out and MLP projections.
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
  reg_tokens: int = 0
  qk_norm: bool = False
  layerscale_init: Optional[float] = None
  mlp: str = "gelu"
  norm: str = "layernorm"
  parallel_block: bool = False
  use_bias: bool = True

  def block_options(self) -> BlockOptions:
    return BlockOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(BlockOptions)})

  def resolved_attention(self) -> str:
    """The attention kind this model runs here: custom | xla | cudnn ("auto" decided)."""
    if self.attention != "auto":
      return self.attention
    arch = self.arch()
    head_dim = arch["width"] // arch["num_heads"]
    # What cuDNN flash attention takes: bf16/fp16 matmuls, a head dim in 8, 16, ..., 256.
    dtype_mm = jnp.dtype(self.resolved_dtype_mm())
    fits = dtype_mm in (jnp.bfloat16, jnp.float16) and head_dim in range(8, 257, 8)
    return "cudnn" if fits and _on_cuda() else "custom"

  def resolved_dtype_mm(self) -> str:
    """The matmul dtype this model runs with here ("auto" decided by the backend)."""
    return resolve_dtype_mm(self.dtype_mm)

  def arch(self) -> dict:
    """The resolved width/depth/mlp_dim/num_heads/patch_size of this model."""
    arch = decode_variant(self.variant) if self.variant else {}
    arch.update({k: getattr(self, k) for k in ("width", "depth", "mlp_dim", "num_heads",
                                               "patch_size") if getattr(self, k) is not None})
    return arch

  def _check(self):
    for name, allowed in (("posemb", ("learn", "sincos2d")), ("pool_type", ("tok", "gap", "map")),
                          ("gelu", ("exact", "tanh")), ("dtype_act", ("float32", "bfloat16")),
                          ("attention", ("auto", "custom", "xla", "cudnn")),
                          ("mlp", ("gelu", "swiglu")), ("norm", ("layernorm", "rmsnorm"))):
      if getattr(self, name) not in allowed:
        raise ValueError(f"Unknown ViT {name}={getattr(self, name)!r}: use one of "
                         f"{', '.join(allowed)}.")
    if not isinstance(self.reg_tokens, int) or self.reg_tokens < 0:
      raise ValueError(f"reg_tokens={self.reg_tokens!r}: use a count of register tokens >= 0.")
    if self.remat_policy not in (None, "none") and not hasattr(jax.checkpoint_policies,
                                                               str(self.remat_policy)):
      raise ValueError(f"Unknown remat_policy={self.remat_policy!r}: use None or a "
                       "jax.checkpoint_policies name such as 'nothing_saveable'.")

  @nn.compact
  def __call__(self, image, *, train: bool = False):
    self._check()
    a, attention = self.arch(), self.resolved_attention()
    dtype_mm = jnp.dtype(self.resolved_dtype_mm())
    b, h, w, _ = image.shape
    p, d = a["patch_size"], a["width"]
    gh, gw = h // p, w // p

    x = image
    if self.stem_channels:
      x = _ConvStem(tuple(self.stem_channels), dtype_mm, self.gelu, name="stem")(x)
    x = jnp.reshape(_Embedding(p, d, dtype_mm, name="embedding")(x), (b, gh * gw, d))
    out = {"stem": x}
    if self.pool_type == "tok":
      cls = self.param("cls", _partitioned(nn.initializers.zeros, (None, None, "embed")),
                       (1, 1, d), jnp.float32)
      x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, d)).astype(x.dtype), x], axis=1)
    num_prefix = int(self.pool_type == "tok")
    registers = None
    if self.reg_tokens:
      registers = self.param("reg", _partitioned(nn.initializers.normal(stddev=1e-6),
                                                 (None, None, "embed")),
                             (1, self.reg_tokens, d), jnp.float32)
    x, enc_out = Encoder(depth=a["depth"], mlp_dim=a["mlp_dim"], num_heads=a["num_heads"],
                         posemb=self.posemb, dropout=self.dropout, drop_path=self.drop_path,
                         remat_policy=self.remat_policy, scan=self.scan, dtype_mm=dtype_mm,
                         gelu=self.gelu, attention=attention, dtype_act=jnp.dtype(self.dtype_act),
                         opts=self.block_options(),
                         name="Transformer")(x, (gh, gw), num_prefix, train, registers)
    if self.reg_tokens:
      x = jnp.concatenate([x[:, :num_prefix], x[:, num_prefix + self.reg_tokens:]], axis=1)
    out.update(enc_out, encoded=x)

    if self.pool_type == "tok":
      x = x[:, 0]
    elif self.pool_type == "gap":
      x = jnp.mean(x, axis=1)
    else:
      # One query: cuDNN's padding would be all waste, so the probe takes the custom path.
      x = MAPHead(mlp_dim=a["mlp_dim"], num_heads=a["num_heads"], dtype_mm=dtype_mm, gelu=self.gelu,
                  attention="custom" if attention == "cudnn" else attention, norm=self.norm,
                  name="MAPHead_0")(x)
    out["head_input"] = x
    if self.rep_size:
      rep = d if self.rep_size is True else int(self.rep_size)
      x = jnp.tanh(nn.Dense(rep, dtype=dtype_mm, name="pre_logits",
                            kernel_init=_partitioned(nn.initializers.lecun_normal(),
                                                     ("embed", "mlp")),
                            bias_init=_partitioned(nn.initializers.zeros, ("mlp",)))(x))
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
      x = _gelu(self.gelu)(nn.Conv(
          ch, (3, 3), padding="SAME", dtype=self.dtype_mm, name=f"conv_{i}",
          kernel_init=_partitioned(nn.initializers.lecun_normal(), (None, None, None, None)),
          bias_init=_partitioned(nn.initializers.zeros, (None,)))(x))
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
    kernel = self.param("kernel", _partitioned(nn.initializers.lecun_normal(),
                                               (None, None, None, "embed")), (p, p, c, d),
                        jnp.float32)
    bias = self.param("bias", _partitioned(nn.initializers.zeros, ("embed",)), (d,), jnp.float32)
    # Pixels past the last whole patch are dropped, as a VALID conv does.
    x = image[:, :h // p * p, :w // p * p].reshape(b, h // p, p, w // p, p, c)
    x, kernel, bias = (a.astype(self.dtype_mm) for a in (x, kernel, bias))
    x = jnp.einsum("bhpwqc,pqcd->bhwd", x, kernel) + bias
    return nn.with_logical_constraint(x, ("batch", None, None, "embed"))


def load(init_params, path, model_cfg=None, dont_load: Sequence[str] = (), grid_hw=None):
  """Loads a checkpoint (.npz, timm .safetensors, training dir) into `init_params`' structure.

  See `formats.load` for the arguments and errors. The file readers (orbax,
  ml_collections) are imported here, so the model imports with jax/flax alone.
  """
  from big_vit_lite.models import formats  # pylint: disable=g-import-not-at-top
  return formats.load(init_params, path, model_cfg, dont_load, grid_hw)


def save_npz(params, path):
  """Saves params (boxed or plain, scan or loop) as a vision_transformer-layout .npz."""
  from big_vit_lite.models import npz  # pylint: disable=g-import-not-at-top
  return npz.save_npz(params, path)
