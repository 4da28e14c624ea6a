"""The EMA of the weights against a float64 numpy recurrence and optax.

The recurrence (ema.py's docstring, tf.train.ExponentialMovingAverage with
num_updates): ema <- d ema + (1 - d) p, d = min(decay, (1 + t) / (10 + t)).
Params change every step and the run crosses the end of the warm-up, so a
swapped d / 1 - d, a warm-up off by one step or a dropped min() all move the
average.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from big_vit_lite.trainer import ema as ema_lib


def _numpy_ema(decay, ema0, params_by_step, first_step):
  ema = np.asarray(ema0, np.float64)
  for i, p in enumerate(params_by_step):
    t = first_step + i
    d = min(decay, (1.0 + t) / (10.0 + t))
    ema = d * ema + (1.0 - d) * np.asarray(p, np.float64)
  return ema


@pytest.mark.parametrize("decay, first_step", [(0.5, 0), (0.9, 3), (0.97, 40)])
def test_update_follows_the_warmed_up_recurrence(decay, first_step):
  """Guards: the decay's warm-up formula wrong ((t)/(10+t), (1+t)/(1+t) ...),
  min() replaced by max(), d and 1 - d swapped, the step not used; checked
  across the warm-up's end ((1+t)/(10+t) passes 0.5 at t=8, 0.9 at t=80)."""
  rng = np.random.default_rng(0)
  steps = 12
  params = rng.normal(size=(steps, 2, 3))
  ema0 = rng.normal(size=(2, 3))
  ema = ema_lib.Ema(decay)
  avg = {"w": jnp.asarray(ema0, jnp.float32)}
  for i in range(steps):
    avg = ema.update(
        avg, {"w": jnp.asarray(params[i], jnp.float32)}, first_step + i
    )
  want = _numpy_ema(decay, ema0, params, first_step)
  np.testing.assert_allclose(np.asarray(avg["w"]), want, rtol=2e-5, atol=2e-6)


def test_update_matches_optax_ema_past_the_warm_up():
  """Guards: the same as above against a second implementation: optax.ema
  (debias off) is ema <- d ema + (1 - d) p at a constant d, which the
  warmed-up decay is once (1 + t) / (10 + t) >= decay."""
  decay = 0.8  # (1 + t) / (10 + t) >= 0.8 from t = 36
  rng = np.random.default_rng(1)
  params = [
      {"w": jnp.asarray(rng.normal(size=4), jnp.float32)} for _ in range(5)
  ]
  ema0 = {"w": jnp.asarray(rng.normal(size=4), jnp.float32)}
  tx = optax.ema(decay, debias=False)
  state = tx.init(ema0)
  state = state._replace(ema=ema0)
  ours = ema0
  for i, p in enumerate(params):
    ours = ema_lib.Ema(decay).update(ours, p, 100 + i)
    _, state = tx.update(p, state)
  np.testing.assert_allclose(ours["w"], state.ema["w"], rtol=1e-6, atol=1e-7)


def test_update_keeps_each_leaf_dtype_and_tree():
  """Guards: the average cast to the params' dtype (or float32) rather than
  kept in its own (a bfloat16 EMA of float32 params, a jit output sharding
  mismatch), or leaves paired across the tree wrongly."""
  ema = ema_lib.Ema(0.5)
  avg = {"a": jnp.zeros(2, jnp.float32), "b": jnp.full(2, 4.0, jnp.bfloat16)}
  params = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.zeros(2, jnp.float32)}
  new = ema.update(avg, params, 100)
  assert new["a"].dtype == jnp.float32 and new["b"].dtype == jnp.bfloat16
  # d = 0.5: halfway between the average and the params, leaf by leaf.
  np.testing.assert_allclose(np.asarray(new["a"], np.float32), 0.5)
  np.testing.assert_allclose(np.asarray(new["b"], np.float32), 2.0)


def test_init_copies_params_into_their_shardings():
  """Guards: init returning the params themselves (the step donates both
  trees: a shared buffer is deleted under the other) or dropping the
  shardings it is given."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = {"w": jnp.arange(4.0), "b": jnp.ones(2)}
  shardings = {"w": sharding, "b": sharding}
  copy = ema_lib.Ema.init(params, shardings)
  for key in params:
    np.testing.assert_array_equal(copy[key], params[key])
    assert copy[key].sharding == sharding
    assert copy[key] is not params[key]
    assert (
        copy[key].unsafe_buffer_pointer() != params[key].unsafe_buffer_pointer()
    )


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.9999])
def test_from_config_keeps_the_decay(decay):
  """Guards: config.ema_decay not passed through (or the range check
  rejecting valid decays such as 0, the no-smoothing EMA)."""
  ema = ema_lib.from_config(ml_collections.ConfigDict(dict(ema_decay=decay)))
  assert isinstance(ema, ema_lib.Ema) and ema.decay == decay
  assert ema_lib.from_config(ml_collections.ConfigDict()) is None


@pytest.mark.parametrize("decay", [1.0, -0.1, 1.5])
def test_from_config_rejects_decays_outside_0_1(decay):
  """Guards: a decay of 1 (the average never moves) or outside [0, 1)
  accepted silently, or an error that stops saying what to do."""
  with pytest.raises(ValueError) as e:
    ema_lib.from_config(ml_collections.ConfigDict(dict(ema_decay=decay)))
  assert str(e.value) == (
      f"config.ema_decay={decay} must be in [0, 1), e.g. 0.9999 (1 would never"
      " move the average; unset: no EMA)."
  )
