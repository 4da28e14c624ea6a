"""Input side of big_vit_lite: tfds/tf.data pipelines, preprocessing, offline datasets.

Modules:
  input_pipeline  train/eval iterators (sharding, exact resume, eval padding)
  sources         where examples come from: prepared tfds datasets (or tfds mocks)
  imagefolder     ROOT/SPLIT/CLASS/*.jpg folders as a source
  image_check     cheap checks that skip corrupt/truncated images up front
  device          host batches -> global jax.Arrays, device prefetch
  pp/             the preprocessing language ("decode|flip_lr|...") and its ops
  mixup           mixup/cutmix, run on device inside the train step
  prepare         `python -m big_vit_lite.data.prepare NAME` (offline datasets)
  offline_sources where prepare finds the offline datasets' source files
  builders/       tfds builders for the offline datasets and ImageNet-21k
Here: the config checks these modules share (config_dict, count), and TensorFlow's import
without its eager Keras load (every module here that uses tf.data imports TensorFlow after this).
Measurements behind the choices: benchmarks/NOTES.md, section "Input pipeline (data/)".
"""

import importlib.abc
import importlib.machinery
import numbers
import sys


class _KerasNotAtTensorFlowImport(importlib.abc.MetaPathFinder):
  """TensorFlow's import without the Keras (and, through it, scikit-learn) it loads eagerly.

  `import tensorflow` (2.16 and later) ends with `import keras.src.optimizers` in a
  `try: ... except ImportError: pass`, which loads all of Keras 3 and scikit-learn: 1.5 of
  5.8 s of CPU per process (measured 2026-12-06, TF 2.21), for nothing tf.data uses.
  While TensorFlow's own module runs, this finder gives `keras` a spec whose loader refuses
  (ImportError, which TensorFlow skips); `importlib.util.find_spec("keras")` still finds the
  real package, whose folder TensorFlow puts on its API paths. Afterwards the finder is gone
  and Keras imports as usual: `import keras` and `tf.keras` (a lazy loader) load it when a
  program uses them. Nothing changes where Keras or TensorFlow is loaded already.
  """

  def __init__(self):
    self.tensorflow_running = False

  def find_spec(self, name, path=None, target=None):
    # (a find_spec that imports nothing, as flax's and etils' probes for
    # TensorFlow, leaves the finder in place)
    if name == "tensorflow" and "keras" not in sys.modules:
      spec = importlib.machinery.PathFinder.find_spec(name, path)
      if spec is not None and spec.loader is not None:
        spec.loader = _RunWithout(spec.loader, self)
      return spec
    if name == "keras" and self.tensorflow_running:
      spec = importlib.machinery.PathFinder.find_spec(name, path)
      if spec is not None:
        spec.loader = _Refuse()
      return spec
    return None


class _RunWithout(importlib.abc.Loader):
  """TensorFlow's own loader, run with `finder` refusing Keras."""

  def __init__(self, loader, finder):
    self.loader = loader
    self.finder = finder

  def create_module(self, spec):
    return self.loader.create_module(spec)

  def exec_module(self, module):
    # (the module keeps its real loader, as if imported plainly)
    module.__loader__ = module.__spec__.loader = self.loader
    self.finder.tensorflow_running = True
    try:
      self.loader.exec_module(module)
    finally:
      self.finder.tensorflow_running = False
      if self.finder in sys.meta_path:  # TensorFlow is loaded: its work is done
        sys.meta_path.remove(self.finder)


class _Refuse(importlib.abc.Loader):

  def create_module(self, spec):
    return None

  def exec_module(self, module):
    raise ImportError("keras: not loaded during TensorFlow's import")


if "tensorflow" not in sys.modules:
  sys.meta_path.insert(0, _KerasNotAtTensorFlowImport())


def config_dict(cfg, allowed, what):
  """A config (dict or ConfigDict) as a plain dict; keys outside `allowed` are an error."""
  if hasattr(cfg, "to_dict"):  # a ConfigDict
    cfg = cfg.to_dict()
  cfg = dict(cfg)
  unknown = sorted(set(cfg) - set(allowed))
  if unknown:
    raise ValueError(
        f"{what} has unknown key(s) {unknown}; allowed: {', '.join(allowed)}"
    )
  return cfg


def count(value, what, minimum):
  """An int config value >= minimum (64.0 is fine, 64.5 / "64" / True are not)."""
  if (
      isinstance(value, bool)
      or not isinstance(value, numbers.Real)
      or not float(value).is_integer()
      or value < minimum
  ):
    raise ValueError(f"{what} must be an int >= {minimum}, got {value!r}")
  return int(value)
