"""animal_mnist: Animal-MNIST silhouettes (PyPI animal-mnist==0.4), fixed split.

10,000 28x28 grey silhouettes, 10 animal classes x 1,000 (the package lists
Bear, Bird, Cat, Cow, Dog, Elephant, Giraffe, Horse, Sheep, Zebra but not
which label number is which, so labels stay 0..9). Split: 8,000 train /
2,000 test by builders/fixed_split.py (seed 0); the 284 exact duplicates
stay with their copies on one side.

The files are gzip'd pickles; unpickling can run code, so they are read
with an Unpickler that admits only what a plain numpy array needs.
"""

import gzip
import pickle

import numpy as np

from big_vit_lite.data import offline_sources
from big_vit_lite.data.builders import fixed_split

# The only globals a pickled plain ndarray references.
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}


class _ArrayOnlyUnpickler(pickle.Unpickler):

  def find_class(self, module, name):
    if (module, name) not in _ALLOWED:
      raise pickle.UnpicklingError(
          f"refusing to unpickle {module}.{name}: only plain numpy "
          f"arrays are allowed"
      )
    if name == "_reconstruct":
      return _reconstruct()
    return getattr(np, name)


def _reconstruct():
  try:
    from numpy._core import multiarray  # pylint: disable=import-outside-toplevel
  except ImportError:  # numpy < 2
    from numpy.core import multiarray  # pylint: disable=import-outside-toplevel
  return multiarray._reconstruct  # pylint: disable=protected-access


def load_array(path):
  with offline_sources.reading(path), gzip.open(path, "rb") as f:
    arr = _ArrayOnlyUnpickler(f).load()
  if not isinstance(arr, np.ndarray) or arr.dtype.hasobject:
    raise ValueError(
        f"{path}: expected a plain numpy array, got {type(arr).__name__}"
    )
  return arr


def load_animals(data_path, label_path):
  images, labels = load_array(data_path), load_array(label_path)
  if (
      images.dtype != np.uint8
      or images.shape[1:3] != (28, 28)
      or len(images) != len(labels)
  ):
    raise ValueError(
        f"unexpected Animal-MNIST arrays: {images.dtype}{images.shape}, "
        f"labels {labels.shape}"
    )
  return images.reshape(-1, 28, 28, 1), labels.astype(np.int64).reshape(-1)


class AnimalMnist(fixed_split.Grey28Builder):
  """Animal-MNIST, 10,000 silhouettes from PyPI animal-mnist==0.4; seeded 8k/2k split."""

  RELEASE_NOTES = {
      "1.0.0": "From animal-mnist==0.4 (version_3 files); split seed 0."
  }
  HOMEPAGE = "https://pypi.org/project/animal-mnist/"

  def _load_arrays(self):
    return load_animals(*offline_sources.animal_mnist_files())
