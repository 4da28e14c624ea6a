r"""Top-k labels and probabilities for image files (timm's inference.py).

  python -m big_vit_lite.predict --model=CKPT --images=DIR_OR_FILES [--top_k=5] \
      [--format=jsonl|csv] [--out=FILE] [--labels=FILE] [--params=ema]

CKPT as for evaluate: a training workdir (its newest checkpoint), a step
directory, an .npz or one of our timm .safetensors; the model runs at the
resolution and channel count it was trained with (the images are decoded to
those channels, resized and scaled to [-1, 1]; --pp replaces that). Images:
folders (read recursively) and/or files, comma-separated or as further
arguments. One output row per image: JSON lines
{"file", "predictions": [{"class", "label", "prob"}, ...]} or CSV rows
file,rank,class,label,prob; to --out or stdout. Class names come from
--labels (one per line) or the dataset the run was trained on (tfds info or
the image folder's class folders), else the class numbers. Batches are
sharded over all devices. A file that is no readable image is skipped with
a one-line reason on stderr and counted; exit status 1 if none was read.
"""

import csv
import json
import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from big_vit_lite.trainer import checkpoint
from big_vit_lite.config import config_loading
from big_vit_lite.logs import console
from big_vit_lite.models import loading
from big_vit_lite.runtime import sharding
from big_vit_lite.data import imagefolder
from big_vit_lite.evaluators import features


def _define_flags():
  flags.DEFINE_string(
      "model", None, "Checkpoint: workdir, step dir, .npz or .safetensors."
  )
  flags.DEFINE_list(
      "images", None, "Image files and/or folders (read recursively)."
  )
  flags.DEFINE_integer("top_k", 5, "How many classes per image.")
  flags.DEFINE_enum("format", "jsonl", ["jsonl", "csv"], "Output format.")
  flags.DEFINE_string("out", None, "Output file (default: stdout).")
  flags.DEFINE_string(
      "labels", None, "Class names, one per line (default: the run's dataset)."
  )
  flags.DEFINE_enum(
      "params",
      "params",
      ["params", "ema"],
      "A training checkpoint's params or EMA.",
  )
  flags.DEFINE_integer(
      "batch_size", 64, "Images per batch (split over the devices)."
  )
  flags.DEFINE_string(
      "pp",
      None,
      "Preprocessing of one image (default: decode, resize, [-1, 1]).",
  )


def image_files(items):
  """The image files named by `items` (files as given, folders walked in sorted order)."""
  files = []
  for item in items:
    item = os.path.expanduser(item)
    if os.path.isdir(item):
      for root, dirs, names in os.walk(item):
        dirs[:] = sorted(d for d in dirs if not imagefolder.is_hidden(d))
        files += [
            os.path.join(root, n)
            for n in sorted(names)
            if not imagefolder.is_hidden(n)
            and n.lower().endswith(imagefolder.EXTENSIONS)
        ]
    elif os.path.exists(item):
      files.append(item)
    else:
      raise ValueError(f"--images: {item} does not exist.")
  return files


def class_names(labels_file, saved_config, num_classes):
  """--labels, else the training dataset's names (tfds info / folder classes), else numbers."""
  names = None
  if labels_file:
    with open(os.path.expanduser(labels_file)) as f:
      names = [line.strip() for line in f if line.strip()]
    if len(names) != num_classes:
      raise ValueError(
          f"--labels={labels_file} has {len(names)} names, but the model has "
          f"{num_classes} classes: give one name per line, one per class."
      )
    return names
  data = (
      saved_config.get("input", {}).get("data", {})
      if saved_config is not None
      else {}
  )
  try:
    if data.get("name") == "imagefolder":
      source = imagefolder.ImageFolderSource(
          data["data_dir"], data.get("split", "train")
      )
      names = source.class_names
    elif data.get("name"):
      import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

      builder = tfds.builder(
          data["name"].split(":")[0], data_dir=data.get("data_dir")
      )
      names = builder.info.features["label"].names
  except Exception as e:  # pylint: disable=broad-except
    logging.warning(
        "No class names from the run's dataset %s (%s): printing class numbers.",
        data.get("name"),
        e,
    )
  ok = names is not None and len(names) == num_classes
  return list(names) if ok else [str(i) for i in range(num_classes)]


def _read(path, preprocess, tmp_dir):
  """(image array, None) or (None, why the file is skipped)."""
  status, reason = imagefolder.check_file(path)
  if status == "bad":
    return None, reason
  # A format tf decodes wrong: through Pillow to PNG first.
  if status == "convert":
    path, reason = imagefolder.convert_to_png(path, tmp_dir, abs(hash(path)))
    if path is None:
      return None, reason
  try:
    with open(path, "rb") as f:
      data = f.read()
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    return (
        np.asarray(
            preprocess({"image": tf.constant(data)})["image"], np.float32
        ),
        None,
    )
  except Exception as e:  # pylint: disable=broad-except
    return None, checkpoint.error_reason(e)


def predict(
    model_src,
    items,
    *,
    top_k=5,
    labels_file=None,
    key="params",
    batch_size=64,
    pp=None,
    on_skip=None,
):
  """Yields (file, [(class, label, prob), ...]) per readable image; on_skip(file, reason)."""
  import tempfile  # pylint: disable=g-import-not-at-top
  from big_vit_lite.data import pp as pp_lib  # pylint: disable=g-import-not-at-top

  files = image_files(items)
  if not files:
    raise ValueError(
        f"--images={','.join(items)} holds no image files "
        f"({', '.join(imagefolder.EXTENSIONS[:5])}, ...)."
    )
  mesh = sharding.make_mesh(None)
  model = loading.load_model(
      model_src,
      key,
      config_loading.TrackedConfig(ml_collections.ConfigDict()),
      mesh,
      sharding.make_rules(None, mesh),
      default_res=224,
  )
  num_classes = model.model_cfg["num_classes"]
  if not num_classes:
    raise ValueError(
        f"{model_src} has no classification head (num_classes=0): nothing to "
        "predict; fine-tune it first (configs/transfer.py)."
    )
  names = class_names(labels_file, model.saved_config, num_classes)
  top_k = max(1, min(int(top_k), num_classes))
  preprocess = pp_lib.get_preprocess_fn(
      pp
      or f"decode(channels={model.channels})|resize({model.res})|value_range(-1, 1)"
  )

  @jax.jit
  def top(params, batch):
    logits, _ = model.predict_fn(params, batch["image"])
    return jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32)), top_k)

  pending = []  # The files of the batches on their way through map_batches.

  def batches(tmp_dir):
    good, images = [], []
    for i, path in enumerate(files):
      image, reason = _read(path, preprocess, tmp_dir)
      if image is not None:
        good.append(path)
        images.append(image)
      elif on_skip:
        on_skip(path, reason)
      if images and (len(images) == batch_size or i == len(files) - 1):
        pending.append(good)
        yield {"image": np.stack(images), "_mask": np.ones(len(images), bool)}
        good, images = [], []

  with tempfile.TemporaryDirectory(
      prefix="bvl-predict-"
  ) as tmp_dir, jax.set_mesh(mesh):
    for probs, idx in features.map_batches(
        top, model.params, batches(tmp_dir), mesh
    ):
      for i, path in enumerate(pending.pop(0)):
        yield path, [
            (int(c), names[int(c)], float(p)) for c, p in zip(idx[i], probs[i])
        ]


def main(argv):
  # Other libraries' INFO lines (orbax, tfds) only with --verbosity=1.
  console.keep_log_readable()
  f = flags.FLAGS
  items = list(f.images or []) + list(argv[1:])
  if not f.model or not items:
    raise app.UsageError("pass --model=CKPT and --images=DIR_OR_FILES.")
  skipped = []

  def on_skip(path, reason):
    skipped.append(path)
    print(f"predict: skipped {path}: {reason}", file=sys.stderr, flush=True)

  try:  # Before the model loads: a bad --out fails in a second.
    out = open(f.out, "w", newline="") if f.out else sys.stdout
  except OSError as e:
    sys.exit(f"predict: error: cannot write --out={f.out}: {e.strerror or e}")
  count = 0
  try:
    writer = csv.writer(out) if f.format == "csv" else None
    if writer:
      writer.writerow(["file", "rank", "class", "label", "prob"])
    for path, preds in predict(
        f.model,
        items,
        top_k=f.top_k,
        labels_file=f.labels,
        key=f.params,
        batch_size=f.batch_size,
        pp=f.pp,
        on_skip=on_skip,
    ):
      count += 1
      if writer:
        writer.writerows(
            [path, r + 1, c, n, f"{p:.6f}"] for r, (c, n, p) in enumerate(preds)
        )
      else:
        out.write(
            json.dumps(
                {
                    "file": path,
                    "predictions": [
                        {"class": c, "label": n, "prob": round(p, 6)}
                        for c, n, p in preds
                    ],
                }
            )
            + "\n"
        )
  except (ValueError, OSError) as e:
    sys.exit(f"predict: error: {' '.join(str(e).split())}")
  finally:
    if f.out:
      out.close()
  print(
      f"predict: {count} images predicted, {len(skipped)} skipped",
      file=sys.stderr,
  )
  if not count:
    sys.exit(1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
