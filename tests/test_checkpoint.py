"""Checkpointer (orbax): round trip, retention policy, atomicity, load_params sources."""
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from big_vit_lite import checkpoint


def _state(scale=1.0):
  params = {"head": {"kernel": jnp.full((3, 2), scale), "bias": jnp.zeros(2)},
            "embedding": {"kernel": jnp.arange(6.0).reshape(2, 3) * scale}}
  return dict(params=params, opt_state=optax.adam(1e-3).init(params),
              step=jnp.array(5, jnp.int32), rng=jax.random.PRNGKey(7))


def _abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_round_trip_holds_state_data_position_and_config(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  state = _state(2.0)
  cfg = ml_collections.ConfigDict(dict(lr=0.1, model=dict(variant="mu/16")))
  ckpt.save(5, state, {"examples_per_shard": 80, "num_shards": 1}, cfg)
  ckpt.close()

  ckpt = checkpoint.Checkpointer(str(tmp_path))
  assert ckpt.latest_step() == 5
  restored, data_state = ckpt.restore(5, _abstract(_state()))
  assert data_state == {"examples_per_shard": 80, "num_shards": 1}
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)  # Structure rebuilt.

  for src in (str(tmp_path), os.path.join(tmp_path, "checkpoints", "5")):
    params, config = checkpoint.load_params(src)
    np.testing.assert_array_equal(params["head"]["kernel"], np.full((3, 2), 2.0))
    assert isinstance(params["head"]["kernel"], np.ndarray)
    assert config.model.variant == "mu/16"


def test_keeps_last_n_plus_every_kth(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path), keep=2, keep_every=4, async_save=False)
  for step in range(1, 10):
    ckpt.save(step, _state(step), {}, None)
  ckpt.close()
  assert sorted(checkpoint.Checkpointer(str(tmp_path)).all_steps()) == [4, 8, 9]


def test_incomplete_save_is_invisible(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  ckpt.save(3, _state(3.0), {}, None)
  ckpt.close()
  # What a kill in the middle of saving step 6 leaves behind: orbax's temporary directory.
  os.makedirs(tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp" / "state")
  assert checkpoint.Checkpointer(str(tmp_path)).latest_step() == 3
  params, _ = checkpoint.load_params(str(tmp_path))
  np.testing.assert_array_equal(params["head"]["kernel"], np.full((3, 2), 3.0))


def test_load_params_from_npz_and_bad_paths(tmp_path):
  path = str(tmp_path / "p.npz")
  np.savez(path, **{"head/kernel": np.ones((2, 2)), "cls": np.zeros((1, 1, 2))})
  params, config = checkpoint.load_params(path)
  assert config is None and params["head"]["kernel"].shape == (2, 2) and "cls" in params
  with pytest.raises(ValueError, match="does not exist"):
    checkpoint.load_params(str(tmp_path / "missing"))
  os.makedirs(tmp_path / "empty")
  with pytest.raises(ValueError, match="No complete checkpoint"):
    checkpoint.load_params(str(tmp_path / "empty"))
