"""Bag-of-pixels baseline for mnist_multilabel (a benchmark, not a test).

  python benchmarks/multilabel_baseline.py [--data_dir=D] [--train=24000]

One logistic regression per class (scikit-learn, L2, C=1/--l2, lbfgs) on the raw 56x56 pixels
scaled to [0, 1], fitted on the train split, scored on the test split with scikit-learn's own
metrics: mAP (macro average_precision_score over the 10 classes) and ReaL-style prec@1 (the
top-scoring class is one of the image's digits). The figure configs/multilabel.py must beat.
Prints one JSON line.
"""

import argparse
import json
import os
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow_datasets as tfds  # noqa: E402
from sklearn import linear_model  # noqa: E402
from sklearn import metrics  # noqa: E402

from big_vit_lite.data import builders  # noqa: F401,E402  (registers mnist_multilabel)


def load(split, data_dir, limit):
  ds = tfds.load(
      "mnist_multilabel", split=f"{split}[:{limit}]", data_dir=data_dir
  )
  images, khot = [], []
  for ex in tfds.as_numpy(ds):
    images.append(ex["image"].reshape(-1) / 255.0)
    row = np.zeros([10], np.int64)
    row[ex["labels"]] = 1
    khot.append(row)
  return np.stack(images), np.stack(khot)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--data_dir", default=None)
  parser.add_argument("--train", type=int, default=24_000)
  parser.add_argument("--l2", type=float, default=1.0)
  args = parser.parse_args()
  x_train, y_train = load("train", args.data_dir, args.train)
  x_test, y_test = load("test", args.data_dir, 4_000)
  t0 = time.time()
  scores = np.stack(
      [
          linear_model.LogisticRegression(C=1 / args.l2, max_iter=300)
          .fit(x_train, y_train[:, c])
          .decision_function(x_test)
          for c in range(10)
      ],
      axis=1,
  )
  top1 = y_test[np.arange(len(y_test)), np.argmax(scores, axis=1)]
  print(
      json.dumps(
          {
              "train_examples": len(x_train),
              "mAP": round(
                  float(
                      metrics.average_precision_score(
                          y_test, scores, average="macro"
                      )
                  ),
                  4,
              ),
              "prec@1": round(float(top1.mean()), 4),
              "fit_seconds": round(time.time() - t0),
          }
      )
  )


if __name__ == "__main__":
  main()
