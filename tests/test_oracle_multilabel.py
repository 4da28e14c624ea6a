"""The multilabel evaluator's whole-split metrics against sklearn and numpy float64.

Oracles: sklearn's average_precision_score, precision_score and recall_score
per class, top-1 hits by hand, and the sigmoid cross-entropy written out in
float64. In-process: the pipeline is replaced by a list of hand-made batches,
the last one padded, with one class that has no positive example, rows with
2-3 labels and an unlabelled row.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as skm

from big_vit_lite.runtime import sharding
from big_vit_lite.evaluators import multilabel
import checks


def _evaluator(monkeypatch, logits, labels, batch_size=4, head=None):
  """An Evaluator whose pipeline yields `labels` in padded batches and whose
  model gives `logits` row by row (times params["scale"]); the pipeline
  checks it is asked for the evaluator's data, pp and batch size."""
  batches = checks.padded_batches(labels, "labels", batch_size)

  def make_eval_iterator(data, pp, size):
    assert (data, pp, size) == ({"name": "fake"}, "PP", batch_size)
    return batches

  monkeypatch.setattr(
      multilabel.input_pipeline, "make_eval_iterator", make_eval_iterator
  )
  table = jnp.asarray(logits)

  def predict_fn(params, images):
    return table[images] * params["scale"], {}

  return multilabel.Evaluator(
      predict_fn,
      mesh=sharding.make_mesh([("data", -1)]),
      data={"name": "fake"},
      pp="PP",
      batch_size=batch_size,
  )


def _run(monkeypatch, logits, labels, batch_size=4):
  ev = _evaluator(monkeypatch, logits, labels, batch_size)
  return ev.run({"scale": jnp.float32(1.0)})


def _case(n, c, seed):
  rng = np.random.default_rng(seed)
  labels = (rng.random((n, c)) < 0.35).astype(np.float32)
  labels[:, c - 1] = 0.0  # a class nobody has: left out of mAP and recall
  labels[0] = 0.0  # an unlabelled row: counts nowhere in prec@1
  labels[1, :3] = 1.0  # a row with several labels
  logits = (rng.normal(0, 1.5, (n, c)) + 1.2 * labels).astype(np.float32)
  return logits, labels


def test_whole_split_metrics_are_sklearns_over_padded_batches(monkeypatch):
  """Guards: padding rows kept, macro averages over the wrong axis or over
  classes without positives (recall, mAP), the 0.5 threshold moved off
  logit 0, prec@1 counting unlabelled rows, per-class keys misnumbered,
  the loss not summed over classes or not averaged over examples."""
  n, c = 13, 6
  logits, labels = _case(n, c, seed=0)
  got = _run(monkeypatch, logits, labels)
  positive = labels > 0
  has = positive.any(axis=0)
  assert not has[c - 1] and has[: c - 1].all()
  want_ap = [
      skm.average_precision_score(positive[:, k], logits[:, k])
      for k in range(c)
      if has[k]
  ]
  assert got["mAP"] == pytest.approx(np.mean(want_ap), abs=1e-9)
  predicted = logits > 0
  precision = skm.precision_score(
      positive, predicted, average=None, zero_division=0
  )
  recall = skm.recall_score(positive, predicted, average=None, zero_division=0)
  assert got["precision"] == pytest.approx(np.mean(precision), abs=1e-9)
  assert got["recall"] == pytest.approx(np.mean(recall[has]), abs=1e-9)
  for k in range(c):
    assert got[f"precision/{k}"] == pytest.approx(precision[k], abs=1e-9)
    assert got[f"recall/{k}"] == pytest.approx(recall[k], abs=1e-9)
  labelled = positive.any(axis=1)
  hits = positive[np.arange(n), logits.argmax(1)][labelled]
  assert got["prec@1"] == pytest.approx(hits.mean(), abs=1e-9)
  assert 0 < hits.mean() < 1
  z, y = logits.astype(np.float64), labels.astype(np.float64)
  xent = np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))
  assert got["loss"] == pytest.approx(xent.sum(1).mean(), rel=1e-5)


@pytest.mark.parametrize("c,per_class", [(32, True), (33, False)])
def test_per_class_metrics_up_to_32_classes(c, per_class):
  """Guards the PER_CLASS_MAX bound (<= 32 classes get per-class keys)."""
  logits, labels = _case(8, c, seed=1)
  got = multilabel.metrics(logits, labels)
  assert (f"precision/{c - 1}" in got) == per_class
  assert (f"recall/{c - 1}" in got) == per_class
  assert ("precision/0" in got) == per_class


def test_average_precision_by_hand():
  """Guards the AP sum: precision at each distinct threshold times the recall
  step, with tied scores one threshold. Scores 0.9 (+), 0.8 (-), 0.8 (+),
  0.1 (+): thresholds 0.9, 0.8, 0.1 give precision 1, 2/3, 3/4 and recall
  steps 1/3 each: AP = (1 + 2/3 + 3/4) / 3. No positive: NaN."""
  scores = np.array([0.8, 0.9, 0.1, 0.8])
  positive = np.array([False, True, True, True])
  assert multilabel.average_precision(scores, positive) == pytest.approx(
      (1 + 2 / 3 + 3 / 4) / 3, abs=1e-12
  )
  assert np.isnan(multilabel.average_precision(scores, np.zeros(4, bool)))


def test_each_row_positive_at_its_own_largest_entry_and_logit_zero_is_no():
  """Guards: a row's classes taken at the largest entry of the whole batch
  (a smoothed row, max 0.9, would lose its label next to a 1.0 row), and
  "predicted" at sigmoid(logit) >= 0.5 instead of > 0.5 (logit 0 exactly).
  Hand-worked: rows {0} (smoothed), {1}, {0, 1}; class 0 predicted for row
  0 only (row 1's logit is exactly 0): precision 1, recall 1/2."""
  labels = np.array(
      [[0.9, 0.05, 0.05], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]], np.float32
  )
  logits = np.array(
      [[2.0, -1.0, -1.0], [0.0, 3.0, -1.0], [-1.0, 4.0, -1.0]], np.float32
  )
  got = multilabel.metrics(logits, labels)
  assert got["precision/0"] == 1.0 and got["recall/0"] == 0.5
  assert got["precision/1"] == 1.0 and got["recall/1"] == 1.0
  assert got["precision/2"] == 0.0  # never predicted
  assert got["recall"] == 0.75  # class 2 has no positive: left out
  assert got["prec@1"] == 1.0


def test_bad_labels_and_outputs_are_one_line_errors(monkeypatch):
  """Guards the evaluator's refusals (each names what is wrong and what to
  do): a pp whose k-hot labels have another class count than the head, a pp
  without 'labels', NaN logits, a split without any positive label."""
  logits, labels = _case(6, 4, seed=2)
  # (batches of 5: no shape of the batch is 3 or 4 but the class counts)
  ev = _evaluator(monkeypatch, logits, labels[:, :3], batch_size=5)
  with pytest.raises(ValueError) as e:
    ev.run({"scale": jnp.float32(1.0)})
  assert str(e.value) == (
      "The eval pp makes 3-class 'labels' but the model's head has 4 outputs;"
      " use onehot(4, key='labels') in the pp."
  )
  ev = _evaluator(monkeypatch, logits, labels)
  ev.batches = [{"image": np.arange(4), "_mask": np.ones(4, bool)}]
  with pytest.raises(ValueError, match=r"makes no k-hot 'labels' \(it gives"):
    ev.run({"scale": jnp.float32(1.0)})
  ev = _evaluator(monkeypatch, logits, labels)
  with pytest.raises(ValueError, match="logits are NaN/inf"):
    ev.run({"scale": jnp.float32(np.nan)})
  ev = _evaluator(monkeypatch, logits, np.zeros_like(labels))
  with pytest.raises(ValueError, match="has no positive label"):
    ev.run({"scale": jnp.float32(1.0)})
