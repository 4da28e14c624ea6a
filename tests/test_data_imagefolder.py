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
