"""The transformer's parts: attention, MLP, norms, LayerScale, the encoder block,
the encoder (a loop or nn.scan over blocks) and the MAP head, with the block
options of `BlockOptions`. `vit.Model` puts them together; the parameter tree
they make is described in vit.py's docstring, and these names are re-exported
there (vit.Encoder1DBlock, vit.MlpBlock, ...).
"""

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
from jax.extend import backend as jex_backend
import jax.numpy as jnp
import numpy as np

from big_vit_lite.models.ops import attention_fn
from big_vit_lite.models.ops import gelu_exact
from big_vit_lite.models.ops import layer_norm
from big_vit_lite.models.ops import rms_norm
from big_vit_lite.models.posemb import sincos_2d as posemb_sincos_2d

_partitioned = nn.with_logical_partitioning


def gelu_fn(kind: str):
  """The GELU of `kind`: "exact" (erf, custom backward pass) or "tanh" (the approximation)."""
  if kind == "exact":
    return gelu_exact
  return functools.partial(nn.gelu, approximate=True)


def on_cuda() -> bool:
  """Whether jax's default backend is a CUDA GPU."""
  return (
      jax.default_backend() == "gpu"
      and "cuda" in jex_backend.get_backend().platform_version.lower()
  )


def resolve_dtype_mm(dtype_mm, platform=None) -> str:
  """dtype_mm="auto" -> "float32" on the CPU, "bfloat16" on accelerators (GPU, TPU); else as is.

  platform: the backend the model will run on (default: jax's default backend).
  """
  if dtype_mm != "auto":
    return dtype_mm
  if (platform or jax.default_backend()) == "cpu":
    return "float32"
  return "bfloat16"


def resolve_dtype_act(dtype_act, platform=None) -> str:
  """dtype_act="auto" -> "bfloat16" on a TPU, "float32" elsewhere; else as is.

  The TPU compiler's cost model puts a bf16 residual stream 8% faster for L/16
  (benchmarks/NOTES.md, "TPU step time by depth"); no GPU has measured it yet.
  """
  if dtype_act != "auto":
    return dtype_act
  if (platform or jax.default_backend()) == "tpu":
    return "bfloat16"
  return "float32"


# Keyword-only and not frozen so that vit.Model can take these fields as its
# own (config.model.qk_norm, ...) by subclassing: one definition of each.
@dataclasses.dataclass(unsafe_hash=True, kw_only=True)
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
    shape, names = (
        ((n, d // n, d), ("heads", "kv", "embed"))
        if self.out
        else ((d, n, d // n), ("embed", "heads", "kv"))
    )

    # as the (d, d) matrix the kernel really is: right fan-in/out
    def init(key, shape, dtype):
      return nn.initializers.xavier_uniform()(key, (d, d), dtype).reshape(shape)

    kernel = self.param("kernel", _partitioned(init, names), shape, jnp.float32)
    x, kernel = x.astype(self.dtype_mm), kernel.astype(self.dtype_mm)
    equation = "btd,dnh->btnh"
    if self.out:
      equation = "btnh,nhd->btd"
    y = jnp.einsum(equation, x, kernel)
    if not self.use_bias:
      return y
    cut = 2 if self.out else 1  # The bias has the output's axes.
    bias = self.param(
        "bias",
        _partitioned(nn.initializers.zeros, names[cut:]),
        shape[cut:],
        jnp.float32,
    )
    return y + bias.astype(self.dtype_mm)


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head attention with vision_transformer's param names and shapes."""

  num_heads: int
  dtype_mm: Any = jnp.float32
  # resolved: custom | xla | cudnn | splash (see Model.attention)
  attention: str = "custom"
  opts: BlockOptions = BlockOptions()

  @nn.compact
  def __call__(self, x_q, x_kv):
    if x_q.shape[-1] % self.num_heads:
      raise ValueError(
          f"Width {x_q.shape[-1]} is not divisible by num_heads={self.num_heads}."
      )
    names = ("batch", "seq", "heads", "kv")
    heads = functools.partial(
        _Heads, self.num_heads, self.dtype_mm, use_bias=self.opts.use_bias
    )
    q, k, v = (
        nn.with_logical_constraint(heads(name=n)(x), names)
        for n, x in (("query", x_q), ("key", x_kv), ("value", x_kv))
    )
    # Each head's q and k normalised over its D/H features (ViT-22B).
    if self.opts.qk_norm:
      q, k = (
          LayerNorm(kind=self.opts.norm, axis_name="kv", name=f"{n}_norm")(
              a
          ).astype(a.dtype)
          for n, a in (("query", q), ("key", k))
      )
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
      return nn.Dense(
          features,
          dtype=self.dtype_mm,
          use_bias=self.use_bias,
          name=name,
          kernel_init=_partitioned(nn.initializers.xavier_uniform(), names),
          bias_init=_partitioned(
              nn.initializers.normal(stddev=1e-6), names[1:]
          ),
      )

    d = x.shape[-1]
    hidden = dense(self.mlp_dim, ("embed", "mlp"), "Dense_0")(x)
    if self.mlp == "swiglu":
      hidden = (
          nn.silu(dense(self.mlp_dim, ("embed", "mlp"), "Dense_gate")(x))
          * hidden
      )
    else:
      hidden = gelu_fn(self.gelu)(hidden)
    x = nn.with_logical_constraint(hidden, ("batch", "seq", "mlp"))
    x = nn.Dropout(rate=self.dropout)(x, deterministic)
    return nn.Dropout(rate=self.dropout)(
        dense(d, ("mlp", "embed"), "Dense_1")(x), deterministic
    )


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
    scale = self.param(
        "scale", _partitioned(nn.initializers.ones, names), (d,), jnp.float32
    )
    if self.kind == "rmsnorm":
      return rms_norm(x, scale, self.epsilon)
    bias = self.param(
        "bias", _partitioned(nn.initializers.zeros, names), (d,), jnp.float32
    )
    return layer_norm(x, scale, bias, self.epsilon)


class LayerScale(nn.Module):
  """y * scale, one learned factor per channel, all `init` at first (CaiT; timm's LayerScale)."""

  init: float

  @nn.compact
  def __call__(self, y):
    scale = self.param(
        "scale",
        _partitioned(nn.initializers.constant(self.init), ("embed",)),
        (y.shape[-1],),
        jnp.float32,
    )
    return y * scale.astype(y.dtype)


class Encoder1DBlock(nn.Module):
  """Pre-LN transformer block. Returns (x, x) so that it can be the body of nn.scan."""

  mlp_dim: int
  num_heads: int
  dropout: float = 0.0
  # whether stochastic depth is on at all (rate comes per call)
  drop_path: bool = False
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
    # One keep/drop decision per example: the branch is skipped for the whole
    # image.
    keep = 1.0 - rate
    mask = jax.random.bernoulli(
        self.make_rng("dropout"), keep, (y.shape[0],) + (1,) * (y.ndim - 1)
    )
    return jnp.where(mask, y / keep, 0).astype(y.dtype)

  @nn.compact
  def __call__(self, x, drop_path_rate):
    norm = self.opts.norm
    y = LayerNorm(kind=norm, name="LayerNorm_0")(x)
    mlp = MlpBlock(
        self.mlp_dim,
        self.dropout,
        self.dtype_mm,
        self.gelu,
        self.opts.mlp,
        self.opts.use_bias,
        name="MlpBlock_0",
    )
    y_attn = MultiHeadDotProductAttention(
        self.num_heads,
        self.dtype_mm,
        self.attention,
        self.opts,
        name="MultiHeadDotProductAttention_0",
    )(y, y)
    y_attn = nn.Dropout(rate=self.dropout)(y_attn, self.deterministic)
    # ViT-22B: x + attn(norm(x)) + mlp(norm(x)), one LayerScale.
    if self.opts.parallel_block:
      y = y_attn + mlp(y, self.deterministic)
      x = x + self._drop_path(y, drop_path_rate, "LayerScale_0").astype(x.dtype)
    else:
      x = x + self._drop_path(y_attn, drop_path_rate, "LayerScale_0").astype(
          x.dtype
      )
      y = mlp(LayerNorm(kind=norm, name="LayerNorm_1")(x), self.deterministic)
      x = x + self._drop_path(y, drop_path_rate, "LayerScale_1").astype(x.dtype)
    x = nn.with_logical_constraint(x, ("batch", "seq", "embed"))
    return x, x


class AddPositionEmbs(nn.Module):
  """Learned position embedding, one row per token (the cls token's first)."""

  @nn.compact
  def __call__(self, x):
    return x + self.param(
        "pos_embedding",
        _partitioned(
            nn.initializers.normal(stddev=0.02), (None, None, "embed")
        ),
        (1,) + x.shape[1:],
        jnp.float32,
    )


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
    # sincos2d: fixed; the prefix (cls) token gets none, as in big_vision.
    else:
      x = x + posemb_sincos_2d(*grid_hw, x.shape[-1], num_prefix=num_prefix)
    # After the prefix (cls) token, with no posemb (timm's order).
    if registers is not None:
      registers = jnp.broadcast_to(
          registers, (x.shape[0],) + registers.shape[1:]
      ).astype(x.dtype)
      x = jnp.concatenate(
          [x[:, :num_prefix], registers, x[:, num_prefix:]], axis=1
      )
    x = nn.with_logical_constraint(
        x.astype(self.dtype_act), ("batch", "seq", "embed")
    )
    out = {"with_posemb": x}
    x = nn.Dropout(rate=self.dropout)(x, not train)

    block_cls = Encoder1DBlock
    if self.remat_policy not in (None, "none"):
      # prevent_cse is only needed outside scan (scan already stops CSE).
      block_cls = nn.remat(
          block_cls,
          prevent_cse=not self.scan,
          policy=getattr(jax.checkpoint_policies, self.remat_policy),
      )
    block_kw = dict(
        mlp_dim=self.mlp_dim,
        num_heads=self.num_heads,
        dropout=self.dropout,
        drop_path=self.drop_path > 0,
        deterministic=not train,
        dtype_mm=self.dtype_mm,
        gelu=self.gelu,
        attention=self.attention,
        opts=self.opts,
    )
    # Stochastic-depth rate of each block: linear from 0 (first) to drop_path
    # (last).
    rates = np.linspace(0.0, self.drop_path, self.depth, dtype=np.float32)
    if self.scan:
      stack = nn.scan(
          block_cls,
          variable_axes={"params": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=0,
          length=self.depth,
          metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, per_block = stack(name="encoderblock", **block_kw)(
          x, jnp.asarray(rates)
      )
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
    probe = self.param(
        "probe",
        _partitioned(nn.initializers.xavier_uniform(), (None, None, "embed")),
        (1, 1, d),
        jnp.float32,
    )
    x = MultiHeadDotProductAttention(
        self.num_heads,
        self.dtype_mm,
        self.attention,
        name="MultiHeadDotProductAttention_0",
    )(jnp.broadcast_to(probe, (n, 1, d)), x)
    y = LayerNorm(kind=self.norm, name="LayerNorm_0")(x)
    x = x + MlpBlock(
        self.mlp_dim, 0.0, self.dtype_mm, self.gelu, name="MlpBlock_0"
    )(y)
    return x[:, 0]
