"""The fixed, seeded train/test split of datasets that ship without one.

Rule (documented in the README): group identical images (exact byte
duplicates, so copies never straddle the split), order the groups by a
numpy.random.default_rng(seed) permutation of the groups (groups numbered in
order of first appearance), then walk them: a group joins "test" while it
still fits in `num_test`, else "train". The result depends on the data and
the seed only, and "test" has exactly `num_test` examples whenever single
images are left to fill it (always the case here).

`Grey28Builder` is the tfds builder both such datasets share (mnist10k,
animal_mnist): 28x28x1 images, 10 classes, this split.
"""

import abc
import sys

import numpy as np
import tensorflow_datasets as tfds

SPLIT_SEED = 0


def split_indices(images, num_test, seed=SPLIT_SEED):
  """images: [N, ...] uint8 -> (train_indices, test_indices), each sorted."""
  groups = {}
  for i, img in enumerate(images):
    groups.setdefault(np.ascontiguousarray(img).tobytes(), []).append(i)
  members = list(groups.values())
  order = np.random.default_rng(seed).permutation(len(members))
  train, test = [], []
  for g in order:
    group = members[g]
    (test if len(test) + len(group) <= num_test else train).extend(group)
  return sorted(train), sorted(test)


class Grey28Builder(tfds.core.GeneratorBasedBuilder, abc.ABC):
  """A 28x28 grey, 10-class dataset read from local files, split by `split_indices`.

  Subclasses set RELEASE_NOTES (of VERSION 1.0.0) and HOMEPAGE, and implement
  `_load_arrays()`; the description is the subclass module's docstring.
  tfds does not register this class itself because it is abstract.
  """

  VERSION = tfds.core.Version("1.0.0")
  NUM_TEST = 2_000

  @abc.abstractmethod
  def _load_arrays(self):
    """-> images [N, 28, 28, 1] uint8, labels [N] int64."""

  def _info(self):
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(shape=(28, 28, 1)),
                "label": tfds.features.ClassLabel(num_classes=10),
            }
        ),
        supervised_keys=("image", "label"),
        homepage=self.HOMEPAGE,
        description=sys.modules[type(self).__module__].__doc__,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # offline: the source files are found on disk
    images, labels = self._load_arrays()
    train, test = split_indices(images, self.NUM_TEST)
    return {
        "train": self._generate_examples(images, labels, train),
        "test": self._generate_examples(images, labels, test),
    }

  def _generate_examples(self, images, labels, indices):
    for i in indices:
      yield int(i), {"image": images[i], "label": int(labels[i])}
