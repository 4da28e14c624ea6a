"""timm VisionTransformer checkpoints (safetensors): export, import, and timm's names for them."""

import itertools
import json
import os
from typing import Mapping, Optional

import numpy as np

from big_vit_lite.runtime import paths
from big_vit_lite.models import layout
from big_vit_lite.models import posemb
from big_vit_lite.models.variants import VARIANTS, size_name

# Re-exported: export.py and the tests call them as timm.timm_usage, ...
from big_vit_lite.models.timm_names import (  # noqa: F401
    TIMM_CLASSES,
    timm_class,
    timm_model_name,
    timm_usage,
)

# How each of our arrays becomes its part of a timm tensor, and back (d: width,
# n: heads).
_TO_TIMM = {
    "copy": lambda x: x,
    "T": lambda x: x.T,
    "conv": lambda x: x.transpose(3, 2, 0, 1),
    "heads_in": lambda x: x.reshape(x.shape[0], -1).T,
    "heads_bias": lambda x: x.reshape(-1),
    "heads_out": lambda x: x.reshape(-1, x.shape[-1]).T,
}
_FROM_TIMM = {
    "copy": lambda y, d, n: y,
    "T": lambda y, d, n: y.T,
    "conv": lambda y, d, n: y.transpose(2, 3, 1, 0),
    "heads_in": lambda y, d, n: y.T.reshape(d, n, d // n),
    "heads_bias": lambda y, d, n: y.reshape(n, d // n),
    "heads_out": lambda y, d, n: y.T.reshape(n, d // n, d),
}
# our pool_type -> timm's global_pool
_POOLS = {"tok": "token", "gap": "avg", "map": "map"}


def _our_options(flat) -> dict:
  """The block options of loop-layout params, in the terms of `_timm_options`."""
  m = layout.model_options(flat)
  return dict(
      reg="reg_tokens" in m,
      qk_norm="qk_norm" in m,
      ls="layerscale_init" in m,
      swiglu="mlp" in m,
      rms="norm" in m,
      parallel="parallel_block" in m,
      bias="use_bias" not in m,
      dist="distill_token" in m,
  )


def _timm_options(sd) -> dict:
  """The same facts of a timm VisionTransformer state dict (block 0 tells for all)."""
  b = "blocks.0."
  parallel = f"{b}in_proj.weight" in sd
  qk_norm = f"{b}attn.q_norm.weight" in sd or f"{b}q_norm.weight" in sd
  return dict(
      reg="reg_token" in sd,
      qk_norm=qk_norm,
      ls=f"{b}ls1.gamma" in sd or f"{b}ls.gamma" in sd,
      swiglu=f"{b}mlp.fc1_g.weight" in sd,
      rms=f"{b}{'in_norm' if parallel else 'norm1'}.bias" not in sd,
      parallel=parallel,
      bias=f"{b}{'in_proj' if parallel else 'attn.qkv'}.bias" in sd,
      dist="dist_token" in sd,  # DeiT's VisionTransformerDistilled
  )


def _names(depth, cls, map_head, head, o):
  """[(timm name, our names, kind)] of every param but the posemb, for both directions.

  A timm tensor is the concatenation (axis 0) of our arrays, each in timm's form by its kind
  (one kind, or one per array). `o`: the block options (`_our_options`).
  """

  def ln(t, o_name, rms=o["rms"]):
    return [(f"{t}.weight", [f"{o_name}/scale"], "copy")] + (
        [] if rms else [(f"{t}.bias", [f"{o_name}/bias"], "copy")]
    )

  # kinds: of the kernel parts, then of the bias parts
  def dense(t, ours, kinds, bias=True):
    w = [(f"{t}.weight", [f"{n}/kernel" for n in ours], kinds[0])]
    return w + (
        [(f"{t}.bias", [f"{n}/bias" for n in ours], kinds[1])] if bias else []
    )

  def mlp(t, o_name, swiglu=False, bias=True):
    fc1 = (
        [("fc1_g", "Dense_gate"), ("fc1_x", "Dense_0")]
        if swiglu
        else [("fc1", "Dense_0")]
    )
    return [
        n
        for tn, on in fc1 + [("fc2", "Dense_1")]
        for n in dense(f"{t}.{tn}", [f"{o_name}/{on}"], ("T", "copy"), bias)
    ]

  # timm's AttentionPoolLatent: q and fused kv.
  def attn(t, o_name, fused=True, bias=True):
    groups = (
        {"qkv": ("query", "key", "value")}
        if fused
        else {"q": ("query",), "kv": ("key", "value")}
    )
    names = [
        n
        for g, ours in groups.items()
        for n in dense(
            f"{t}.{g}",
            [f"{o_name}/{k}" for k in ours],
            ("heads_in", "heads_bias"),
            bias,
        )
    ]
    return names + dense(
        f"{t}.proj", [f"{o_name}/out"], ("heads_out", "copy"), bias
    )

  def qk_norm(t, o_name):
    return ln(f"{t}.q_norm", f"{o_name}/query_norm") + ln(
        f"{t}.k_norm", f"{o_name}/key_norm"
    )

  names = [
      ("patch_embed.proj.weight", ["embedding/kernel"], "conv"),
      ("patch_embed.proj.bias", ["embedding/bias"], "copy"),
  ]
  names += [("cls_token", ["cls"], "copy")] if cls else []
  names += [("dist_token", ["dist"], "copy")] if o["dist"] else []
  names += [("reg_token", ["reg"], "copy")] if o["reg"] else []
  for i in range(depth):
    t, b = f"blocks.{i}", f"Transformer/encoderblock_{i}"
    a, m, bias = (
        f"{b}/MultiHeadDotProductAttention_0",
        f"{b}/MlpBlock_0",
        o["bias"],
    )
    if o["qk_norm"]:
      # A parallel block's q/k norms sit on the block itself, not on .attn.
      qk_norm_owner = f"{t}.attn"
      if o["parallel"]:
        qk_norm_owner = t
      names += qk_norm(qk_norm_owner, a)
    # timm's ParallelScalingBlock: MLP fc1 and qkv fused into in_proj.
    if o["parallel"]:
      ours = [f"{m}/Dense_0"] + [f"{a}/{k}" for k in ("query", "key", "value")]
      names += (
          ln(f"{t}.in_norm", f"{b}/LayerNorm_0")
          + dense(
              f"{t}.in_proj",
              ours,
              (["T"] + ["heads_in"] * 3, ["copy"] + ["heads_bias"] * 3),
              bias,
          )
          + dense(
              f"{t}.attn_out_proj", [f"{a}/out"], ("heads_out", "copy"), bias
          )
          + dense(f"{t}.mlp_out_proj", [f"{m}/Dense_1"], ("T", "copy"), bias)
      )
      names += (
          [(f"{t}.ls.gamma", [f"{b}/LayerScale_0/scale"], "copy")]
          if o["ls"]
          else []
      )
      continue
    names += (
        ln(f"{t}.norm1", f"{b}/LayerNorm_0")
        + attn(f"{t}.attn", a, bias=bias)
        + ln(f"{t}.norm2", f"{b}/LayerNorm_1")
        + mlp(f"{t}.mlp", m, o["swiglu"], bias)
    )
    if o["ls"]:
      names += [
          (f"{t}.ls{j + 1}.gamma", [f"{b}/LayerScale_{j}/scale"], "copy")
          for j in range(2)
      ]
  names += ln("norm", "Transformer/encoder_norm")
  if map_head:
    names += (
        [("attn_pool.latent", ["MAPHead_0/probe"], "copy")]
        + attn(
            "attn_pool", "MAPHead_0/MultiHeadDotProductAttention_0", fused=False
        )
        + ln("attn_pool.norm", "MAPHead_0/LayerNorm_0")
        + mlp("attn_pool.mlp", "MAPHead_0/MlpBlock_0")
    )
  heads = ("head", "head_dist") if o["dist"] else ("head",)
  return names + [
      n for h in heads if head for n in dense(h, [h], ("T", "copy"))
  ]


def _kinds(kind, n):
  return [kind] * n if isinstance(kind, str) else kind


def _split(y, kinds, d):
  """A timm tensor cut into our arrays' parts: d rows per head-split part, the rest to the other."""
  known = [d if k.startswith("heads") else None for k in kinds]
  rest = (y.shape[0] - sum(k for k in known if k)) // max(1, known.count(None))
  return np.split(y, np.cumsum([k or rest for k in known])[:-1])


def image_hw(image_size):
  """int or (h, w) -> (h, w) ints; None stays None."""
  if image_size is None:
    return None
  return tuple(
      int(x)
      for x in ((image_size,) * 2 if np.ndim(image_size) == 0 else image_size)
  )


def to_timm(params, image_size=None) -> tuple[dict, dict]:
  """Params (any supported layout) -> (timm state dict of np arrays, timm create_model kwargs).

  Load it with `timm.create_model("vit_base_patch16_224", num_classes=..., **kwargs)`
  (or timm's VisionTransformer(**kwargs)) and `load_state_dict(sd, strict=True)`.
  Global average pooling maps to timm's `global_pool="avg", fc_norm=False`:
  ours normalises the tokens and then averages them, which timm does only
  without fc_norm. image_size: an int (square) or (height, width). A sincos2d
  model has no posemb param: pass it so that the fixed embedding is written
  as timm's `pos_embed`. A model trained on non-square images needs it too:
  its posemb's token count does not say the grid (4x9 and 6x6 are both 36),
  and timm would lay the rows out on the wrong one.
  """
  # nested or flat, any layout
  flat = layout.canonicalize(layout.to_numpy_flat(params))
  if any(k.startswith(("pre_logits/", "stem/")) for k in flat):
    raise ValueError(
        "timm's VisionTransformer has no pre-logits layer (rep_size) and no "
        "convolutional stem (stem_channels): export a model without them."
    )
  a, o = layout.arch(flat), _our_options(flat)
  if o["parallel"] and o["swiglu"]:
    raise ValueError(
        "timm's ParallelScalingBlock has a GELU MLP only: export a parallel_block "
        "model with mlp='gelu'."
    )
  if o["dist"] and o["reg"]:
    raise ValueError(
        "timm's VisionTransformerDistilled has no register tokens: export a "
        "distill_token model with reg_tokens=0."
    )
  try:
    p, d, cls = a["patch"], a["width"], "cls" in flat
    names = _names(
        a["depth"], cls, a["pool_type"] == "map", "head/kernel" in flat, o
    )
    sd = {
        t: np.concatenate(
            [
                _TO_TIMM[k](flat[n])
                for n, k in zip(ours, _kinds(kind, len(ours)))
            ]
        )
        for t, ours, kind in names
    }
  except KeyError as e:
    raise ValueError(
        f"These params lack {e}: not a ViT in a supported layout."
    ) from None
  # timm keeps an MLP bias where in_proj has none
  if o["parallel"] and not o["bias"]:
    sd.update(
        {
            f"blocks.{i}.mlp_bias": np.zeros(a["mlp_dim"])
            for i in range(a["depth"])
        }
    )
  hw = image_hw(image_size)
  n_pre = layout.num_prefix(flat)  # cls and DeiT's dist token
  grid = None if hw is None else (hw[0] // p, hw[1] // p)
  if posemb.PARAM in flat:
    pe = flat[posemb.PARAM]
    tokens = pe.shape[1] - n_pre
    grid = grid or posemb.square_grid(tokens)
    if grid is None or grid[0] * grid[1] != tokens:
      not_grid = (
          f"the {grid[0]}x{grid[1]} grid of image_size={image_size} (patch {p})"
          if grid
          else "a square grid"
      )
      raise ValueError(
          f"The posemb has {tokens} grid tokens: not {not_grid}; pass the (height, "
          "width) the model was trained at (--res=HxW)."
      )
  elif grid is None:
    raise ValueError(
        "These params have no learned posemb (sincos2d): pass image_size "
        "(--res) so the fixed embedding can be written for timm."
    )
  else:
    pe = posemb.sincos_2d(*grid, d, num_prefix=n_pre)
  n_reg = flat["reg"].shape[1] if o["reg"] else 0
  # timm adds pos_embed to the registers too: zero rows (ours have none).
  if n_reg:
    pe = np.concatenate(
        [
            pe[:, :n_pre],
            np.zeros((1, n_reg, d), pe.dtype),
            pe[:, n_pre:],
        ],
        1,
    )
  sd = {
      k: np.ascontiguousarray(v, dtype=np.float32)
      for k, v in dict(sd, pos_embed=pe).items()
  }
  # The size given (timm, like us, drops the pixels past the last whole patch:
  # So400m/14 runs at 384), else the grid's.
  img_size = hw or (grid[0] * p, grid[1] * p)
  img_size = img_size[0] if img_size[0] == img_size[1] else img_size
  num_classes = flat["head/kernel"].shape[1] if "head/kernel" in flat else 0
  kwargs = dict(
      img_size=img_size,
      patch_size=p,
      in_chans=a["channels"],
      embed_dim=d,
      depth=a["depth"],
      num_heads=a["heads"],
      mlp_ratio=a["mlp_dim"] / d,
      num_classes=num_classes,
      global_pool=_POOLS[a["pool_type"]],
      class_token=cls,
      fc_norm=False,
  )
  # The block options, only where on (a plain ViT's kwargs stay as they were).
  options = {}
  if n_reg:
    options["reg_tokens"] = n_reg
  if o["qk_norm"]:
    options["qk_norm"] = o["qk_norm"]
  if o["ls"]:
    options["init_values"] = 1.0
  if not o["bias"]:
    options["qkv_bias"] = False
    options["proj_bias"] = False
  if o["rms"]:
    options["norm_layer"] = "rmsnorm"
  if o["swiglu"]:
    options["mlp_layer"] = "SwiGLU"
    options["act_layer"] = "silu"
  if o["parallel"]:
    options["block_fn"] = "ParallelScalingBlock"
  if o["dist"]:
    # Not a constructor kwarg: says the class, VisionTransformerDistilled
    # (timm_names.timm_class).
    options["distilled"] = o["dist"]
  return sd, dict(kwargs, **options)


def write_timm(params, path, image_size=None) -> dict:
  """Writes params as a timm safetensors file; returns the timm create_model kwargs.

  The file's metadata holds them as JSON (file_metadata): "timm_kwargs", what
  `timm_class(**kwargs)` takes as it is; "timm_class", that class's import path;
  "timm_classes", the kwargs whose value is a class (mlp_layer, block_fn), as import
  paths for `pkgutil.resolve_name` (JSON holds no class).
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  sd, kwargs = to_timm(params, image_size)
  save_file(sd, os.fspath(path), metadata=file_metadata(kwargs))
  # safetensors writes 0600 whatever the umask: give the file the mode any
  # other file of its owner gets (0644 under the usual umask 022).
  os.chmod(path, 0o666 & ~_umask())
  return kwargs


def file_metadata(kwargs):
  """The safetensors metadata (str -> str) for `to_timm`'s kwargs; see write_timm."""
  # "distilled" picks the class (timm_class); it is no constructor kwarg.
  plain = {
      k: v
      for k, v in kwargs.items()
      if k not in TIMM_CLASSES and k != "distilled"
  }
  classes = {
      k: TIMM_CLASSES[k] + v for k, v in kwargs.items() if k in TIMM_CLASSES
  }
  metadata = {
      "format": "pt",
      "timm_kwargs": json.dumps(plain),
      "timm_class": timm_class(kwargs),
  }
  if classes:
    metadata["timm_classes"] = json.dumps(classes)
  return metadata


def _umask():
  """The process's umask (os.umask can only read it by setting it)."""
  umask = os.umask(0o077)
  os.umask(umask)
  return umask


def _read_safetensors(path, tensors=True):
  """(metadata dict, {name: np.ndarray} or None) of a local or bucket (gs://) file."""
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  # (through epath: safe_open maps local files only)
  data = paths.resolve(path).read_bytes()
  header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
  return (
      header.get("__metadata__") or {},
      st_numpy.load(data) if tensors else None,
  )


def _standard_heads(sd) -> Optional[int]:
  """The head count of a timm state dict of a standard size (VARIANTS), else None.

  timm's own files (the hub's model.safetensors) do not store it. Width,
  depth and MLP size together pick one of the literature's sizes, whose head
  count timm's registered ViTs (and DeiT) share.
  """
  try:
    width, mlp_dim = (
        sd["patch_embed.proj.weight"].shape[0],
        sd["blocks.0.mlp.fc1.weight"].shape[0],
    )
  except KeyError:
    return None
  size = size_name(
      width,
      len({k.split(".")[1] for k in sd if k.startswith("blocks.")}),
      mlp_dim,
  )
  return VARIANTS[size][3] if size else None


def timm_image_size(path) -> Optional[tuple[int, int]]:
  """(h, w) from the timm_kwargs metadata `write_timm` stores, or None."""
  try:
    return image_hw(
        json.loads(_read_safetensors(path, tensors=False)[0]["timm_kwargs"])[
            "img_size"
        ]
    )
  except Exception:  # pylint: disable=broad-except
    # No metadata (another tool's file): read_timm says what is wrong, if
    # anything.
    return None


def from_timm(
    sd: Mapping[str, np.ndarray],
    num_heads: int,
    grid_tokens: Optional[int] = None,
) -> dict:
  """timm VisionTransformer state dict -> canonical flat params.

  grid_tokens: the model's patch count (from img_size and patch_size), when
  known, tells whether pos_embed has a row for the class token; else a
  square row count is taken for a grid without one.
  """
  sd = {k: np.asarray(v) for k, v in sd.items()}
  d = sd["patch_embed.proj.weight"].shape[0]
  depth = next(
      i
      for i in itertools.count()
      if f"blocks.{i}.norm1.weight" not in sd
      and f"blocks.{i}.in_norm.weight" not in sd
  )
  o = _timm_options(sd)
  # ParallelScalingBlock's MLP bias where in_proj has none: zeros only
  for i in range(depth):
    if np.any(sd.pop(f"blocks.{i}.mlp_bias", 0)):
      raise ValueError(
          f"timm state dict has a non-zero blocks.{i}.mlp_bias without "
          "qkv_bias: this ViT's use_bias=False has no MLP bias to hold it."
      )
  names = _names(
      depth, "cls_token" in sd, "attn_pool.latent" in sd, "head.weight" in sd, o
  )
  flat = {}
  for t, ours, kind in names:
    if t not in sd:
      raise ValueError(f"timm state dict has no {t!r}.")
    kinds = _kinds(kind, len(ours))
    flat.update(
        (n, _FROM_TIMM[k](y, d, num_heads))
        for n, k, y in zip(ours, kinds, _split(sd[t], kinds, d))
    )
  if "pos_embed" in sd:
    pe = sd["pos_embed"]
    n_cls, n_reg = (
        int("cls_token" in sd) + int(o["dist"]),
        flat["reg"].shape[1] if o["reg"] else 0,
    )
    n = pe.shape[1]
    if n_reg and (
        n - n_cls - n_reg == grid_tokens
        if grid_tokens
        else posemb.square_grid(n - n_cls - n_reg) is not None
    ):
      # Register rows (no_embed_class=False): a register is a constant token,
      # its posemb row folds into it.
      flat["reg"] = flat["reg"] + pe[:, n_cls : n_cls + n_reg]
      pe = np.concatenate([pe[:, :n_cls], pe[:, n_cls + n_reg :]], 1)
      n = pe.shape[1]
    grid_only = (
        n == grid_tokens if grid_tokens else posemb.square_grid(n) is not None
    )
    if "cls_token" in sd and grid_only:
      # timm's no_embed_class models (DeiT III, ...): the grid rows only, the
      # class (and dist) token gets no posemb, i.e. a zero row (a square grid's count plus
      # one is never square; a non-square grid's can be, hence grid_tokens).
      pe = np.concatenate([np.zeros_like(pe[:, :n_cls]), pe], axis=1)
    flat[posemb.PARAM] = pe
  if extra := sorted(set(sd) - {t for t, _, _ in names} - {"pos_embed"}):
    raise ValueError(
        f"timm state dict has params this ViT does not support, e.g. {extra[0]!r}."
    )
  return flat


def read_timm(path, num_heads: Optional[int]) -> dict:
  """Canonical flat params of a timm ViT .safetensors file.

  num_heads=None takes it from the "timm_kwargs" metadata that `write_timm`
  stores (timm's state dict itself does not say how qkv splits into heads).
  """
  try:
    meta, sd = _read_safetensors(path)
  except Exception as e:  # pylint: disable=broad-except
    # SafetensorError (a bad header) or a dtype numpy lacks: not ours to show as
    # a traceback.
    raise ValueError(
        f"Cannot read {path}: not a readable safetensors file "
        f"({' '.join(str(e).split())}); copy or export it again."
    ) from None
  kwargs = json.loads(meta.get("timm_kwargs", "{}"))
  saved_heads = kwargs.get("num_heads")
  if num_heads is None and saved_heads is None:
    saved_heads = _standard_heads(sd)
    if saved_heads is None:
      raise ValueError(
          f"{path} does not say its number of attention heads (no timm_kwargs "
          "metadata) and is not a standard ViT size (Ti, S, B, L, ...): load it "
          "with vit.load into a model of that architecture instead."
      )
  if num_heads is not None and saved_heads not in (None, num_heads):
    # qkv splits into any head count that divides the width: it would load, as
    # another model.
    raise ValueError(
        f"{path} holds a ViT with {saved_heads} attention heads, the model has "
        f"{num_heads}: build the model with num_heads={saved_heads}."
    )
  num_heads = num_heads or saved_heads
  grid_tokens = None
  if "img_size" in kwargs:
    h, w = image_hw(kwargs["img_size"])
    grid_tokens = (h // kwargs["patch_size"]) * (w // kwargs["patch_size"])
  return from_timm(sd, num_heads, grid_tokens)
