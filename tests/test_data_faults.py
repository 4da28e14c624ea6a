"""Faults a user makes with the input pipeline give one-line errors, never silent wrong data."""

import gc
import json
import logging
import os
import shutil

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from big_vit_lite.data import input_pipeline as ip
from big_vit_lite.data import prepare

import checks


def _train_iterator(data_dir, pp, **kw):
  cfg = dict(
      data=dict(name="mnist10k", split="test[:64]", data_dir=data_dir),
      batch_size=8,
      pp=pp,
      shuffle_buffer_size=0,
  )
  cfg.update(kw)
  return ip.make_train_iterator(cfg, seed=0, process_index=0, process_count=1)


def _train(data_dir, pp, **kw):
  return next(_train_iterator(data_dir, pp, **kw))


_one_line_error = checks.one_line_error


@pytest.mark.parametrize(
    "pp, words",
    [
        # big_vision's classic: keep() of the key onehot did not write.
        (
            "decode|onehot(10)|keep('image', 'labels')",
            ["keep", "'labels'", "'label'"],
        ),
        ("decode|onehot(10, key='labl')", ["onehot", "'labl'", "'label'"]),
        ("value_range(-1, 1)", ["value_range", "decode"]),  # decode forgotten
        (
            "decode|central_crop(32)",
            ["central_crop", "smaller than the crop", "resize"],
        ),
        ("decode|random_crop(32)", ["random_crop", "smaller than the crop"]),
        # 10 classes: was all-zero targets
        ("decode|onehot(5)", ["onehot(5)", "depth"]),
        ("decode|value_rang(-1, 1)", ["did you mean 'value_range'"]),
        ("decode(1)|randaug(2, 10)", ["randaug", "RGB"]),
    ],
)
def test_pp_faults_in_the_pipeline_are_one_line(tfds_data_dir, pp, words):
  _one_line_error(lambda: _train(tfds_data_dir, pp), *words)


def _read_eval(data_dir, pp):
  """An eval iterator of mnist10k read to its end."""
  data = dict(name="mnist10k", split="test[:64]", data_dir=data_dir)
  list(ip.make_eval_iterator(data, pp, 4, process_index=0, process_count=1))


@pytest.mark.parametrize("read", [_train, _read_eval])
def test_a_failed_iterator_lets_its_threads_go_while_the_error_is_kept(
    tfds_data_dir, read
):
  """Guards: a failed tf.data iterator kept alive by an error kept after the fact
  (pytest.raises, a notebook's `except ... as e`): the frames of tf's traceback hold
  it, and a TrainIterator held on to it, so its threads stayed until a garbage
  collection, which then waits for each to stop. Oracle: the process's threads,
  counted with the collector off, back to their count before the failing iterator
  was made (after a first one, which starts TensorFlow's process-wide pools)."""
  kept = []
  gc.disable()
  try:
    for _ in range(2):
      threads_before = len(os.listdir("/proc/self/task"))
      with pytest.raises(ValueError, match="smaller than the crop") as error:
        read(tfds_data_dir, "decode|central_crop(32)")
      kept.append(error)
    assert len(os.listdir("/proc/self/task")) <= threads_before
  finally:
    gc.enable()


def test_a_failed_train_iterator_starts_again_at_the_same_position(
    tfds_data_dir,
):
  """Guards: the TrainIterator that dropped its failed tf.data iterator moving on,
  or not building a new one. Oracle: a pp that fails on every example fails again
  on the next call, and the position read by get_state() has not moved."""
  it = _train_iterator(tfds_data_dir, "decode|central_crop(32)")
  before = json.dumps(it.get_state(), sort_keys=True, default=str)
  for _ in range(2):
    with pytest.raises(ValueError, match="smaller than the crop"):
      next(it)
  assert json.dumps(it.get_state(), sort_keys=True, default=str) == before


def test_eval_pp_faults_are_one_line(tfds_data_dir):
  data = dict(name="mnist10k", split="test[:10]", data_dir=tfds_data_dir)
  _one_line_error(
      lambda: list(
          ip.make_eval_iterator(
              data,
              "decode|central_crop(29)",
              4,
              process_index=0,
              process_count=1,
          )
      ),
      "eval data mnist10k",
      "smaller than the crop",
  )


def test_onehot_with_enough_depth_is_unchanged(tfds_data_dir):
  b = _train(tfds_data_dir, "decode(1)|onehot(10, key_result='labels')")
  np.testing.assert_array_equal(b["labels"].argmax(-1), b["label"])
  assert (b["labels"].sum(-1) == 1).all()


@pytest.mark.parametrize(
    "data, words",
    [
        (
            dict(name="fashon_mnist", split="train"),
            ["did you mean 'fashion_mnist'"],
        ),
        # was AssertionError
        (dict(name="mnist10k:9.9.9", split="train"), ["mnist10k", "9.9.9"]),
        # was -1000 examples
        (dict(name="mnist10k", split="train[5000:4000]"), ["no examples"]),
    ],
)
def test_dataset_name_and_split_faults(tfds_data_dir, data, words):
  _one_line_error(
      lambda: ip.get_num_examples(dict(data, data_dir=tfds_data_dir)), *words
  )


def test_prepare_suggests_the_near_name(tmp_path):
  _one_line_error(
      lambda: prepare.prepare("animal_minst", str(tmp_path)),
      "did you mean 'animal_mnist'",
  )


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(batch_size=0), ["batch_size", ">= 1"]),
        (dict(shuffle_buffer_size=-1), ["shuffle_buffer_size"]),
        (dict(batch_size=8.5), ["batch_size"]),
    ],
)
def test_bad_input_numbers(tfds_data_dir, change, words):
  _one_line_error(lambda: _train(tfds_data_dir, "decode", **change), *words)
  if "batch_size" in change:
    _one_line_error(
        lambda: ip.make_eval_iterator(
            dict(name="mnist10k", split="test", data_dir=tfds_data_dir),
            "decode",
            change["batch_size"],
            process_index=0,
            process_count=1,
        ),
        "batch_size",
    )


def test_state_of_another_split_size_warns(tfds_data_dir, caplog):
  cfg = dict(
      data=dict(name="mnist10k", split="test[:64]", data_dir=tfds_data_dir),
      batch_size=8,
      pp="decode",
      shuffle_buffer_size=0,
  )
  state = ip.make_train_iterator(
      cfg, seed=0, process_index=0, process_count=1
  ).get_state()
  cfg["data"]["split"] = "test[:96]"
  other = ip.make_train_iterator(cfg, seed=0, process_index=0, process_count=1)
  with caplog.at_level(logging.WARNING):
    other.set_state(state)
  assert "64 examples" in caplog.text and "96" in caplog.text


def _save(path, img, fmt, **kw):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  img.save(path, fmt, **kw)


def test_imagefolder_nested_and_odd_formats_into_a_grey_model(tmp_path):
  root = str(tmp_path)
  grey = np.random.default_rng(0).integers(0, 256, (9, 11), dtype=np.uint8)
  g = Image.fromarray(grey)
  _save(f"{root}/train/a/x.png", g, "PNG")
  # was silently left out
  _save(f"{root}/train/a/2024/deep/nested.png", g, "PNG")
  # decode(1) crashed on these
  _save(f"{root}/train/b/x.gif", g, "GIF")
  _save(f"{root}/train/b/x.bmp", g.convert("RGB"), "BMP")
  _save(f"{root}/train/b/x.webp", g, "WEBP", lossless=True)
  _save(f"{root}/train/b/cmyk.jpg", g.convert("CMYK"), "JPEG", quality=100)
  # 16-bit TIFF: came out white (Pillow's 8-bit conversion clips at 255).
  _save(
      f"{root}/train/b/x16.tif",
      Image.fromarray(grey.astype(np.uint16) * 257),
      "TIFF",
  )
  # not in a class: ignored
  _save(f"{root}/train/loose.png", g, "PNG")
  data = dict(name="imagefolder", data_dir=root, split="train")
  batches = list(
      ip.make_eval_iterator(
          data, "decode(1)", 8, process_index=0, process_count=1
      )
  )
  (b,) = batches
  names = [n.decode() for n in b["file_name"][b["_mask"]]]
  assert sorted(names) == [
      "train/a/2024/deep/nested.png",
      "train/a/x.png",
      "train/b/cmyk.jpg",
      "train/b/x.bmp",
      "train/b/x.gif",
      "train/b/x.webp",
      "train/b/x16.tif",
  ]
  images = dict(zip(names, b["image"][b["_mask"]]))
  labels = dict(zip(names, b["label"][b["_mask"]]))
  assert (
      labels["train/a/2024/deep/nested.png"] == 0
      and labels["train/b/x.gif"] == 1
  )
  for name in (
      "train/a/x.png",
      "train/a/2024/deep/nested.png",
      "train/b/x.bmp",
      "train/b/x.webp",
      "train/b/x16.tif",
  ):
    assert images[name].shape == (9, 11, 1)
    np.testing.assert_array_equal(images[name][..., 0], grey, err_msg=name)
  # palette / lossy: close, not exact
  for name in ("train/b/x.gif", "train/b/cmyk.jpg"):
    assert np.abs(images[name][..., 0].astype(int) - grey).mean() < 8, name


class _FakeBuilder:
  name = "somedata"
  url_infos = {"https://nonexistent.invalid/data.tgz": None}

  def is_prepared(self):
    return False

  def download_and_prepare(self, download_config=None):
    raise AssertionError("offline: would retry for minutes")


def test_prepare_offline_fails_fast_in_one_line(monkeypatch, tmp_path):
  for var in ("https_proxy", "http_proxy", "all_proxy"):
    monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv(var.upper(), raising=False)
  monkeypatch.setattr(prepare, "GCS_HOST", ("nonexistent.invalid", 443))
  monkeypatch.setattr(prepare, "get_builder", lambda *a, **k: _FakeBuilder())
  _one_line_error(
      lambda: prepare.prepare("somedata", str(tmp_path)),
      "cannot download somedata",
      "nonexistent.invalid",
      str(tmp_path),
  )
  # only the proxy can tell
  monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
  with pytest.raises(AssertionError, match="would retry"):
    prepare.prepare("somedata", str(tmp_path))


def test_imagefolder_without_readable_images_says_so(tmp_path):
  os.makedirs(tmp_path / "train" / "a")
  (tmp_path / "train" / "a" / "x.jpg").write_bytes(b"not a jpeg")
  cfg = dict(
      data=dict(name="imagefolder", data_dir=str(tmp_path), split="train"),
      # was: "shard 0 has 0 examples ... lower batch_size"
      batch_size=2,
      pp="decode",
  )
  _one_line_error(
      lambda: ip.make_train_iterator(
          cfg, seed=0, process_index=0, process_count=1
      ),
      "no examples",
      "1 unreadable",
  )


def test_corrupt_dataset_file_is_one_line(tfds_data_dir, tmp_path):
  src = os.path.join(tfds_data_dir, "mnist10k", "1.0.0")
  dst = tmp_path / "mnist10k" / "1.0.0"
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*train*"))
  (test_file,) = [p for p in dst.iterdir() if "test.tfrecord" in p.name]
  test_file.write_bytes(test_file.read_bytes()[:5000])  # a truncated copy
  data = dict(name="mnist10k", split="test", data_dir=str(tmp_path))
  _one_line_error(
      lambda: list(
          ip.make_eval_iterator(
              data, "decode", 500, process_index=0, process_count=1
          )
      ),
      "eval data mnist10k",
      "prepare",
  )


def test_imagefolder_non_ascii_names(tmp_path):
  # crashed the pipeline (ASCII-only)
  for path in ("train/café/é.png", "train/猫/x y.png"):
    _save(
        str(tmp_path / path),
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)),
        "PNG",
    )
  (b,) = ip.make_eval_iterator(
      dict(name="imagefolder", data_dir=str(tmp_path), split="train"),
      "decode",
      2,
      process_index=0,
      process_count=1,
  )
  assert [n.decode() for n in b["file_name"]] == [
      "train/café/é.png",
      "train/猫/x y.png",
  ]
  assert b["label"].tolist() == [0, 1]


class BvlOddLabels(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """test: 6 examples whose labels are -1 (as ImageNet's test split), float and huge ids, and
  a float32 image feature."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(shape=(4, 4, 3)),
                "label": tfds.features.Scalar(np.int64),
                "soft": tfds.features.Tensor(shape=(3,), dtype=np.float32),
                "big": tfds.features.Scalar(np.int64),
                "depth": tfds.features.Image(shape=(4, 4, 1), dtype=np.float32),
            }
        ),
    )

  def _split_generators(self, dl_manager):
    return {"test": self._generate_examples()}

  def _generate_examples(self):  # pylint: disable=arguments-differ
    for i in range(6):
      yield i, {
          "image": np.zeros((4, 4, 3), np.uint8),
          "label": -1,
          "soft": np.eye(3, dtype=np.float32)[i % 3],
          "big": 2**32 + 1,
          "depth": np.full((4, 4, 1), 0.5 + i, np.float32),
      }


@pytest.fixture(scope="module")
def odd_labels(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tfds"))
  BvlOddLabels(data_dir=d).download_and_prepare()
  return dict(name="bvl_odd_labels", split="test", data_dir=d)


@pytest.mark.parametrize(
    "pp_string, words",
    [
        # tf.one_hot gives all-zero targets for -1: an eval or training on nothing,
        # silently.
        (
            "decode|onehot(10, key_result='labels')",
            ["onehot(10)", "negative", "labelled split"],
        ),
        # 2**32 + 1 wrapped to 1 in int32, inside the depth.
        (
            "decode|onehot(10, key='big', key_result='labels')",
            ["onehot(10)", ">= depth"],
        ),
        # one-hot already: became a k-hot of {0, 1}.
        (
            "decode|onehot(3, key='soft', key_result='labels')",
            ["onehot(3", "integer class ids", "float32"],
        ),
    ],
)
def test_labels_onehot_cannot_encode_are_errors(odd_labels, pp_string, words):
  _one_line_error(
      lambda: list(
          ip.make_eval_iterator(
              odd_labels, pp_string, 4, process_index=0, process_count=1
          )
      ),
      *words,
  )
  train = dict(data=odd_labels, batch_size=2, pp=pp_string)
  _one_line_error(
      lambda: next(
          ip.make_train_iterator(
              train, seed=0, process_index=0, process_count=1
          )
      ),
      *words,
  )


def test_float32_image_features_decode_to_their_values(odd_labels):
  (b,) = ip.make_eval_iterator(
      odd_labels,
      "decode(1, key='depth')|keep('depth')",
      6,
      process_index=0,
      process_count=1,
  )
  # Was the float's 4 bytes read as an RGBA pixel: 0.5 -> (0, 0, 0, 63).
  assert b["depth"].dtype == np.float32 and b["depth"].shape == (6, 4, 4, 1)
  assert sorted(b["depth"][:, 0, 0, 0].tolist()) == [
      0.5,
      1.5,
      2.5,
      3.5,
      4.5,
      5.5,
  ]


def test_every_process_refuses_a_split_too_small_for_its_shards(odd_labels):
  # 6 examples in 8 shards: two shards are empty. Only the processes reading an
  # empty shard failed (at their first batch); the others went on to wait in
  # collectives.
  cfg = dict(
      data=dict(odd_labels, split="test"),
      batch_size=8,
      pp="decode",
      num_shards=8,
  )
  for p in range(8):
    _one_line_error(
        lambda p=p: ip.make_train_iterator(
            cfg, seed=0, process_index=p, process_count=8
        ),
        "6 examples",
        "8 shard(s)",
        "lower input.batch_size",
    )


def test_prepare_of_a_hand_downloaded_dataset_says_manual_dir(tmp_path):
  # Was tfds' AssertionError, cut to "... using instructions:" with the
  # instructions lost.
  _one_line_error(
      lambda: prepare.prepare("imagenet2012", str(tmp_path)),
      "--manual_dir=FOLDER",
      "ILSVRC2012_img_train.tar",
  )


@pytest.mark.parametrize(
    "name, near",
    [
        # Hugging Face's spelling: was a 10-line tfds error
        ("fashion-mnist", "fashion_mnist"),
        ("ImageFolder", "imagefolder"),  # was "run prepare ImageFolder"
    ],
)
def test_dataset_names_people_write_get_the_right_name(tmp_path, name, near):
  _one_line_error(
      lambda: ip.get_num_examples(
          dict(name=name, split="train", data_dir=str(tmp_path))
      ),
      f"did you mean {near!r}",
  )
  _one_line_error(
      lambda: prepare.prepare(name, str(tmp_path)), f"did you mean {near!r}"
  )
