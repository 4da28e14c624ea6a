"""The preprocessing language: `get_preprocess_fn("decode|flip_lr|...")`.

Syntax: ops separated by "|" (so no "|" inside string arguments), each
`name` or `name(literal args, key=literal)`. Ops live in ops_general (keys,
labels), ops_image (decode, crops, resizes, flips, value ranges) and
randaug; importing this package registers them all.
"""
import tensorflow as tf

from big_vit_lite.data.pp import ops_general  # noqa: F401  (registers ops)
from big_vit_lite.data.pp import ops_image  # noqa: F401
from big_vit_lite.data.pp import randaug  # noqa: F401
from big_vit_lite.data.pp.registry import build_op, known_ops, register  # noqa: F401

# Random ops draw their seeds from this key (a stateless [2] int seed that
# the input pipeline derives from (seed, shard, epoch, example index)), so
# an example's augmentation is a pure function of its position: that is
# what makes resuming exact.
from big_vit_lite.data.pp.rng import RNG_KEY  # noqa: E402


def get_preprocess_fn(pp_string):
  """Builds `example_dict -> example_dict` from a pp string.

  Raises ValueError (one line, naming the op) on an unknown op or bad args.
  """
  if not isinstance(pp_string, str) or not pp_string.strip():
    raise ValueError(f"pp must be a non-empty string like 'decode|value_range(-1, 1)', "
                     f"got {pp_string!r}")
  ops = [build_op(text) for text in pp_string.split("|") if text.strip()]

  def preprocess(data):
    data = dict(data)
    for op in ops:
      data = op(data)
    return data

  return preprocess


def ensure_rng(data, seed=0):
  """Adds a fixed `_rng` when the caller provided none (e.g. ad-hoc use)."""
  if RNG_KEY not in data:
    data = dict(data, **{RNG_KEY: tf.constant([seed, 0], tf.int64)})
  return data
