"""tfds' own `fashion_mnist`, fed from the Debian package's IDX files.

Debian re-gzipped the original files, so tfds' builder rejects them (checksum
mismatch) even as a manual download; the decompressed IDX bytes are the
standard ones. This builder is tfds' FashionMNIST class (same name, version,
features, splits and example keys) with only the file source replaced, and
is not registered: once written, `tfds.builder("fashion_mnist")` reads it
like a normal download.
"""

import gzip
import os

import numpy as np
from tensorflow_datasets.image_classification import mnist as tfds_mnist

from big_vit_lite.data import offline_sources


def read_idx(path, magic, count):
  """Reads one gzip'd IDX file, checking its header against what tfds expects."""
  with offline_sources.reading(path), gzip.open(path, "rb") as f:
    raw = f.read()
  ndim = raw[3]
  header = np.frombuffer(raw[: 4 + 4 * ndim], ">u4")
  if header[0] != magic or header[1] != count:
    raise ValueError(
        f"{path}: IDX header {header.tolist()} is not magic {magic} with {count} "
        f"items"
    )
  return np.frombuffer(raw[4 + 4 * ndim :], np.uint8).reshape(header[1:])


class OfflineFashionMnist(tfds_mnist.FashionMNIST, skip_registration=True):
  name = "fashion_mnist"

  def _split_generators(self, dl_manager):
    del dl_manager
    d = offline_sources.fashion_mnist_dir()
    read = lambda part, n: self._generate_examples(  # noqa: E731
        read_idx(os.path.join(d, f"{part}-images-idx3-ubyte.gz"), 2051, n),
        read_idx(os.path.join(d, f"{part}-labels-idx1-ubyte.gz"), 2049, n),
    )
    return {"train": read("train", 60_000), "test": read("t10k", 10_000)}

  def _generate_examples(self, images, labels):  # pylint: disable=arguments-differ
    # Same keys and records as tfds' builder: the index in the IDX file.
    for index, (image, label) in enumerate(zip(images, labels)):
      yield index, {"image": image.reshape(28, 28, 1), "label": int(label)}
