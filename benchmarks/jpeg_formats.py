"""ImageNet-style input pipeline from TFRecord vs ArrayRecord (a benchmark, not a test).

  python benchmarks/jpeg_formats.py [--images=1024] [--batch=64] [--steps=40] [--repeats=3]

Writes ImageNet-like JPEGs (benchmarks/input_pipeline.py's, 500x375, ~37 KB) into one tfds
dataset prepared twice, as TFRecord and as ArrayRecord, then times img/s of the training
pipeline (make_train_iterator; pp decode_jpeg_and_inception_crop(224)|flip_lr|value_range;
the TFRecord copy with a 1,000-record shuffle buffer, the ArrayRecord copy with its whole-shard
permutation), the two interleaved `--repeats` times. Prints one JSON line with the medians and
img/s per CPU core (tf.data uses every core of the process's machine). The machine is shared:
compare within one run. Figures: benchmarks/NOTES.md, "Input throughput by file format".
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow_datasets as tfds  # noqa: E402

from big_vit_lite.data import input_pipeline as ip  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import input_pipeline as folder_bench  # noqa: E402  (benchmarks/input_pipeline.py)

PP = "decode_jpeg_and_inception_crop(224)|flip_lr|value_range(-1, 1)|keep('image', 'label')"


class BvlJpegBench(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """train: the JPEG files of an image folder, stored as they are (no re-encoding)."""

  VERSION = tfds.core.Version("1.0.0")
  folder = None

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(encoding_format="jpeg"),
                "label": tfds.features.ClassLabel(num_classes=10),
            }
        ),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):  # pylint: disable=arguments-differ
    for cls in range(10):
      cdir = os.path.join(self.folder, "train", f"class_{cls}")
      for name in sorted(os.listdir(cdir)):
        yield f"{cls}/{name}", {"image": os.path.join(cdir, name), "label": cls}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--images", type=int, default=1024)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  cores = len(os.sched_getaffinity(0))
  result = {"cores": cores, "batch": args.batch}
  with tempfile.TemporaryDirectory() as root:
    result["jpeg_kb"] = round(
        folder_bench.write_jpegs(os.path.join(root, "folder"), args.images)
        / 1024,
        1,
    )
    BvlJpegBench.folder = os.path.join(root, "folder")
    iters = {}
    for file_format, buf in (("tfrecord", 1000), ("array_record", 1000)):
      data_dir = os.path.join(root, file_format)
      BvlJpegBench(
          data_dir=data_dir, file_format=file_format
      ).download_and_prepare(
          download_config=tfds.download.DownloadConfig(num_shards=4)
      )
      iters[file_format] = ip.make_train_iterator(
          dict(
              data=dict(
                  name="bvl_jpeg_bench", split="train", data_dir=data_dir
              ),
              batch_size=args.batch,
              pp=PP,
              shuffle_buffer_size=buf,
          ),
          seed=0,
          process_index=0,
          process_count=1,
      )
    runs = {k: [] for k in iters}
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
      for k, it in iters.items():
        runs[k].append(folder_bench.time_iterator(it, args.batch, args.steps))
    for k, v in runs.items():
      result[f"{k}_img_per_s"] = round(statistics.median(v), 1)
      result[f"{k}_min_max"] = [round(min(v), 1), round(max(v), 1)]
      result[f"{k}_img_per_s_per_core"] = round(statistics.median(v) / cores, 1)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
