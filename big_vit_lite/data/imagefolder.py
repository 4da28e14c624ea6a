"""A folder of images as a dataset: ROOT/SPLIT/CLASS/*.{jpg,png,...} (EXTENSIONS).

Images in sub-folders of a class folder belong to that class (as in
torchvision's ImageFolder, links to folders included; a link back to a folder
above it, a cycle, is not followed, and a real folder is read once); images
directly in ROOT/SPLIT are ignored. Class folder names are compared in
Unicode NFC: "café" spelt decomposed (NFD, as macOS copies make it) in one
split and composed in another is one class (named by its first spelling in
sorted order). Hidden files and folders (".x", macOS's
"._x.jpg") and "__MACOSX" folders are not read: they are not images of the
dataset, nor classes.

Config: data=dict(name="imagefolder", data_dir=ROOT, split="train").
An eval's split may be left unset (None): it is then found, the first of
EVAL_SPLITS that ROOT holds ("val", "validation", then "test"), so that
ROOT/{train,val} and ROOT/{train,test} both work with every config.
Labels are the index of CLASS in the sorted union of class folders over all
splits of ROOT (so train and val agree even if a split lacks a class).

Splits can be sliced with tfds' split syntax (tfds parses them and rounds
percents): "train[:90%]", "train[90%:]", "train[:500]", "train[10:20]",
"train[-10%:]", and parts joined with "+" ("train[:10%]+val"). Slices index
a fixed shuffle of the split's files (sorted by class, then path), not the
sorted list itself, so every slice holds the classes in about their
proportions: the order is the argsort of the first n raw draws of numpy's
PCG64 bit generator seeded with SPLIT_SEED (raw draws, unlike
Generator.permutation, are guaranteed the same in every numpy version). So
"train[:90%]" and "train[90%:]" are disjoint, together hold every file, and
are the same on every run and machine while the folder holds the same files.
A slice counts files before the check below: unreadable files in it are
skipped, so "train[:500]" may give fewer than 500 examples. A split that
names an existing folder (even "a+b") is that whole folder.

Bad files must not stop a run. When the source is built, every file gets a
cheap check (header parsed by Pillow, and the file complete; see
image_check) in a thread pool; files that fail are skipped and counted in
the log. Grey, CMYK, RGBA, palette and odd-sized images decode with tf (the
pp `decode` op converts channels); the files tf cannot decode right (TIFF,
BMP, WebP, ...) are converted once to PNG files in a temporary folder
(removed at exit); 16-bit TIFFs keep their top 8 bits (as tf reads 16-bit
PNGs); 16-bit PGMs and PPMs are scaled to 8 bits, round(v * 255 / maxval)
(as Pillow reads 16-bit PPMs). 32-bit integer and float TIFFs (Pillow modes "I" and "F") are skipped
with the reason in the log: no one 8-bit reading fits them all (a float
image may hold [0, 1] or [0, 255]); save them as 8- or 16-bit PNG/TIFF.
"""

import atexit
import concurrent.futures
import logging
import os
import shutil
import tempfile
import types
import unicodedata

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from PIL import Image

from big_vit_lite.data import image_check

EXTENSIONS = (
    ".jpg",
    ".jpeg",
    ".jfif",
    ".jpe",
    ".png",
    ".gif",
    ".bmp",
    ".webp",
    ".tif",
    ".tiff",
    ".ppm",
    ".pgm",
    ".pbm",
    ".pnm",
    ".avif",
)

log = logging.getLogger(__name__)

# An eval's split when the config names none, in this order (eval_split).
EVAL_SPLITS = ("val", "validation", "test")
SPLIT_SEED = 20250101  # seeds the fixed file order that split slices index


def check_file(path):
  """-> (status, reason), status "ok" | "convert" (tf cannot decode it right) | "bad".

  Cheap: header + end marker, not a full decode (see image_check).
  """
  try:
    with open(path, "rb") as f:
      return image_check.check(f)
  except OSError as e:  # a broken link, a file without read permission
    return "bad", f"{type(e).__name__}: {e}"


def fixed_order(n):
  """The fixed shuffle of n files that split slices index (see the module docstring)."""
  return np.argsort(np.random.PCG64(SPLIT_SEED).random_raw(n), kind="stable")


def convert_to_png(path, out_dir, index):
  """Converts an image to out_dir/index.png -> (PNG path, None), or (None, why it cannot)."""
  out = os.path.join(out_dir, f"{index}.png")
  try:
    with Image.open(path) as im:
      if im.mode.startswith("I;16"):  # the top 8 bits, as tf reads 16-bit PNGs
        im = Image.fromarray(
            (np.asarray(im).astype(np.uint16) >> 8).astype(np.uint8)
        )
      # a 16-bit PGM, which Pillow scales to 16 bits
      elif im.mode == "I" and im.format == "PPM":
        im = Image.fromarray(
            np.round(np.asarray(im) * (255 / 65535)).astype(np.uint8)
        )
      # (Pillow's 8-bit conversion would clip them silently)
      elif im.mode in ("I", "F"):
        raise ValueError(
            f"32-bit image (Pillow mode {im.mode}) has no one 8-bit reading: "
            f"save it as an 8- or 16-bit PNG/TIFF"
        )
      im.convert("RGB").save(out, "PNG")
    return out, None
  except Exception as e:  # pylint: disable=broad-except
    return None, f"{type(e).__name__}: {e}"


def eval_split(root):
  """The first of EVAL_SPLITS that ROOT holds; else a one-line ValueError naming the keys."""
  root = os.path.expanduser(root or "")
  for name in EVAL_SPLITS:
    if os.path.isdir(os.path.join(root, name)):
      return name
  if os.path.isdir(root):
    found = f"its folders: {_subdirs(root)[:8]}"
  else:
    found = "it does not exist"
  raise ValueError(
      f"imagefolder {root} has no eval split: none of "
      f"{', '.join(n + '/' for n in EVAL_SPLITS)} ({found}); add one, or name "
      "the split: evals.NAME.data.split (classification), "
      "evals.NAME.test_split (fewshot, linear_probe), split= of "
      "configs/classify.py"
  )


def class_names(root):
  """The classes of ROOT as its splits make them: the class folders of every split, those
  equal in Unicode NFC one class (module docstring), sorted."""
  return _class_labels(_class_folders(root))[0]


def _class_folders(root):
  """The names of the class folders of every split of ROOT."""
  return {c for s in _subdirs(root) for c in _subdirs(os.path.join(root, s))}


def is_hidden(name):
  """Hidden files and folders, and what macOS leaves in copies and zips ("._x.jpg" resource
  forks, "__MACOSX/"): not images of the dataset, and not a class."""
  return name.startswith(".") or name == "__MACOSX"


def _subdirs(path):
  return sorted(
      d
      for d in os.listdir(path)
      if os.path.isdir(os.path.join(path, d)) and not is_hidden(d)
  )


def _leads_back(link_target, real_top):
  """True when a folder (a link's real path) is real_top or above it: following it cycles."""
  return real_top == link_target or real_top.startswith(
      link_target.rstrip(os.sep) + os.sep
  )


def _images_under(cdir):
  """Image files in a class folder and its sub-folders (links followed, each real folder once,
  none that leads back above itself), sorted."""
  out, seen = [], set()
  for top, dirs, names in os.walk(cdir, followlinks=True):
    real_top = os.path.realpath(top)
    if real_top in seen:  # (two links to one folder)
      dirs[:] = []
      continue
    seen.add(real_top)
    cycles = [
        d
        for d in dirs
        if _leads_back(os.path.realpath(os.path.join(top, d)), real_top)
    ]
    if cycles:
      log.warning(
          "imagefolder: not following %s: it leads back to a folder above it (a cycle)",
          os.path.join(top, cycles[0]),
      )
    dirs[:] = [d for d in dirs if not is_hidden(d) and d not in cycles]
    out += [
        os.path.join(top, n)
        for n in names
        if not is_hidden(n) and n.lower().endswith(EXTENSIONS)
    ]
  return sorted(out)


def _class_labels(folder_names):
  """(class names, {folder name: label}): spellings equal in Unicode NFC are one class, named
  by its first spelling in sorted order."""
  first = {}
  for name in sorted(folder_names):
    first.setdefault(unicodedata.normalize("NFC", name), name)
  class_names = sorted(first.values())
  index = {name: i for i, name in enumerate(class_names)}
  labels = {
      name: index[first[unicodedata.normalize("NFC", name)]]
      for name in folder_names
  }
  return class_names, labels


_CONVERTED_DIRS = []


@atexit.register
def _remove_converted():
  for d in _CONVERTED_DIRS:
    shutil.rmtree(d, ignore_errors=True)


class ImageFolderSource:
  """Split SPLIT of ROOT: the same interface as sources.TfdsSource."""

  def __init__(self, root, split):
    if not root:
      raise ValueError(
          "imagefolder needs data_dir=ROOT (images in ROOT/SPLIT/CLASS/*.jpg)"
      )
    root = os.path.expanduser(root)
    split_dir = os.path.join(root, split)
    self.name = f"imagefolder {split_dir}"
    whole = os.path.isdir(split_dir)
    names = (
        [split]
        if whole
        else sorted({p.split("[")[0].strip() for p in split.split("+")} - {""})
    )
    for name in names:
      if not os.path.isdir(os.path.join(root, name)):
        found = _subdirs(root) if os.path.isdir(root) else []
        raise ValueError(
            f"imagefolder: no folder {os.path.join(root, name)} (expected "
            f"ROOT/SPLIT/CLASS/*.jpg); splits in {root}: {found[:8]}"
        )
    self.class_names, labels = _class_labels(_class_folders(root))
    # [(file, label)] of each split folder, sorted by class, then path
    per_split = {}
    for name in names:
      cdirs = _subdirs(os.path.join(root, name))
      per_split[name] = [
          (f, labels[c])
          for c in cdirs
          for f in _images_under(os.path.join(root, name, c))
      ]
    files = per_split[split] if whole else self._slices(split, per_split)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
      checks = list(pool.map(check_file, [f for f, _ in files]))
      # The files tf cannot decode right (e.g. TIFF) are converted once to PNGs
      # in a temporary folder (in the pool too: a folder may hold thousands),
      # so the pipeline reads every image the same way.
      paths = [f for f, _ in files]
      todo = [i for i, (status, _) in enumerate(checks) if status == "convert"]
      if todo:
        out_dir = tempfile.mkdtemp(prefix="bvl_imagefolder_")
        _CONVERTED_DIRS.append(out_dir)
        for i, (path, error) in zip(
            todo, pool.map(lambda i: convert_to_png(paths[i], out_dir, i), todo)
        ):
          paths[i] = path
          if error:
            checks[i] = ("bad", error)
    self.skipped = [
        (f, why)
        for (f, _), (status, why) in zip(files, checks)
        if status == "bad"
    ]
    keep = [i for i, (status, _) in enumerate(checks) if status != "bad"]
    self.files = [files[i][0] for i in keep]
    self._paths = [paths[i] for i in keep]
    self.labels = np.asarray([files[i][1] for i in keep], np.int64)
    self.num_examples, self.num_skipped = len(self.files), len(self.skipped)
    log.info(
        "imagefolder %s: %d images, %d classes",
        split_dir,
        self.num_examples,
        len(self.class_names),
    )
    if self.skipped:
      log.warning(
          "imagefolder %s: skipped %d unreadable or unsupported file(s), e.g. %s",
          split_dir,
          self.num_skipped,
          "; ".join(f"{f} ({why})" for f, why in self.skipped[:3]),
      )
    self._root = root

  @staticmethod
  def _slices(split, per_split):
    """The files a split with tfds slices ("train[:90%]+val") selects, each slice indexing
    the fixed shuffle of its split folder's files."""
    try:
      lengths = {
          k: types.SimpleNamespace(num_examples=len(v))
          for k, v in per_split.items()
      }
      instructions = tfds.core.ReadInstruction.from_spec(split).to_absolute(
          lengths
      )
    except (ValueError, AssertionError) as e:
      raise ValueError(
          f"imagefolder split {split!r}: {' '.join(str(e).split())}"
      ) from None
    files = []
    for ins in instructions:
      part = per_split[ins.splitname]
      chosen = np.sort(fixed_order(len(part))[ins.from_ : ins.to])
      if not len(chosen):
        raise ValueError(
            f"imagefolder split {split!r} selects none of the {len(part)} files "
            f"of {ins.splitname}"
        )
      files += [part[i] for i in chosen]
    return files

  def raw(self, start, end, order_seed=None):
    """Indices of images [start, end); a full permutation when order_seed is given."""
    ds = tf.data.Dataset.range(start, end)
    if order_seed is not None and end - start > 1:
      ds = ds.shuffle(end - start, seed=order_seed)
    return ds

  def decode(self, index):
    # numpy -> constants in whichever tf.data function traces this. os.fsencode:
    # the names' bytes on disk (also names that are not UTF-8, held by Python as
    # surrogate escapes).
    as_bytes = lambda xs: np.asarray(
        [os.fsencode(x) for x in xs] or [b""], dtype=object  # noqa: E731
    )
    names = [os.path.relpath(f, self._root) for f in self.files]
    labels = self.labels if len(self.labels) else np.zeros([1], np.int64)
    return {
        "image": tf.io.read_file(
            tf.gather(tf.constant(as_bytes(self._paths)), index)
        ),
        "label": tf.gather(tf.constant(labels), index),
        "file_name": tf.gather(tf.constant(as_bytes(names)), index),
    }
