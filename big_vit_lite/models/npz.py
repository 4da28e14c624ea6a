""".npz checkpoints (vision_transformer, big_vision): read and write flat "a/b/c" arrays."""

import zipfile

import jax
import numpy as np

from big_vit_lite.runtime import paths
from big_vit_lite.models import layout


def read_npz(path) -> dict:
  """Flat dict of a params .npz. Pickled (object) entries are refused.

  A file that is not a whole .npz (empty, truncated by a copy, an .npy or
  anything else under that name) is a one-line ValueError, not numpy's or
  zipfile's traceback.
  """
  try:
    # Through epath, so that a gs:// model_init reads like a local file.
    with paths.resolve(path).open("rb") as fh:
      # zip: local header / empty archive
      if fh.read(4) in (b"PK\x03\x04", b"PK\x05\x06"):
        fh.seek(0)
        with np.load(fh, allow_pickle=False) as f:
          return {k: _recover_bfloat16(f[k]) for k in f.files}
  except (zipfile.BadZipFile, EOFError, OSError) as e:
    raise ValueError(
        f"Cannot read {path}: a damaged or truncated .npz ({e}); copy or "
        "download it again."
    ) from None
  except ValueError as e:
    raise ValueError(
        f"Cannot read {path}: {e} (pickled npz files are refused; "
        "re-save the arrays with np.savez)."
    ) from None
  raise ValueError(
      f"Cannot read {path}: not an .npz (zip) file; pass an .npz written by "
      "np.savez or vit.save_npz."
  )


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
  flat = layout.unstack_layers(layout.to_numpy_flat(params))
  flat = {
      k: v.astype(np.float32) if v.dtype == jax.numpy.bfloat16 else v
      for k, v in flat.items()
  }
  with open(path, "wb") as f:  # np.savez would append ".npz" to other names.
    np.savez(f, **flat)
