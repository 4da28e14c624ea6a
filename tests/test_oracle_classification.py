"""The classification evaluator's prec@1, prec@5 and loss against sklearn and numpy float64.

Oracles: sklearn's top_k_accuracy_score for prec@k, log-softmax and the
sigmoid cross-entropy written out in float64 numpy for the losses. In-process
on hand-made batches (the pipeline is replaced by a list of batches): several
batches with padding rows, 7 classes (prec@5 exists) and 5 (it does not),
random logits so that top-1, top-5 and the loss all differ from row to row.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as skm

from big_vit_lite.runtime import sharding
from big_vit_lite.evaluators import classification
import checks


def _log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _sigmoid_xent(z, y):
  return np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))


def _case(n, c, seed):
  rng = np.random.default_rng(seed)
  logits = rng.normal(0, 2.0, (n, c)).astype(np.float32)
  label = rng.integers(0, c, n)
  return logits, label


def _run(monkeypatch, logits, batches, loss_name="softmax_xent"):
  """Evaluator.run over `batches` (dicts with image = row index, labels/label, _mask)."""
  monkeypatch.setattr(
      classification.input_pipeline,
      "make_eval_iterator",
      lambda data, pp, batch_size: batches,
  )
  table = jnp.asarray(logits)

  def predict_fn(params, images):
    del params
    out = table[images]
    return out, {"pre_logits": out}

  ev = classification.Evaluator(
      predict_fn,
      mesh=sharding.make_mesh([("data", -1)]),
      data={"name": "fake"},
      pp="",
      batch_size=4,
      loss_name=loss_name,
  )
  return ev.run({})


def _batches(label_rows, key):
  """Batches of 4 row ids and labels; the last one padded with masked rows."""
  return checks.padded_batches(label_rows, key, batch_size=4)


@pytest.mark.parametrize("c", [7, 5])
def test_prec_at_k_and_softmax_loss_over_padded_batches(monkeypatch, c):
  """Guards: padding rows counted (in hits, loss or count), hits summed over
  the wrong axis, top-5 taken as the 5 smallest or 4/6 classes, prec@5 for a
  5-class head (always 1), the loss as a sum over rows or the wrong sign,
  the totals divided by the batch count instead of the example count."""
  logits, label = _case(11, c, seed=c)
  got = _run(monkeypatch, logits, _batches(label, "label"))
  assert got["prec@1"] == pytest.approx(
      skm.top_k_accuracy_score(label, logits, k=1, labels=range(c)), abs=1e-6
  )
  want_loss = -np.mean(
      _log_softmax(logits.astype(np.float64))[np.arange(11), label]
  )
  assert got["loss"] == pytest.approx(want_loss, rel=1e-5)
  if c > 5:
    top5 = skm.top_k_accuracy_score(label, logits, k=5, labels=range(c))
    assert got["prec@5"] == pytest.approx(top5, abs=1e-6)
    assert 0 < top5 < 1
  else:
    assert "prec@5" not in got
  assert 0 < got["prec@1"] < 1


def test_one_hot_labels_with_smoothing_and_sigmoid_loss(monkeypatch):
  """Guards: label smoothing's off-values counted as hits, a row's class taken
  as any nonzero entry, the sigmoid loss not summed over classes or taken
  without the targets' smoothing, rows with no positive entry counted."""
  c = 7
  logits, label = _case(10, c, seed=3)
  smooth = np.full((10, c), 0.1 / c, np.float32)
  smooth[np.arange(10), label] += 0.9
  smooth[4] = 0.0  # an unlabelled (ImageNet-ReaL style) row: counts nowhere
  got = _run(
      monkeypatch, logits, _batches(smooth, "labels"), loss_name="sigmoid_xent"
  )
  keep = np.arange(10) != 4
  assert got["prec@1"] == pytest.approx(
      skm.top_k_accuracy_score(label[keep], logits[keep], k=1, labels=range(c)),
      abs=1e-6,
  )
  assert got["prec@5"] == pytest.approx(
      skm.top_k_accuracy_score(label[keep], logits[keep], k=5, labels=range(c)),
      abs=1e-6,
  )
  z = logits.astype(np.float64)[keep]
  want = np.mean(np.sum(_sigmoid_xent(z, smooth[keep]), axis=1))
  assert got["loss"] == pytest.approx(want, rel=1e-5)


def test_multi_hot_rows_hit_on_any_of_their_classes():
  """Guards: a k-hot row's hit at 1 or 5 judged against one class only
  (its first), or the top-5 membership test inverted. Hand-worked case."""
  labels = jnp.array(
      [
          [0, 0, 1, 1, 0, 0, 0],  # top-1 is class 3: a hit
          [1, 0, 0, 0, 0, 0, 1],  # top-1 is class 2; class 6 is 2nd: hit@5
          [0, 0, 0, 0, 0, 0, 1],  # class 6 is the lowest logit: miss at 5
      ],
      jnp.float32,
  )
  logits = jnp.array(
      [
          [0.0, 1, 2, 9, 3, 4, 5],
          [0.0, 1, 9, 2, 3, 4, 8],
          [9.0, 8, 7, 6, 5, 4, -1],
      ]
  )
  sums = classification.batch_sums(logits, labels, jnp.ones(3), "sigmoid_xent")
  assert float(sums["correct@1"]) == 1.0
  assert float(sums["correct@5"]) == 2.0
  assert float(sums["count"]) == 3.0


def test_non_finite_rows_are_counted_but_masked_ones_are_not():
  """Guards: the NaN/inf count taken over the wrong axis or including padding
  rows (a padded NaN row would refuse a finite model's result)."""
  logits = jnp.array([[0.0, jnp.nan], [jnp.inf, 1.0], [1.0, 2.0], [jnp.nan, 0]])
  labels = jnp.eye(2)[jnp.array([0, 1, 0, 1])]
  mask = jnp.array([True, True, True, False])
  sums = classification.batch_sums(logits, labels, mask, "softmax_xent")
  assert float(sums["non_finite"]) == 2.0
  assert float(sums["count"]) == 3.0


def test_unlabelled_splits_and_labels_outside_the_head_are_refused(monkeypatch):
  """Guards the refusals that keep a wrong prec@1 from being reported: a
  split whose rows all lack a positive label (count 0), integer labels
  outside the head's classes (the message names the largest, 9)."""
  logits, label = _case(6, 7, seed=1)
  with pytest.raises(ValueError, match="yielded no labelled examples"):
    _run(monkeypatch, logits, _batches(np.zeros((6, 7), np.float32), "labels"))
  label[2] = 9
  with pytest.raises(
      ValueError,
      match=r"1 examples have a label outside the model's 7 classes \(largest label 9\)",
  ):
    _run(monkeypatch, logits, _batches(label, "label"))
