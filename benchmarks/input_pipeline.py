"""Input pipeline throughput (a benchmark, not a test).

  python benchmarks/input_pipeline.py [--images=1024] [--batch=64] [--steps=40] [--repeats=3]
                                      [--prepare]

Writes ImageNet-like JPEGs (500x375, ~35-40 KB, smooth content plus noise)
as an image folder, then times img/s of the ImageNet-style training pp
(decode + inception crop 224 + flip + normalise) through
`input_pipeline.make_train_iterator` -- once with separate decode and crop
ops, once with the fused decode_jpeg_and_inception_crop op -- and a bare
tf.data pipeline doing the same work side by side (the machine is noisy:
compare within one run). With --prepare it also times preparing the three
offline datasets into a fresh temporary data dir. Prints one JSON line.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from big_vit_lite.data import input_pipeline as ip  # noqa: E402


def write_jpegs(root, n, seed=0):
  rng = np.random.default_rng(seed)
  yy, xx = np.mgrid[0:375, 0:500].astype(np.float32)
  sizes = []
  for i in range(n):
    cls = f"class_{i % 10}"
    os.makedirs(os.path.join(root, "train", cls), exist_ok=True)
    fx, fy, ph = rng.uniform(0.005, 0.05, 3)
    base = np.stack(
        [
            np.sin(xx * fx + c + ph * 100) * np.cos(yy * fy + c)
            for c in range(3)
        ],
        -1,
    )
    img = 127 + 90 * base + rng.normal(0, 12, (375, 500, 3))
    path = os.path.join(root, "train", cls, f"{i:05d}.jpg")
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
        path, "JPEG", quality=75
    )
    sizes.append(os.path.getsize(path))
  return float(np.mean(sizes))


def time_iterator(it, batch, steps, warmup=5):
  for _ in range(warmup):
    next(it)
  t0 = time.perf_counter()
  for _ in range(steps):
    next(it)
  return batch * steps / (time.perf_counter() - t0)


def bare_tf_data(root, batch):
  """The plain pipeline PERF.md quotes: files -> decode -> crop -> flip -> normalise."""
  files = tf.io.gfile.glob(os.path.join(root, "train", "*", "*.jpg"))

  def fn(path):
    img = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        tf.shape(img),
        tf.zeros([0, 0, 4]),
        area_range=(0.05, 1.0),
        aspect_ratio_range=(3 / 4, 4 / 3),
        use_image_if_no_bounding_boxes=True,
    )
    img = tf.image.resize(tf.slice(img, begin, size), (224, 224))
    img = tf.image.random_flip_left_right(img)
    return img / 127.5 - 1

  ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files)).repeat()
  ds = (
      ds.map(fn, num_parallel_calls=tf.data.AUTOTUNE)
      .batch(batch)
      .prefetch(tf.data.AUTOTUNE)
  )
  return iter(ds)


def prepare_times():
  out = {}
  with tempfile.TemporaryDirectory() as d:
    for name in ("fashion_mnist", "mnist10k", "animal_mnist"):
      t0 = time.perf_counter()
      subprocess.run(
          [
              sys.executable,
              "-m",
              "big_vit_lite.data.prepare",
              name,
              f"--data_dir={d}",
          ],
          check=True,
          capture_output=True,
      )
      out[name] = round(time.perf_counter() - t0, 1)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--images", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--prepare", action="store_true")
  args = parser.parse_args()
  result = {"cpus": os.cpu_count(), "batch": args.batch}
  with tempfile.TemporaryDirectory() as root:
    result["jpeg_kb"] = round(write_jpegs(root, args.images) / 1024, 1)
    data = dict(name="imagefolder", data_dir=root, split="train")
    pps = {
        "pipeline_img_per_s": (
            "decode|inception_crop(224)|flip_lr|value_range(-1, 1)|"
            "keep('image', 'label')"
        ),
        "pipeline_fused_img_per_s": (
            "decode_jpeg_and_inception_crop(224)|flip_lr|"
            "value_range(-1, 1)|keep('image', 'label')"
        ),
    }
    iters = {
        k: ip.make_train_iterator(
            dict(
                data=data, batch_size=args.batch, pp=v, shuffle_buffer_size=1000
            ),
            seed=0,
            process_index=0,
            process_count=1,
        )
        for k, v in pps.items()
    }
    iters["bare_tf_data_img_per_s"] = bare_tf_data(root, args.batch)
    runs = {k: [] for k in iters}
    for _ in range(args.repeats):  # interleaved, so drift hits all alike
      for k, it in iters.items():
        runs[k].append(time_iterator(it, args.batch, args.steps))
    for k, v in runs.items():
      result[k] = round(statistics.median(v), 1)
      result[k.replace("img_per_s", "min_max")] = [
          round(min(v), 1),
          round(max(v), 1),
      ]
    # Ratios within each repeat (side by side) are steadier than the raw
    # figures.
    bare = runs["bare_tf_data_img_per_s"]
    for k in pps:
      result[k.replace("img_per_s", "vs_bare")] = round(
          statistics.median(a / b for a, b in zip(runs[k], bare)), 2
      )
  if args.prepare:
    result["prepare_s"] = prepare_times()
  print(json.dumps(result))


if __name__ == "__main__":
  main()
