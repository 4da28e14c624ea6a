"""A folder of images as a dataset: ROOT/SPLIT/CLASS/*.{jpg,jpeg,png,...}.

Images in sub-folders of a class folder belong to that class (as in
torchvision's ImageFolder); images directly in ROOT/SPLIT are ignored with
a warning.

Config: data=dict(name="imagefolder", data_dir=ROOT, split="train").
Labels are the index of CLASS in the sorted union of class folders over all
splits of ROOT (so train and val agree even if a split lacks a class).

Splits can be sliced as in tfds: "train[:90%]", "train[90%:]", "train[:500]",
"train[10:20]", "train[-10%:]", and parts joined with "+" ("train[:10%]+val").
Percent bounds are rounded as tfds does (rounding='closest': Python's round
of pct * n / 100). Slices index a fixed shuffle of the split's files (sorted
by class, then path), not the sorted list itself, so every slice holds the
classes in about their proportions: the order is the argsort of the first n
raw draws of numpy's PCG64 bit generator seeded with SPLIT_SEED (raw draws,
unlike Generator.permutation, are guaranteed the same in every numpy
version). So "train[:90%]" and "train[90%:]" are disjoint, together hold every
file, and are the same on every run and machine while the folder holds the
same files. A slice counts files before the check below: unreadable files in
it are skipped, so "train[:500]" may give fewer than 500 examples. A split
that names an existing folder (even "a+b") is that whole folder. A count and
a percent in one slice are refused (tfds reads "train[10:50%]" as percents).

Bad files must not stop a run. When the source is built, every file gets a
cheap check (header parsed by Pillow, and for JPEG/PNG the end-of-image
marker present, which catches truncated files) in a thread pool; files that
fail are skipped and counted in the log. Grey, CMYK, RGBA, palette, 16-bit
and odd-sized images decode with tf (the pp `decode` op converts channels);
the few formats tf cannot decode (e.g. TIFF) are converted once to PNG files
in a temporary folder (removed at exit). 16-bit TIFFs keep their top 8 bits
(as tf reads 16-bit PNGs). 32-bit integer and float TIFFs (Pillow modes "I"
and "F") are skipped like unreadable files, with the reason in the log:
Pillow's 8-bit conversion (torchvision's default loader) would clip them
silently, and no one rule fits them all (a float image may hold [0, 1] or
[0, 255]; an int32 one 8-, 12-, 16-bit or other values): save them as 8- or
16-bit PNG/TIFF.
"""
import atexit
import concurrent.futures
import logging
import os
import re
import shutil
import tempfile

import numpy as np
import tensorflow as tf
from PIL import Image

from big_vit_lite.data import image_check

EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff")
_TF_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "WEBP")  # tf.io.decode_image reads these

log = logging.getLogger(__name__)

SPLIT_SEED = 20250101  # seeds the fixed file order that split slices index

_SPLIT_FORM = ("use SPLIT or SPLIT[A:B], A and B each empty, a count or a percent "
               "(e.g. train[:90%], train[90%:], train[10:20]), several joined with +")


def check_file(path):
  """-> (status, reason), status "ok" | "convert" (tf cannot decode it) | "bad".

  Cheap: header + end marker, not a full decode.
  """
  try:
    with open(path, "rb") as f:
      fmt, size = image_check.header(f)
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - image_check.TAIL_BYTES))
      tail = f.read()
    if min(size) < 1:
      return "bad", f"empty image {size}"
    problem = image_check.tail_problem(fmt, tail)
    if problem:
      return "bad", problem
    return ("ok" if fmt in _TF_FORMATS else "convert"), ""
  except Exception as e:  # pylint: disable=broad-except
    return "bad", f"{type(e).__name__}: {e}"


def _split_error(split, problem):
  return ValueError(f"imagefolder split {split!r}: {problem}; {_SPLIT_FORM}")


def parse_split(split):
  """'train[:90%]+val' -> [("train", None, "90%"), ("val", None, None)]: (name, lo, hi)."""
  parts = []
  for part in split.split("+"):
    m = re.fullmatch(r"\s*([^\[\]:]+?)\s*(?:\[([^\[\]:]*):([^\[\]:]*)\])?\s*", part)
    if not m:
      raise _split_error(split, f"cannot read {part.strip()!r}")
    name, lo, hi = m.groups()
    for bound in (lo, hi):
      if bound and not re.fullmatch(r"-?\d+(\.\d+)?%|-?\d+", bound):
        raise _split_error(split, f"bad bound {bound!r}")
    if lo and hi and lo.endswith("%") != hi.endswith("%"):
      raise _split_error(split, "it mixes a count and a percent")
    parts.append((name, lo or None, hi or None))
  return parts


def slice_indices(split, name, lo, hi, n):
  """Sorted indices into the n sorted files of split folder `name` that [lo:hi] selects."""
  if lo is None and hi is None:
    return np.arange(n)
  def index(bound):
    if bound.endswith("%"):
      pct = float(bound[:-1])
      if abs(pct) > 100:
        raise _split_error(split, f"percent {bound} is outside [-100%, 100%]")
      i = int(round(pct * n / 100))  # tfds' rounding='closest'
    else:
      i = int(bound)
      if abs(i) > n:
        raise _split_error(split, f"{bound} is outside the {n} files of {name}")
    return i + n if i < 0 else i
  start = 0 if lo is None else index(lo)
  end = n if hi is None else index(hi)
  if start >= end:
    raise _split_error(split, f"[{lo or ''}:{hi or ''}] selects none of the {n} files of {name}")
  order = np.argsort(np.random.PCG64(SPLIT_SEED).random_raw(n), kind="stable")
  return np.sort(order[start:end])


def _convert_to_png(path, out_dir, index):
  out = os.path.join(out_dir, f"{index}.png")
  with Image.open(path) as im:
    if im.mode in ("I", "F"):
      kind = "float" if im.mode == "F" else "integer"
      raise ValueError(f"32-bit {kind} image (Pillow mode {im.mode}) has no one 8-bit reading: "
                       f"save it as an 8- or 16-bit PNG/TIFF")
    if im.mode.startswith("I;16"):
      # Pillow's convert("RGB") clips 16-bit values at 255 (a white image):
      # scale to 8 bits as tf does for 16-bit PNGs.
      im = Image.fromarray((np.asarray(im).astype(np.uint16) >> 8).astype(np.uint8))
    im.convert("RGB").save(out, "PNG")
  return out


_CONVERTED_DIRS = []


@atexit.register
def _remove_converted():
  for d in _CONVERTED_DIRS:
    shutil.rmtree(d, ignore_errors=True)


class ImageFolderSource:
  """Split SPLIT of ROOT: the same interface as sources.TfdsSource."""

  def __init__(self, root, split, num_threads=16):
    if not root:
      raise ValueError("imagefolder needs data_dir=ROOT (images in ROOT/SPLIT/CLASS/*.jpg)")
    root = os.path.expanduser(root)
    split_dir = os.path.join(root, split)
    self.name = f"imagefolder {split_dir}"
    parts = [(split, None, None)] if os.path.isdir(split_dir) else parse_split(split)
    for name, _, _ in parts:
      if not os.path.isdir(os.path.join(root, name)):
        found = sorted(self._subdirs(root)) if os.path.isdir(root) else "none"
        raise ValueError(f"imagefolder: no folder {os.path.join(root, name)} (expected "
                         f"ROOT/SPLIT/CLASS/*.jpg); splits in {root}: {found}")
    self.class_names = sorted({c for s in self._subdirs(root)
                               for c in self._subdirs(os.path.join(root, s))})
    files, labels = [], []
    for name, lo, hi in parts:
      part_files, part_labels = self._split_files(os.path.join(root, name))
      for i in slice_indices(split, name, lo, hi, len(part_files)):
        files.append(part_files[i])
        labels.append(part_labels[i])
    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
      checks = list(pool.map(check_file, files))
    # The few files tf cannot decode (e.g. TIFF) are converted once to PNGs in
    # a temporary folder, so the pipeline reads every image the same way.
    convert_dir = None
    paths = list(files)
    for i, (status, _) in enumerate(checks):
      if status == "convert":
        if convert_dir is None:
          convert_dir = tempfile.mkdtemp(prefix="bvl_imagefolder_")
          _CONVERTED_DIRS.append(convert_dir)
        try:
          paths[i] = _convert_to_png(files[i], convert_dir, i)
        except Exception as e:  # pylint: disable=broad-except
          checks[i] = ("bad", f"{type(e).__name__}: {e}")
    self.skipped = [(f, why) for f, (status, why) in zip(files, checks) if status == "bad"]
    keep = [i for i, (status, _) in enumerate(checks) if status != "bad"]
    self.files = [files[i] for i in keep]
    self._paths = [paths[i] for i in keep]
    self.labels = np.asarray([labels[i] for i in keep], np.int64)
    self.num_examples = len(self.files)
    self.num_skipped = len(self.skipped)
    log.info("imagefolder %s: %d images, %d classes", split_dir, self.num_examples,
             len(self.class_names))
    if self.skipped:
      log.warning("imagefolder %s: skipped %d unreadable or unsupported file(s), e.g. %s",
                  split_dir, self.num_skipped, "; ".join(f"{f} ({why})" for f, why in self.skipped[:3]))
    self._root = root

  def _split_files(self, split_dir):
    """(files, labels) of a split folder, sorted by class, then path."""
    files, labels = [], []
    for label, cls in enumerate(self.class_names):
      names = self._images_under(os.path.join(split_dir, cls))
      files += names
      labels += [label] * len(names)
    loose = [n for n in os.listdir(split_dir) if n.lower().endswith(EXTENSIONS)
             and os.path.isfile(os.path.join(split_dir, n))]
    if loose:
      log.warning("imagefolder %s: ignored %d image(s) outside class folders (e.g. %s): "
                  "put them in %s/CLASS/", split_dir, len(loose), loose[0], split_dir)
    return files, labels

  @staticmethod
  def _images_under(cdir):
    """Image files in a class folder and its sub-folders (as torchvision's ImageFolder)."""
    out = []
    for top, dirs, names in os.walk(cdir, followlinks=True):
      dirs[:] = [d for d in dirs if not d.startswith(".")]
      out += [os.path.join(top, n) for n in names if n.lower().endswith(EXTENSIONS)]
    return sorted(out)

  @staticmethod
  def _subdirs(path):
    return [d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))
            and not d.startswith(".")]

  def raw(self, start, end, order_seed=None):
    """Indices of images [start, end); a full permutation when order_seed is given."""
    ds = tf.data.Dataset.range(start, end)
    if order_seed is not None and end - start > 1:
      ds = ds.shuffle(end - start, seed=order_seed)
    return ds

  def decode(self, index):
    # numpy -> constants in whichever tf.data function traces this.
    # UTF-8 by hand: numpy's astype(bytes) is ASCII-only ("café.jpg" would crash).
    as_bytes = lambda xs: np.asarray([x.encode("utf-8") for x in xs] or [b""],  # noqa: E731
                                     dtype=object)
    names = [os.path.relpath(f, self._root) for f in self.files]
    labels = self.labels if len(self.labels) else np.zeros([1], np.int64)
    return {"image": tf.io.read_file(tf.gather(tf.constant(as_bytes(self._paths)), index)),
            "label": tf.gather(tf.constant(labels), index),
            "file_name": tf.gather(tf.constant(as_bytes(names)), index)}
