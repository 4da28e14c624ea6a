"""The linear probe's logistic regression against scikit-learn, weights and bias included.

scikit-learn's LogisticRegression minimises C * sum_i xent_i + ||W||^2 / 2
with an unpenalised intercept; ours is mean_i xent_i + l2 / 2 ||W||^2 over the
rows of weight 1, the same minimiser for C = 1 / (rows * l2). Small problems
(tens of rows), tight tolerances, each l2 value of a vmapped batch checked.
"""

import numpy as np
import pytest
from sklearn import linear_model

from big_vit_lite.evaluators import logistic


def _problem(n=60, d=4, c=3, seed=0):
  rng = np.random.default_rng(seed)
  centres = rng.normal(0, 1.0, (c, d))
  labels = np.arange(n) % c
  x = centres[labels] + rng.normal(0, 1.0, (n, d))
  x[:, 0] += 2.0  # an offset the unpenalised bias must absorb
  return x.astype(np.float32), labels


def _sklearn(x, labels, l2):
  return linear_model.LogisticRegression(
      C=1.0 / (len(labels) * l2), max_iter=10_000, tol=1e-10
  ).fit(x, labels)


def test_each_l2_of_a_batch_is_sklearns_fit_with_its_bias():
  """Guards: the penalty's scale (l2 vs l2 / 2, or a sum instead of a mean
  over rows), the bias penalised, or the l2 values of the vmapped batch
  mixed up."""
  x, labels = _problem()
  l2s = [0.3, 0.01]
  kernels, biases, _ = logistic.fit(x, labels, 3, l2s, tol=1e-7)
  for k, l2 in enumerate(l2s):
    ref = _sklearn(x, labels, l2)
    np.testing.assert_allclose(kernels[k], ref.coef_.T, atol=2e-3)
    # sklearn's multinomial intercepts are defined up to a common shift.
    np.testing.assert_allclose(
        biases[k] - biases[k].mean(),
        ref.intercept_ - ref.intercept_.mean(),
        atol=2e-3,
    )


def test_zero_weight_rows_do_not_count():
  """Guards: 0-weight (padding) rows counted in the loss or its mean's
  denominator: the fit must be sklearn's on the weight-1 rows alone."""
  x, labels = _problem()
  weights = np.ones(len(labels), np.float32)
  weights[::4] = 0.0  # a quarter of the rows, of every class
  l2 = 0.05
  kernels, biases, _ = logistic.fit(
      x, labels, 3, [l2], weights=weights, tol=1e-7
  )
  keep = weights == 1
  ref = _sklearn(x[keep], labels[keep], l2)
  np.testing.assert_allclose(kernels[0], ref.coef_.T, atol=2e-3)
  np.testing.assert_allclose(
      biases[0] - biases[0].mean(),
      ref.intercept_ - ref.intercept_.mean(),
      atol=2e-3,
  )


def test_iterations_stop_at_max_iter_or_tolerance():
  """Guards: max_iter or tol not honoured (a probe that stops after one
  step, or runs to the cap on an easy problem)."""
  x, labels = _problem()
  _, _, iters = logistic.fit(x, labels, 3, [0.1], max_iter=3)
  assert iters[0] == 3
  _, _, iters = logistic.fit(x, labels, 3, [0.1], tol=1e-2)
  assert 1 <= iters[0] < 100


def test_accuracy_by_hand():
  """Guards: accuracy taken on the wrong axis or against the wrong labels, and
  the bias dropped or subtracted (the labels are chosen so that each of those
  gives another figure)."""
  kernel = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
  bias = np.array([0.0, 0.5], np.float32)
  x = np.array([[2.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 3.0]], np.float32)
  # Scores: [2, .5], [0, .5], [1, 1.5], [0, 3.5] -> 0, 1, 1, 1. Without the
  # bias: 0, 0, 0, 1 (argmax takes the first of a tie) -> 0.5; with it
  # subtracted: [2, -.5], [0, -.5], [1, .5], [0, 2.5] -> 0, 0, 0, 1 -> 0.5.
  assert logistic.accuracy(kernel, bias, x, [0, 1, 0, 1]) == pytest.approx(0.75)
  assert logistic.accuracy(kernel, bias, x, [0, 1, 1, 1]) == pytest.approx(1.0)


def test_on_fit_hears_each_l2_with_its_iterations_and_seconds():
  """Guards: the progress callback told another l2, no iteration count or no
  elapsed time (the caller's progress line prints all three)."""
  x, labels = _problem()
  heard = []
  _, _, iterations = logistic.fit(
      x, labels, 3, [0.3, 0.01], on_fit=lambda *a: heard.append(a)
  )
  assert [h[0] for h in heard] == pytest.approx([0.3, 0.01])
  assert [h[1] for h in heard] == [int(i) for i in iterations]
  for _, _, seconds in heard:
    assert isinstance(seconds, float) and seconds >= 0.0


def test_weights_as_a_column_fit_like_a_flat_vector():
  """Guards: row weights not flattened to (n,): a (n, 1) column would then
  broadcast against the (n,) per-row losses into an (n, n) table."""
  x, labels = _problem()
  weights = (np.arange(len(labels)) % 3 != 0).astype(np.float32)
  flat, _, _ = logistic.fit(x, labels, 3, [0.1], weights=weights)
  column, _, _ = logistic.fit(x, labels, 3, [0.1], weights=weights[:, None])
  np.testing.assert_allclose(column, flat, rtol=1e-5, atol=1e-6)
