"""Flat param dicts, their layouts, and fitting them to a model's params.

Every checkpoint format goes through one canonical flat form ({"a/b/c":
np.ndarray}): vision_transformer's AugReg-era loop layout
(`Transformer/encoderblock_{i}/...`, posemb under `Transformer/posembed_input`
with the class token's row first when there is a class token). `canonicalize`
reads the other layouts: big_vision's (top-level `pos_embedding` without a
cls row; "params/" training files; the "img/" tower of SigLIP / LiT), the
scan layout (`Transformer/encoderblock/...` stacked on a leading axis) and
the pre-linen numbering of the original paper's files. `merge` fits
canonical params to a model (scan or loop, grid size, dont_load).
"""

import logging
import re
from typing import Any, Mapping, Sequence

from flax import traverse_util
import flax.linen as nn
import jax
import numpy as np

from big_vit_lite.models import posemb
from big_vit_lite.models.variants import size_name

POSEMB = posemb.PARAM
BLOCK_RE = re.compile(r"^Transformer/encoderblock_(\d+)/(.*)$")
SCAN_PREFIX = "Transformer/encoderblock/"
_BV_POSEMB = "pos_embedding"  # big_vision's top-level posemb (no cls entry)
_PRE_LINEN = {
    "MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0",
    "LayerNorm_2": "LayerNorm_1",
    "MlpBlock_3": "MlpBlock_0",
}
_PRE_LINEN_RE = re.compile(
    rf"^(Transformer/encoderblock_\d+/)({'|'.join(_PRE_LINEN)})/"
)


def flatten(tree: Mapping[str, Any]) -> dict:
  """Nested dict -> {"a/b/c": leaf}, in the tree's own order."""
  return traverse_util.flatten_dict(tree, sep="/")


def unflatten(flat: Mapping[str, Any]) -> dict:
  return traverse_util.unflatten_dict(flat, sep="/")


def to_numpy_flat(params) -> dict:
  """Boxed or plain params (device or host) -> flat dict of host np.ndarrays."""
  params = nn.meta.unbox(params)
  return {k: np.asarray(jax.device_get(v)) for k, v in flatten(params).items()}


# ----------------------------------------------------------------------------
# Layouts.


def unstack_layers(flat: Mapping[str, np.ndarray]) -> dict:
  """Scan layout (`Transformer/encoderblock/...`, leading depth axis) -> loop layout."""
  result = {}
  for k, v in flat.items():
    if k.startswith(SCAN_PREFIX):
      result.update(
          (f"Transformer/encoderblock_{i}/{k[len(SCAN_PREFIX):]}", layer)
          for i, layer in enumerate(v)
      )
    else:
      result[k] = v
  return result


def stack_layers(flat: Mapping[str, np.ndarray]) -> dict:
  """Loop layout -> scan layout; `flat` must hold blocks 0..depth-1 of each param."""
  result, blocks = {}, {}
  for k, v in flat.items():
    if m := BLOCK_RE.match(k):
      blocks.setdefault(m.group(2), {})[int(m.group(1))] = v
    else:
      result[k] = v
  for rest, layers in blocks.items():
    result[SCAN_PREFIX + rest] = np.stack([layers[i] for i in sorted(layers)])
  return result


def canonicalize(flat: Mapping[str, np.ndarray]) -> dict:
  """Any supported npz layout -> canonical flat dict (posemb has a cls row iff there is a cls)."""
  # big_vision train checkpoints hold the params under "params/" (older ones
  # under "opt/target/") next to the optimizer state: keep only the params. Its
  # two-tower models (SigLIP, LiT) keep the image ViT under "img/": keep that.
  for prefix in ("params/img/", "img/", "params/", "opt/target/"):
    if f"{prefix}embedding/kernel" in flat:
      flat = {
          k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)
      }
      break
  flat = {
      _PRE_LINEN_RE.sub(
          lambda m: f"{m.group(1)}{_PRE_LINEN[m.group(2)]}/", k
      ): v
      for k, v in unstack_layers(flat).items()
  }
  if _BV_POSEMB in flat:
    pe = flat.pop(_BV_POSEMB)
    # big_vision adds no posemb to the cls token: a zero row is the same.
    if "cls" in flat:
      pe = np.concatenate([np.zeros_like(pe[:, :1]), pe], axis=1)
    flat[POSEMB] = pe
  return flat


def merge(
    init_params,
    src_flat: Mapping[str, np.ndarray],
    dont_load: Sequence[str] = (),
    grid_hw=None,
    src_grid_hw=None,
):
  """Fits canonical flat params `src_flat` to `init_params` (see `formats.load`).

  src_grid_hw: the (h, w) patch grid `src_flat` was trained on, if known.
  """
  tgt = flatten(nn.meta.unbox(init_params))
  keep = set()
  for pattern in dont_load:
    hits = {k for k in tgt if re.fullmatch(pattern, k)}
    # As in big_vision, a pattern may also name checkpoint params to leave out.
    if not hits and not any(re.fullmatch(pattern, k) for k in src_flat):
      raise ValueError(
          f"dont_load pattern {pattern!r} matches no model param "
          f"(names look like {next(iter(tgt))!r})."
      )
    keep |= hits
  # Work in the loop layout so that messages name single blocks, on zero-memory
  # stand-ins.
  shapes = {
      k: np.broadcast_to(np.zeros((), v.dtype), v.shape) for k, v in tgt.items()
  }
  kept_loop = unstack_layers({k: shapes[k] for k in keep})
  loop = unstack_layers(shapes)
  tgt_loop = {k: v for k, v in loop.items() if k not in kept_loop}
  # Names the architectures when they differ: "add X to dont_load" alone would
  # send a user loading a B/16 into a Ti/16 through every param in turn.
  arch_note = _arch_difference(src_flat, loop)
  advice = "add it to dont_load to re-initialise it"
  if arch_note:
    advice = "build the model to match, or " + advice

  loaded = {}
  for k, spec in tgt_loop.items():
    if k not in src_flat:
      raise ValueError(
          f"the checkpoint has no param {k!r}{arch_note}; {advice}."
      )
    v = np.asarray(src_flat[k])
    if k == POSEMB:
      v = posemb.fit(
          v,
          num_prefix(src_flat),
          spec.shape,
          num_prefix(tgt),
          grid_hw,
          src_grid_hw,
      )
    if v.shape != spec.shape:
      raise ValueError(
          f"param {k!r} has shape {v.shape} in the checkpoint but {spec.shape} in "
          f"the model{arch_note}; {advice}."
      )
    loaded[k] = v.astype(spec.dtype)
  unused = sorted(
      k
      for k in set(src_flat) - set(loop)
      if not any(re.fullmatch(p, k) for p in dont_load)
  )
  # Dropping the classifier (a headless feature model), vision_transformer's
  # pre-logits layer (fine-tuning without representation_size), a posemb
  # table for a sincos2d model (timm files always hold one) or the projection
  # of feature distillation (distill.py: training only) is routine.
  # Anything else unused means another architecture (more blocks, a class
  # token or MAP head the model lacks): loading it would give a different
  # model without complaint, so it is an error unless dont_load names it.
  if dropped := [
      k
      for k in unused
      if k == POSEMB
      or k.split("/")[0] in ("head", "pre_logits", "distill_proj")
  ]:
    logging.warning(
        "Checkpoint params not used by the model: %s", ", ".join(dropped)
    )
  if other := [k for k in unused if k not in dropped]:
    raise ValueError(
        f"the checkpoint has {len(other)} params the model lacks, e.g. "
        f"{other[0]!r}{arch_note or ': it is another architecture (stem, ...)'}; "
        "build the model to match, or name them in dont_load."
    )

  if any(k.startswith(SCAN_PREFIX) for k in tgt):
    loaded = stack_layers(loaded)
  for k in keep:  # (values: abstract init_params have none to keep)
    loaded[k] = np.asarray(jax.device_get(tgt[k]))
  # Boxed in, boxed out: the values go into init_params' boxes, or are the
  # leaves.
  return nn.meta.replace_boxed(
      init_params, unflatten({k: loaded[k] for k in tgt})
  )


def arch(flat) -> dict:
  """Width, depth, heads, MLP size, patch, channels and pooling of loop-layout params.

  `flat` maps names to anything with a .shape; facts whose params are absent
  are left out.
  """
  facts = {}
  if "embedding/kernel" in flat:
    facts["patch"], _, facts["channels"], facts["width"] = flat[
        "embedding/kernel"
    ].shape
  if blocks := {m.group(1) for m in map(BLOCK_RE.match, flat) if m}:
    facts["depth"] = len(blocks)
  for fact, name in (
      ("heads", "MultiHeadDotProductAttention_0/query/kernel"),
      ("mlp_dim", "MlpBlock_0/Dense_0/kernel"),
  ):
    if f"Transformer/encoderblock_0/{name}" in flat:
      facts[fact] = flat[f"Transformer/encoderblock_0/{name}"].shape[1]
  facts["pool_type"] = "gap"
  if "cls" in flat:
    facts["pool_type"] = "tok"
  elif "MAPHead_0/probe" in flat:
    facts["pool_type"] = "map"
  return facts


def num_prefix(flat) -> int:
  """The tokens before the patches that have a posemb row: class and DeiT distillation."""
  return int("cls" in flat) + int("dist" in flat)


_OPTION_DEFAULTS = dict(
    distill_token=False,
    reg_tokens=0,
    qk_norm=False,
    layerscale_init=None,
    mlp="gelu",
    norm="layernorm",
    parallel_block=False,
    use_bias=True,
)


def model_options(flat) -> dict:
  """vit.Model's block options (those not at their default) of loop-layout params `flat`.

  layerscale_init comes back as 1.0 where there is LayerScale: the init is not in the params.
  """
  b = "Transformer/encoderblock_0/"
  attn = f"{b}MultiHeadDotProductAttention_0/"
  opts = dict(
      distill_token="dist" in flat,
      qk_norm=f"{attn}query_norm/scale" in flat,
      parallel_block=f"{b}LayerNorm_1/scale" not in flat,
      use_bias=f"{attn}query/bias" in flat,
  )
  if "reg" in flat:
    opts["reg_tokens"] = int(flat["reg"].shape[1])
  if f"{b}LayerScale_0/scale" in flat:
    opts["layerscale_init"] = 1.0
  if f"{b}MlpBlock_0/Dense_gate/kernel" in flat:
    opts["mlp"] = "swiglu"
  if f"{b}LayerNorm_0/bias" not in flat:
    opts["norm"] = "rmsnorm"
  return {k: v for k, v in opts.items() if v != _OPTION_DEFAULTS[k]}


def _arch_difference(src_flat, tgt_loop) -> str:
  """ " (another architecture...; checkpoint vs model: width 768 vs 192, ...)" or "" if alike."""
  src, tgt = arch(src_flat), arch(tgt_loop)
  if not (
      diff := [
          f"{k} {src[k]} vs {tgt[k]}"
          for k in tgt
          if k in src and src[k] != tgt[k]
      ]
  ):
    return ""
  size = size_name(
      *(src.get(k) for k in ("width", "depth", "mlp_dim", "heads"))
  )
  hint = ""
  if size and "patch" in src:
    hint = f", a ViT-{size}/{src['patch']}"
  return (
      f" (another architecture{hint}; checkpoint vs model: {', '.join(diff)})"
  )
