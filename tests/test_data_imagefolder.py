"""Image folders as datasets: odd modes and sizes load, bad files are skipped and counted."""
import io
import logging
import os

import numpy as np
import pytest
from PIL import Image

from big_vit_lite.data import input_pipeline as ip


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
  _save(f"{root}/train/dog/rgba.png", rgb(7, 300).convert("RGBA"), "PNG")   # odd size
  _save(f"{root}/train/dog/tiny.png", rgb(1, 1), "PNG")
  _save(f"{root}/train/dog/scan.tiff", rgb(16, 16), "TIFF")  # tf cannot decode: converted
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
  batches = list(ip.make_eval_iterator(data, "decode|resize(16)|value_range(0, 1)", 4,
                                       process_index=0, process_count=1))
  mask = np.concatenate([b["_mask"] for b in batches])
  assert mask.sum() == 7 and len(mask) == 8
  images = np.concatenate([b["image"] for b in batches])[mask]
  assert images.shape == (7, 16, 16, 3) and images.max() <= 1
  # Labels: sorted union of classes over splits -> bird 0, cat 1, dog 2.
  names = np.concatenate([b["file_name"] for b in batches])[mask]
  labels = np.concatenate([b["label"] for b in batches])[mask]
  by_name = {n.decode(): int(l) for n, l in zip(names, labels)}
  assert by_name["train/cat/grey.jpg"] == 1 and by_name["train/dog/cmyk.jpg"] == 2
  grey = images[list(by_name).index("train/cat/grey.jpg")]
  np.testing.assert_allclose(grey[..., 0], grey[..., 2])  # grey -> RGB


def test_imagefolder_trains_with_augmentation(folder):
  it = ip.make_train_iterator(dict(
      data=dict(name="imagefolder", data_dir=folder, split="train"), batch_size=4,
      pp="decode_jpeg_and_inception_crop(8)|flip_lr|value_range(-1, 1)|"
         "onehot(3, key_result='labels')|keep('image', 'labels')"),
      seed=0, process_index=0, process_count=1)
  seen = np.concatenate([next(it)["labels"].argmax(-1) for _ in range(7)])  # 4 epochs
  assert set(seen.tolist()) == {1, 2}
  assert np.bincount(seen, minlength=3)[1:].tolist() == [12, 16]  # 3 cats, 4 dogs, x4


def test_imagefolder_missing_split_is_one_line(folder):
  with pytest.raises(ValueError, match="no folder .*test"):
    ip.get_num_examples(dict(name="imagefolder", data_dir=folder, split="test"))


def test_images_of_different_sizes_without_resize_say_what_to_do(folder):
  it = ip.make_train_iterator(dict(
      data=dict(name="imagefolder", data_dir=folder, split="train"), batch_size=7,
      pp="decode|keep('image', 'label')"), seed=0, process_index=0, process_count=1)
  with pytest.raises(ValueError, match=r"different shapes.*resize"):
    next(it)


# --- Split slices ("train[:90%]") and 32-bit TIFFs -----------------------------------------------

_COUNTS = {"c0": 12, "c1": 9, "c2": 7, "c3": 5}  # 33 training files, sorted by class on disk


@pytest.fixture(scope="module")
def classes_folder(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("sliced"))
  for cls, count in _COUNTS.items():
    for i in range(count):
      _save(f"{root}/train/{cls}/{i:02d}.png", Image.fromarray(np.full((4, 4, 3), i, np.uint8)),
            "PNG")
  _save(f"{root}/val/c4/x.png", Image.fromarray(np.zeros((4, 4, 3), np.uint8)), "PNG")
  return root


def _read(root, split):
  """{file name: label} of an imagefolder split, read through the eval pipeline."""
  data = dict(name="imagefolder", data_dir=root, split=split)
  out = {}
  for b in ip.make_eval_iterator(data, "decode|keep('label', 'file_name')", 8, process_index=0,
                                 process_count=1):
    for name, label, real in zip(b["file_name"], b["label"], b["_mask"]):
      if real:
        assert name.decode() not in out
        out[name.decode()] = int(label)
  assert len(out) == ip.get_num_examples(data)
  return out


def test_split_slices_are_disjoint_cover_and_hold_every_class(classes_folder):
  everything = _read(classes_folder, "train")
  assert len(everything) == 33
  head, tail = _read(classes_folder, "train[:90%]"), _read(classes_folder, "train[90%:]")
  assert (len(head), len(tail)) == (30, 3)  # tfds: round(0.9 * 33) = 30
  assert not set(head) & set(tail) and {**head, **tail} == everything
  # The first 16 files of the class-sorted list are only c0 and c1.
  half = _read(classes_folder, "train[:50%]")
  assert len(half) == 16 and set(half.values()) == {0, 1, 2, 3}
  for name, label in half.items():  # labels follow the files (c4, in val only, is label 4)
    assert name.split("/")[1] == f"c{label}"
  counts = _read(classes_folder, "train[10:20]")
  assert len(counts) == 10 and set(counts) < set(everything)
  assert len(_read(classes_folder, "train[-3:]")) == 3
  joined = _read(classes_folder, "train[:10%]+val")
  assert len(joined) == 4 and joined["val/c4/x.png"] == 4


def test_split_slices_are_stable(classes_folder):
  from big_vit_lite.data import imagefolder  # pylint: disable=import-outside-toplevel
  # The fixed shuffle, pinned: the same on every machine and numpy version.
  assert imagefolder.slice_indices("t", "t", None, "5", 33).tolist() == [4, 24, 26, 29, 32]
  a = imagefolder.ImageFolderSource(classes_folder, "train[:25%]")
  b = imagefolder.ImageFolderSource(classes_folder, "train[:25%]")
  assert a.files == b.files and len(a.files) == 8  # round(8.25)


def test_split_percent_rounding_is_tfds(classes_folder):
  import types  # pylint: disable=import-outside-toplevel
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  from big_vit_lite.data import imagefolder  # pylint: disable=import-outside-toplevel
  del classes_folder
  for n in (1, 7, 10, 33, 50):
    for lo, hi in ((None, "90%"), ("90%", None), ("12.5%", "-12.5%"), ("-50%", None),
                   ("25%", "75%"), (None, "2.5%")):
      spec = f"train[{lo or ''}:{hi or ''}]"
      (abs_instr,) = tfds.core.ReadInstruction.from_spec(spec).to_absolute(
          {"train": types.SimpleNamespace(num_examples=n)})
      want = (n if abs_instr.to is None else abs_instr.to) - (abs_instr.from_ or 0)
      if want <= 0:
        with pytest.raises(ValueError, match="selects none"):
          imagefolder.slice_indices(spec, "train", lo, hi, n)
      else:
        assert len(imagefolder.slice_indices(spec, "train", lo, hi, n)) == want, (spec, n)


@pytest.mark.parametrize("split,problem", [
    ("train[:90", "cannot read"), ("train[a:b]", "bad bound 'a'"), ("train[5]", "cannot read"),
    ("train[10:50%]", "mixes a count and a percent"), ("train[:500]", "500 is outside the 33"),
    ("train[:101%]", "outside"), ("train[5:5]", "selects none of the 33"),
    ("train[50%:40%]", "selects none"), ("train+", "cannot read"),
])
def test_bad_split_slices_are_one_line(classes_folder, split, problem):
  with pytest.raises(ValueError) as e:
    ip.get_num_examples(dict(name="imagefolder", data_dir=classes_folder, split=split))
  msg = str(e.value)
  assert "\n" not in msg and repr(split) in msg and problem in msg and "train[:90%]" in msg
  with pytest.raises(ValueError, match="no folder .*test"):
    ip.get_num_examples(dict(name="imagefolder", data_dir=classes_folder, split="test[:50%]"))


def test_sliced_split_trains(classes_folder):
  head = _read(classes_folder, "train[:90%]")
  it = ip.make_train_iterator(dict(
      data=dict(name="imagefolder", data_dir=classes_folder, split="train[:90%]"), batch_size=10,
      pp="decode|flip_lr|keep('image', 'label', 'file_name')"),
      seed=0, process_index=0, process_count=1)
  assert it.num_examples == 30
  batches = [next(it) for _ in range(3)]  # one epoch
  seen = [n.decode() for b in batches for n in b["file_name"]]
  assert sorted(seen) == sorted(head)
  assert all(b["image"].shape == (10, 4, 4, 3) for b in batches)


def test_folder_named_like_a_slice_is_read_whole(tmp_path):
  _save(str(tmp_path / "a+b" / "c" / "x.png"), Image.fromarray(np.zeros((4, 4, 3), np.uint8)),
        "PNG")
  assert ip.get_num_examples(dict(name="imagefolder", data_dir=str(tmp_path), split="a+b")) == 1


def test_32bit_tiffs_are_skipped_not_clipped(tmp_path, caplog):
  ramp = np.arange(12 * 10).reshape(12, 10)
  _save(str(tmp_path / "train/a/float.tif"), Image.fromarray((ramp / 119).astype(np.float32)),
        "TIFF")
  _save(str(tmp_path / "train/a/int32.tif"), Image.fromarray((ramp * 500).astype(np.int32)),
        "TIFF")
  _save(str(tmp_path / "train/a/uint16.tif"), Image.fromarray((ramp * 500).astype(np.uint16)),
        "TIFF")
  _save(str(tmp_path / "train/a/uint8.tif"), Image.fromarray(ramp.astype(np.uint8)), "TIFF")
  for name, mode in (("float", "F"), ("int32", "I"), ("uint16", "I;16"), ("uint8", "L")):
    with Image.open(tmp_path / f"train/a/{name}.tif") as im:
      assert im.mode == mode  # what the test is about
  data = dict(name="imagefolder", data_dir=str(tmp_path), split="train")
  with caplog.at_level(logging.WARNING):
    (b,) = ip.make_eval_iterator(data, "decode(1)", 4, process_index=0, process_count=1)
  names = [n.decode() for n in b["file_name"][b["_mask"]]]
  assert names == ["train/a/uint16.tif", "train/a/uint8.tif"]  # the others were clipped at 255
  images = b["image"][b["_mask"]][..., 0]
  np.testing.assert_array_equal(images[0], (ramp * 500) >> 8)
  np.testing.assert_array_equal(images[1], ramp)
  assert "skipped 2 unreadable or unsupported" in caplog.text
  for name, mode in (("float.tif", "mode F"), ("int32.tif", "mode I")):
    line = next(l for l in caplog.text.split(";") if name in l)
    assert mode in line and "8- or 16-bit PNG/TIFF" in line


def test_a_split_of_only_unsupported_files_says_so(tmp_path):
  ramp = np.arange(12 * 10).reshape(12, 10)
  _save(str(tmp_path / "train/a/float.tif"), Image.fromarray((ramp / 119).astype(np.float32)),
        "TIFF")
  with pytest.raises(ValueError, match=r"no examples \(1 unreadable or unsupported file\(s\) "
                                       r"skipped, see the log\)"):
    ip.make_train_iterator(dict(data=dict(name="imagefolder", data_dir=str(tmp_path),
                                          split="train"), batch_size=2, pp="decode(1)"), seed=0,
                           process_index=0, process_count=1)
