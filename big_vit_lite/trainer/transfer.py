"""What a fine-tuning config reads off disk: its checkpoint's model, its dataset's classes.

configs/transfer.py rebuilds the model of the checkpoint it starts from (the
architecture, and the resolution and channels it was trained at) and sizes
its new head by the dataset's classes. Config files do no file I/O
themselves (config_loading's docstring); these functions do it for them.

Light on purpose: a training checkpoint's saved config is read as JSON (no
arrays, no jax backend started: the trainer sets up its devices later); an
.npz or .safetensors is read with numpy.
"""

import json
import os
import re

_NOTHING = (None, None, None)


def checkpoint_model(src):
  """(vit.Model kwargs, res, channels) of the checkpoint `src`; None where it cannot tell.

  `src`: a training workdir (its last step) or step dir of this project, whose
  saved run config gives the model and whose training pp gives the
  resolution and channels; or a vision_transformer / big_vision .npz or a
  timm .safetensors, whose param shapes give all three. (None, None, None)
  when `src` does not exist (yet) or holds no checkpoint.
  """
  src = os.path.expanduser(src)
  if os.path.isdir(src):
    return _saved_run_model(src)
  if os.path.isfile(src):
    return _params_file_model(src)
  return _NOTHING


def _last_step_dir(src):
  """`src` if it is a step dir, else the last step dir of workdir `src`; None: no step."""
  if os.path.isdir(os.path.join(src, "config")):
    return src
  ckpts = os.path.join(src, "checkpoints")
  if not os.path.isdir(ckpts):
    ckpts = src
  steps = [int(d) for d in os.listdir(ckpts) if d.isdigit()]
  if not steps:
    return None
  return os.path.join(ckpts, str(max(steps)))


def _saved_run_model(src):
  step_dir = _last_step_dir(src)
  if step_dir is None:
    return _NOTHING
  try:
    with open(os.path.join(step_dir, "config", "metadata")) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return _NOTHING
  pp = str(saved.get("input", {}).get("pp", ""))
  decode = re.search(r"decode\([^)]*channels=(\d+)", pp)
  channels = int(decode.group(1)) if decode else 3
  res = None
  if pp:
    # pylint: disable-next=g-import-not-at-top
    from big_vit_lite.data import pp as pp_lib

    hw = pp_lib.output_hw(pp, channels=channels)
    res = hw[0] if hw else None
  # JSON has no tuples; the model's tuple fields (stem_channels) need them.
  model = {}
  for key, value in saved["model"].items():
    model[key] = tuple(value) if isinstance(value, list) else value
  return model, res, channels


def _params_file_model(src):
  from big_vit_lite.models import loading  # pylint: disable=g-import-not-at-top
  from big_vit_lite.models import formats  # pylint: disable=g-import-not-at-top

  flat = formats.read_params(src)
  model = loading.infer_model_cfg(flat)
  # The image goes into the stem, if any.
  kernel = flat.get("stem/conv_0/kernel", flat["embedding/kernel"])
  posemb = flat.get("Transformer/posembed_input/pos_embedding")
  res = None
  if posemb is not None:
    patch_tokens = posemb.shape[1] - ("cls" in flat)
    side = int(round(patch_tokens**0.5))
    res = side * model["patch_size"]
  return model, res, int(kernel.shape[2])


def num_classes(data=None, folder=None):
  """The classes of image folder `folder` (ROOT/SPLIT/CLASS/*), else of tfds dataset `data`.

  A folder's classes are those its image folder reads (imagefolder.class_names:
  the class folders of all its splits, hidden ones left out, spellings equal in
  Unicode NFC one class); a tfds dataset's, its "label" feature's.
  """
  if folder:
    if not os.path.isdir(folder):
      raise ValueError(
          f"folder={folder}: no such folder; give the image folder that "
          "holds train/CLASS/* and val/CLASS/* (the README's layout)."
      )
    # As the image folder counts them: NFC and NFD spellings are one class.
    from big_vit_lite.data import imagefolder  # pylint: disable=g-import-not-at-top

    return len(imagefolder.class_names(folder))
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  try:
    return tfds.builder(data).info.features["label"].num_classes
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"Cannot read the classes of data={data} ({e}): prepare it (python "
        "-m big_vit_lite.data.prepare NAME) or pass classes=K."
    ) from None
