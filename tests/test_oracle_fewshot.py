"""The few-shot evaluator in-process on hand-made splits, against scikit-learn.

The input pipeline is replaced by hand-made batches (features as the
"image", a pixels model), padded as the eval pipeline pads, so the evaluator
runs whole (labels pass, samples, the sampled rows' second pass, the test
split, ridge per seed and shot) in a second. The case is chosen so that the
plausible wrong versions disagree: class ids that are neither small nor
contiguous, a train split whose length is not a multiple of the batch (the
padding rows must not be sampled), classes that overlap (accuracy well
between chance and 1, different per seed), two seeds and two shot counts.
"""

import logging
import re

import numpy as np
import pytest
from sklearn import linear_model

from big_vit_lite.data import input_pipeline
from big_vit_lite.evaluators import fewshot
from big_vit_lite.evaluators import ridge
from big_vit_lite.runtime import sharding
import checks

CLASSES = np.array([4, 9, 30])
REGS = (0.5, 8.0, 128.0)


def _split(counts, seed):
  """Features of 6 dims (the same class centres in every split, overlapping) and labels, shuffled."""
  centres = np.random.default_rng(42).normal(0, 1.0, (CLASSES.size, 6))
  rng = np.random.default_rng(seed)
  labels = np.repeat(CLASSES, counts)
  rng.shuffle(labels)
  pos = np.searchsorted(CLASSES, labels)
  x = centres[pos] + rng.normal(0, 1.2, (labels.size, 6))
  return x.astype(np.float32), labels


def _serve(monkeypatch, splits):
  """make_eval_iterator -> the hand-made split's padded batches, whatever the pp."""

  def batches(data_cfg, pp, batch_size):
    del pp
    x, labels = splits[data_cfg["split"]]
    out = checks.padded_batches(labels, "label", batch_size)
    for b in out:
      b["image"] = x[b["image"]]
    return out

  monkeypatch.setattr(input_pipeline, "make_eval_iterator", batches)


def _pixels(params, images):
  del params
  return images, {"pre_logits": images}


def _evaluator(**kw):
  return fewshot.Evaluator(
      _pixels,
      mesh=sharding.make_mesh([("data", -1)]),
      datasets={"toy": dict(name="toy")},
      batch_size=8,
      l2_regs=REGS,
      **kw,
  )


def _sklearn_accuracy(x, y, x_test, y_test):
  """Ridge to {-1, +1} targets on standardised features, l2 by brute-force
  leave-one-out (accuracy, then squared error, ties to the larger l2)."""
  x, x_test = x.astype(np.float64), x_test.astype(np.float64)
  mean, std = x.mean(0), x.std(0)
  std[std < 1e-6 * std.max()] = 1.0
  z, z_test = (x - mean) / std, (x_test - mean) / std
  onehot = 2.0 * (y[:, None] == CLASSES) - 1.0
  best = None
  for l2 in REGS:
    loo = np.stack(
        [
            linear_model.Ridge(alpha=l2)
            .fit(np.delete(z, i, 0), np.delete(onehot, i, 0))
            .predict(z[i : i + 1])[0]
            for i in range(len(y))
        ]
    )
    key = (
        -np.mean(CLASSES[loo.argmax(1)] == y),
        np.mean((loo - onehot) ** 2),
        -l2,
    )
    best = min(best or (key, l2), (key, l2))
  pred = linear_model.Ridge(alpha=best[1]).fit(z, onehot).predict(z_test)
  return np.mean(CLASSES[pred.argmax(1)] == y_test)


def test_fewshot_accuracy_is_sklearn_ridge_on_nested_per_class_samples(
    monkeypatch,
):
  """Guards: a sample of the wrong size per class (k rows in all, or one
  class short), samples not nested across shots or the same for every seed,
  padding rows sampled, rows matched to the wrong features or labels, class
  ids used as positions, a metric that is not the mean over seeds (the
  last seed's, the best's), the test split's labels misread. Oracle:
  sklearn's Ridge with brute-force leave-one-out on the rows the evaluator
  fitted (read by a spy on ridge.fit_and_score), checked to be a draw of k
  train examples per class."""
  train_x, train_y = _split([7, 5, 6], seed=0)  # 18 rows, batches of 8
  test_x, test_y = _split([5, 4, 5], seed=1)
  _serve(monkeypatch, {"train": (train_x, train_y), "test": (test_x, test_y)})
  fits = []
  real = ridge.fit_and_score

  def spy(x, y, *args, **kwargs):
    fits.append(np.asarray(x))
    return real(x, y, *args, **kwargs)

  monkeypatch.setattr(ridge, "fit_and_score", spy)
  got = _evaluator(shots=(1, 3), num_seeds=2).run({})
  assert sorted(got) == ["toy_1shot", "toy_3shot"]
  # In scores' order: shot 1 (seeds 0, 1), then shot 3 (seeds 0, 1).
  assert [len(x) for x in fits] == [3, 3, 9, 9]
  row_of = {x.tobytes(): i for i, x in enumerate(train_x)}
  rows = [np.array([row_of[r.tobytes()] for r in x]) for x in fits]
  for r, shot in zip(rows, (1, 1, 3, 3)):
    assert len(set(r)) == len(r)
    np.testing.assert_array_equal(
        np.unique(train_y[r], return_counts=True)[1], [shot] * 3
    )
  for seed in (0, 1):  # the 1-shot sample of a seed is in its 3-shot sample
    assert set(rows[seed]) <= set(rows[2 + seed])
  assert set(rows[2]) != set(rows[3])  # the seeds draw different samples
  for shot, (a, b) in ((1, rows[:2]), (3, rows[2:])):
    want = np.mean(
        [
            _sklearn_accuracy(train_x[r], train_y[r], test_x, test_y)
            for r in (a, b)
        ]
    )
    assert got[f"toy_{shot}shot"] == pytest.approx(want, abs=1e-9), shot
  assert 0.3 < got["toy_3shot"] < 1.0  # the case tells right from wrong


def test_default_shots_drop_only_what_a_class_cannot_supply(
    monkeypatch, caplog
):
  """Guards: the default shot counts trimmed by the wrong class count (the
  most common class's, or the total), a count a class can just supply
  dropped, the warning naming the wrong counts; explicit shots above a class's
  count accepted (a "7shot" that used 5) or refused with the wrong class or
  number."""
  train = _split([7, 5, 6], seed=0)
  _serve(monkeypatch, {"train": train, "test": _split([2, 2, 2], seed=1)})
  ev = _evaluator(num_seeds=1)  # default shots (1, 5, 10, 25); class 9 has 5
  assert ev._plans["toy"].shots == (1, 5)  # pylint: disable=protected-access
  assert (
      "class 9 has only 5 train examples: skipping the default 10-shot, 25-shot"
      in caplog.text
  )
  assert sorted(ev.run({})) == ["toy_1shot", "toy_5shot"]
  message = (
      "Few-shot dataset 'toy' (toy, split 'train'): class 9 has only 5 train "
      "examples, too few for 6-shot; lower `shots` to at most 5"
  )
  with pytest.raises(ValueError, match=re.escape(message)):
    _evaluator(shots=(1, 6), num_seeds=1)
  assert _evaluator(shots=(5,), num_seeds=1)._plans["toy"].shots == (5,)  # pylint: disable=protected-access


def test_class_ids_are_positions_among_the_train_classes_by_hand():
  """Guards: labels used as class positions (ids need not be small or
  contiguous), test labels mapped with another table than the train labels',
  a test class the train split lacks (or -1, unlabelled) accepted as a
  silent miss, a single train class accepted (every prediction right)."""
  train, test, n = fewshot.class_ids(
      np.array([30, 4, 30, 1000]), np.array([1000, 4, 30, 4]), "x"
  )
  np.testing.assert_array_equal(train, [1, 0, 1, 2])
  np.testing.assert_array_equal(test, [2, 0, 1, 0])
  assert n == 3
  with pytest.raises(
      ValueError,
      match=re.escape("x: 2 of 3 test examples have labels 7, 2000:"),
  ):
    fewshot.class_ids(np.array([4, 30]), np.array([7, 4, 2000]), "x")
  with pytest.raises(ValueError, match="labels -1: negative labels"):
    fewshot.class_ids(np.array([4, 30]), np.array([-1, 4]), "x")
  with pytest.raises(ValueError, match=r"train split has 1 class\(es\) \[4\]"):
    fewshot.class_ids(np.array([4, 4]), np.array([4]), "x")
  # More than five unseen labels: the first five, then "...".
  with pytest.raises(ValueError, match=re.escape("labels 0, 1, 2, 3, 5, ...:")):
    fewshot.class_ids(np.array([4, 30]), np.array([0, 1, 2, 3, 5, 6]), "x")


def test_second_pass_forwards_only_the_sampled_rows(monkeypatch, caplog):
  """Guards: the second pass forwarding more than the samples' union (the
  whole train split, or extra batches of padding: a batch of forward passes
  per dataset per eval wasted). By hand: 1 shot, 1 seed, 3 classes: 3 rows,
  one batch of 8."""
  _serve(
      monkeypatch,
      {"train": _split([7, 5, 6], seed=0), "test": _split([2, 2, 2], seed=1)},
  )
  forwarded = []
  real = fewshot.feats.select_batches

  def spy(*args, **kwargs):
    for batch in real(*args, **kwargs):
      forwarded.append(batch)
      yield batch

  monkeypatch.setattr(fewshot.feats, "select_batches", spy)
  with caplog.at_level(logging.DEBUG, logger="absl"):
    _evaluator(shots=(1,), num_seeds=1).run({})
  assert [int(b["_mask"].sum()) for b in forwarded] == [3]
  # The per-seed line of --verbosity=1 names the dataset, shot and seed.
  assert "fewshot toy 1-shot seed 0: " in caplog.text
  assert len(forwarded[0]["_mask"]) == 8
