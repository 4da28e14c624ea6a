"""Tiny tfds datasets for data tests: every example carries its own id."""

import numpy as np
import tensorflow_datasets as tfds


class BvlTinyIds(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """train: 1000 examples (ids 0..999), test: 101 (ids 1000..1100); 8x8 PNGs."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(shape=(8, 8, 1)),
                "label": tfds.features.ClassLabel(num_classes=10),
                "id": tfds.features.Scalar(np.int64),
            }
        ),
    )

  def _split_generators(self, dl_manager):
    return {
        "train": self._generate_examples(0, 1000),
        "test": self._generate_examples(1000, 1101),
    }

  def _generate_examples(self, lo, hi):  # pylint: disable=arguments-differ
    rng = np.random.default_rng(lo)
    for i in range(lo, hi):
      yield i, {
          "image": rng.integers(0, 256, (8, 8, 1), dtype=np.uint8),
          "label": i % 10,
          "id": i,
      }


def prepare_tiny_ids(data_dir, file_format="tfrecord"):
  builder = BvlTinyIds(data_dir=data_dir, file_format=file_format)
  if not builder.is_prepared():
    # Several files per split, so file-order shuffling and piece slicing are
    # exercised.
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(num_shards=4)
    )
  return builder
