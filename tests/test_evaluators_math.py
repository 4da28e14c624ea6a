"""Correctness of the few-shot ridge and linear-probe math on synthetic features."""

import numpy as np
import pytest

from big_vit_lite.evaluators import logistic
from big_vit_lite.evaluators import ridge


def _blobs(n, d, c, sep, seed=0, problem=0):
  """n points of c Gaussian classes; `problem` fixes the class centres, `seed` the draws."""
  centers = np.random.default_rng(1000 + problem).normal(size=(c, d))
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, c, n)
  return centers[labels] * sep + rng.normal(size=(n, d)), labels


# more rows than dims and fewer
@pytest.mark.parametrize("n,d", [(40, 12), (12, 40)])
def test_ridge_equals_normal_equations(n, d):
  x, labels = _blobs(n, d, 4, 1.0)
  y = ridge.signed_onehot(labels, 4)
  regs = [0.1, 7.0]
  ws, bs, _ = ridge.ridge_path(x, y, regs)
  # Normal equations with a bias column that the penalty leaves out.
  x1 = np.concatenate([x, np.ones((n, 1))], axis=1)
  penalty = np.diag([1.0] * d + [0.0])
  for k, l2 in enumerate(regs):
    direct = np.linalg.solve(x1.T @ x1 + l2 * penalty, x1.T @ y)
    np.testing.assert_allclose(ws[k], direct[:d], atol=1e-9)
    np.testing.assert_allclose(bs[k], direct[d], atol=1e-9)


def test_ridge_leave_one_out_is_exact():
  x, labels = _blobs(30, 8, 3, 1.0)
  y = ridge.signed_onehot(labels, 3)
  _, _, loo = ridge.ridge_path(x, y, [2.0])
  x1 = np.concatenate([x, np.ones((30, 1))], axis=1)
  penalty = np.diag([1.0] * 8 + [0.0])
  for i in (0, 11, 29):
    keep = np.arange(30) != i
    sol = np.linalg.solve(
        x1[keep].T @ x1[keep] + 2.0 * penalty, x1[keep].T @ y[keep]
    )
    np.testing.assert_allclose(loo[0, i], x1[i] @ sol, atol=1e-9)


def test_ridge_separable_features_give_full_accuracy():
  # 10 classes, 5 shots each, well separated in a 64-d space.
  x, labels = _blobs(50, 64, 10, 6.0, seed=1)
  xt, lt = _blobs(500, 64, 10, 6.0, seed=2)
  assert len(np.unique(labels)) == 10
  acc, fit = ridge.fit_and_score(x, labels, xt, lt, 10)
  assert acc == 1.0
  # a class with a single example cannot be LOO-predicted
  assert fit.loo_accuracy >= 0.9


def test_ridge_chooses_l2_on_train_side_only():
  x, labels = _blobs(40, 20, 4, 1.0)
  xt, lt = _blobs(200, 20, 4, 1.0, seed=5)
  _, fit_a = ridge.fit_and_score(x, labels, xt, lt, 4)
  # scrambled test labels
  _, fit_b = ridge.fit_and_score(x, labels, xt, (lt + 1) % 4, 4)
  assert fit_a.l2 == fit_b.l2
  assert fit_a.l2 in ridge.DEFAULT_L2_REGS


def test_ridge_rejects_bad_l2():
  with pytest.raises(ValueError, match="l2_regs"):
    ridge.check_l2_regs([0.0])


def test_standardizer_handles_constant_dims():
  x = np.array([[1.0, 5.0], [3.0, 5.0]])
  z = ridge.Standardizer.fit(x)(x)
  np.testing.assert_allclose(z, [[-1.0, 0.0], [1.0, 0.0]])


def test_logistic_matches_sklearn():
  sklearn_lm = pytest.importorskip("sklearn.linear_model")
  # Overlapping classes, so the l2 value matters and accuracy is < 100%.
  x, labels = _blobs(600, 16, 5, 0.35, seed=2)
  xt, lt = _blobs(2000, 16, 5, 0.35, seed=3)
  st = ridge.Standardizer.fit(x)
  xs, xts = st(x), st(xt)
  l2 = 1e-2
  kernels, biases, iters = logistic.fit(xs, labels, 5, [l2])
  ours = logistic.accuracy(kernels[0], biases[0], xts, lt)
  ref = sklearn_lm.LogisticRegression(
      C=1.0 / (len(labels) * l2), max_iter=5000, tol=1e-8
  ).fit(xs, labels)
  theirs = ref.score(xts, lt)
  assert 0.4 < theirs < 0.99, theirs  # a problem where the fit actually matters
  assert abs(ours - theirs) <= 0.01, (ours, theirs)
  np.testing.assert_allclose(kernels[0], ref.coef_.T, atol=2e-3)
  assert 0 < iters[0] < 1000


def test_logistic_path_of_warm_started_fits_matches_sklearn_per_l2():
  """Guards the regularisation path (each fit started from the previous one's
  solution): every l2 value must still reach its own minimiser, returned in the
  order of `l2s` (not the path's), and a fit started from a solution is shorter.
  """
  sklearn_lm = pytest.importorskip("sklearn.linear_model")
  x, labels = _blobs(600, 16, 5, 0.35, seed=2)
  xs = ridge.Standardizer.fit(x)(x)
  l2s = [1e-3, 1e-1, 1e-2]  # Not sorted: the path runs 1e-1, 1e-2, 1e-3.
  seen = []
  kernels, biases, iters = logistic.fit(
      xs, labels, 5, l2s, on_fit=lambda l2, it, sec: seen.append((l2, it))
  )
  assert [l2 for l2, _ in seen] == [1e-1, 1e-2, 1e-3]
  assert dict(seen) == dict(zip(l2s, iters.tolist()))
  for k, b, l2 in zip(kernels, biases, l2s):
    ref = sklearn_lm.LogisticRegression(
        C=1.0 / (len(labels) * l2), max_iter=5000, tol=1e-8
    ).fit(xs, labels)
    np.testing.assert_allclose(k, ref.coef_.T, atol=2e-3, err_msg=str(l2))
    # (softmax biases are defined up to a constant.)
    np.testing.assert_allclose(
        b - b.mean(), ref.intercept_ - ref.intercept_.mean(), atol=2e-3
    )
  # Started from its own solution, a fit has (almost) nothing left to do.
  _, _, again = logistic.fit(
      xs, labels, 5, [1e-3], start=(kernels[0], biases[0])
  )
  assert again[0] < iters[0] / 4, (again, iters)


def test_logistic_fits_several_l2_at_once():
  x, labels = _blobs(200, 8, 3, 1.0)
  kernels, _, _ = logistic.fit(x, labels, 3, [1e-4, 1.0])
  # A larger penalty gives a smaller weight norm.
  assert np.linalg.norm(kernels[1]) < np.linalg.norm(kernels[0])
