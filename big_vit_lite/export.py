r"""Exports ViT params as a vision_transformer-layout .npz or a timm safetensors file.

  python -m big_vit_lite.export --src=SRC --out=FILE --format=npz|timm [--res=224]

SRC: an .npz (vision_transformer, big_vision or pre-linen layout), a training
workdir (its latest checkpoint) or an orbax step directory. With
--format=timm the file loads into timm with strict=True:

  import timm, safetensors.torch
  model = timm.create_model("vit_base_patch16_224", num_classes=1000)   # for a B/16
  model.load_state_dict(safetensors.torch.load_file(FILE), strict=True)

The timm kwargs that rebuild the exact architecture (global_pool, class_token,
fc_norm, ...) are printed and stored in the file's metadata ("timm_kwargs").
--res is needed only for sincos2d models (they have no posemb param to copy).
"""
import json
import sys

from absl import app
from absl import flags

from big_vit_lite.models import interop


def _define_flags():
  # Defined only when run as a command, so that importing this module (tests,
  # other tools) does not clash with other CLIs' flags in one process.
  flags.DEFINE_string("src", None, "Params to export: .npz, training workdir or step dir.")
  flags.DEFINE_string("out", None, "Output file (.npz or .safetensors).")
  flags.DEFINE_enum("format", "npz", ["npz", "timm"], "Output layout.")
  flags.DEFINE_integer("res", None, "Image size; needed for timm export of sincos2d models.")


def export(src: str, out: str, fmt: str, res=None) -> dict:
  """Reads `src` and writes `out`; returns a summary dict (printed by the CLI)."""
  flat = interop.read_params(src)
  if fmt == "npz":
    interop.save_npz(flat, out)
    return {"out": out, "format": "npz", "num_params": len(flat)}
  kwargs = interop.write_timm(flat, out, image_size=res)
  return {"out": out, "format": "timm", "timm_kwargs": kwargs}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  f = flags.FLAGS
  if not f.src or not f.out:
    sys.exit("export: pass --src=SRC and --out=FILE.")
  try:
    summary = export(f.src, f.out, f.format, f.res)
  except (ValueError, OSError, KeyError) as e:
    sys.exit(f"export: {e}")
  print(json.dumps(summary))


if __name__ == "__main__":
  _define_flags()
  app.run(main)
