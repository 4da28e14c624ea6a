"""An image folder's files by hand: which names count as images, whatever their letter case."""

import os

import numpy as np
from PIL import Image

from big_vit_lite import predict
from big_vit_lite.data import imagefolder


def _save(path, fmt):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  Image.fromarray(np.zeros((4, 5, 3), np.uint8)).save(path, fmt)


def test_upper_and_mixed_case_extensions_are_images(tmp_path):
  """Guards: extensions matched case-sensitively (`n.endswith(EXTENSIONS)`
  without `.lower()`), which silently drops every camera's `IMG_0001.JPG`
  and Windows' `.PNG` from a training set or a predict run (the run trains on
  what is left, or predict says it found nothing). Oracle: the file list by
  hand (as torchvision's and Keras' image folders, which lower-case the name
  first): the six images in any case, not the text file, not the resource
  fork."""
  root = tmp_path / "data"
  by_hand = {
      "train/cat/a.JPG": "JPEG",
      "train/cat/b.Jpeg": "JPEG",
      "train/cat/c.jpg": "JPEG",
      "train/dog/d.PNG": "PNG",
      "train/dog/e.png": "PNG",
      "train/dog/f.BMP": "BMP",
  }
  for name, fmt in by_hand.items():
    _save(f"{root}/{name}", fmt)
  (root / "train/dog/notes.TXT").write_text("not an image")
  (root / "train/dog/._d.PNG").write_bytes(b"\x00\x05\x16\x07" + bytes(60))

  source = imagefolder.ImageFolderSource(str(root), "train")
  got = [os.path.relpath(f, root) for f in source.files]
  assert got == sorted(by_hand)
  assert source.labels.tolist() == [0, 0, 0, 1, 1, 1]
  assert source.num_skipped == 0
  # predict's walk of a folder picks the same files.
  walked = predict.image_files([str(root / "train")])
  assert [os.path.relpath(f, root) for f in walked] == sorted(by_hand)
