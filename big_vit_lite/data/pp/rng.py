"""Per-example stateless randomness for pp ops.

The input pipeline puts a [2] int seed under `_rng` in every example; a
random op takes a fresh sub-seed with `take_seed` (which also advances the
example's `_rng`), so two random ops never share randomness and the whole
chain stays a pure function of (seed, example position).
"""

import tensorflow as tf

RNG_KEY = "_rng"


def take_seed(data, op_name):
  """Returns (data with advanced _rng, a [2] int32 seed for one random op)."""
  if RNG_KEY not in data:
    raise ValueError(
        f"pp op {op_name!r} is random and needs the per-example seed "
        f"'{RNG_KEY}' (the input pipeline adds it; for ad-hoc use call "
        f"big_vit_lite.data.pp.ensure_rng(example))"
    )
  seed = data[RNG_KEY]
  # Advance by a counter, not stateless_split: tf scrambles stateless seeds
  # (Philox) before use, so seeds (a, b) and (a, b + 1) give independent
  # streams, and one add is far cheaper per example than a split kernel.
  return {**data, RNG_KEY: seed + tf.constant([0, 1], seed.dtype)}, seed
