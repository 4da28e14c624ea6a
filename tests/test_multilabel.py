"""Multi-label end to end: the mnist_multilabel builder, the `multilabel` evaluator's metrics
(oracle: scikit-learn), and configs/multilabel.py training through the ordinary trainer.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds
from sklearn import metrics as skm

from big_vit_lite.runtime import sharding
from big_vit_lite.evaluators import multilabel

import trainer_runs

PP = (
    "decode(channels=1)|value_range(-1, 1)"
    "|onehot(10, key='labels', key_result='labels')|keep('image', 'labels')"
)


@pytest.fixture(scope="module")
def data_dir(tfds_data_dir, prepare_in_test_data):
  """tfds_data_dir with mnist_multilabel (and mnist10k) prepared."""
  prepare_in_test_data("mnist_multilabel")
  return tfds_data_dir


def khot(label_lists, num_classes=10):
  out = np.zeros([len(label_lists), num_classes], np.float32)
  for row, labels in zip(out, label_lists):
    row[list(labels)] = 1
  return out


def test_average_precision_matches_sklearn_also_with_tied_scores():
  rng = np.random.default_rng(0)
  for trial in range(20):
    positive = rng.random(50) < rng.uniform(0.05, 0.6)
    positive[trial % 50] = True
    # ties, or none
    scores = np.round(rng.normal(size=50) + positive, 1 if trial % 2 else 6)
    want = skm.average_precision_score(positive, scores)
    assert multilabel.average_precision(scores, positive) == pytest.approx(
        want, abs=1e-12
    )


def test_metrics_match_sklearn_and_a_hand_case():
  logits = np.array(
      [[2.0, -1.0, 0.5], [-1.0, 3.0, -2.0], [0.1, 0.2, -5.0], [1.0, -1.0, -1.0]]
  )
  labels = khot([[0, 2], [0], [1], []], num_classes=3)
  got = multilabel.metrics(logits, labels)
  # prec@1: top classes 0, 1, 1 against {0,2}, {0}, {1}; the empty row counts
  # nowhere.
  assert got["prec@1"] == pytest.approx(2 / 3)
  positive = labels > 0
  want_ap = [
      skm.average_precision_score(positive[:, c], logits[:, c])
      for c in range(3)
  ]
  assert got["mAP"] == pytest.approx(np.mean(want_ap))
  predicted = logits > 0
  precision = skm.precision_score(
      positive, predicted, average=None, zero_division=0
  )
  recall = skm.recall_score(positive, predicted, average=None, zero_division=0)
  for c in range(3):
    assert got[f"precision/{c}"] == pytest.approx(precision[c])
    assert got[f"recall/{c}"] == pytest.approx(recall[c])
  assert got["precision"] == pytest.approx(precision.mean())
  # A class without positives is left out of mAP and recall, and label smoothing
  # changes nothing.
  smoothed = np.where(labels > 0, 0.9, 0.1 / 3)
  smoothed[3] = 0
  no_class_2 = khot([[0], [0], [1], []], num_classes=3)
  assert multilabel.metrics(logits, smoothed)["mAP"] == pytest.approx(
      got["mAP"]
  )
  assert multilabel.metrics(logits, no_class_2)["mAP"] == pytest.approx(
      np.mean(
          [
              skm.average_precision_score(no_class_2[:, c], logits[:, c])
              for c in (0, 1)
          ]
      )
  )


def test_builder_labels_are_the_set_of_the_placed_test_digits(data_dir):
  mnist = tfds.load("mnist10k", split="test", data_dir=data_dir)
  digit_of = {
      ex["image"].tobytes(): int(ex["label"]) for ex in tfds.as_numpy(mnist)
  }
  ds = tfds.load("mnist_multilabel", split="test[:300]", data_dir=data_dir)
  counts = []
  for ex in tfds.as_numpy(ds):
    image, placed = ex["image"], []
    for cell in range(4):
      row, col = divmod(cell, 2)
      patch = image[28 * row : 28 * row + 28, 28 * col : 28 * col + 28]
      if ex["digits"][cell] < 0:
        assert not patch.any()
      else:  # one of mnist10k's *test* digits, with its own class
        assert digit_of[patch.tobytes()] == ex["digits"][cell]
        placed.append(int(ex["digits"][cell]))
    assert sorted(set(placed)) == ex["labels"].tolist()
    counts.append(len(placed))
  assert set(counts) == {2, 3}


@pytest.fixture
def mesh():
  return sharding.make_mesh([("data", -1)])


def test_evaluator_scores_the_whole_split_like_sklearn(data_dir, mesh):
  rng = np.random.default_rng(1)
  proj = rng.normal(size=(56 * 56, 10)).astype(np.float32) / 56

  def predict_fn(params, images):
    del params
    return images.reshape(len(images), -1) @ jnp.asarray(proj), {}

  split = "test[:300]"  # 300 = 4 batches of 64 + 44: the last batch is padded
  data = dict(name="mnist_multilabel", split=split, data_dir=data_dir)
  got = multilabel.Evaluator(
      predict_fn, mesh=mesh, data=data, pp=PP, batch_size=64
  ).run({})
  ds = tfds.as_numpy(
      tfds.load("mnist_multilabel", split=split, data_dir=data_dir)
  )
  examples = list(ds)
  pixels = np.stack([ex["image"].reshape(-1) / 127.5 - 1 for ex in examples])
  logits = pixels.astype(np.float32) @ proj
  labels = khot([ex["labels"] for ex in examples])
  assert got["mAP"] == pytest.approx(
      skm.average_precision_score(labels, logits), abs=1e-5
  )
  top1 = labels[np.arange(300), np.argmax(logits, axis=1)]
  assert got["prec@1"] == pytest.approx(top1.mean())
  assert got["recall/3"] == pytest.approx(
      skm.recall_score(labels[:, 3], logits[:, 3] > 0)
  )
  want_loss = np.sum(np.logaddexp(0, logits) - labels * logits, axis=1).mean()
  assert got["loss"] == pytest.approx(want_loss, rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_multilabel_config_trains_with_the_jft_settings(data_dir, tmp_path):
  """configs/multilabel.py:runlocal through the trainer: sigmoid xent on k-hot label sets, a
  zero head with bias init_head_bias=-10, and the multilabel eval at the end.

  The first step's loss pins all of that down: every logit is -10, so an example's loss is
  10 * softplus(-10) + 10 * (its number of labels), and the batch's total label count (32
  examples of 1-3 distinct digits) comes out an integer. That the model then learns more than
  the label prior takes longer than a test: see the config's docstring for the full run.
  """
  workdir = str(tmp_path / "w")
  r = trainer_runs.run_train(
      data_dir,
      workdir,
      "--config.total_steps=150",
      "--config.log_training_steps=1",
      "--config.evals.multilabel.log_steps=150",
      config=os.path.join(
          trainer_runs.ROOT, "configs", "multilabel.py:runlocal"
      ),
      timeout=800,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [
      json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))
  ]
  losses = {r["step"]: r["training_loss"] for r in rows if "training_loss" in r}
  labels_in_batch = (losses[1] - 10 * np.log1p(np.exp(-10.0))) * 32 / 10
  assert abs(labels_in_batch - round(labels_in_batch)) < 1e-3, labels_in_batch
  assert 32 <= round(labels_in_batch) <= 96
  # The gradients flow through the sigmoid from -10: the loss falls (23 -> ~16
  # here).
  assert np.mean([losses[s] for s in range(141, 151)]) < 0.8 * losses[1]
  final = [r for r in rows if "multilabel/mAP" in r][-1]
  assert final["step"] == 150 and 0 < final["multilabel/mAP"] <= 1
  assert {
      "multilabel/prec@1",
      "multilabel/precision/9",
      "multilabel/recall/0",
  } <= set(final)
