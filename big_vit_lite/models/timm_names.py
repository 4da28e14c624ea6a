"""timm's names for our exports: its registered model names and the line that builds one."""

import os
from typing import Any, Mapping, Optional

from big_vit_lite.models.variants import size_name

# timm's registered plain ViTs: their size names (by ours), and the (patch,
# image size) pairs timm defines a model name for.
_TIMM_SIZES = {
    "Ti": "tiny",
    "S": "small",
    "B": "base",
    "L": "large",
    "H": "huge",
    "g": "giant",
    "G": "gigantic",
}
_TIMM_NAMED = {
    "tiny": {(16, 224), (16, 384)},
    "small": {(8, 224), (16, 224), (16, 384), (32, 224), (32, 384)},
    "base": {(8, 224), (16, 224), (16, 384), (32, 224), (32, 384)},
    "large": {(14, 224), (16, 224), (16, 384), (32, 224), (32, 384)},
    "huge": {(14, 224)},
    "giant": {(14, 224)},
    "gigantic": {(14, 224)},
}


# The kwargs whose value is a timm class: its module, where the kwargs (JSON)
# hold its name.
TIMM_CLASSES = {
    "mlp_layer": "timm.layers.",
    "block_fn": "timm.models.vision_transformer.",
}


def timm_model_name(kwargs: Mapping[str, Any]) -> Optional[str]:
  """timm's registered name for the architecture of `to_timm`'s kwargs, or None.

  Only plain RGB class-token ViTs have one (e.g. "vit_base_patch16_224");
  the others load with `VisionTransformer(**kwargs)`.
  """
  d = kwargs["embed_dim"]
  if (
      set(kwargs) & set(TIMM_CLASSES)
      or "distilled" in kwargs
      or "reg_tokens" in kwargs
      or "qkv_bias" in kwargs
  ):
    # Block options: only VisionTransformer(**kwargs) says them all.
    return None
  size = _TIMM_SIZES.get(
      size_name(
          d,
          kwargs["depth"],
          round(kwargs["mlp_ratio"] * d),
          kwargs["num_heads"],
      )
  )
  if (
      size is None
      or kwargs["in_chans"] != 3
      or kwargs["global_pool"] != "token"
      or not kwargs["class_token"]
      or (kwargs["patch_size"], kwargs["img_size"]) not in _TIMM_NAMED[size]
  ):
    return None
  return f"vit_{size}_patch{kwargs['patch_size']}_{kwargs['img_size']}"


def timm_usage(kwargs: Mapping[str, Any], path) -> str:
  """The Python line that builds the timm model for a file written by `write_timm`."""
  name, n = timm_model_name(kwargs), kwargs["num_classes"]
  if name:
    # num_classes goes into the overlay too: when it differs from the
    # registered model's (1000), timm's pretrained loading drops the head and
    # leaves a random one without a word.
    return (
        f'timm.create_model("{name}", pretrained=True, num_classes={n}, '
        f'pretrained_cfg_overlay=dict(file="{os.fspath(path)}", num_classes={n}))'
    )
  args = ", ".join(
      f"{k}={TIMM_CLASSES[k]}{v}" if k in TIMM_CLASSES else f"{k}={v!r}"
      for k, v in kwargs.items()
      if k != "distilled"
  )
  return (
      f"m = {timm_class(kwargs)}(" + args + "); "
      f'm.load_state_dict(safetensors.torch.load_file("{os.fspath(path)}"), strict=True)'
  )


def timm_class(kwargs: Mapping[str, Any]) -> str:
  """The timm class that takes `to_timm`'s kwargs (less "distilled", which picks it)."""
  if kwargs.get("distilled"):  # DeiT's distillation token and head
    return "timm.models.deit.VisionTransformerDistilled"
  return "timm.models.vision_transformer.VisionTransformer"
