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
Here: the config checks these modules share (config_dict, count).
Measurements behind the choices: benchmarks/NOTES.md, section "Input pipeline (data/)".
"""

import numbers


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
