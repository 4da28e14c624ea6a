r"""Exports ViT params as a vision_transformer-layout .npz or a timm safetensors file.

  python -m big_vit_lite.export --src=SRC --out=FILE.npz|FILE.safetensors [--res=224] [--params=ema]

SRC: an .npz (vision_transformer, big_vision or pre-linen layout), a training
workdir (its latest checkpoint), an orbax step directory or a .safetensors
this tool wrote. The format follows FILE's suffix (--format=npz|timm may say
it too). A timm file (.safetensors) loads into timm with strict=True:

  import timm, safetensors.torch
  model = timm.create_model("vit_base_patch16_224", num_classes=1000)   # for a B/16
  model.load_state_dict(safetensors.torch.load_file(FILE), strict=True)

or, for timm's registered names, as pretrained weights (num_classes in the
overlay too, or timm silently replaces a head of another size):

  timm.create_model("vit_base_patch16_224", pretrained=True, num_classes=N,
                    pretrained_cfg_overlay=dict(file=FILE, num_classes=N))

The printed summary holds that line ("timm_usage") and timm's name for the
architecture when it has one ("timm_name"). The timm kwargs that rebuild the
exact architecture (global_pool, class_token, fc_norm, ...) are printed too
and stored in the file's metadata ("timm_kwargs").
--res (N or HxW) is needed for sincos2d models (they have no posemb param to
copy) and for an .npz of a model trained on non-square images (a 4x9 patch
grid has as many posemb rows as a 6x6 one); a training workdir or step
directory, or a .safetensors this tool wrote, says its image size itself.
"""

import json
import os
import sys

from absl import app
from absl import flags
import safetensors

from big_vit_lite.logs import console
from big_vit_lite.models import loading
from big_vit_lite.models import formats
from big_vit_lite.models import steps
from big_vit_lite.models import timm


def _define_flags():
  # Defined only when run as a command, so that importing this module (tests,
  # other tools) does not clash with other CLIs' flags in one process.
  flags.DEFINE_string(
      "src",
      None,
      "Params to export: .npz, training workdir, step dir or our "
      ".safetensors.",
  )
  flags.DEFINE_string("out", None, "Output file (.npz or .safetensors).")
  flags.DEFINE_enum(
      "format",
      None,
      ["npz", "timm"],
      "Output layout; default: from --out's suffix (.npz or .safetensors).",
  )
  flags.DEFINE_enum(
      "params",
      "params",
      ["params", "ema"],
      "Which weights of a training checkpoint: its params or their EMA "
      "(runs with config.ema_decay).",
  )
  flags.DEFINE_string(
      "res",
      None,
      "Image size, N or HxW; for timm export of sincos2d models "
      "and of non-square .npz models.",
  )


_SUFFIX = {"npz": ".npz", "timm": ".safetensors"}


def export(src: str, out: str, fmt=None, res=None, key="params") -> dict:
  """Reads `src` and writes `out`; returns a summary dict (printed by the CLI).

  fmt None takes the format from the suffix of `out`. key "ema": a training checkpoint's
  EMA of the weights (config.ema_decay) instead of its params. The suffix must match
  the format: `vit.load` and `evaluate` tell the two apart by it.
  """
  by_suffix = next(
      (f for f, suffix in _SUFFIX.items() if str(out).endswith(suffix)), None
  )
  fmt = fmt or by_suffix
  if fmt not in _SUFFIX or by_suffix != fmt:
    raise ValueError(
        f"--out={out}: name it *{_SUFFIX.get(fmt, '.npz or *.safetensors')} "
        f"for --format={fmt or 'npz|timm'} (the loaders go by the suffix)."
    )
  parent = os.path.dirname(os.path.abspath(out))
  if not os.path.isdir(parent):
    raise ValueError(f"--out={out}: the directory {parent} does not exist.")
  flat, config, _ = loading.read_source(src, key)
  res = _parse_res(res)
  # Our timm file or a run's config says its image size.
  if res is None and fmt == "timm":
    res = (
        timm.timm_image_size(src)
        if str(src).endswith(".safetensors")
        else steps.trained_hw(config, flat)
    )
  try:
    kwargs = formats.save(flat, out, image_size=res)
  # (not an OSError: a read-only or full disk, ...)
  except safetensors.SafetensorError as e:
    raise OSError(f"--out={out}: cannot write it: {e}") from e
  if fmt == "npz":
    return {"out": out, "format": "npz", "num_params": len(flat)}
  return {
      "out": out,
      "format": "timm",
      "timm_kwargs": kwargs,
      "timm_name": timm.timm_model_name(kwargs),
      "timm_usage": timm.timm_usage(kwargs, out),
  }


def _parse_res(res):
  """None, an int, (h, w) or "N" / "HxW" -> None, int or (h, w)."""
  if res is None or not isinstance(res, str):
    return res
  parts = res.lower().split("x")
  if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
    raise ValueError(
        f"--res={res}: use an image size N or HxW, e.g. 224 or 160x320."
    )
  return int(parts[0]) if len(parts) == 1 else (int(parts[0]), int(parts[1]))


def main(argv):
  # Other libraries' INFO lines (orbax, tfds) only with --verbosity=1.
  console.keep_log_readable()
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  f = flags.FLAGS
  if not f.src or not f.out:
    sys.exit("export: pass --src=SRC and --out=FILE.")
  try:
    summary = export(f.src, f.out, f.format, f.res, f.params)
  except (ValueError, OSError, KeyError) as e:
    sys.exit(f"export: {e}")
  print(json.dumps(summary))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
