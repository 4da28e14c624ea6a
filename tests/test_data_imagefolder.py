"""Image folders as datasets: odd modes and sizes load, bad files are skipped and counted."""

import io
import logging
import os
import struct
import unicodedata

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from big_vit_lite.data import input_pipeline as ip
from big_vit_lite.data import sources

import checks


def _save(path, img, fmt, **kw):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  img.save(path, fmt, **kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("imagefolder"))
  rng = np.random.default_rng(0)
  rgb = lambda h, w: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))  # noqa: E731
  _save(f"{root}/train/cat/rgb.jpg", rgb(40, 50), "JPEG")
  _save(f"{root}/train/cat/plain.png", rgb(30, 31), "PNG")
  _save(f"{root}/train/cat/grey.jpg", rgb(20, 60).convert("L"), "JPEG")
  _save(f"{root}/train/dog/cmyk.jpg", rgb(50, 40).convert("CMYK"), "JPEG")
  # odd size
  _save(f"{root}/train/dog/rgba.png", rgb(7, 300).convert("RGBA"), "PNG")
  _save(f"{root}/train/dog/tiny.png", rgb(1, 1), "PNG")
  # tf cannot decode: converted
  _save(f"{root}/train/dog/scan.tiff", rgb(16, 16), "TIFF")
  buf = io.BytesIO()
  rgb(64, 64).save(buf, "JPEG")
  with open(f"{root}/train/dog/truncated.jpg", "wb") as f:
    f.write(buf.getvalue()[:500])
  with open(f"{root}/train/cat/corrupt.jpg", "wb") as f:
    f.write(b"this is not an image")
  with open(f"{root}/train/cat/notes.txt", "w") as f:
    f.write("ignored: not an image extension")
  _save(f"{root}/val/bird/x.jpg", rgb(40, 50), "JPEG")  # class only in val
  return root


def test_imagefolder_loads_odd_images_and_counts_skips(folder, caplog):
  data = dict(name="imagefolder", data_dir=folder, split="train")
  with caplog.at_level(logging.INFO):
    n = ip.get_num_examples(data)
  assert n == 7
  assert "skipped 2 unreadable" in caplog.text
  assert "truncated.jpg" in caplog.text and "corrupt.jpg" in caplog.text
  batches = list(
      ip.make_eval_iterator(
          data,
          "decode|resize(16)|value_range(0, 1)",
          4,
          process_index=0,
          process_count=1,
      )
  )
  mask = np.concatenate([b["_mask"] for b in batches])
  assert mask.sum() == 7 and len(mask) == 8
  images = np.concatenate([b["image"] for b in batches])[mask]
  assert images.shape == (7, 16, 16, 3) and images.max() <= 1
  # Labels: sorted union of classes over splits -> bird 0, cat 1, dog 2.
  names = np.concatenate([b["file_name"] for b in batches])[mask]
  labels = np.concatenate([b["label"] for b in batches])[mask]
  by_name = {n.decode(): int(l) for n, l in zip(names, labels)}
  assert (
      by_name["train/cat/grey.jpg"] == 1 and by_name["train/dog/cmyk.jpg"] == 2
  )
  grey = images[list(by_name).index("train/cat/grey.jpg")]
  np.testing.assert_allclose(grey[..., 0], grey[..., 2])  # grey -> RGB


def test_imagefolder_trains_with_augmentation(folder):
  it = ip.make_train_iterator(
      dict(
          data=dict(name="imagefolder", data_dir=folder, split="train"),
          batch_size=4,
          pp="decode_jpeg_and_inception_crop(8)|flip_lr|value_range(-1, 1)|"
          "onehot(3, key_result='labels')|keep('image', 'labels')",
      ),
      seed=0,
      process_index=0,
      process_count=1,
  )
  # 4 epochs
  seen = np.concatenate([next(it)["labels"].argmax(-1) for _ in range(7)])
  assert set(seen.tolist()) == {1, 2}
  # 3 cats, 4 dogs, x4
  assert np.bincount(seen, minlength=3)[1:].tolist() == [12, 16]


def test_imagefolder_missing_split_is_one_line(folder):
  with pytest.raises(ValueError, match="no folder .*test"):
    ip.get_num_examples(dict(name="imagefolder", data_dir=folder, split="test"))


def test_images_of_different_sizes_without_resize_say_what_to_do(folder):
  it = ip.make_train_iterator(
      dict(
          data=dict(name="imagefolder", data_dir=folder, split="train"),
          batch_size=7,
          pp="decode|keep('image', 'label')",
      ),
      seed=0,
      process_index=0,
      process_count=1,
  )
  with pytest.raises(ValueError, match=r"different shapes.*resize"):
    next(it)


# --- Split slices ("train[:90%]") and 32-bit TIFFs
# -----------------------------------------------

# 33 training files, sorted by class on disk
_COUNTS = {"c0": 12, "c1": 9, "c2": 7, "c3": 5}


@pytest.fixture(scope="module")
def classes_folder(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("sliced"))
  for cls, count in _COUNTS.items():
    for i in range(count):
      _save(
          f"{root}/train/{cls}/{i:02d}.png",
          Image.fromarray(np.full((4, 4, 3), i, np.uint8)),
          "PNG",
      )
  _save(
      f"{root}/val/c4/x.png",
      Image.fromarray(np.zeros((4, 4, 3), np.uint8)),
      "PNG",
  )
  return root


def _read(root, split):
  """{file name: label} of an imagefolder split, read through the eval pipeline."""
  data = dict(name="imagefolder", data_dir=root, split=split)
  out = {}
  for b in ip.make_eval_iterator(
      data,
      "decode|keep('label', 'file_name')",
      8,
      process_index=0,
      process_count=1,
  ):
    for name, label, real in zip(b["file_name"], b["label"], b["_mask"]):
      if real:
        assert name.decode() not in out
        out[name.decode()] = int(label)
  assert len(out) == ip.get_num_examples(data)
  return out


def test_split_slices_are_disjoint_cover_and_hold_every_class(classes_folder):
  everything = _read(classes_folder, "train")
  assert len(everything) == 33
  head, tail = _read(classes_folder, "train[:90%]"), _read(
      classes_folder, "train[90%:]"
  )
  assert (len(head), len(tail)) == (30, 3)  # tfds: round(0.9 * 33) = 30
  assert not set(head) & set(tail) and {**head, **tail} == everything
  # The first 16 files of the class-sorted list are only c0 and c1.
  half = _read(classes_folder, "train[:50%]")
  assert len(half) == 16 and set(half.values()) == {0, 1, 2, 3}
  # labels follow the files (c4, in val only, is label 4)
  for name, label in half.items():
    assert name.split("/")[1] == f"c{label}"
  counts = _read(classes_folder, "train[10:20]")
  assert len(counts) == 10 and set(counts) < set(everything)
  assert len(_read(classes_folder, "train[-3:]")) == 3
  joined = _read(classes_folder, "train[:10%]+val")
  assert len(joined) == 4 and joined["val/c4/x.png"] == 4


def test_split_slices_are_stable(classes_folder):
  from big_vit_lite.data import imagefolder  # pylint: disable=import-outside-toplevel
  # The fixed shuffle, pinned: the same on every machine and numpy version.
  assert sorted(imagefolder.fixed_order(33)[:5]) == [4, 24, 26, 29, 32]
  a = imagefolder.ImageFolderSource(classes_folder, "train[:25%]")
  b = imagefolder.ImageFolderSource(classes_folder, "train[:25%]")
  assert a.files == b.files and len(a.files) == 8  # round(8.25)


@pytest.mark.parametrize(
    "split,problem",
    [
        ("train[:90", "Error parsing split"),
        ("train[a:b]", "Error parsing split"),
        ("train[5]", "Error parsing split"),
        ("train[:500]", "incompatible with 33"),
        ("train[:101%]", "[-100, 100]"),
        ("train[5:5]", "selects none of the 33"),
        ("train[50%:40%]", "selects none"),
        ("train+", "Error parsing split"),
    ],
)
def test_bad_split_slices_are_one_line(classes_folder, split, problem):
  with pytest.raises(ValueError) as e:
    ip.get_num_examples(
        dict(name="imagefolder", data_dir=classes_folder, split=split)
    )
  msg = str(e.value)
  assert "\n" not in msg and repr(split) in msg and problem in msg
  with pytest.raises(ValueError, match="no folder .*test"):
    ip.get_num_examples(
        dict(name="imagefolder", data_dir=classes_folder, split="test[:50%]")
    )


def test_sliced_split_trains(classes_folder):
  head = _read(classes_folder, "train[:90%]")
  it = ip.make_train_iterator(
      dict(
          data=dict(
              name="imagefolder", data_dir=classes_folder, split="train[:90%]"
          ),
          batch_size=10,
          pp="decode|flip_lr|keep('image', 'label', 'file_name')",
      ),
      seed=0,
      process_index=0,
      process_count=1,
  )
  assert it.num_examples == 30
  batches = [next(it) for _ in range(3)]  # one epoch
  seen = [n.decode() for b in batches for n in b["file_name"]]
  assert sorted(seen) == sorted(head)
  assert all(b["image"].shape == (10, 4, 4, 3) for b in batches)


def test_folder_named_like_a_slice_is_read_whole(tmp_path):
  _save(
      str(tmp_path / "a+b" / "c" / "x.png"),
      Image.fromarray(np.zeros((4, 4, 3), np.uint8)),
      "PNG",
  )
  assert (
      ip.get_num_examples(
          dict(name="imagefolder", data_dir=str(tmp_path), split="a+b")
      )
      == 1
  )


def test_32bit_tiffs_are_skipped_not_clipped(tmp_path, caplog):
  ramp = np.arange(12 * 10).reshape(12, 10)
  _save(
      str(tmp_path / "train/a/float.tif"),
      Image.fromarray((ramp / 119).astype(np.float32)),
      "TIFF",
  )
  _save(
      str(tmp_path / "train/a/int32.tif"),
      Image.fromarray((ramp * 500).astype(np.int32)),
      "TIFF",
  )
  _save(
      str(tmp_path / "train/a/uint16.tif"),
      Image.fromarray((ramp * 500).astype(np.uint16)),
      "TIFF",
  )
  _save(
      str(tmp_path / "train/a/uint8.tif"),
      Image.fromarray(ramp.astype(np.uint8)),
      "TIFF",
  )
  for name, mode in (
      ("float", "F"),
      ("int32", "I"),
      ("uint16", "I;16"),
      ("uint8", "L"),
  ):
    with Image.open(tmp_path / f"train/a/{name}.tif") as im:
      assert im.mode == mode  # what the test is about
  data = dict(name="imagefolder", data_dir=str(tmp_path), split="train")
  with caplog.at_level(logging.WARNING):
    (b,) = ip.make_eval_iterator(
        data, "decode(1)", 4, process_index=0, process_count=1
    )
  names = [n.decode() for n in b["file_name"][b["_mask"]]]
  # the others were clipped at 255
  assert names == ["train/a/uint16.tif", "train/a/uint8.tif"]
  images = b["image"][b["_mask"]][..., 0]
  np.testing.assert_array_equal(images[0], (ramp * 500) >> 8)
  np.testing.assert_array_equal(images[1], ramp)
  assert "skipped 2 unreadable or unsupported" in caplog.text
  for name, mode in (("float.tif", "mode F"), ("int32.tif", "mode I")):
    line = next(l for l in caplog.text.split(";") if name in l)
    assert mode in line and "8- or 16-bit PNG/TIFF" in line


def test_a_split_of_only_unsupported_files_says_so(tmp_path):
  ramp = np.arange(12 * 10).reshape(12, 10)
  _save(
      str(tmp_path / "train/a/float.tif"),
      Image.fromarray((ramp / 119).astype(np.float32)),
      "TIFF",
  )
  with pytest.raises(
      ValueError,
      match=r"no examples \(1 unreadable or unsupported file\(s\) "
      r"skipped, see the log\)",
  ):
    ip.make_train_iterator(
        dict(
            data=dict(
                name="imagefolder", data_dir=str(tmp_path), split="train"
            ),
            batch_size=2,
            pp="decode(1)",
        ),
        seed=0,
        process_index=0,
        process_count=1,
    )


RNG = np.random.default_rng(0)


def _write(path, data):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "wb") as f:
    f.write(data)


def _folder_eval(root, pp_string, split="train"):
  """{file name: (image, label)} of an image folder, read through the eval pipeline."""
  data = dict(name="imagefolder", data_dir=str(root), split=split)
  out = {}
  for b in ip.make_eval_iterator(
      data, pp_string, 8, process_index=0, process_count=1
  ):
    for name, img, label, real in zip(
        b["file_name"], b["image"], b["label"], b["_mask"]
    ):
      if real:
        out[name.decode()] = (img, int(label))
  return out


_one_line_error = checks.one_line_error


def _bmp16(rgb565):
  """A 16-bit (RGB 5-6-5, BI_BITFIELDS) BMP of a [H, W] uint16 array (Pillow cannot write it)."""
  h, w = rgb565.shape
  rows = b"".join(
      r.astype("<u2").tobytes().ljust((2 * w + 3) // 4 * 4, b"\0")
      for r in rgb565[::-1]
  )
  masks = struct.pack("<III", 0xF800, 0x07E0, 0x001F)
  offset = 14 + 40 + len(masks)
  info = struct.pack(
      "<IiiHHIIiiII", 40, w, h, 1, 16, 3, len(rows), 2835, 2835, 0, 0
  )
  return (
      b"BM"
      + struct.pack("<IHHI", offset + len(rows), 0, 0, offset)
      + info
      + masks
      + rows
  )


def test_bmps_tf_cannot_read_right_are_read_with_pillow(tmp_path):
  rgb = RNG.integers(0, 256, (9, 13, 3), dtype=np.uint8)
  im = Image.fromarray(rgb)
  # tf: indices read as grey
  _save(f"{tmp_path}/train/a/palette.bmp", im.convert("P"), "BMP")
  # tf: crashed the run
  _save(f"{tmp_path}/train/a/1bit.bmp", im.convert("1"), "BMP")
  _save(f"{tmp_path}/train/a/plain.bmp", im, "BMP")
  # tf: crashed on 2 extra bytes
  with open(f"{tmp_path}/train/a/plain.bmp", "rb") as f:
    _write(f"{tmp_path}/train/a/padded.bmp", f.read() + b"\0\0")
  _write(
      f"{tmp_path}/train/a/16bit.bmp",
      _bmp16(
          RNG.integers(0, 2**16, (9, 13)).astype(
              # tf: crashed the run
              np.uint16
          )
      ),
  )
  got = _folder_eval(tmp_path, "decode")
  assert sorted(got) == [
      f"train/a/{n}.bmp"
      for n in ("16bit", "1bit", "padded", "palette", "plain")
  ]
  for name, (img, _) in got.items():
    with Image.open(tmp_path / name) as want:
      np.testing.assert_array_equal(
          img, np.asarray(want.convert("RGB")), err_msg=name
      )


def test_truncated_gif_and_bmp_are_skipped_not_a_crash(tmp_path, caplog):
  im = Image.fromarray(RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8))
  for fmt in ("GIF", "BMP"):
    _save(f"{tmp_path}/train/a/ok.{fmt.lower()}", im, fmt)
    with open(f"{tmp_path}/train/a/ok.{fmt.lower()}", "rb") as f:
      data = f.read()
    _write(f"{tmp_path}/train/a/cut.{fmt.lower()}", data[: len(data) * 2 // 3])
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")
  assert sorted(got) == ["train/a/ok.bmp", "train/a/ok.gif"]
  assert "skipped 2 unreadable" in caplog.text


def test_macos_leftovers_are_neither_images_nor_classes(tmp_path, caplog):
  im = Image.fromarray(np.zeros((4, 4, 3), np.uint8))
  _save(f"{tmp_path}/train/cat/x.jpg", im, "JPEG")
  _save(f"{tmp_path}/train/dog/y.jpg", im, "JPEG")
  # What a Mac leaves on a copied drive or in a zip: "._" resource forks with
  # the image's name, and a "__MACOSX" tree of them. It was a class (shifting
  # the labels after it) and every fork a skipped "unreadable" file.
  for path in (
      "train/cat/._x.jpg",
      "train/__MACOSX/cat/._x.jpg",
      "train/dog/._y.jpg",
  ):
    _write(f"{tmp_path}/{path}", b"\x00\x05\x16\x07" + bytes(60))
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")
    source = sources.get_source(
        dict(name="imagefolder", data_dir=str(tmp_path), split="train")
    )
  assert {n: label for n, (_, label) in got.items()} == {
      "train/cat/x.jpg": 0,
      "train/dog/y.jpg": 1,
  }
  assert source.class_names == ["cat", "dog"] and source.num_skipped == 0
  assert "skipped" not in caplog.text


def test_linked_folders_are_followed_and_a_link_cycle_does_not_repeat_images(
    tmp_path, caplog
):
  im = Image.fromarray(np.zeros((4, 4, 3), np.uint8))
  _save(f"{tmp_path}/train/a/x.png", im, "PNG")
  _save(f"{tmp_path}/train/b/y.png", im, "PNG")
  _save(f"{tmp_path}/elsewhere/z.png", im, "PNG")
  # a cycle: was ~60 copies of each image
  os.symlink("..", f"{tmp_path}/train/a/up")
  # images kept on another disk
  os.symlink("../../elsewhere", f"{tmp_path}/train/a/more")
  # the same real folder: read once
  os.symlink("more", f"{tmp_path}/train/a/more_again")
  # (as torchvision reads it)
  os.symlink(f"{tmp_path}/train/b", f"{tmp_path}/train/a/b_too")
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")
  assert {n: label for n, (_, label) in got.items()} == {
      "train/a/x.png": 0,
      "train/a/b_too/y.png": 0,
      "train/a/more/z.png": 0,
      "train/b/y.png": 1,
  }
  assert (
      "train/a/up: it leads back to a folder above it (a cycle)" in caplog.text
  )


def test_16bit_netpbm_images_are_scaled_to_8_bits(tmp_path, caplog):
  # Were skipped as "32-bit image". maxval 4095 (12-bit data): round(v * 255 /
  # 4095), by hand.
  raw = np.array([[0, 1000, 4095], [2048, 3, 4000]])
  want = np.array([[0, 62, 255], [128, 0, 249]], np.uint8)
  header = lambda magic: f"{magic}\n3 2\n4095\n".encode()  # noqa: E731
  _write(
      f"{tmp_path}/train/a/grey.pgm", header("P5") + raw.astype(">u2").tobytes()
  )
  rgb = np.stack([raw, raw[::-1], 4095 - raw], axis=-1)
  _write(
      f"{tmp_path}/train/a/colour.ppm",
      header("P6") + rgb.astype(">u2").tobytes(),
  )
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")
  assert "skipped" not in caplog.text
  np.testing.assert_array_equal(got["train/a/grey.pgm"][0][..., 0], want)
  want_rgb = np.stack([want, want[::-1], 255 - want], axis=-1)
  np.testing.assert_array_equal(got["train/a/colour.ppm"][0], want_rgb)


def test_mixed_channel_counts_say_how_to_batch_them(tmp_path):
  _save(
      f"{tmp_path}/train/a/grey.png",
      Image.fromarray(np.zeros((4, 4), np.uint8)),
      "PNG",
  )
  _save(
      f"{tmp_path}/train/a/rgb.png",
      Image.fromarray(np.zeros((4, 4, 3), np.uint8)),
      "PNG",
  )
  # Was "end the pp with ops giving a fixed size" (the size was fixed) and tf's
  # graph text.
  msg = _one_line_error(
      lambda: _folder_eval(tmp_path, "decode(0)|resize(4)"),
      "different shapes",
      "decode(3) or decode(1)",
  )
  assert "function_node" not in msg


def test_transparent_and_animated_webps_are_read_with_pillow(tmp_path):
  rgba = RNG.integers(0, 256, (6, 8, 4), dtype=np.uint8)
  # (lossless WebP drops the colour of fully transparent pixels)
  rgba[..., 3] |= 1
  # tf decodes an RGBA WebP only to 4 channels (decode(3) stopped the run), and
  # an animated one not at all: decode(0) corrupted memory and aborted the
  # process.
  _save(
      f"{tmp_path}/train/a/rgba.webp",
      Image.fromarray(rgba, "RGBA"),
      "WEBP",
      lossless=True,
  )
  frames = [
      Image.fromarray(rgba[..., :3]),
      Image.fromarray(255 - rgba[..., :3]),
  ]
  _save(
      f"{tmp_path}/train/a/anim.webp",
      frames[0],
      "WEBP",
      lossless=True,
      save_all=True,
      append_images=frames[1:],
  )
  for channels in (0, 3):
    got = _folder_eval(tmp_path, f"decode({channels})")
    np.testing.assert_array_equal(
        got["train/a/rgba.webp"][0][..., :3], rgba[..., :3]
    )
    np.testing.assert_array_equal(
        got["train/a/anim.webp"][0][..., :3], rgba[..., :3]
    )


def test_a_damaged_png_is_skipped_not_a_crash(tmp_path, caplog):
  im = Image.fromarray(RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8))
  _save(f"{tmp_path}/train/a/ok.png", im, "PNG")
  with open(f"{tmp_path}/train/a/ok.png", "rb") as f:
    data = bytearray(f.read())
  # bit rot in the middle: IEND intact
  data[len(data) // 2 : len(data) // 2 + 16] = bytes(16)
  _write(f"{tmp_path}/train/a/damaged.png", bytes(data))
  with caplog.at_level(logging.WARNING):
    # was: "Invalid PNG data" stopping the run
    got = _folder_eval(tmp_path, "decode")
  assert list(got) == ["train/a/ok.png"]
  assert "damaged.png" in caplog.text


def test_jfif_and_netpbm_images_are_read(tmp_path):
  rgb = RNG.integers(0, 256, (5, 6, 3), dtype=np.uint8)
  # Were dropped without a word (torchvision reads .ppm and .pgm; browsers save
  # .jfif).
  _save(
      f"{tmp_path}/train/a/photo.jfif",
      Image.fromarray(rgb),
      "JPEG",
      quality=100,
  )
  _save(f"{tmp_path}/train/a/x.ppm", Image.fromarray(rgb), "PPM")
  # not an image extension
  _save(f"{tmp_path}/train/a/icon.ico", Image.fromarray(rgb), "ICO")
  got = _folder_eval(tmp_path, "decode")
  assert sorted(got) == ["train/a/photo.jfif", "train/a/x.ppm"]
  np.testing.assert_array_equal(got["train/a/x.ppm"][0], rgb)
  want = tf.io.decode_jpeg(
      tf.io.read_file(str(tmp_path / "train/a/photo.jfif"))
  )
  np.testing.assert_array_equal(got["train/a/photo.jfif"][0], want)


def test_file_names_that_are_not_utf8_are_read(tmp_path):
  # Latin-1 names from an old archive: Python holds them as surrogate escapes,
  # and the pipeline's encode("utf-8") stopped the run before the first batch.
  cls, name = os.fsdecode(b"caf\xe9"), os.fsdecode(b"na\xefve.png")
  _save(
      f"{tmp_path}/train/{cls}/{name}",
      Image.fromarray(np.full((2, 2, 3), 7, np.uint8)),
      "PNG",
  )
  (b,) = ip.make_eval_iterator(
      dict(name="imagefolder", data_dir=str(tmp_path), split="train"),
      "decode",
      1,
      process_index=0,
      process_count=1,
  )
  # the bytes on disk
  assert b["file_name"].tolist() == [b"train/caf\xe9/na\xefve.png"]
  assert (b["image"] == 7).all()


def test_images_with_bytes_after_their_end_are_read_truncated_ones_skipped(
    tmp_path, caplog
):
  rgb = RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)
  _save(f"{tmp_path}/src/x.jpg", Image.fromarray(rgb), "JPEG")
  _save(f"{tmp_path}/src/x.png", Image.fromarray(rgb), "PNG")
  jpg, png = (tmp_path / "src/x.jpg").read_bytes(), (
      tmp_path / "src/x.png"
  ).read_bytes()
  # Phones append data after a JPEG's end marker (Samsung's "SEFT" trailer);
  # both were skipped as "truncated", though tf reads them.
  _write(f"{tmp_path}/train/a/phone.jpg", jpg + b"SEFT" + bytes(300))
  _write(f"{tmp_path}/train/a/padded.png", png + bytes(100))
  # Truncated in its scan, with an end marker earlier (an EXIF thumbnail's):
  # still skipped.
  thumb = (
      b"\xff\xe1"
      + (2 + 8).to_bytes(2, "big")
      + b"\xff\xd8\x00\x00\x00\x00\xff\xd9"
  )
  _write(
      f"{tmp_path}/train/a/cut.jpg",
      (jpg[:2] + thumb + jpg[2:])[: len(jpg) * 2 // 3],
  )
  with caplog.at_level(logging.WARNING):
    got = _folder_eval(tmp_path, "decode")
  assert sorted(got) == ["train/a/padded.png", "train/a/phone.jpg"]
  np.testing.assert_array_equal(got["train/a/padded.png"][0], rgb)
  assert "cut.jpg (truncated JPEG" in caplog.text


def test_classes_spelt_decomposed_everywhere_keep_their_sort_order(tmp_path):
  im = Image.fromarray(np.zeros((2, 2, 3), np.uint8))
  # "cafe" + accent: sorts before "cafz"
  nfd = unicodedata.normalize("NFD", "café")
  for cls in (nfd, "cafz"):
    _save(f"{tmp_path}/train/{cls}/x.png", im, "PNG")
  source = sources.get_source(
      dict(name="imagefolder", data_dir=str(tmp_path), split="train")
  )
  assert source.class_names == [nfd, "cafz"]  # as torchvision, and as before


def test_class_folders_spelt_in_nfd_and_nfc_are_one_class(tmp_path):
  # A macOS copy spells "café" decomposed (NFD); the test split, made on Linux,
  # composed. They were two classes: train and test labels silently disagreed.
  im = Image.fromarray(np.zeros((2, 2, 3), np.uint8))
  nfd, nfc = unicodedata.normalize("NFD", "café"), unicodedata.normalize(
      "NFC", "café"
  )
  for split, cls in (
      ("train", nfd),
      ("train", "cafz"),
      ("test", nfc),
      ("test", "cafz"),
  ):
    _save(f"{tmp_path}/{split}/{cls}/x.png", im, "PNG")
  train = sources.get_source(
      dict(name="imagefolder", data_dir=str(tmp_path), split="train")
  )
  test = sources.get_source(
      dict(name="imagefolder", data_dir=str(tmp_path), split="test")
  )
  assert train.class_names == test.class_names == [nfd, "cafz"]
  for source in (train, test):
    by_folder = {
        unicodedata.normalize("NFC", os.path.basename(os.path.dirname(f))): int(
            label
        )
        for f, label in zip(source.files, source.labels)
    }
    assert by_folder == {nfc: 0, "cafz": 1}
