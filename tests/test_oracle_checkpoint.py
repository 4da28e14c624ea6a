"""Checkpointer options that decide what is on disk when, by their effect.

Oracle: the files themselves (orbax's complete steps), read the moment
`save` returns, with no wait or close in between.
"""

import jax.numpy as jnp

from big_vit_lite.trainer import checkpoint


def test_a_synchronous_save_is_complete_when_save_returns(tmp_path):
  """Guards: config.ckpt_async=False (async_save=False) not reaching orbax,
  so the save still runs in the background: a step reported saved that a
  kill a moment later loses. A state of 8 MB, so that a background write is
  still running when save returns."""
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  state = {"w": jnp.ones((2048, 1024), jnp.float32)}
  ckpt.save(3, state, {}, None)
  assert not ckpt.manager.is_saving_in_progress()
  assert checkpoint.complete_steps(str(tmp_path)) == [3]
  ckpt.close()
