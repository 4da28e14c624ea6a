"""Time to the first batch after a resume, early vs late in an epoch (a benchmark, not a test).

  python benchmarks/resume_seek.py [--records=200000] [--data_dir=D] [--repeats=3]

Writes one dataset of `--records` small examples (an 8x8 grey PNG and an id, ~100 bytes each)
twice, as TFRecord and as ArrayRecord (`prepare --file_format=array_record` writes the same),
into D (default: a temporary folder; pass a folder to keep them between runs), then for each
format times a fresh training pipeline (make_train_iterator + set_state + first batch, the
ordinary pp `decode|value_range|keep`, batch 256, the default 10,000-record shuffle buffer)
resumed at 0% and at 95% of the epoch. Prints one JSON line of median seconds; the machine is
shared and noisy, so compare within one run. Figures: benchmarks/NOTES.md, "Resume".
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow_datasets as tfds  # noqa: E402

from big_vit_lite.data import input_pipeline as ip  # noqa: E402


class BvlResumeBench(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """train: `num_records` examples, an 8x8 PNG and the example's id."""

  VERSION = tfds.core.Version("1.0.0")
  num_records = 200_000

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(shape=(8, 8, 1)),
                "id": tfds.features.Scalar(np.int64),
            }
        ),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples()}

  def _generate_examples(self):  # pylint: disable=arguments-differ
    rng = np.random.default_rng(0)
    for i in range(self.num_records):
      yield i, {
          "image": rng.integers(0, 256, (8, 8, 1), dtype=np.uint8),
          "id": i,
      }


def prepare(data_dir, file_format, records):
  BvlResumeBench.num_records = records
  builder = BvlResumeBench(data_dir=data_dir, file_format=file_format)
  if not builder.is_prepared():
    t0 = time.time()
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(num_shards=8)
    )
    print(
        f"wrote {records} records as {file_format} in {time.time() - t0:.0f}s",
        flush=True,
    )
  return int(builder.info.splits["train"].num_examples)


def time_resume(data_dir, num_examples, fraction):
  t0 = time.perf_counter()
  it = ip.make_train_iterator(
      dict(
          data=dict(name="bvl_resume_bench", split="train", data_dir=data_dir),
          batch_size=256,
          pp="decode|value_range(-1, 1)|keep('image', 'id')",
          num_shards=1,
      ),
      seed=0,
      process_index=0,
      process_count=1,
  )
  it.set_state(
      {**it.get_state(), "examples_per_shard": int(fraction * num_examples)}
  )
  next(it)
  return time.perf_counter() - t0


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--records", type=int, default=200_000)
  parser.add_argument("--data_dir", default=None)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  root = args.data_dir or tempfile.mkdtemp(prefix="bvl_resume_")
  out = {"records": args.records}
  for file_format in ("tfrecord", "array_record"):
    data_dir = os.path.join(root, file_format)
    n = prepare(data_dir, file_format, args.records)
    time_resume(data_dir, n, 0.0)  # warm-up: source, tf function tracing
    for fraction in (0.0, 0.95):
      runs = [time_resume(data_dir, n, fraction) for _ in range(args.repeats)]
      out[f"{file_format}_resume_at_{int(fraction * 100)}pct_s"] = round(
          statistics.median(runs), 3
      )
  print(json.dumps(out))


if __name__ == "__main__":
  main()
