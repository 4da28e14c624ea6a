"""Closed-form ridge regression classifier for few-shot evaluation.

The few-shot protocol of the ViT paper: regress standardised frozen features
onto {-1, +1} one-hot targets with an L2 penalty, classify by the argmax of the
regression outputs. Everything here is float64 numpy: the problems are small
(at most a few hundred training rows) and exactness matters more than speed.

One thin SVD of the centred training features gives the solution for every
l2 value at once, and also the exact leave-one-out (LOO) residuals, so the l2
value is chosen on the training examples alone (the test split is never
looked at to pick it).
"""

import dataclasses

import numpy as np

# Standardised features have unit variance per dimension, so X^T X ~ n * I and
# useful l2 values sit around the number of training rows; this grid covers
# 1-shot (10 rows) to full-data (10^5 rows) problems.
DEFAULT_L2_REGS = tuple(2.0**k for k in range(-4, 17, 2))


def check_l2_regs(l2_regs, allow_zero=False):
  """l2_regs (one number or several) as a float64 vector: finite, > 0 (>= 0 with allow_zero)."""
  regs = np.asarray(l2_regs, np.float64).reshape(-1)
  if allow_zero:
    in_range, bound = regs >= 0, ">="
  else:
    in_range, bound = regs > 0, ">"
  # (NaN or inf would fit nothing and report chance accuracy.)
  if not regs.size or not np.all(np.isfinite(regs) & in_range):
    raise ValueError(
        f"l2_regs must be finite numbers {bound} 0, e.g. "
        f"(1e-6, 1e-4, 1e-2); got {l2_regs!r}."
    )
  return regs


@dataclasses.dataclass
class Standardizer:
  """Per-dimension z-scoring with statistics taken from the training rows."""

  mean: np.ndarray
  std: np.ndarray

  @classmethod
  def fit(cls, x):
    x = np.asarray(x, np.float64)
    std = x.std(axis=0)
    # Constant dimensions carry no information; dividing by 1 keeps them at 0
    # instead of producing inf/nan.
    std = np.where(
        std > 1e-6 * max(float(std.max(initial=0.0)), 1e-30), std, 1.0
    )
    return cls(mean=x.mean(axis=0), std=std)

  def __call__(self, x):
    return (np.asarray(x, np.float64) - self.mean) / self.std


def signed_onehot(labels, num_classes):
  """Integer labels -> {-1, +1} targets of shape (n, num_classes)."""
  labels = np.asarray(labels)
  y = -np.ones((labels.shape[0], num_classes), np.float64)
  y[np.arange(labels.shape[0]), labels] = 1.0
  return y


@dataclasses.dataclass
class RidgeFit:
  """A fitted ridge model: predict(x) = x @ w + b."""

  w: np.ndarray  # (d, c)
  b: np.ndarray  # (c,)
  l2: float  # the chosen l2 value
  loo_accuracy: float  # leave-one-out accuracy of the chosen value

  def predict(self, x):
    return np.asarray(x, np.float64) @ self.w + self.b


def ridge_path(x, y, l2_regs):
  """Ridge with an unpenalised intercept for many l2 values from one SVD.

  Minimises ||x w + 1 b - y||^2 + l2 ||w||^2 for each l2.

  Returns (ws, bs, loo_preds): ws (k, d, c), bs (k, c) and the exact leave-one-out
  predictions (k, n, c) of each training row by a model fit without it.
  """
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  regs = np.asarray(l2_regs, np.float64).reshape(-1)
  n = x.shape[0]
  # With an unpenalised intercept the solution for w depends only on the
  # centred data, and the intercept is the target mean minus the shift.
  x_mean, y_mean = x.mean(axis=0), y.mean(axis=0)
  xc, yc = x - x_mean, y - y_mean
  u, s, vt = np.linalg.svd(xc, full_matrices=False)  # xc = u diag(s) vt
  uty = u.T @ yc  # (r, c)
  s2 = s**2
  shrink = s[None, :] / (s2[None, :] + regs[:, None])  # (k, r)
  ws = np.einsum("dr,kr,rc->kdc", vt.T, shrink, uty)
  b = y_mean[None, :] - np.einsum("d,kdc->kc", x_mean, ws)
  # Hat matrix of the fit: H = 1 1^T / n + u diag(s^2 / (s^2 + l2)) u^T.
  # LOO prediction of row i: y_i - (y_i - yhat_i) / (1 - H_ii), exact for
  # any quadratic-penalty least squares with a data-independent penalty.
  gain = s2[None, :] / (s2[None, :] + regs[:, None])  # (k, r)
  fitted = y_mean + np.einsum("nr,kr,rc->knc", u, gain, uty)
  h_diag = 1.0 / n + np.einsum("nr,kr->kn", u**2, gain)
  # h_ii reaches 1 only for a row nothing else can predict (e.g. n == 1);
  # clipping keeps its LOO prediction finite (and wrong, as it should be).
  denom = np.maximum(1.0 - h_diag, 1e-9)[..., None]
  loo_preds = y[None] - (y[None] - fitted) / denom
  return ws, b, loo_preds


def fit(x, labels, num_classes, l2_regs=DEFAULT_L2_REGS):
  """Fits ridge to {-1,+1} targets, choosing l2 by leave-one-out accuracy.

  Ties in LOO accuracy (common at 1 shot, where every held-out row loses its
  only class example) are broken by the LOO squared error, then by the larger
  l2 value (the safer choice with so little data).
  """
  labels = np.asarray(labels)
  regs = np.asarray(l2_regs, np.float64).reshape(-1)
  y = signed_onehot(labels, num_classes)
  ws, bs, loo = ridge_path(x, y, regs)
  loo_acc = (loo.argmax(-1) == labels[None]).mean(axis=1)
  loo_mse = ((loo - y[None]) ** 2).mean(axis=(1, 2))
  best = min(
      range(regs.size), key=lambda k: (-loo_acc[k], loo_mse[k], -regs[k])
  )
  return RidgeFit(
      w=ws[best],
      b=bs[best],
      l2=float(regs[best]),
      loo_accuracy=float(loo_acc[best]),
  )


def fit_and_score(
    x_train, y_train, x_test, y_test, num_classes, l2_regs=DEFAULT_L2_REGS
):
  """Standardise on train, fit with LOO-chosen l2, return (test accuracy, fit)."""
  standardize = Standardizer.fit(x_train)
  model = fit(standardize(x_train), y_train, num_classes, l2_regs)
  pred = model.predict(standardize(x_test)).argmax(-1)
  return float((pred == np.asarray(y_test)).mean()), model
