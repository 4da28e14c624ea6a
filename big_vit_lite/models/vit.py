"""Vision Transformer (Dosovitskiy et al., ICLR 2021) in Flax linen.

The parameter tree (names and shapes) is that of the AugReg-era
google-research/vision_transformer `.npz` checkpoints, so those files load
without renaming:

  embedding/{kernel (P,P,C,D), bias}
  cls (1,1,D)                                        pool_type="tok" only
  dist (1,1,D)                                       distill_token only
  Transformer/posembed_input/pos_embedding (1,T,D)   posemb="learn"; T counts cls (and dist)
  Transformer/encoderblock_{i}/LayerNorm_0, LayerNorm_1,
      MultiHeadDotProductAttention_0/{query,key,value}/{kernel (D,H,D/H), bias (H,D/H)},
      MultiHeadDotProductAttention_0/out/{kernel (H,D/H,D), bias (D)},
      MlpBlock_0/Dense_0, MlpBlock_0/Dense_1
  Transformer/encoder_norm
  MAPHead_0/{probe, MultiHeadDotProductAttention_0, LayerNorm_0, MlpBlock_0}   pool_type="map"
  pre_logits/{kernel,bias}                           rep_size only
  head/{kernel,bias}                                 num_classes > 0 only
  head_dist/{kernel,bias}                            distill_token, num_classes > 0

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
takes cudnn on a CUDA GPU where the shapes allow it, xla on a TPU (the TPU
compiler's cost model puts it 6% faster than custom for L/16,
benchmarks/NOTES.md "TPU step time by depth") and custom elsewhere. "splash" is
Pallas' splash attention, TPU kernels that keep no (seq x seq) probabilities
(models/splash.py: the tokens padded to 256, the padded keys masked); it
compiles for a TPU only. All give the same function (to rounding) and the same
params. GELU is exact (erf), as in timm; `gelu="tanh"` is the original code's
approximation.
Attention, LayerNorm and GELU are hand-written in `ops` (why, with
measurements: benchmarks/NOTES.md, section "Model (models/)").
"""

import dataclasses
from typing import Any, Optional, Sequence, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

# Re-exported, so that vit.Encoder1DBlock, vit.dot_product_attention, ... work.
from big_vit_lite.models.blocks import (  # noqa: F401
    AddPositionEmbs,
    BlockOptions,
    Encoder,
    Encoder1DBlock,
    gelu_fn,
    LayerNorm,
    MAPHead,
    MlpBlock,
    MultiHeadDotProductAttention,
    on_cuda,
    resolve_dtype_act,
    resolve_dtype_mm,
)
from big_vit_lite.models.ops import (  # noqa: F401
    CUDNN_SEQ_MULTIPLE,
    dot_product_attention,
    gelu_exact,
    layer_norm,
    padded_attention,
)
from big_vit_lite.models.variants import VARIANTS, decode_variant  # noqa: F401

_partitioned = nn.with_logical_partitioning


class Model(nn.Module, BlockOptions):
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
  `attention`: "auto" | "custom" | "xla" | "cudnn" | "splash" (module docstring).
  `dtype_act`: dtype of the residual stream between blocks (default float32). "bfloat16"
  halves its memory traffic; LayerNorm statistics stay float32. Changes numerics (~1e-2).
  "auto": bfloat16 on a TPU, float32 elsewhere (resolve_dtype_act).
  `dtype_mm`: dtype of matmul inputs ("bfloat16" for fast matmuls; "auto": float32 on the
  CPU, bfloat16 on accelerators, see resolve_dtype_mm); params and LayerNorm/softmax stay
  float32.
  `stem_channels`: () for the paper's plain patchify; else a convolutional stem
  before it, one 3x3 stride-1 conv + GELU per entry (its output channels). Such
  models do not export to timm.

  `out` holds "stem" (patch embeddings), "with_posemb", "block00".."blockNN"
  (each block's output), "encoded" (all tokens after the final LayerNorm),
  "head_input" (pooled), "pre_logits" (after rep_size) and "logits".

  Block options (all off by default; docs/vit_options.md; the fields of
  `BlockOptions`, which Model subclasses to take them as its own): `reg_tokens` N learned register
  tokens after the class token, without posemb, dropped after the encoder ("encoded" and
  pooling never see them); `qk_norm` normalises each head's q and k; `layerscale_init`: a
  per-channel scale on each residual branch, initialised to this value (None: none);
  `mlp`: "gelu" | "swiglu"; `norm`: "layernorm" | "rmsnorm" (every norm of the model);
  `parallel_block`: x + attn(norm(x)) + mlp(norm(x)), ViT-22B's block; `use_bias`: False
  drops the biases of the blocks' q/k/v/out and MLP projections.

  `distill_token` (DeiT, Touvron et al. 2021): a second learned token after the class
  token (with its own posemb row) and a second head, `head_dist`, on it. The logits are
  the mean of the two heads' (as timm's VisionTransformerDistilled at inference), and so
  are "head_input" and "pre_logits"; `out` also holds each head's logits, "logits_cls" and
  "logits_dist", which distillation trains apart (distill.py). Needs pool_type="tok" and
  no rep_size.
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
  distill_token: bool = False

  def block_options(self) -> BlockOptions:
    return BlockOptions(
        **{
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(BlockOptions)
        }
    )

  def resolved_attention(self, platform=None) -> str:
    """The attention kind this model runs here: custom | xla | cudnn ("auto" decided).

    platform: the backend the model will run on (default: jax's default backend;
    a "gpu" named here counts as a CUDA one).
    """
    if self.attention != "auto":
      return self.attention
    if platform is None:
      cuda = on_cuda()
    else:
      cuda = platform == "gpu"
    platform = platform or jax.default_backend()
    if platform == "tpu":
      return "xla"
    if platform == "cpu":
      return "custom"
    arch = self.arch()
    head_dim = arch["width"] // arch["num_heads"]
    # What cuDNN flash attention takes: bf16/fp16 matmuls, a head dim in 8, 16,
    # ..., 256.
    dtype_mm = jnp.dtype(self.resolved_dtype_mm(platform))
    fits = dtype_mm in (jnp.bfloat16, jnp.float16) and head_dim in range(
        8, 257, 8
    )
    if fits and cuda:
      return "cudnn"
    return "custom"

  def resolved_dtype_mm(self, platform=None) -> str:
    """The matmul dtype this model runs with here ("auto" decided by the backend)."""
    return resolve_dtype_mm(self.dtype_mm, platform)

  def resolved_dtype_act(self, platform=None) -> str:
    """The residual stream's dtype here ("auto" decided by the backend)."""
    return resolve_dtype_act(self.dtype_act, platform)

  def arch(self) -> dict:
    """The resolved width/depth/mlp_dim/num_heads/patch_size of this model."""
    arch = decode_variant(self.variant) if self.variant else {}
    arch.update(
        {
            k: getattr(self, k)
            for k in ("width", "depth", "mlp_dim", "num_heads", "patch_size")
            if getattr(self, k) is not None
        }
    )
    return arch

  def _check(self):
    for name, allowed in (
        ("posemb", ("learn", "sincos2d")),
        ("pool_type", ("tok", "gap", "map")),
        ("gelu", ("exact", "tanh")),
        ("dtype_act", ("auto", "float32", "bfloat16")),
        ("attention", ("auto", "custom", "xla", "cudnn", "splash")),
        ("mlp", ("gelu", "swiglu")),
        ("norm", ("layernorm", "rmsnorm")),
    ):
      if getattr(self, name) not in allowed:
        raise ValueError(
            f"Unknown ViT {name}={getattr(self, name)!r}: use one of "
            f"{', '.join(allowed)}."
        )
    for name, what in (
        ("dropout", "the dropout rate"),
        ("drop_path", "the stochastic-depth rate of the last block"),
    ):
      rate = getattr(self, name)
      if not 0 <= rate < 1:
        raise ValueError(
            f"ViT {name}={rate!r} is out of range: {what} is a probability in "
            f"[0, 1), e.g. 0.1 (config.model.{name})."
        )
    if not isinstance(self.reg_tokens, int) or self.reg_tokens < 0:
      raise ValueError(
          f"reg_tokens={self.reg_tokens!r}: use a count of register tokens >= 0."
      )
    if self.distill_token and (self.pool_type != "tok" or self.rep_size):
      raise ValueError(
          f"distill_token=True with pool_type={self.pool_type!r}, rep_size="
          f"{self.rep_size!r}: the distillation token needs pool_type='tok' "
          "and no rep_size."
      )
    if self.remat_policy not in (None, "none") and not hasattr(
        jax.checkpoint_policies, str(self.remat_policy)
    ):
      raise ValueError(
          f"Unknown remat_policy={self.remat_policy!r}: use None or a "
          "jax.checkpoint_policies name such as 'nothing_saveable'."
      )

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
      x = _ConvStem(
          tuple(self.stem_channels), dtype_mm, self.gelu, name="stem"
      )(x)
    x = jnp.reshape(
        _Embedding(p, d, dtype_mm, name="embedding")(x), (b, gh * gw, d)
    )
    out = {"stem": x}
    if self.pool_type == "tok":
      cls = self.param(
          "cls",
          _partitioned(nn.initializers.zeros, (None, None, "embed")),
          (1, 1, d),
          jnp.float32,
      )
      prefix = [cls]
      if self.distill_token:
        prefix.append(
            self.param(
                "dist",
                _partitioned(
                    nn.initializers.normal(stddev=0.02), (None, None, "embed")
                ),
                (1, 1, d),
                jnp.float32,
            )
        )
      prefix = [jnp.broadcast_to(t, (b, 1, d)).astype(x.dtype) for t in prefix]
      x = jnp.concatenate(prefix + [x], axis=1)
    num_prefix = int(self.pool_type == "tok") + int(self.distill_token)
    registers = None
    if self.reg_tokens:
      registers = self.param(
          "reg",
          _partitioned(
              nn.initializers.normal(stddev=1e-6), (None, None, "embed")
          ),
          (1, self.reg_tokens, d),
          jnp.float32,
      )
    x, enc_out = Encoder(
        depth=a["depth"],
        mlp_dim=a["mlp_dim"],
        num_heads=a["num_heads"],
        posemb=self.posemb,
        dropout=self.dropout,
        drop_path=self.drop_path,
        remat_policy=self.remat_policy,
        scan=self.scan,
        dtype_mm=dtype_mm,
        gelu=self.gelu,
        attention=attention,
        dtype_act=jnp.dtype(self.resolved_dtype_act()),
        opts=self.block_options(),
        name="Transformer",
    )(x, (gh, gw), num_prefix, train, registers)
    if self.reg_tokens:
      x = jnp.concatenate(
          [x[:, :num_prefix], x[:, num_prefix + self.reg_tokens :]], axis=1
      )
    out.update(enc_out, encoded=x)

    if self.distill_token:
      return self._distilled_heads(x[:, 0], x[:, 1], dtype_mm, out)
    if self.pool_type == "tok":
      x = x[:, 0]
    elif self.pool_type == "gap":
      x = jnp.mean(x, axis=1)
    else:
      # One query: cuDNN's padding would be all waste, so the probe takes the
      # custom path.
      probe_attention = attention
      if attention == "cudnn":
        probe_attention = "custom"
      x = MAPHead(
          mlp_dim=a["mlp_dim"],
          num_heads=a["num_heads"],
          dtype_mm=dtype_mm,
          gelu=self.gelu,
          attention=probe_attention,
          norm=self.norm,
          name="MAPHead_0",
      )(x)
    out["head_input"] = x
    if self.rep_size:
      rep = d if self.rep_size is True else int(self.rep_size)
      x = jnp.tanh(
          nn.Dense(
              rep,
              dtype=dtype_mm,
              name="pre_logits",
              kernel_init=_partitioned(
                  nn.initializers.lecun_normal(), ("embed", "mlp")
              ),
              bias_init=_partitioned(nn.initializers.zeros, ("mlp",)),
          )(x)
      )
    out["pre_logits"] = x
    if self.num_classes:
      x = self._head("head", dtype_mm)(x)
    out["logits"] = x
    return x, out

  def _head(self, name, dtype_mm):
    kinit = (
        nn.initializers.zeros
        if self.head_zeroinit
        else nn.initializers.lecun_normal()
    )
    return nn.Dense(
        self.num_classes,
        dtype=dtype_mm,
        name=name,
        kernel_init=_partitioned(kinit, ("embed", "classes")),
        bias_init=_partitioned(nn.initializers.zeros, ("classes",)),
    )

  def _distilled_heads(self, x_cls, x_dist, dtype_mm, out):
    """DeiT's two heads: `head` on the class token, `head_dist` on the distillation token."""
    out["head_input"] = out["pre_logits"] = (x_cls + x_dist) / 2
    if not self.num_classes:
      out["logits"] = out["pre_logits"]
      return out["logits"], out
    out["logits_cls"] = self._head("head", dtype_mm)(x_cls)
    out["logits_dist"] = self._head("head_dist", dtype_mm)(x_dist)
    out["logits"] = (out["logits_cls"] + out["logits_dist"]) / 2
    return out["logits"], out


class _ConvStem(nn.Module):
  """3x3 stride-1 convs with GELU (param scope `stem/conv_{i}`); keeps H and W."""

  channels: Sequence[int]
  dtype_mm: Any = jnp.float32
  gelu: str = "exact"

  @nn.compact
  def __call__(self, x):
    for i, ch in enumerate(self.channels):
      x = gelu_fn(self.gelu)(
          nn.Conv(
              ch,
              (3, 3),
              padding="SAME",
              dtype=self.dtype_mm,
              name=f"conv_{i}",
              kernel_init=_partitioned(
                  nn.initializers.lecun_normal(), (None, None, None, None)
              ),
              bias_init=_partitioned(nn.initializers.zeros, (None,)),
          )(x)
      )
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
    kernel = self.param(
        "kernel",
        _partitioned(
            nn.initializers.lecun_normal(), (None, None, None, "embed")
        ),
        (p, p, c, d),
        jnp.float32,
    )
    bias = self.param(
        "bias",
        _partitioned(nn.initializers.zeros, ("embed",)),
        (d,),
        jnp.float32,
    )
    # Pixels past the last whole patch are dropped, as a VALID conv does.
    x = image[:, : h // p * p, : w // p * p].reshape(b, h // p, p, w // p, p, c)
    x, kernel, bias = (a.astype(self.dtype_mm) for a in (x, kernel, bias))
    x = jnp.einsum("bhpwqc,pqcd->bhwd", x, kernel) + bias
    return nn.with_logical_constraint(x, ("batch", None, None, "embed"))


def load(
    init_params,
    path,
    model_cfg=None,
    dont_load: Sequence[str] = (),
    grid_hw=None,
):
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
