"""Input side of big_vit_lite: tfds/tf.data pipelines, preprocessing, offline datasets.

Modules:
  input_pipeline  train/eval iterators (sharding, exact resume, eval padding)
  sources         where examples come from: tfds builders and image folders
  device          host batches -> global jax.Arrays, device prefetch
  pp/             the preprocessing language ("decode|flip_lr|...") and its ops
  mixup           mixup/cutmix, run on device inside the train step
  prepare         `python -m big_vit_lite.data.prepare NAME` (offline datasets)
  builders/       tfds builders for the offline datasets and ImageNet-21k
"""
