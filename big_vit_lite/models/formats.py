"""One entry for every checkpoint format: `read_params`, `load` and `save` go by the path.

Formats: `.npz` (models.npz: vision_transformer, big_vision, pre-linen),
`.safetensors` (models.timm), and a directory (models.steps: a training
workdir or one of its step dirs).
"""

import os
from typing import Sequence

import flax.linen as nn

from big_vit_lite.runtime import paths
from big_vit_lite.models import npz
from big_vit_lite.models import layout
from big_vit_lite.models import steps
from big_vit_lite.models import timm


def read_params(path) -> dict:
  """Canonical flat params from an .npz, a training checkpoint or our timm .safetensors.

  A .safetensors must come from `timm.write_timm` (its metadata gives the
  number of heads needed to split qkv; for other timm files see `timm.read_timm`).
  """
  return read_params_and_grid(path)[0]


def read_params_and_grid(path, num_heads=None):
  """(canonical flat params, the (h, w) patch grid they were trained on or None).

  The grid is known for training checkpoints (workdir, step dir) whose saved
  config has a training pp; files do not say it. num_heads: a timm file's, when the
  model that reads it says it (else its metadata's, see `timm.read_timm`).
  """
  resolved = paths.resolve(path)
  if not resolved.exists():
    raise ValueError(f"Checkpoint {path} does not exist.")
  if os.fspath(path).endswith(".safetensors"):
    return timm.read_timm(path, num_heads), None
  if resolved.is_dir():
    tree, config = steps.load_params(resolved)
    flat = layout.canonicalize(layout.to_numpy_flat(tree))
    # The image size its pp gives -> the patch grid.
    hw = steps.trained_hw(config, flat)
    if hw:
      patch = flat["embedding/kernel"].shape[0]
      hw = tuple(n // patch for n in hw)
    return flat, hw
  return layout.canonicalize(npz.read_npz(resolved)), None


def load(
    init_params,
    path,
    model_cfg=None,
    dont_load: Sequence[str] = (),
    grid_hw=None,
):
  """Loads a checkpoint into the structure of `init_params`.

  init_params: the model's params (the "params" collection), boxed
    (nn.Partitioned, as `init` returns them) or plain; arrays or
    jax.ShapeDtypeStruct (abstract: fine unless dont_load needs init values).
  path: .npz (vision_transformer, big_vision or pre-linen layout, scan or
    loop), .safetensors in timm layout, or a directory that
    `steps.load_params` reads (training workdir / step dir).
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
  num_heads = next(
      v.shape[-2]
      for k, v in layout.flatten(nn.meta.unbox(init_params)).items()
      if k.endswith("MultiHeadDotProductAttention_0/query/kernel")
  )
  flat, src_grid_hw = read_params_and_grid(path, num_heads)
  try:
    return layout.merge(init_params, flat, dont_load, grid_hw, src_grid_hw)
  except ValueError as e:
    raise ValueError(f"Cannot load {os.fspath(path)}: {e}") from None


def save(params, path, image_size=None):
  """Writes params (any layout) by the suffix of `path`: .npz, or timm .safetensors.

  Returns None for .npz and timm's create_model kwargs for .safetensors;
  image_size (int or (h, w)) is for timm only (see `timm.to_timm`).
  """
  if os.fspath(path).endswith(".safetensors"):
    return timm.write_timm(params, path, image_size=image_size)
  return npz.save_npz(params, path)
