"""Where training/eval examples come from: prepared tfds datasets or image folders.

A source exposes the size of a split and, for any example range
[start, end) of it, a tf.data pipeline of *raw* records (serialized tfds
examples, or file paths) plus a `decode` function that turns one raw record
into an example dict with the image still encoded. Reading raw records is
cheap, so the input pipeline can shuffle and skip them (resume) before it
does the expensive decode + pp in a parallel map.

A source with `random_access = True` (a tfds dataset prepared in the
ArrayRecord file format) has example indices as its raw records and reads
the record itself in `decode`: the pipeline permutes and skips indices, so a
resume seeks instead of reading what was consumed.
"""

import difflib
import os

import tensorflow as tf
import tensorflow_datasets as tfds

from big_vit_lite.data import config_dict

# Registers mnist10k, animal_mnist, mnist_multilabel and imagenet21k with tfds.
from big_vit_lite.data import builders  # noqa: F401

# Names `python -m big_vit_lite.data.prepare` knows how to build offline.
OFFLINE_DATASETS = (
    "fashion_mnist",
    "mnist10k",
    "animal_mnist",
    "mnist_multilabel",
)


def resolve_data_dir(data_dir):
  """Config value, else $TFDS_DATA_DIR, else tfds' default (~/tensorflow_datasets)."""
  return os.path.expanduser(
      data_dir
      or os.environ.get("TFDS_DATA_DIR")
      or tfds.core.constants.DATA_DIR
  )


def _prepare_hint(name, data_dir):
  if name.split("/")[0] == "imagenet21k":
    # The release too (imagenet21k/winter21): plain imagenet21k builds fall11.
    return (
        f"put the official ImageNet-21k tar file(s) in a folder and run `python -m "
        f"big_vit_lite.data.prepare {name} --data_dir={data_dir} --manual_dir=FOLDER`"
    )
  return (
      f"run `python -m big_vit_lite.data.prepare {name} --data_dir={data_dir}`"
  )


def name_hint(name):
  """'did you mean ...' for a misspelt dataset name, or ''."""
  known = tfds.list_builders(with_community_datasets=False) + ["imagefolder"]
  base = name.split(":")[0].split("/")[0].lower().replace("-", "_")
  near = difflib.get_close_matches(base, known, n=3, cutoff=0.75)
  return f"did you mean {' or '.join(repr(n) for n in near)}?" if near else ""


def tfds_builder(name, data_dir, unknown, **kwargs):
  """tfds.builder with one-line errors; unknown(name_hint(name)) is the one for a name tfds
  does not know."""
  try:
    return tfds.builder(name, data_dir=data_dir, **kwargs)
  except tfds.core.registered.DatasetNotFoundError:
    raise ValueError(unknown(name_hint(name))) from None
  # a version, config or name ("fashion-mnist") it lacks
  except (AssertionError, ValueError) as e:
    hint = name_hint(name)
    raise ValueError(
        f"dataset {name!r}: {str(e).splitlines()[0].rstrip('.: ')}"
        + (f"; {hint}" if hint else "")
    ) from None


def check_data_cfg(data_cfg):
  """data_cfg (dict or ConfigDict) -> plain dict; unknown keys are an error."""
  data_cfg = config_dict(data_cfg, ("name", "split", "data_dir"), "data config")
  if not data_cfg.get("name") or not data_cfg.get("split"):
    raise ValueError(f"data config needs name and split, got {data_cfg}")
  return data_cfg


def encoded_images(features):
  """tfds decoders that keep image features encoded: the pp `decode` op decodes them
  inside the parallel map. Not float32 images: tfds stores those as their bytes in an
  RGBA PNG, which `decode` would read as colours; tfds decodes them to float32.
  """
  return {
      k: tfds.decode.SkipDecoding()
      for k, f in features.items()
      if isinstance(f, tfds.features.Image) and f.tf_dtype != tf.float32
  }


def with_eval_split(data_cfg):
  """An eval's data config with its split: an image folder's unset split is found
  (imagefolder.eval_split: val, validation, then test)."""
  data_cfg = config_dict(data_cfg, ("name", "split", "data_dir"), "data config")
  if data_cfg.get("name") == "imagefolder" and not data_cfg.get("split"):
    from big_vit_lite.data import imagefolder  # pylint: disable=import-outside-toplevel

    data_cfg["split"] = imagefolder.eval_split(data_cfg.get("data_dir"))
  return data_cfg


_SOURCES = {}


def get_source(data_cfg):
  """The source for a data config; cached per process (evals rebuild iterators often)."""
  data_cfg = check_data_cfg(data_cfg)
  name, split, data_dir = (
      data_cfg["name"],
      data_cfg["split"],
      data_cfg.get("data_dir"),
  )
  if _tfds_is_mocked():  # never cached: each mock context has its own fake data
    return MockedTfdsSource(name, split, data_dir)
  key = (name, split, resolve_data_dir(data_dir))
  if key not in _SOURCES:
    if name == "imagefolder":
      from big_vit_lite.data import imagefolder  # pylint: disable=import-outside-toplevel

      _SOURCES[key] = imagefolder.ImageFolderSource(data_dir, split)
    else:
      _SOURCES[key] = TfdsSource(name, split, data_dir)
  return _SOURCES[key]


def _tfds_is_mocked():
  """True inside `tfds.testing.mock_data` (which fakes as_dataset, not the files)."""
  reader = tfds.core.dataset_builder.FileReaderBuilder._as_dataset  # pylint: disable=W0212
  return getattr(reader, "__module__", "").startswith(
      "tensorflow_datasets.testing"
  )


class TfdsSource:
  """A split (any tfds split syntax, e.g. "train[:90%]") of a prepared tfds dataset."""

  def __init__(self, name, split, data_dir=None):
    data_dir = resolve_data_dir(data_dir)
    hint = _prepare_hint(name.split(":")[0], data_dir)
    builder = tfds_builder(
        name,
        data_dir,
        lambda near: (
            f"dataset {name!r} is unknown to tfds and not found in {data_dir}; {near or hint}"
        ),
    )
    if not builder.is_prepared():
      raise ValueError(
          f"dataset {name!r} is not prepared in {data_dir}; {hint}"
      )
    self.name, self.info = name, builder.info
    try:
      split_info = builder.info.splits[split]
    except (KeyError, ValueError, AssertionError) as e:
      raise ValueError(
          f"bad split {split!r} for {name!r} (splits: "
          f"{sorted(builder.info.splits)}): {e}".replace("\n", " ")
      ) from None
    self.num_examples = int(split_info.num_examples)
    if self.num_examples <= 0:
      raise ValueError(
          f"split {split!r} of {name!r} selects no examples "
          f"({split_info.num_examples}); check its slice bounds"
      )
    # (filename, skip, take) of every file piece, in tfds' canonical order.
    self._pieces = [
        (fi.filename, fi.skip, fi.take)
        for fi in split_info.file_instructions
        if fi.take > 0
    ]
    self._features = builder.info.features
    self._decoders = encoded_images(self._features)
    self.random_access = (
        builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
    )
    if self.random_access:
      self._records = array_records(split_info.file_instructions, name)
      # records read so far (tests check that a resume reads few)
      self.reads = 0

  def _pieces_in(self, start, end):
    """File pieces covering examples [start, end) of the split."""
    out, pos = [], 0
    for fname, skip, take in self._pieces:
      lo, hi = max(start, pos), min(end, pos + take)
      if lo < hi:
        out.append((fname, skip + lo - pos, hi - lo))
      pos += take
    return out

  def raw(self, start, end, order_seed=None):
    """Serialized records of examples [start, end).

    `order_seed` (int64 scalar tensor) shuffles the order in which file
    pieces are interleaved; None keeps the canonical order.
    """
    if self.random_access:
      # indices; `decode` reads the record
      return tf.data.Dataset.range(start, end)
    pieces = self._pieces_in(start, end)
    if not pieces:
      return tf.data.Dataset.from_tensor_slices(tf.constant([], tf.string))
    if len(pieces) == 1:
      fname, skip, take = pieces[0]
      return tf.data.TFRecordDataset(fname).skip(skip).take(take)
    files, skips, takes = zip(*pieces)
    ds = tf.data.Dataset.from_tensor_slices(
        (
            tf.constant(files),
            tf.constant(skips, tf.int64),
            tf.constant(takes, tf.int64),
        )
    )
    if order_seed is not None:
      ds = ds.shuffle(len(pieces), seed=order_seed)
    return ds.interleave(
        lambda f, s, t: tf.data.TFRecordDataset(f).skip(s).take(t),
        cycle_length=min(len(pieces), 16),
        block_length=1,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )

  def decode(self, record):
    if self.random_access:
      record = tf.numpy_function(
          self._read, [record], tf.string, stateful=False
      )
      record.set_shape([])
    return self._features.deserialize_example(record, decoders=self._decoders)

  def _read(self, index):
    """The serialized example at `index` of the split (ArrayRecord: random access)."""
    self.reads += 1
    return self._records[int(index)]


def array_records(file_instructions, name):
  """Random access to the records of a split's ArrayRecord file pieces."""
  try:
    from array_record.python import array_record_data_source  # pylint: disable=C0415
  except ImportError:
    raise ValueError(
        f"dataset {name!r} is in the ArrayRecord format: pip install "
        f"array_record"
    ) from None
  return array_record_data_source.ArrayRecordDataSource(
      [fi for fi in file_instructions if fi.take > 0]
  )


class MockedTfdsSource:
  """Under `tfds.testing.mock_data`: the fake examples of builder.as_dataset.

  Lets configs for datasets that cannot be had here (ImageNet, ImageNet-21k)
  run a few steps in tests. The split size is the mock's example count.
  """

  def __init__(self, name, split, data_dir=None):
    builder = tfds.builder(name, data_dir=resolve_data_dir(data_dir))
    decoders = encoded_images(builder.info.features)
    # Built once here, outside any tf.data function that later slices it.
    self._ds = builder.as_dataset(
        split=split, decoders=decoders, shuffle_files=False
    )
    self.num_examples = int(self._ds.cardinality())
    self.name, self.info = name, builder.info

  def raw(self, start, end, order_seed=None):
    del order_seed
    return self._ds.skip(start).take(end - start)

  def decode(self, record):
    return record
