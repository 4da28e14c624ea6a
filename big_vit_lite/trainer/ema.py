"""An exponential moving average (EMA) of the weights, kept in the train state.

config.ema_decay = 0.9999 (unset: no EMA). After each optimizer step

    ema <- d * ema + (1 - d) * params,   d = min(ema_decay, (1 + t) / (10 + t))

(optax.incremental_update; t the step just taken, counting from 0: the
warm-up of tf.train.ExponentialMovingAverage's num_updates, so that a short
run does not average in its initial weights for ~1/(1 - ema_decay) steps).
The average starts as a copy of the initial (or model_init) params, is
saved in the checkpoint as `ema` beside `params` (so kill/resume stays bit
exact) and is what an eval with `use_ema=True` scores; `evaluate` and
`export` read it with `--config.use_ema=True` / `--params=ema`.
"""

import jax
import jax.numpy as jnp
import optax

KEY = "ema"  # The train state's / checkpoint's key.


class Ema:
  """The EMA update of one config (`decay` in [0, 1))."""

  def __init__(self, decay):
    self.decay = float(decay)

  @staticmethod
  def init(params, shardings):
    """A copy of `params` in their own buffers (the step donates both trees)."""
    return jax.tree.map(
        lambda x, s: jax.device_put(x, s, may_alias=False), params, shardings
    )

  def update(self, ema, params, step):
    t = jnp.asarray(step, jnp.float32)
    decay = jnp.minimum(self.decay, (1.0 + t) / (10.0 + t))
    new = optax.incremental_update(params, ema, 1.0 - decay)
    return jax.tree.map(lambda n, o: n.astype(o.dtype), new, ema)


def from_config(config):
  """An Ema for config.ema_decay, or None when it is unset."""
  decay = config.get("ema_decay", None)
  if decay is not None and not 0 <= float(decay) < 1:
    raise ValueError(
        f"config.ema_decay={decay} must be in [0, 1), e.g. 0.9999 (1 would never "
        "move the average; unset: no EMA)."
    )
  return None if decay is None else Ema(decay)
