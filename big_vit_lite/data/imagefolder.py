"""A folder of images as a dataset: ROOT/SPLIT/CLASS/*.{jpg,png,...} (EXTENSIONS).

Images in sub-folders of a class folder belong to that class (as in
torchvision's ImageFolder); images directly in ROOT/SPLIT are ignored with
a warning. Hidden files and folders (".x", macOS's "._x.jpg") and "__MACOSX"
folders are not read: they are not images of the dataset, nor classes.

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
cheap check (header parsed by Pillow, and the file complete: JPEG/PNG end
markers, GIF trailer, BMP size, PNG chunk CRCs; see image_check) in a
thread pool; files that fail are skipped and counted in the log. Grey,
CMYK, RGBA, palette, 16-bit and odd-sized images decode with tf (the pp
`decode` op converts channels); the files tf cannot decode right (TIFF,
palette/1-bit/16-bit/RLE BMPs, transparent or animated WebP) are converted
once to PNG files in a temporary folder (removed at exit). 16-bit TIFFs
keep their top 8 bits (as tf reads 16-bit PNGs). 32-bit integer and float
TIFFs (Pillow modes "I" and "F") are skipped like unreadable files, with the
reason in the log: Pillow's 8-bit conversion (torchvision's default loader)
would clip them silently, and no one rule fits them all (a float image may
hold [0, 1] or [0, 255]; an int32 one 8-, 12-, 16-bit or other values):
save them as 8- or 16-bit PNG/TIFF.
"""
import atexit
import concurrent.futures
import logging
import os
import re
import shutil
import tempfile
import unicodedata

import numpy as np
import tensorflow as tf
from PIL import Image

from big_vit_lite.data import image_check

EXTENSIONS = (".jpg", ".jpeg", ".jfif", ".jpe", ".png", ".gif", ".bmp", ".webp", ".tif",
              ".tiff", ".ppm", ".pgm", ".pbm", ".pnm", ".avif")
# Image formats not read here: files with these are counted and said in the log, not
# dropped without a word.
OTHER_IMAGE_EXTENSIONS = (".heic", ".heif", ".jxl", ".jp2", ".j2k", ".psd", ".ico", ".tga",
                          ".pcx", ".dds", ".svg", ".exr", ".hdr", ".dng", ".cr2", ".nef",
                          ".raw", ".xpm", ".qoi")

log = logging.getLogger(__name__)

SPLIT_SEED = 20250101  # seeds the fixed file order that split slices index

_SPLIT_FORM = ("use SPLIT or SPLIT[A:B], A and B each empty, a count or a percent "
               "(e.g. train[:90%], train[90%:], train[10:20]), several joined with +")


def check_file(path):
  """-> (status, reason), status "ok" | "convert" (tf cannot decode it right) | "bad".

  Cheap: header + end marker, not a full decode (see image_check).
  """
  try:
    with open(path, "rb") as f:
      return image_check.check(f)
  except OSError as e:  # a broken link, a file without read permission
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


def _try_convert(path, out_dir, index):
  """Converts an image to out_dir/index.png -> (PNG path, None), or (None, why it cannot)."""
  out = os.path.join(out_dir, f"{index}.png")
  try:
    with Image.open(path) as im:
      # Pillow reads 16-bit PGM/PPM into 32-bit mode "I", from 16-bit rows ("I;16B").
      rows = im.tile[0].args if im.tile else ""
      rows = str(rows if isinstance(rows, str) else (rows or [""])[0])
      sixteen = im.mode.startswith("I;16") or (im.mode == "I" and rows.startswith("I;16"))
      if im.mode in ("I", "F") and not sixteen:
        kind = "float" if im.mode == "F" else "integer"
        raise ValueError(f"32-bit {kind} image (Pillow mode {im.mode}) has no one 8-bit "
                         f"reading: save it as an 8- or 16-bit PNG/TIFF")
      if sixteen:
        # Pillow's convert("RGB") clips 16-bit values at 255 (a white image):
        # scale to 8 bits as tf does for 16-bit PNGs.
        im = Image.fromarray((np.asarray(im).astype(np.uint16) >> 8).astype(np.uint8))
      im.convert("RGB").save(out, "PNG")
    return out, None
  except Exception as e:  # pylint: disable=broad-except
    return None, f"{type(e).__name__}: {e}"


def _nfc(name):
  return unicodedata.normalize("NFC", name)


def _hidden(name):
  """Hidden files and folders, and what macOS leaves in copies and zips ("._x.jpg" resource
  forks, "__MACOSX/"): not images of the dataset, and not a class."""
  return name.startswith(".") or name == "__MACOSX"


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
        raise ValueError(f"imagefolder: no folder {os.path.join(root, name)} (expected "
                         f"ROOT/SPLIT/CLASS/*.jpg); {self._root_hint(root)}")
    # Folder names that differ only in Unicode normalisation are one class: macOS writes
    # "café" decomposed (NFD), so a split copied from a Mac gave that class a second label.
    # Each class is named and placed by its first spelling in sort order, as before.
    spellings = {}
    for s in self._subdirs(root):
      for c in self._subdirs(os.path.join(root, s)):
        spellings.setdefault(_nfc(c), set()).add(c)
    self.class_names = sorted(min(v) for v in spellings.values())
    self._labels = {_nfc(c): i for i, c in enumerate(self.class_names)}
    names = self.class_names
    by_number = sorted(names, key=int) if all(c.isdecimal() for c in names) else names
    if names != by_number:
      odd = next(a for a, b in zip(names, by_number) if a != b)
      log.warning("imagefolder %s: the class folders are numbers, but labels are their places "
                  "in name order (as in torchvision): folder %r is label %d; name them with "
                  "leading zeros (%s for 1) to make each label its number", root, odd,
                  names.index(odd), "1".zfill(max(len(c) for c in names)))
    files = []  # (file, label)
    for name, lo, hi in parts:
      part = self._split_files(os.path.join(root, name))
      files += [part[i] for i in slice_indices(split, name, lo, hi, len(part))]
    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
      checks = list(pool.map(check_file, [f for f, _ in files]))
      # The files tf cannot decode right (e.g. TIFF) are converted once to PNGs
      # in a temporary folder (in the pool too: a folder may hold thousands),
      # so the pipeline reads every image the same way.
      paths = [f for f, _ in files]
      todo = [i for i, (status, _) in enumerate(checks) if status == "convert"]
      if todo:
        out_dir = tempfile.mkdtemp(prefix="bvl_imagefolder_")
        _CONVERTED_DIRS.append(out_dir)
        for i, (path, error) in zip(todo, pool.map(
            lambda i: _try_convert(paths[i], out_dir, i), todo)):
          paths[i] = path
          if error:
            checks[i] = ("bad", error)
    self.skipped = [(f, why) for (f, _), (status, why) in zip(files, checks) if status == "bad"]
    keep = [i for i, (status, _) in enumerate(checks) if status != "bad"]
    self.files = [files[i][0] for i in keep]
    self._paths = [paths[i] for i in keep]
    self.labels = np.asarray([files[i][1] for i in keep], np.int64)
    self.num_examples, self.num_skipped = len(self.files), len(self.skipped)
    log.info("imagefolder %s: %d images, %d classes", split_dir, self.num_examples,
             len(self.class_names))
    if self.skipped:
      log.warning("imagefolder %s: skipped %d unreadable or unsupported file(s), e.g. %s",
                  split_dir, self.num_skipped,
                  "; ".join(f"{f} ({why})" for f, why in self.skipped[:3]))
    self._root = root

  def _root_hint(self, root):
    """What ROOT holds, for the error on a missing split: its splits, or that it is a split."""
    if not os.path.isdir(root):
      return f"splits in {root}: none"
    found = sorted(self._subdirs(root))
    for d in found[:8]:
      try:
        names = os.listdir(os.path.join(root, d))
      except OSError:  # (no permission: say what can be said)
        continue
      if any(n.lower().endswith(EXTENSIONS) for n in names):
        return (f"{root} holds class folders ({d!r} has images): it is a split folder itself; "
                f"set data_dir={os.path.dirname(root.rstrip(os.sep))} and "
                f"split={os.path.basename(root.rstrip(os.sep))!r}")
    more = f", ... ({len(found)} in all)" if len(found) > 8 else ""
    return f"splits in {root}: {found[:8]}{more}"

  def _split_files(self, split_dir):
    """[(file, label)] of a split folder, sorted by class, then path."""
    files, others = [], []
    for d in sorted(self._subdirs(split_dir), key=lambda d: (self._labels[_nfc(d)], d)):
      files += [(f, self._labels[_nfc(d)])
                for f in self._images_under(os.path.join(split_dir, d), others)]
    if others:
      log.warning("imagefolder %s: ignored %d file(s) in image formats not read here (e.g. "
                  "%s): convert them to PNG or JPEG", split_dir, len(others), others[0])
    loose = [n for n in os.listdir(split_dir) if n.lower().endswith(EXTENSIONS)
             and os.path.isfile(os.path.join(split_dir, n))]
    if loose:
      log.warning("imagefolder %s: ignored %d image(s) outside class folders (e.g. %s): "
                  "put them in %s/CLASS/", split_dir, len(loose), loose[0], split_dir)
    return files

  @staticmethod
  def _images_under(cdir, others):
    """Image files in a class folder and its sub-folders (as torchvision's ImageFolder);
    files of OTHER_IMAGE_EXTENSIONS are appended to `others`.

    Links to folders are followed, except into a folder the path is already
    in: such a cycle repeated its images some 40 times, until the path got
    too deep to resolve.
    """
    out, above = [], {}  # folder -> ids of it and the folders above it in the walk
    for top, dirs, names in os.walk(cdir, followlinks=True):
      st = os.stat(top)
      path_ids = above.get(os.path.dirname(top), frozenset())
      if (st.st_dev, st.st_ino) in path_ids:
        dirs[:] = []
        continue
      above[top] = path_ids | {(st.st_dev, st.st_ino)}
      dirs[:] = [d for d in dirs if not _hidden(d)]
      names = [n for n in names if not _hidden(n)]
      out += [os.path.join(top, n) for n in names if n.lower().endswith(EXTENSIONS)]
      others += [os.path.join(top, n) for n in names
                 if n.lower().endswith(OTHER_IMAGE_EXTENSIONS)]
    return sorted(out)

  @staticmethod
  def _subdirs(path):
    return [d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d))
            and not _hidden(d)]

  def raw(self, start, end, order_seed=None):
    """Indices of images [start, end); a full permutation when order_seed is given."""
    ds = tf.data.Dataset.range(start, end)
    if order_seed is not None and end - start > 1:
      ds = ds.shuffle(end - start, seed=order_seed)
    return ds

  def decode(self, index):
    # numpy -> constants in whichever tf.data function traces this.
    # The names' bytes on disk by hand: numpy's astype(bytes) is ASCII-only ("café.jpg"
    # would crash), and encode("utf-8") fails on names that are not UTF-8 (Latin-1 ones
    # from old archives, which Python holds as surrogate escapes).
    as_bytes = lambda xs: np.asarray([os.fsencode(x) for x in xs] or [b""],  # noqa: E731
                                     dtype=object)
    names = [os.path.relpath(f, self._root) for f in self.files]
    labels = self.labels if len(self.labels) else np.zeros([1], np.int64)
    return {"image": tf.io.read_file(tf.gather(tf.constant(as_bytes(self._paths)), index)),
            "label": tf.gather(tf.constant(labels), index),
            "file_name": tf.gather(tf.constant(as_bytes(names)), index)}
