"""Gradient accumulation against the loss and gradient of each microbatch, worked
out one by one (numpy slicing for the rows, jax.value_and_grad for each).

The loss uses its rng (a random mask per microbatch) and is not linear in the
batch, so a microbatch holding other rows, the same rng reused for every
microbatch, a sum instead of a mean or a gradient of the wrong microbatch all
change the result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite.trainer import grad_accum


def _loss_fn(params, batch, rng):
  """A mean loss over the batch that depends on rng (a dropout-like mask)."""
  keep = jax.random.bernoulli(rng, 0.6, batch["x"].shape).astype(jnp.float32)
  pred = jnp.tanh((batch["x"] * keep) @ params["w"]) + params["b"]
  return jnp.mean((pred - batch["y"]) ** 2)


def _problem(batch_size=12):
  rng = np.random.default_rng(0)
  params = {
      "w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
      "b": jnp.asarray(rng.normal(size=2), jnp.float32),
  }
  batch = {
      "x": jnp.asarray(rng.normal(size=(batch_size, 3)), jnp.float32),
      "y": jnp.asarray(rng.normal(size=(batch_size, 2)), jnp.float32),
  }
  return params, batch


@pytest.mark.parametrize("steps", [2, 3])
def test_value_and_grad_is_the_mean_over_interleaved_microbatches(steps):
  """Guards: microbatch i not rows i, i+k, ... (a contiguous split or a
  transposed reshape), the same rng for every microbatch (fold_in dropped or
  folding a constant), summed instead of averaged loss or gradient."""
  params, batch = _problem()
  rng = jax.random.PRNGKey(7)
  loss, grads = jax.jit(
      lambda p, b: grad_accum.value_and_grad(_loss_fn, p, b, rng, steps)
  )(params, batch)
  want_loss, want_grads = 0.0, jax.tree.map(np.zeros_like, params)
  for i in range(steps):
    micro = {k: v[i::steps] for k, v in batch.items()}  # rows i, i+k, ...
    l, g = jax.value_and_grad(_loss_fn)(
        params, micro, jax.random.fold_in(rng, i)
    )
    want_loss += float(l) / steps
    want_grads = jax.tree.map(
        lambda a, b: a + np.asarray(b) / steps, want_grads, g
    )
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  for key in params:
    np.testing.assert_allclose(
        grads[key], want_grads[key], rtol=1e-5, atol=1e-6
    )
    assert grads[key].dtype == params[key].dtype


def test_sharded_batch_gives_the_same_mean_gradient():
  """Guards: the sharding branch (a mesh's batch sharding and the params'
  shardings given, as the trainer does) dropping or mis-ranking a microbatch
  (P(None, ...) for the microbatch axis) or the accumulators."""
  params, batch = _problem()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rng = jax.random.PRNGKey(5)
  plain = jax.jit(
      lambda p, b: grad_accum.value_and_grad(_loss_fn, p, b, rng, 3)
  )(params, batch)
  sharded = jax.jit(
      lambda p, b: grad_accum.value_and_grad(
          _loss_fn,
          p,
          b,
          rng,
          3,
          batch_sharding=rows,
          param_shardings={"w": replicated, "b": replicated},
      )
  )(params, batch)
  np.testing.assert_allclose(float(sharded[0]), float(plain[0]), rtol=1e-6)
  for key in params:
    np.testing.assert_allclose(sharded[1][key], plain[1][key], rtol=1e-6)


def test_shardings_constrain_the_microbatches_and_accumulators(monkeypatch):
  """Guards: the batch's sharding not handed to split (the stacked
  microbatches left to XLA's choice), split's spec without its leading None
  for the microbatch axis or without the batch's axes, a microbatch or the
  accumulators left unconstrained. On one CPU device jax normalises every
  spec to P(), so no number shows these (on a pod each gathers or
  re-shards every microbatch); the oracle is what reaches
  jax.lax.with_sharding_constraint, recorded: microbatches stacked
  (3, 4, ...) as P(None, "data"), each microbatch (4, ...) as P("data"),
  the float32 accumulators as the params' shardings."""
  P = jax.sharding.PartitionSpec  # pylint: disable=invalid-name
  params, batch = _problem()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  rows = jax.sharding.NamedSharding(mesh, P("data"))
  replicated = jax.sharding.NamedSharding(mesh, P())
  constrain, seen = jax.lax.with_sharding_constraint, []

  def recording(x, shardings):
    # One sharding for a whole tree, or a tree of them.
    if isinstance(shardings, jax.sharding.Sharding):
      seen.append(jax.tree.map(lambda a: (a.shape, shardings.spec), x))
    else:
      seen.append(jax.tree.map(lambda a, s: (a.shape, s.spec), x, shardings))
    return constrain(x, shardings)

  monkeypatch.setattr(jax.lax, "with_sharding_constraint", recording)
  jax.jit(
      lambda p, b: grad_accum.value_and_grad(
          _loss_fn,
          p,
          b,
          jax.random.PRNGKey(5),
          3,
          batch_sharding=rows,
          param_shardings={"w": replicated, "b": replicated},
      )
  )(params, batch)
  assert {"w": ((3, 2), P()), "b": ((2,), P())} in seen
  assert ((3, 4, 3), P(None, "data")) in seen
  assert ((3, 4, 2), P(None, "data")) in seen
  assert {"x": ((4, 3), P("data")), "y": ((4, 2), P("data"))} in seen


def test_one_step_is_plain_value_and_grad():
  """Guards: k = 1 taking the scan path (a fold_in of the rng: the k = 1 run
  would not reproduce runs made without accumulation)."""
  params, batch = _problem()
  rng = jax.random.PRNGKey(3)
  loss, grads = grad_accum.value_and_grad(_loss_fn, params, batch, rng, 1)
  want_loss, want_grads = jax.value_and_grad(_loss_fn)(params, batch, rng)
  assert float(loss) == float(want_loss)
  for key in params:
    np.testing.assert_array_equal(grads[key], want_grads[key])


def test_bfloat16_gradients_are_summed_in_float32():
  """Guards: accumulators in the params' bfloat16 (k additions lose bits):
  microbatch gradients 256, 1, 1, ... sum to 263 in float32 (mean 32.875,
  33 in bfloat16), but 256 + 1 rounds back to 256 in bfloat16 (mean 32)."""
  steps = 8
  # d loss / d w = mean(x) over the microbatch; microbatch 0 = rows 0 and 8.
  x = np.ones((steps * 2, 1), np.float32)
  x[[0, steps]] = 256.0
  params = {"w": jnp.zeros((), jnp.bfloat16)}
  batch = {"x": jnp.asarray(x)}

  def loss_fn(p, b, rng):
    del rng
    return jnp.mean(b["x"][:, 0] * p["w"])

  _, grads = grad_accum.value_and_grad(
      loss_fn, params, batch, jax.random.PRNGKey(0), steps
  )
  assert grads["w"].dtype == jnp.bfloat16
  assert float(grads["w"]) == 33.0


@pytest.mark.parametrize(
    "steps, batch_size, devices",
    [(1, 1, 1), (1, 8, 1), (2, 8, 2), (4, 16, 2), (3, 6, 1)],
)
def test_check_accepts_dividing_steps(steps, batch_size, devices):
  """Guards: the divisibility checks rejecting valid configs (a batch that
  per device is a multiple of k)."""
  assert grad_accum.check(steps, batch_size, devices) == steps


def test_check_errors_name_the_numbers():
  """Guards: error messages with the wrong numbers (a per-device batch or a
  suggested multiple a user would follow into a second error)."""
  with pytest.raises(ValueError) as e:
    grad_accum.check(2, 6, 4)
  assert str(e.value) == (
      "input.batch_size=6 is not divisible by the 4 devices the batch is split"
      " over (the mesh's data and fsdp axes): use a multiple of 8, or a mesh"
      " with fewer data/fsdp devices."
  )
  with pytest.raises(ValueError) as e:
    grad_accum.check(3, 8, 2)
  assert str(e.value) == (
      "grad_accum_steps=3 does not divide the per-device batch:"
      " input.batch_size=8 over 2 device(s) is 4 per device. Choose"
      " grad_accum_steps dividing it, or a batch size divisible by 6."
  )
  with pytest.raises(ValueError) as e:
    grad_accum.check(0, 8, 1)
  assert str(e.value) == (
      "grad_accum_steps=0: use a positive integer (1 = no accumulation)."
  )
