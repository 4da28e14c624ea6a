"""Multinomial logistic regression with L-BFGS (optax), on device.

Used by the linear probe: full-batch L-BFGS on frozen, standardised features.
The objective is

    mean_i  w_i * xent(x_i W + b, y_i) / mean_i w_i  +  l2 / 2 * ||W||^2

with an unpenalised bias; w_i are 0/1 row weights so that padded rows (added
to make the row count divisible by the mesh) do not count. This is
scikit-learn's `LogisticRegression(C=1 / (n * l2))` objective up to a factor
n, so both reach the same minimiser.

Several l2 values are solved along the regularisation path: from the largest
penalty (few iterations from zero) down, each fit starting from the previous
one's solution (a warm start, as glmnet and scikit-learn's
`LogisticRegressionCV` do). Each fit stops at its own tolerance, and one
compiled L-BFGS loop serves every value (l2 and the start are arguments).
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from big_vit_lite.runtime import sharding


def _objective(params, x, y, w, l2):
  logits = x @ params["kernel"] + params["bias"]
  xent = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[
      :, 0
  ]
  data = jnp.sum(w * xent) / jnp.maximum(jnp.sum(w), 1.0)
  return data + 0.5 * l2 * jnp.sum(params["kernel"] ** 2)


@functools.partial(jax.jit, static_argnames=("max_iter",))
def _lbfgs(x, y, w, l2, start, *, max_iter, tol):
  """Minimises the objective for one l2 value from `start`; returns (params, iterations)."""
  fun = functools.partial(_objective, x=x, y=y, w=w, l2=l2)
  value_and_grad = optax.value_and_grad_from_state(fun)
  opt = optax.lbfgs()

  def step(carry):
    params, state = carry
    value, grad = value_and_grad(params, state=state)
    updates, state = opt.update(
        grad, state, params, value=value, grad=grad, value_fn=fun
    )
    return optax.apply_updates(params, updates), state

  def not_done(carry):
    _, state = carry
    count = optax.tree.get(state, "count")
    grad_norm = optax.tree.norm(optax.tree.get(state, "grad"))
    return (count == 0) | ((count < max_iter) & (grad_norm >= tol))

  params, state = jax.lax.while_loop(not_done, step, (start, opt.init(start)))
  return params, optax.tree.get(state, "count")


def _to_device(arrays, mesh):
  """Device copies of host arrays, rows sharded over the batch axes.

  The caller padded the rows to a multiple of the batch-axis size.
  """
  if mesh is None or not sharding.batch_axes(mesh):
    return [jnp.asarray(a) for a in arrays]
  rows = sharding.batch_sharding(mesh)
  # Every process holds all rows (features were gathered), so each device
  # just takes its slice of the host copy.
  return [
      jax.make_array_from_callback(a.shape, rows, lambda idx, a=a: a[idx])
      for a in arrays
  ]


def fit(
    x,
    labels,
    num_classes,
    l2s,
    *,
    weights=None,
    mesh=None,
    max_iter=1000,
    tol=1e-5,
    start=None,
    on_fit=None,
):
  """Fits one logistic regression per l2 value, along the path from the largest.

  Args:
    x: (n, d) float features (already standardised).
    labels: (n,) int class ids in [0, num_classes).
    num_classes: number of classes.
    l2s: sequence of l2 penalties (coefficient of ||W||^2 / 2).
    weights: optional (n,) 0/1 row weights; rows with 0 are ignored. Fitting
      a subset through weights keeps the shapes, so it reuses the compiled
      solver (a held-out split and the final fit compile once).
    mesh: optional mesh; rows are sharded over its batch axes (sharding.batch_axes).
    max_iter: L-BFGS iteration cap per l2 value; tol: gradient-norm stopping
      tolerance.
    start: optional (kernel, bias) the largest penalty's fit starts from
      (default zeros); each smaller one starts from the previous solution.
    on_fit: optional callable(l2, iterations, seconds) after each fit (the
      caller's progress line).

  Returns:
    (kernels (k, d, c), biases (k, c), iterations (k,)) as numpy arrays, in
    the order of `l2s`.
  """
  x, labels = np.asarray(x, np.float32), np.asarray(labels, np.int32)
  n = x.shape[0]
  if weights is None:
    weights = np.ones((n,), np.float32)
  weights = np.asarray(weights, np.float32).reshape(n)
  pad = (-n) % sharding.batch_devices(mesh)  # Zero rows of weight 0.
  padded = [
      np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
      for a in (x, labels, weights)
  ]
  xd, yd, wd = _to_device(padded, mesh)
  if start is None:
    start = (
        np.zeros((x.shape[1], num_classes), np.float32),
        np.zeros((num_classes,), np.float32),
    )
  params = {
      "kernel": jnp.asarray(start[0], jnp.float32),
      "bias": jnp.asarray(start[1], jnp.float32),
  }
  solutions = {}
  for i in sorted(range(len(l2s)), key=lambda i: -float(l2s[i])):
    t0 = time.perf_counter()
    params, iters = _lbfgs(
        xd,
        yd,
        wd,
        jnp.float32(l2s[i]),
        params,
        max_iter=max_iter,
        tol=tol,
    )
    # process_allgather also handles arrays spread over several processes.
    solutions[i] = multihost_utils.process_allgather(
        (params, iters), tiled=True
    )
    if on_fit is not None:
      on_fit(float(l2s[i]), int(solutions[i][1]), time.perf_counter() - t0)
  ordered = [solutions[i] for i in range(len(l2s))]
  return (
      np.stack([np.asarray(p["kernel"]) for p, _ in ordered]),
      np.stack([np.asarray(p["bias"]) for p, _ in ordered]),
      np.array([int(it) for _, it in ordered]),
  )


def accuracy(kernel, bias, x, labels):
  """Top-1 accuracy of one fitted (kernel, bias) on host features."""
  pred = (np.asarray(x, np.float32) @ kernel + bias).argmax(-1)
  return float((pred == np.asarray(labels)).mean())
