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
from big_vit_lite.data.pp.registry import build_op, known_ops, register, register_image_op  # noqa: F401

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
    raise ValueError(
        f"pp must be a non-empty string like 'decode|value_range(-1, 1)', "
        f"got {pp_string!r}"
    )
  texts = [text.strip() for text in pp_string.split("|")]
  ops = [(text, build_op(text)) for text in texts if text]

  def preprocess(data):
    data = dict(data)
    for text, op in ops:
      try:
        data = op(data)
      except KeyError as e:
        # An op reading a key the example lacks (a typo, or keep() removed it).
        have = sorted(k for k in data if not k.startswith("_"))
        raise op_error(
            text,
            f"the example has no key {e.args[0]!r} (it has {have}); "
            f"check the key names of the ops before it",
        ) from None
      except (ValueError, TypeError) as e:
        raise op_error(text, e) from e
    return data

  return preprocess


def output_hw(pp_string, key="image", channels=3):
  """(height, width) that the pp gives `key` whatever the input, else None.

  Found by tracing the pp on symbolic inputs (encoded bytes, then a decoded
  uint8 image of any size), so it follows key=/inkey=/outkey= and copies
  exactly as the pipeline will: in "decode|resize(64)|copy('image', 'prof')|
  resize(32, key='prof')" the image is 64x64. None when the size depends on
  the input (resize_small without a crop), or the pp needs features other
  than image and label.
  """
  fn = tf.function(get_preprocess_fn(pp_string), autograph=False)
  specs = {
      "label": tf.TensorSpec([], tf.int64),
      RNG_KEY: tf.TensorSpec([2], tf.int64),
  }
  for image in (
      tf.TensorSpec([], tf.string),
      tf.TensorSpec([None, None, channels], tf.uint8),
  ):
    try:
      traced = fn.get_concrete_function({"image": image, **specs})
    except (ValueError, TypeError, KeyError, tf.errors.OpError):
      continue
    out = traced.structured_outputs
    if not isinstance(out, dict) or key not in out:
      return None
    shape = out[key].shape
    if shape.rank == 3 and shape[:2].is_fully_defined():
      return tuple(shape[:2])
    return None
  return None


def op_error(op_text, reason):
  """A one-line ValueError naming the op, that survives tf.data's tracing.

  Where tf.data traces the pp function with autograph (a user's own
  `ds.map(get_preprocess_fn(...))`; our input pipeline does not convert it),
  autograph rewrites any error raised inside into a multi-line "in user
  code: ..." report; `ag_pass_through` tells it to re-raise this one as it is.
  """
  message = " ".join(str(reason).split())
  if not message.startswith("pp op "):
    message = f"pp op {op_text!r}: {message}"
  e = ValueError(message)
  e.ag_pass_through = True
  return e


def ensure_rng(data, seed=0):
  """Adds a fixed `_rng` when the caller provided none (e.g. ad-hoc use)."""
  if RNG_KEY in data:
    return data
  return {**data, RNG_KEY: tf.constant([seed, 0], tf.int64)}
