"""The few-shot ridge classifier against scikit-learn and a brute-force leave-one-out.

Oracles: sklearn's StandardScaler and RidgeClassifier ({-1, +1} targets, an
unpenalised intercept, argmax of the outputs: the ViT paper's few-shot
protocol), and leave-one-out accuracy computed by refitting without each row
(np.linalg.solve in float64), not by the hat-matrix shortcut under test.
Small problems (tens of rows), several classes and seeds, features on
different scales so that a wrong standardisation changes the fit.
"""

import numpy as np
import pytest
from sklearn import linear_model
from sklearn import preprocessing

from big_vit_lite.evaluators import ridge


def _problem(n, d, c, seed, sep=1.0, balanced=True):
  """n rows of c classes, every class present, dims on scales 0.1 to 10.

  Unbalanced: class k has about k + 1 times the rows of class 0 (so the
  intercepts differ between classes and decide some predictions).
  """
  rng = np.random.default_rng(seed)
  labels = np.arange(n) % c
  if not balanced:
    labels = np.arange(c).repeat(
        np.arange(1, c + 1) * n // (c * (c + 1) // 2) + 1
    )[:n]
  rng.shuffle(labels)
  centres = rng.normal(0, sep, (c, d))
  scales = np.geomspace(0.1, 10.0, d)
  x = (centres[labels] + rng.normal(0, 1.0, (n, d))) * scales + 3.0
  return x, labels


def _brute_force_choice(x, labels, c, regs):
  """The (l2, LOO accuracy) fit() should pick: LOO by refitting n times.

  Highest LOO accuracy; ties by lowest LOO squared error, then largest l2.
  """
  n, d = x.shape
  y = -np.ones((n, c))
  y[np.arange(n), labels] = 1.0
  x1 = np.concatenate([x, np.ones((n, 1))], axis=1)
  penalty = np.diag([1.0] * d + [0.0])  # the intercept is not penalised
  scored = []
  for l2 in regs:
    preds = np.empty((n, c))
    for i in range(n):
      keep = np.arange(n) != i
      sol = np.linalg.solve(
          x1[keep].T @ x1[keep] + l2 * penalty, x1[keep].T @ y[keep]
      )
      preds[i] = x1[i] @ sol
    acc = np.mean(preds.argmax(1) == labels)
    mse = np.mean((preds - y) ** 2)
    scored.append((-acc, mse, -l2))
  best = min(scored)
  return -best[2], -best[0], scored


def test_fit_and_score_is_sklearn_scaler_and_ridge_classifier():
  """Guards: standardisation with the wrong statistics (test rows', std with
  ddof, no centring, constant-dim threshold off), {0, 1} or {-1, +1} targets
  swapped, the intercept penalised, dropped or subtracted in predict, l2
  scaled (l2 / 2, l2 * n) or the grid ignored, predictions not the argmax
  over classes, accuracy against the wrong labels, float32 features (what
  models give) not computed in float64. Unbalanced classes: the intercepts
  differ."""
  for seed, (n, d, c) in enumerate([(24, 6, 4), (15, 30, 3), (40, 5, 5)]):
    rows = _problem(n + 60, d, c, seed, balanced=False)
    x, labels = rows[0][:n].astype(np.float32), rows[1][:n]
    xt, lt = rows[0][n:].astype(np.float32), rows[1][n:]
    acc, fit = ridge.fit_and_score(x, labels, xt, lt, c, l2_regs=(0.3, 9.0))
    assert fit.l2 in (0.3, 9.0)
    x, xt = x.astype(np.float64), xt.astype(np.float64)
    scaler = preprocessing.StandardScaler().fit(x)
    ref = linear_model.RidgeClassifier(alpha=fit.l2, solver="svd")
    ref.fit(scaler.transform(x), labels)
    np.testing.assert_allclose(fit.w, ref.coef_.T, atol=1e-10)
    np.testing.assert_allclose(fit.b, ref.intercept_, atol=1e-10)
    expected = np.mean(ref.predict(scaler.transform(xt)) == lt)
    assert acc == expected, (seed, acc, expected)
    assert 0.0 < acc < 1.0, acc  # a problem where a wrong fit shows


def test_standardizer_is_sklearns_standard_scaler():
  """Guards: the per-dimension mean/std taken over the wrong axis, ddof=1,
  scaling without centring, or a constant-dimension threshold that also
  catches small but real dimensions (or lets a constant one divide by 0)."""
  rng = np.random.default_rng(0)
  x = rng.normal(0, 1, (9, 5)) * [1e-3, 0.5, 1.0, 40.0, 0.0] + [0, 1, -2, 7, 5]
  xt = rng.normal(0, 1, (4, 5))
  standardize = ridge.Standardizer.fit(x)
  scaler = preprocessing.StandardScaler().fit(x)
  np.testing.assert_allclose(standardize(xt), scaler.transform(xt), atol=1e-9)
  np.testing.assert_allclose(standardize(x), scaler.transform(x), atol=1e-9)


def test_float32_features_are_standardised_and_fit_in_float64():
  """Guards the module's float64 promise: float32 features (what a model
  gives) must not be averaged, decomposed or regressed in float32 (errors of
  1e-7 relative, against 1e-12 here)."""
  x, labels = _problem(30, 8, 3, seed=4)
  x32 = (x * 1000 + 5e4).astype(np.float32)  # large offset: float32 sums drift
  x64 = x32.astype(np.float64)
  scaler = preprocessing.StandardScaler().fit(x64)
  standardize = ridge.Standardizer.fit(x32)
  np.testing.assert_allclose(standardize.mean, scaler.mean_, rtol=1e-13)
  np.testing.assert_allclose(standardize.std, scaler.scale_, rtol=1e-12)
  y = ridge.signed_onehot(labels, 3)
  ws, bs, _ = ridge.ridge_path(x32, y, [4.0])
  ref = linear_model.Ridge(alpha=4.0, solver="svd").fit(x64, y)
  np.testing.assert_allclose(ws[0], ref.coef_.T, rtol=1e-8, atol=1e-12)
  np.testing.assert_allclose(bs[0], ref.intercept_, rtol=1e-9)


def test_one_l2_value_may_be_a_plain_number():
  """Guards the l2 vector's shape: one number is a grid of one (not a 0-d
  array that cannot be indexed)."""
  assert ridge.check_l2_regs(2.0).shape == (1,)
  x, labels = _problem(12, 4, 3, seed=0)
  ws, bs, loo = ridge.ridge_path(x, ridge.signed_onehot(labels, 3), 2.0)
  assert (
      ws.shape == (1, 4, 3) and bs.shape == (1, 3) and loo.shape == (1, 12, 3)
  )
  assert ridge.fit(x, labels, 3, 2.0).l2 == 2.0


def test_standardizer_treats_relatively_tiny_dims_as_constant():
  """Guards the constant-dimension threshold: a dimension a million times
  flatter than the widest is noise (divided by 1, not blown up), one only a
  thousand times flatter is real signal (divided by its std)."""
  x = np.array(
      [[0.0, 0.0, 0.0], [2.0, 2e-3, 2e-7], [4.0, 4e-3, 4e-7], [6.0, 6e-3, 6e-7]]
  )
  std = x.std(axis=0)  # 2.236..., 2.236e-3, 2.236e-7
  z = ridge.Standardizer.fit(x)(x)
  centred = x - x.mean(axis=0)
  np.testing.assert_allclose(z[:, 0], centred[:, 0] / std[0], rtol=1e-12)
  np.testing.assert_allclose(z[:, 1], centred[:, 1] / std[1], rtol=1e-12)
  np.testing.assert_allclose(z[:, 2], centred[:, 2], rtol=1e-12)
  # All dimensions tiny: the threshold is relative to the widest of them.
  z = ridge.Standardizer.fit(x * 1e-9)(x * 1e-9)
  np.testing.assert_allclose(z[:, 0], centred[:, 0] / std[0], rtol=1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_l2_is_chosen_by_brute_force_leave_one_out(seed):
  """Guards the hyper-parameter choice: l2 picked by LOO accuracy (not by the
  LOO squared error alone, not the training fit, not the first or smallest
  value), accuracy per row over the right axis, and the LOO accuracy reported
  with the chosen value. Brute force: n refits without each row."""
  regs = (0.05, 1.0, 8.0, 60.0, 500.0)
  x, labels = _problem(18, 6, 3, seed, sep=0.8)
  standardize = ridge.Standardizer.fit(x)
  fit = ridge.fit(standardize(x), labels, 3, regs)
  l2, loo_acc, _ = _brute_force_choice(standardize(x), labels, 3, regs)
  assert fit.l2 == l2, (fit.l2, l2)
  assert fit.loo_accuracy == pytest.approx(loo_acc, abs=1e-12)


def test_accuracy_not_squared_error_decides_the_l2():
  """Guards the order of the choice: on this problem the l2 with the best LOO
  accuracy is not the one with the lowest LOO squared error (checked by
  brute force), so picking by squared error first gives a different l2."""
  regs = (0.05, 1.0, 8.0, 60.0, 500.0)
  for seed in range(20):
    x, labels = _problem(18, 6, 3, seed, sep=0.8)
    xs = ridge.Standardizer.fit(x)(x)
    l2, _, scored = _brute_force_choice(xs, labels, 3, regs)
    by_mse = regs[int(np.argmin([mse for _, mse, _ in scored]))]
    if by_mse != l2:
      break
  else:
    raise AssertionError("no problem where LOO accuracy and error disagree")
  assert ridge.fit(xs, labels, 3, regs).l2 == l2


def test_ties_go_to_the_larger_l2():
  """Guards the tie-break (the docstring's "then by the larger l2"): when
  every l2 gives the same LOO predictions (identical feature rows: the fit is
  the intercept alone), the largest value is chosen, whatever the grid order."""
  x = np.ones((6, 3))
  labels = np.array([0, 1, 2, 0, 1, 2])
  for regs in [(0.1, 10.0, 3.0), (10.0, 3.0, 0.1)]:
    assert ridge.fit(x, labels, 3, regs).l2 == 10.0


def test_one_shot_picks_by_squared_error_then_larger_l2():
  """Guards the 1-shot tie: every row's LOO prediction misses its class (it
  held the class's only example), so LOO accuracy ties at 0 for every l2 and
  the squared error decides (brute-force oracle)."""
  regs = (0.01, 0.5, 4.0, 30.0, 1000.0)
  for seed in range(3):
    x, labels = _problem(4, 5, 4, seed, sep=2.0)
    l2, loo_acc, _ = _brute_force_choice(x, labels, 4, regs)
    fit = ridge.fit(x, labels, 4, regs)
    assert loo_acc == 0.0
    assert fit.l2 == l2, (seed, fit.l2, l2)


def test_default_grid_spans_one_shot_to_full_data():
  """Guards the default l2 grid (a slip that narrows or coarsens it): the
  module's promise is 2^-4 to 2^16 in steps of 4x, covering useful values
  around the row count from 10 rows (1-shot, 10 classes) to 10^5 rows."""
  grid = np.array(ridge.DEFAULT_L2_REGS)
  np.testing.assert_array_equal(grid, 4.0 ** np.arange(-2, 9))
  for rows in (10, 100, 1000, 10**4, 10**5):
    assert np.min(np.abs(np.log2(grid / rows))) <= 1.0, rows


def test_check_l2_regs_bounds():
  """Guards the l2 check: zero refused unless allowed (linear probe allows
  it), negatives, NaN, inf and an empty grid refused, values kept in order."""
  np.testing.assert_array_equal(ridge.check_l2_regs(2.0), [2.0])
  np.testing.assert_array_equal(
      ridge.check_l2_regs([0.0, 3.0], allow_zero=True), [0.0, 3.0]
  )
  assert ridge.check_l2_regs([1, 2]).dtype == np.float64
  for bad, allow_zero in [
      ([0.0], False),
      ([-1.0], True),
      ([np.nan], True),
      ([np.inf], False),
      ([], True),
      ([1.0, -1e-9], False),
  ]:
    with pytest.raises(ValueError, match="l2_regs must be finite numbers") as e:
      ridge.check_l2_regs(bad, allow_zero=allow_zero)
    bound = ">= 0" if allow_zero else "> 0"
    assert bound in str(e.value), str(e.value)
