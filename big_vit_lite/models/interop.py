"""Checkpoint interop for the ViT: .npz (vision_transformer, big_vision, pre-linen) and timm.

Everything here works on "flat" param dicts ({"a/b/kernel": np.ndarray}) and
goes through one canonical form: vision_transformer's AugReg-era loop layout
(`Transformer/encoderblock_{i}/...`, posemb under `Transformer/posembed_input`
with the class token's entry first when there is a class token).

Readers turn each foreign layout into the canonical one:
  - big_vision: top-level `pos_embedding` without a cls entry (the cls token
    gets no position embedding there, which equals a zero cls row); its
    training `.npz` ("params/" next to the optimizer state) and the image
    tower ("img/") of its two-tower SigLIP / LiT files;
  - scan layout: `Transformer/encoderblock/...` stacked on a leading axis;
  - the original paper's pre-linen numbering: `MultiHeadDotProductAttention_1`,
    `LayerNorm_2`, `MlpBlock_3` inside each block;
  - timm VisionTransformer state dicts (safetensors).
`load` then fits the canonical params to the model's own structure (scan or
loop, grid size, dont_load) and checks every name and shape.
"""
import json
import logging
import math
import os
import re
import zipfile
from typing import Any, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np

from big_vit_lite import paths
from big_vit_lite.models import vit

_POSEMB = "Transformer/posembed_input/pos_embedding"
_BV_POSEMB = "pos_embedding"  # big_vision's top-level posemb (no cls entry)
_BLOCK_RE = re.compile(r"^Transformer/encoderblock_(\d+)/(.*)$")
_SCAN_PREFIX = "Transformer/encoderblock/"
_PRE_LINEN = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0",
              "LayerNorm_2": "LayerNorm_1", "MlpBlock_3": "MlpBlock_0"}


# ----------------------------------------------------------------------------
# Flat dicts.

def _is_box(x):
  return isinstance(x, nn.meta.AxisMetadata)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict:
  """Nested dict -> {"a/b/c": leaf}, in the tree's own order."""
  flat = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      flat.update(flatten(v, f"{prefix}{k}/"))
    else:
      flat[f"{prefix}{k}"] = v
  return flat


def unflatten(flat: Mapping[str, Any]) -> dict:
  tree = {}
  for k, v in flat.items():
    *parents, leaf = k.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return tree


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
    if k.startswith(_SCAN_PREFIX):
      rest = k[len(_SCAN_PREFIX):]
      for i in range(v.shape[0]):
        result[f"Transformer/encoderblock_{i}/{rest}"] = v[i]
    else:
      result[k] = v
  return result


def stack_layers(flat: Mapping[str, np.ndarray], depth: int) -> dict:
  """Loop layout -> scan layout; `flat` must hold blocks 0..depth-1 and no others."""
  result, blocks = {}, {}
  for k, v in flat.items():
    m = _BLOCK_RE.match(k)
    if m:
      blocks.setdefault(m.group(2), {})[int(m.group(1))] = v
    else:
      result[k] = v
  for rest, layers in blocks.items():
    if sorted(layers) != list(range(depth)):
      raise ValueError(f"Cannot stack {_SCAN_PREFIX}{rest}: found layers {sorted(layers)}, "
                       f"expected 0..{depth - 1}.")
    result[_SCAN_PREFIX + rest] = np.stack([layers[i] for i in range(depth)])
  return result


def canonicalize(flat: Mapping[str, np.ndarray]) -> dict:
  """Any supported npz layout -> canonical flat dict (posemb has a cls row iff there is a cls)."""
  flat = dict(flat)
  # big_vision train checkpoints hold the params under "params/" (older ones under
  # "opt/target/") next to the optimizer state: keep only the params. Its
  # two-tower models (SigLIP, LiT) keep the image ViT under "img/": keep that.
  for prefix in ("params/img/", "img/", "params/", "opt/target/"):
    if f"{prefix}embedding/kernel" in flat:
      flat = {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}
      break
  flat = unstack_layers(flat)
  if any(f"/{old}/" in k for k in flat for old in _PRE_LINEN if _BLOCK_RE.match(k)):
    renamed = {}
    for k, v in flat.items():
      m = _BLOCK_RE.match(k)
      if m:
        head, _, tail = m.group(2).partition("/")
        k = f"Transformer/encoderblock_{m.group(1)}/{_PRE_LINEN.get(head, head)}/{tail}"
      renamed[k] = v
    flat = renamed
  if _BV_POSEMB in flat:
    pe = flat.pop(_BV_POSEMB)
    if "cls" in flat:  # big_vision adds no posemb to the cls token: a zero row is the same.
      pe = np.concatenate([np.zeros_like(pe[:, :1]), pe], axis=1)
    flat[_POSEMB] = pe
  return flat


def resample_posemb(posemb: np.ndarray, new_hw: tuple[int, int], old_hw=None) -> np.ndarray:
  """Bilinear resize of a grid posemb (1, N, D) to (1, h*w, D); no prefix rows.

  old_hw: the source's (h, w) grid; None for a square one.
  """
  _, n, d = posemb.shape
  if old_hw is None:
    gs = int(round(np.sqrt(n)))
    if gs * gs != n:
      raise ValueError(f"Cannot resample a position embedding of {n} tokens: not a square grid.")
    old_hw = (gs, gs)
  if tuple(old_hw) == tuple(new_hw):
    return posemb
  grid = np.asarray(posemb[0], np.float32).reshape(*old_hw, d)
  # antialias matters only when shrinking; it avoids aliasing of the learned field.
  new = jax.image.resize(grid, (*new_hw, d), method="bilinear", antialias=True)
  return np.asarray(new, posemb.dtype).reshape(1, -1, d)


def _fit_posemb(src: np.ndarray, src_prefix: int, tgt_shape: tuple, tgt_prefix: int,
                grid_hw=None, src_grid_hw=None) -> np.ndarray:
  """Source posemb -> target shape: resample the grid part, keep/add/drop the cls row.

  grid_hw: the model's (h, w) patch grid. Without it the target grid is taken
  to be square, which is wrong for a non-square input whose token count
  happens to be square (4x9 = 36 tokens is not 6x6).
  src_grid_hw: the checkpoint's grid when known (a training checkpoint's pp
  says it); else it is taken to be square. Equal token counts keep their
  rows unless both grids are known to differ (a warning says when the rows
  of a square count go to a non-square grid: 36 rows may be 6x6 or 4x9).
  """
  prefix, grid = src[:, :src_prefix], src[:, src_prefix:]
  n_src, n_tgt = grid.shape[1], tgt_shape[1] - tgt_prefix
  if grid_hw is not None and grid_hw[0] * grid_hw[1] != n_tgt:
    raise ValueError(f"param {_POSEMB!r}: grid {grid_hw[0]}x{grid_hw[1]} does not match the "
                     f"model's {n_tgt} grid tokens.")
  if src_grid_hw is not None and src_grid_hw[0] * src_grid_hw[1] != n_src:
    src_grid_hw = None  # The saved config does not describe these params.
  if grid.shape[2] != tgt_shape[2]:
    return src  # Another width: merge's shape check says so, naming both architectures.
  side, src_side = math.isqrt(n_tgt), math.isqrt(n_src)
  tgt_hw = (tuple(grid_hw) if grid_hw is not None
            else (side, side) if side * side == n_tgt else None)
  src_hw = (tuple(src_grid_hw) if src_grid_hw is not None
            else (src_side, src_side) if src_side * src_side == n_src else None)
  if n_src == n_tgt and (src_grid_hw is None or tgt_hw is None):
    # Nothing says the two grids differ: keep the rows.
    if src_hw is not None and tgt_hw is not None and src_hw != tgt_hw:
      logging.warning("Took the checkpoint's %d posemb rows for the model's %dx%d grid as they "
                      "are; if it was trained on another grid (e.g. %dx%d), load it from its "
                      "training workdir, whose config says so.", n_src, *tgt_hw, *src_hw)
  elif src_hw != tgt_hw:
    if tgt_hw is None:
      raise ValueError(f"param {_POSEMB!r}: cannot fit checkpoint shape {src.shape} to model "
                       f"shape {tgt_shape}; add it to dont_load to re-initialise it.")
    grid = resample_posemb(grid, tgt_hw, src_hw)
    logging.info("Resampled posemb from %d grid tokens to a %dx%d grid.", n_src, *tgt_hw)
  if tgt_prefix and not src_prefix:  # big_vision/gap: the cls token had no posemb.
    prefix = np.zeros((1, tgt_prefix, src.shape[2]), src.dtype)
  elif not tgt_prefix:
    prefix = src[:, :0]
  return np.concatenate([prefix, grid], axis=1)


# ----------------------------------------------------------------------------
# .npz

def read_npz(path) -> dict:
  """Flat dict of a params .npz. Pickled (object) entries are refused.

  A file that is not a whole .npz (empty, truncated by a copy, an .npy or
  anything else under that name) is a one-line ValueError, not numpy's or
  zipfile's traceback.
  """
  try:
    # Through epath, so that a gs:// model_init reads like a local file.
    with paths.resolve(path).open("rb") as fh:
      if fh.read(4) not in (b"PK\x03\x04", b"PK\x05\x06"):  # zip: local header / empty archive
        raise ValueError(f"Cannot read {path}: not an .npz (zip) file; pass an .npz written by "
                         "np.savez or vit.save_npz.")
      fh.seek(0)
      with np.load(fh, allow_pickle=False) as f:
        return {k: _recover_bfloat16(f[k]) for k in f.files}
  except (zipfile.BadZipFile, EOFError, OSError) as e:
    raise ValueError(f"Cannot read {path}: a damaged or truncated .npz ({e}); copy or "
                     "download it again.") from None
  except ValueError as e:
    if str(e).startswith(f"Cannot read {path}:"):
      raise
    raise ValueError(f"Cannot read {path}: {e} (pickled npz files are refused; "
                     "re-save the arrays with np.savez).") from None


def _recover_bfloat16(a):
  """np.savez writes bfloat16 as a 2-byte void type (big_vision reads it back the same way)."""
  if a.dtype.kind == "V" and a.dtype.itemsize == 2 and a.dtype.names is None:
    return a.view(jax.numpy.bfloat16)
  return a


def save_npz(params, path):
  """Writes params (boxed or plain, scan or loop) as a vision_transformer-layout .npz.

  Keys are "/"-joined paths in the loop layout; bfloat16 is widened to float32
  because .npz has no bfloat16 type.
  """
  flat = unstack_layers(to_numpy_flat(params))
  flat = {k: v.astype(np.float32) if v.dtype == jax.numpy.bfloat16 else v for k, v in flat.items()}
  with open(path, "wb") as f:  # np.savez would append ".npz" to other names.
    np.savez(f, **flat)


def read_params(path) -> dict:
  """Canonical flat params from an .npz, a training checkpoint or our timm .safetensors.

  A training checkpoint is a workdir or step dir. A .safetensors must come from
  `write_timm` (its metadata gives the number of heads needed to split qkv; for
  other timm files see `read_timm`).
  """
  if os.fspath(path).endswith(".safetensors"):
    return read_timm(path, num_heads=None)
  return read_params_and_grid(path)[0]


def read_params_and_grid(path):
  """(canonical flat params, the (h, w) patch grid they were trained on or None).

  The grid is known for training checkpoints (workdir, step dir) whose saved
  config has a training pp; files do not say it.
  """
  if os.fspath(path).endswith(".safetensors"):
    return read_timm(path, num_heads=None), None
  path = paths.resolve(path)
  if path.is_dir():
    try:
      from big_vit_lite import checkpoint  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise ValueError(f"{path} is a directory but big_vit_lite.checkpoint is not available; "
                       "pass an .npz file.") from None
    params, config = checkpoint.load_params(path)
    flat = canonicalize(to_numpy_flat(params))
    hw = trained_hw(config, flat)
    patch = flat["embedding/kernel"].shape[0] if "embedding/kernel" in flat else None
    return flat, (hw[0] // patch, hw[1] // patch) if hw and patch else None
  if not path.exists():
    raise ValueError(f"Checkpoint {path} does not exist.")
  return canonicalize(read_npz(path)), None


def trained_hw(config, flat) -> Optional[tuple[int, int]]:
  """(h, w) a training run's pp gives its images (config: the run's saved config), or None."""
  pp = str(config.input.get("pp", "")) if config is not None and "input" in config else ""
  if not pp.strip() or "embedding/kernel" not in flat:
    return None
  from big_vit_lite.data import pp as pp_lib  # pylint: disable=g-import-not-at-top
  stem = flat.get("stem/conv_0/kernel")  # The image goes into the stem, if any.
  channels = (stem if stem is not None else flat["embedding/kernel"]).shape[2]
  try:
    return pp_lib.output_hw(pp, channels=int(channels))
  except ValueError:  # a pp this version cannot build: the posemb's shape must do
    return None


# ----------------------------------------------------------------------------
# load

def load(init_params, path, model_cfg=None, dont_load: Sequence[str] = (), grid_hw=None):
  """Loads a checkpoint into the structure of `init_params`.

  init_params: the model's params (the "params" collection), boxed
    (nn.Partitioned, as `init` returns them) or plain; arrays or
    jax.ShapeDtypeStruct (abstract: fine unless dont_load needs init values).
  path: .npz (vision_transformer, big_vision or pre-linen layout, scan or
    loop), .safetensors in timm layout, or a directory that
    `big_vit_lite.checkpoint.load_params` reads (training workdir / step dir).
  model_cfg: the Model's kwargs; kept for big_vision's signature, the target
    structure is read from init_params.
  dont_load: regexes (re.fullmatch on the model's "/"-joined param names, e.g.
    "head/.*") whose params keep their init values.
  grid_hw: the model's (h, w) patch grid (image size // patch size), for
    resampling a learned posemb to a non-square grid; if None, a posemb that
    needs resampling is resampled to a square grid.

  Returns params of the same kind as init_params: a boxed tree when boxed was
  given, else a plain nested dict; leaves are host np.ndarrays in init's dtype.
  Raises ValueError naming the first missing or mismatched param.
  """
  del model_cfg
  path = os.fspath(path)
  if path.endswith(".safetensors"):
    flat, src_grid_hw = read_timm(path, num_heads=_num_heads(init_params)), None
  else:
    flat, src_grid_hw = read_params_and_grid(path)
  try:
    return merge(init_params, flat, dont_load, grid_hw, src_grid_hw)
  except ValueError as e:
    raise ValueError(f"Cannot load {path}: {e}") from None


def _num_heads(init_params) -> int:
  for k, v in flatten(nn.meta.unbox(init_params)).items():
    if k.endswith("MultiHeadDotProductAttention_0/query/kernel"):
      return v.shape[-2]
  raise ValueError("The model has no attention params.")


def merge(init_params, src_flat: Mapping[str, np.ndarray], dont_load: Sequence[str] = (),
          grid_hw=None, src_grid_hw=None):
  """Fits canonical flat params `src_flat` to `init_params` (see `load`).

  src_grid_hw: the (h, w) patch grid `src_flat` was trained on, if known.
  """
  if isinstance(init_params, Mapping) and set(init_params) == {"params"}:  # whole variables
    return {"params": merge(init_params["params"], src_flat, dont_load, grid_hw, src_grid_hw)}
  boxed = any(_is_box(x) for x in jax.tree.leaves(init_params, is_leaf=_is_box))
  tgt = flatten(nn.meta.unbox(init_params))
  keep = set()
  for pattern in dont_load:
    hits = {k for k in tgt if re.fullmatch(pattern, k)}
    # As in big_vision, a pattern may also name checkpoint params to leave out.
    if not hits and not any(re.fullmatch(pattern, k) for k in src_flat):
      raise ValueError(f"dont_load pattern {pattern!r} matches no model param "
                       f"(names look like {next(iter(tgt))!r}).")
    keep |= hits
  scan_depth = next((v.shape[0] for k, v in tgt.items() if k.startswith(_SCAN_PREFIX)), None)
  # Work in the loop layout so that messages name single blocks.
  tgt_loop = unstack_layers({k: _Abstract(v.shape, v.dtype) for k, v in tgt.items() if k not in keep})
  tgt_prefix = 1 if "cls" in tgt else 0
  src_prefix = 1 if "cls" in src_flat else 0

  # Names the architectures when they differ: "add X to dont_load" alone would
  # send a user loading a B/16 into a Ti/16 through every param in turn.
  arch_note = _arch_difference(src_flat, unstack_layers(
      {k: _Abstract(v.shape, v.dtype) for k, v in tgt.items()}))
  advice = "add it to dont_load to re-initialise it"
  if arch_note:
    advice = f"build the model to match, or {advice}"

  loaded = {}
  for k, spec in tgt_loop.items():
    if k not in src_flat:
      raise ValueError(f"the checkpoint has no param {k!r}{arch_note}; {advice}.")
    v = np.asarray(src_flat[k])
    if k == _POSEMB:
      v = _fit_posemb(v, src_prefix, spec.shape, tgt_prefix, grid_hw, src_grid_hw)
    if v.shape != spec.shape:
      raise ValueError(f"param {k!r} has shape {v.shape} in the checkpoint but {spec.shape} in "
                       f"the model{arch_note}; {advice}.")
    loaded[k] = v.astype(spec.dtype)
  kept_loop = unstack_layers({k: _Abstract(tgt[k].shape, tgt[k].dtype) for k in keep})
  unused = sorted(k for k in set(src_flat) - set(tgt_loop) - set(kept_loop)
                  if not any(re.fullmatch(p, k) for p in dont_load))
  # Dropping the classifier (a headless feature model), vision_transformer's
  # pre-logits layer (fine-tuning without representation_size) or a posemb
  # table for a sincos2d model (timm files always hold one) is routine.
  # Anything else unused means another architecture (more blocks, a class
  # token or MAP head the model lacks): loading it would give a different
  # model without complaint, so it is an error unless dont_load names it.
  dropped = [k for k in unused if k == _POSEMB or k.split("/")[0] in ("head", "pre_logits")]
  if dropped:
    logging.warning("Checkpoint params not used by the model: %s", ", ".join(dropped))
  other = [k for k in unused if k not in dropped]
  if other:
    raise ValueError(f"the checkpoint has {len(other)} params the model lacks, e.g. "
                     f"{other[0]!r}{arch_note or ': it is another architecture (stem, ...)'}; "
                     "build the model to match, or name them in dont_load.")

  if scan_depth is not None:
    loaded = stack_layers(loaded, scan_depth)
  for k in keep:
    if isinstance(tgt[k], jax.ShapeDtypeStruct):
      raise ValueError(f"dont_load keeps {k!r} at its init value, but init_params are abstract; "
                       "pass initialised params.")
    loaded[k] = np.asarray(jax.device_get(tgt[k]))
  loaded = unflatten({k: loaded[k] for k in tgt})  # the model's own key order
  if boxed:
    loaded = jax.tree.map(lambda box, v: box.replace_boxed(v) if _is_box(box) else v,
                          init_params, loaded, is_leaf=_is_box)
  return loaded


def _arch(flat) -> dict:
  """Width, depth, heads, MLP size, patch, channels and pooling of loop-layout params.

  `flat` maps names to anything with a .shape; facts whose params are absent
  are left out.
  """
  def shape(k):
    return tuple(flat[k].shape) if k in flat else None
  block = "Transformer/encoderblock_0"
  facts = {}
  if shape("embedding/kernel"):
    facts["patch"], _, facts["channels"], facts["width"] = shape("embedding/kernel")
  blocks = {m.group(1) for m in map(_BLOCK_RE.match, flat) if m}
  if blocks:
    facts["depth"] = len(blocks)
  if shape(f"{block}/MultiHeadDotProductAttention_0/query/kernel"):
    facts["heads"] = shape(f"{block}/MultiHeadDotProductAttention_0/query/kernel")[1]
  if shape(f"{block}/MlpBlock_0/Dense_0/kernel"):
    facts["mlp_dim"] = shape(f"{block}/MlpBlock_0/Dense_0/kernel")[1]
  facts["pool_type"] = "tok" if "cls" in flat else "map" if "MAPHead_0/probe" in flat else "gap"
  return facts


def _arch_difference(src_flat, tgt_loop) -> str:
  """" (another architecture...; checkpoint vs model: width 768 vs 192, ...)" or "" if alike."""
  src, tgt = _arch(src_flat), _arch(tgt_loop)
  diff = [f"{k} {src[k]} vs {tgt[k]}" for k in tgt if k in src and src[k] != tgt[k]]
  if not diff:
    return ""
  size = next((n for n, v in vit.VARIANTS.items()
               if v == tuple(src.get(k) for k in ("width", "depth", "mlp_dim", "heads"))), None)
  hint = f", a ViT-{size}/{src['patch']}" if size and "patch" in src else ""
  return f" (another architecture{hint}; checkpoint vs model: {', '.join(diff)})"


class _Abstract:
  """Shape/dtype stand-in, sliceable like an array (for unstack_layers)."""

  def __init__(self, shape, dtype):
    self.shape, self.dtype = tuple(shape), dtype

  def __getitem__(self, i):
    return _Abstract(self.shape[1:], self.dtype)


# ----------------------------------------------------------------------------
# timm

def _infer_arch(flat: Mapping[str, np.ndarray]) -> dict:
  """Architecture facts of canonical flat params (for timm naming and kwargs)."""
  depth = 1 + max(int(m.group(1)) for m in map(_BLOCK_RE.match, flat) if m)
  q = flat["Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel"]
  kernel = flat["embedding/kernel"]
  pool = "token" if "cls" in flat else "map" if "MAPHead_0/probe" in flat else "avg"
  return dict(patch_size=kernel.shape[0], in_chans=kernel.shape[2], embed_dim=kernel.shape[3],
              depth=depth, num_heads=q.shape[1],
              mlp_dim=flat["Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel"].shape[1],
              global_pool=pool, class_token=pool == "token",
              num_classes=flat["head/kernel"].shape[1] if "head/kernel" in flat else 0)


def _attn_to_timm(flat, src, dst, sd, fused_qkv=True):
  d = flat[f"{src}/query/kernel"].shape[0]
  w = {n: flat[f"{src}/{n}/kernel"].reshape(d, -1).T for n in ("query", "key", "value")}
  b = {n: flat[f"{src}/{n}/bias"].reshape(-1) for n in ("query", "key", "value")}
  if fused_qkv:
    sd[f"{dst}.qkv.weight"] = np.concatenate([w["query"], w["key"], w["value"]])
    sd[f"{dst}.qkv.bias"] = np.concatenate([b["query"], b["key"], b["value"]])
  else:  # timm's AttentionPoolLatent: separate q and fused kv.
    sd[f"{dst}.q.weight"], sd[f"{dst}.q.bias"] = w["query"], b["query"]
    sd[f"{dst}.kv.weight"] = np.concatenate([w["key"], w["value"]])
    sd[f"{dst}.kv.bias"] = np.concatenate([b["key"], b["value"]])
  sd[f"{dst}.proj.weight"] = flat[f"{src}/out/kernel"].reshape(-1, d).T
  sd[f"{dst}.proj.bias"] = flat[f"{src}/out/bias"]


def _ln_to_timm(flat, src, dst, sd):
  sd[f"{dst}.weight"], sd[f"{dst}.bias"] = flat[f"{src}/scale"], flat[f"{src}/bias"]


def _mlp_to_timm(flat, src, dst, sd):
  for i in (0, 1):
    sd[f"{dst}.fc{i + 1}.weight"] = flat[f"{src}/Dense_{i}/kernel"].T
    sd[f"{dst}.fc{i + 1}.bias"] = flat[f"{src}/Dense_{i}/bias"]


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
  try:
    return _to_timm(canonicalize(to_numpy_flat(params)), image_size)  # nested or flat, any layout
  except KeyError as e:
    raise ValueError(f"These params lack {e}: not a ViT in a supported layout.") from None


def _image_hw(image_size):
  """int or (h, w) -> (h, w) ints; None stays None."""
  if image_size is None:
    return None
  hw = (image_size, image_size) if np.ndim(image_size) == 0 else tuple(image_size)
  if len(hw) != 2 or min(int(x) for x in hw) < 1:
    raise ValueError(f"image_size={image_size!r}: use an int or (height, width).")
  return tuple(int(x) for x in hw)


def _to_timm(flat, image_size):
  if "pre_logits/kernel" in flat:
    raise ValueError("timm's VisionTransformer has no pre-logits (rep_size) layer; export a model "
                     "with rep_size=False.")
  if any(k.startswith("stem/") for k in flat):
    raise ValueError("timm's VisionTransformer has no convolutional stem (stem_channels); "
                     "only plain-patchify models export to timm.")
  a = _infer_arch(flat)
  p, d = a["patch_size"], a["embed_dim"]
  sd = {"patch_embed.proj.weight": flat["embedding/kernel"].transpose(3, 2, 0, 1),
        "patch_embed.proj.bias": flat["embedding/bias"]}
  tgt_prefix = 1 if a["class_token"] else 0
  if a["class_token"]:
    sd["cls_token"] = flat["cls"]
  hw = _image_hw(image_size)
  grid = None if hw is None else (hw[0] // p, hw[1] // p)
  if _POSEMB in flat:
    pe = flat[_POSEMB]
    tokens = pe.shape[1] - tgt_prefix
    side = int(round(np.sqrt(tokens)))
    if grid is None and side * side != tokens:
      raise ValueError(f"The position embedding has {tokens} grid tokens, not a square grid: "
                       "pass the (height, width) the model was trained at (--res=HxW).")
    if grid is None:
      grid = (side, side)
    elif grid[0] * grid[1] != tokens:
      raise ValueError(f"image_size={image_size} gives a {grid[0]}x{grid[1]} grid (patch {p}) but "
                       f"the posemb has {tokens} grid tokens; pass the size the model was "
                       "trained at, or resample by loading into a model first.")
  else:
    if grid is None:
      raise ValueError("These params have no learned posemb (sincos2d): pass image_size "
                       "(--res) so the fixed embedding can be written for timm.")
    pe = vit.posemb_sincos_2d(*grid, d)
    pe = np.concatenate([np.zeros((1, tgt_prefix, d), pe.dtype), pe], axis=1)
  sd["pos_embed"] = pe
  for i in range(a["depth"]):
    src, dst = f"Transformer/encoderblock_{i}", f"blocks.{i}"
    _ln_to_timm(flat, f"{src}/LayerNorm_0", f"{dst}.norm1", sd)
    _attn_to_timm(flat, f"{src}/MultiHeadDotProductAttention_0", f"{dst}.attn", sd)
    _ln_to_timm(flat, f"{src}/LayerNorm_1", f"{dst}.norm2", sd)
    _mlp_to_timm(flat, f"{src}/MlpBlock_0", f"{dst}.mlp", sd)
  _ln_to_timm(flat, "Transformer/encoder_norm", "norm", sd)
  if a["global_pool"] == "map":
    sd["attn_pool.latent"] = flat["MAPHead_0/probe"]
    _attn_to_timm(flat, "MAPHead_0/MultiHeadDotProductAttention_0", "attn_pool", sd,
                  fused_qkv=False)
    _ln_to_timm(flat, "MAPHead_0/LayerNorm_0", "attn_pool.norm", sd)
    _mlp_to_timm(flat, "MAPHead_0/MlpBlock_0", "attn_pool.mlp", sd)
  if a["num_classes"]:
    sd["head.weight"], sd["head.bias"] = flat["head/kernel"].T, flat["head/bias"]
  sd = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in sd.items()}
  # The size given (timm, like us, drops the pixels past the last whole patch:
  # So400m/14 runs at 384), else the grid's.
  img_size = hw or (grid[0] * p, grid[1] * p)
  img_size = img_size[0] if img_size[0] == img_size[1] else img_size
  kwargs = dict(img_size=img_size, patch_size=p, in_chans=a["in_chans"], embed_dim=d,
                depth=a["depth"], num_heads=a["num_heads"], mlp_ratio=a["mlp_dim"] / d,
                num_classes=a["num_classes"], global_pool=a["global_pool"],
                class_token=a["class_token"], fc_norm=False)
  return sd, kwargs


# timm's registered plain ViTs: size name by (embed_dim, depth, num_heads, mlp_dim),
# and the (patch, image size) pairs timm defines a model name for.
_TIMM_SIZES = {(192, 12, 3, 768): "tiny", (384, 12, 6, 1536): "small",
               (768, 12, 12, 3072): "base", (1024, 24, 16, 4096): "large",
               (1280, 32, 16, 5120): "huge", (1408, 40, 16, 6144): "giant",
               (1664, 48, 16, 8192): "gigantic"}
_TIMM_NAMED = {"tiny": {(16, 224), (16, 384)},
               "small": {(8, 224), (16, 224), (16, 384), (32, 224), (32, 384)},
               "base": {(8, 224), (16, 224), (16, 384), (32, 224), (32, 384)},
               "large": {(14, 224), (16, 224), (16, 384), (32, 224), (32, 384)},
               "huge": {(14, 224)}, "giant": {(14, 224)}, "gigantic": {(14, 224)}}


def timm_model_name(kwargs: Mapping[str, Any]) -> Optional[str]:
  """timm's registered name for the architecture of `to_timm`'s kwargs, or None.

  Only plain RGB class-token ViTs have one (e.g. "vit_base_patch16_224");
  the others load with `VisionTransformer(**kwargs)`.
  """
  d = kwargs["embed_dim"]
  size = _TIMM_SIZES.get((d, kwargs["depth"], kwargs["num_heads"], round(kwargs["mlp_ratio"] * d)))
  if (size is None or kwargs["in_chans"] != 3 or kwargs["global_pool"] != "token"
      or not kwargs["class_token"]
      or (kwargs["patch_size"], kwargs["img_size"]) not in _TIMM_NAMED[size]):
    return None
  return f"vit_{size}_patch{kwargs['patch_size']}_{kwargs['img_size']}"


def timm_usage(kwargs: Mapping[str, Any], path) -> str:
  """The Python line that builds the timm model for a file written by `write_timm`."""
  name, n = timm_model_name(kwargs), kwargs["num_classes"]
  if name:
    # num_classes goes into the overlay too: when it differs from the
    # registered model's (1000), timm's pretrained loading drops the head and
    # leaves a random one without a word.
    return (f'timm.create_model("{name}", pretrained=True, num_classes={n}, '
            f'pretrained_cfg_overlay=dict(file="{os.fspath(path)}", num_classes={n}))')
  args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
  return ("m = timm.models.vision_transformer.VisionTransformer(" + args + "); "
          f'm.load_state_dict(safetensors.torch.load_file("{os.fspath(path)}"), strict=True)')


def write_timm(params, path, image_size=None) -> dict:
  """Writes params as a timm safetensors file; returns the timm create_model kwargs.

  The kwargs are also stored as JSON in the file's metadata under "timm_kwargs".
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  sd, kwargs = to_timm(params, image_size)
  save_file(sd, os.fspath(path), metadata={"format": "pt", "timm_kwargs": json.dumps(kwargs)})
  return kwargs


def _read_safetensors(path, tensors=True):
  """(metadata dict, {name: np.ndarray} or None) of a local or bucket (gs://) file."""
  from safetensors import numpy as st_numpy  # pylint: disable=g-import-not-at-top
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  if paths.is_uri(path):  # safe_open maps local files only: read the bytes through epath.
    data = paths.resolve(path).read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return header.get("__metadata__") or {}, st_numpy.load(data) if tensors else None
  with safe_open(os.fspath(path), "np") as f:
    return f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()} if tensors else None


def _standard_heads(sd) -> Optional[int]:
  """The head count of a timm state dict of a standard size (vit.VARIANTS), else None.

  timm's own files (the hub's model.safetensors) do not store it. Width,
  depth and MLP size together pick one of the literature's sizes, whose head
  count timm's registered ViTs (and DeiT) share.
  """
  try:
    width = sd["patch_embed.proj.weight"].shape[0]
    mlp_dim = sd["blocks.0.mlp.fc1.weight"].shape[0]
  except KeyError:
    return None
  depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
  return next((h for w, d, m, h in vit.VARIANTS.values() if (w, d, m) == (width, depth, mlp_dim)),
              None)


def timm_image_size(path) -> Optional[tuple[int, int]]:
  """(h, w) from the timm_kwargs metadata `write_timm` stores, or None."""
  try:
    return _image_hw(json.loads(_read_safetensors(path, tensors=False)[0]["timm_kwargs"])
                     ["img_size"])
  except Exception:  # pylint: disable=broad-except
    return None  # No metadata (another tool's file): read_timm says what is wrong, if anything.


def from_timm(sd: Mapping[str, np.ndarray], num_heads: int,
              grid_tokens: Optional[int] = None) -> dict:
  """timm VisionTransformer state dict -> canonical flat params.

  grid_tokens: the model's patch count (from img_size and patch_size), when
  known, tells whether pos_embed has a row for the class token; else a
  square row count is taken for a grid without one.
  """
  sd = {k: np.asarray(v) for k, v in sd.items()}
  if "fc_norm.weight" in sd:
    raise ValueError("This timm model normalises after pooling (fc_norm); ours normalises "
                     "before, so it cannot be converted exactly.")
  used = set()

  def take(k):
    if k not in sd:
      raise ValueError(f"timm state dict has no {k!r}.")
    used.add(k)
    return sd[k]

  d = take("patch_embed.proj.weight").shape[0]
  if d % num_heads:
    raise ValueError(f"Width {d} is not divisible by num_heads={num_heads}.")
  hd = d // num_heads
  flat = {"embedding/kernel": take("patch_embed.proj.weight").transpose(2, 3, 1, 0),
          "embedding/bias": take("patch_embed.proj.bias")}
  if "cls_token" in sd:
    flat["cls"] = take("cls_token")
  if "pos_embed" in sd:
    pe = take("pos_embed")
    n = pe.shape[1]
    grid_only = n == grid_tokens if grid_tokens else round(np.sqrt(n)) ** 2 == n
    if "cls_token" in sd and grid_only:
      # timm's no_embed_class models (DeiT III, ...): the grid rows only, the class
      # token gets no posemb, i.e. a zero row (a square grid's count plus one is
      # never square; a non-square grid's can be, hence grid_tokens).
      pe = np.concatenate([np.zeros_like(pe[:, :1]), pe], axis=1)
    flat[_POSEMB] = pe

  def attn(src, dst, fused_qkv=True):
    if fused_qkv:
      w = np.split(take(f"{src}.qkv.weight"), 3)
      b = np.split(take(f"{src}.qkv.bias"), 3)
    else:
      w = [take(f"{src}.q.weight")] + np.split(take(f"{src}.kv.weight"), 2)
      b = [take(f"{src}.q.bias")] + np.split(take(f"{src}.kv.bias"), 2)
    for n, wn, bn in zip(("query", "key", "value"), w, b):
      flat[f"{dst}/{n}/kernel"] = wn.T.reshape(d, num_heads, hd)
      flat[f"{dst}/{n}/bias"] = bn.reshape(num_heads, hd)
    flat[f"{dst}/out/kernel"] = take(f"{src}.proj.weight").T.reshape(num_heads, hd, d)
    flat[f"{dst}/out/bias"] = take(f"{src}.proj.bias")

  def ln(src, dst):
    flat[f"{dst}/scale"], flat[f"{dst}/bias"] = take(f"{src}.weight"), take(f"{src}.bias")

  def mlp(src, dst):
    for i in (0, 1):
      flat[f"{dst}/Dense_{i}/kernel"] = take(f"{src}.fc{i + 1}.weight").T
      flat[f"{dst}/Dense_{i}/bias"] = take(f"{src}.fc{i + 1}.bias")

  i = 0
  while f"blocks.{i}.norm1.weight" in sd:
    src, dst = f"blocks.{i}", f"Transformer/encoderblock_{i}"
    ln(f"{src}.norm1", f"{dst}/LayerNorm_0")
    attn(f"{src}.attn", f"{dst}/MultiHeadDotProductAttention_0")
    ln(f"{src}.norm2", f"{dst}/LayerNorm_1")
    mlp(f"{src}.mlp", f"{dst}/MlpBlock_0")
    i += 1
  ln("norm", "Transformer/encoder_norm")
  if "attn_pool.latent" in sd:
    flat["MAPHead_0/probe"] = take("attn_pool.latent")
    attn("attn_pool", "MAPHead_0/MultiHeadDotProductAttention_0", fused_qkv=False)
    ln("attn_pool.norm", "MAPHead_0/LayerNorm_0")
    mlp("attn_pool.mlp", "MAPHead_0/MlpBlock_0")
  if "head.weight" in sd:
    flat["head/kernel"], flat["head/bias"] = take("head.weight").T, take("head.bias")
  extra = sorted(set(sd) - used)
  if extra:
    raise ValueError(f"timm state dict has params this ViT does not support, e.g. {extra[0]!r}.")
  return flat


def read_timm(path, num_heads: Optional[int]) -> dict:
  """Canonical flat params of a timm ViT .safetensors file.

  num_heads=None takes it from the "timm_kwargs" metadata that `write_timm`
  stores (timm's state dict itself does not say how qkv splits into heads).
  """
  if not paths.resolve(path).exists():
    raise ValueError(f"Checkpoint {path} does not exist.")
  try:
    meta, sd = _read_safetensors(path)
  except Exception as e:  # pylint: disable=broad-except
    # SafetensorError (a bad header) or a dtype numpy lacks: not ours to show as a traceback.
    raise ValueError(f"Cannot read {path}: not a readable safetensors file "
                     f"({' '.join(str(e).split())}); copy or export it again.") from None
  try:
    kwargs = json.loads(meta["timm_kwargs"])
  except (KeyError, ValueError):
    kwargs = {}
  try:
    saved_heads = int(kwargs["num_heads"])
  except (KeyError, ValueError, TypeError):
    saved_heads = None
  if num_heads is None and saved_heads is None:
    saved_heads = _standard_heads(sd)
    if saved_heads is None:
      raise ValueError(f"{path} does not say its number of attention heads (no timm_kwargs "
                       "metadata) and is not a standard ViT size (Ti, S, B, L, ...): load it "
                       "with vit.load into a model of that architecture instead.")
    logging.info("%s has no timm_kwargs metadata: %d heads, as every ViT of its width, depth "
                 "and MLP size.", path, saved_heads)
  if num_heads is not None and saved_heads not in (None, num_heads):
    # qkv splits into any head count that divides the width: it would load, as another model.
    raise ValueError(f"{path} holds a ViT with {saved_heads} attention heads, the model has "
                     f"{num_heads}: build the model with num_heads={saved_heads}.")
  num_heads = num_heads or saved_heads
  grid_tokens = None
  try:
    h, w = _image_hw(kwargs["img_size"])
    grid_tokens = (h // kwargs["patch_size"]) * (w // kwargs["patch_size"])
  except (KeyError, ValueError, TypeError):
    pass
  return from_timm(sd, num_heads, grid_tokens)
