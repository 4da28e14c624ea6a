"""Checkpointer options that decide what is on disk when, and what a run directory reads as.

Oracle: the files themselves (orbax's complete steps), read the moment
`save` returns, with no wait or close in between; checkpoints of known
numbers saved here.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from big_vit_lite.models import loading
from big_vit_lite.models import vit
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


def test_a_workdir_reads_as_its_newest_step_and_ema_as_the_ema(tmp_path):
  """Guards: a workdir read at its oldest kept step, not its newest
  (evaluate, export, predict and model_init of a run directory scoring old
  weights), and `--params=ema` / `use_ema=True` silently reading the params
  (the key not passed on to the checkpoint read). Oracle: two real
  checkpoints saved here, each step's params and EMA filled with known
  numbers."""
  model = vit.Model(
      num_classes=2,
      variant=None,
      width=8,
      depth=1,
      mlp_dim=16,
      num_heads=2,
      patch_size=8,
  )
  shapes = jax.eval_shape(
      model.init, jax.random.key(0), jnp.zeros((1, 8, 8, 3))
  )
  shapes = nn.meta.unbox(shapes["params"])
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  for step in (4, 8):
    fill = lambda value: jax.tree.map(  # noqa: E731
        lambda s: jnp.full(s.shape, value, s.dtype), shapes
    )
    ckpt.save(step, dict(params=fill(step), ema=fill(step + 0.5)), {}, None)
  ckpt.close()
  for key, value in (("params", 8.0), ("ema", 8.5)):
    flat, _, step = loading.read_source(str(tmp_path), key)
    assert step == 8
    assert flat and all(np.all(v == value) for v in flat.values()), key
