"""pp ops on keys and labels: onehot, keep, drop, copy, rename.

As big_vision's, except (deliberately): onehot reads "label" by default
(big_vision: "labels"; our datasets give "label"), its result is always
float32, and a label outside [0, depth) or of a non-integer dtype is an
error; keep fails on a missing key and never drops the pipeline's "_" keys;
rename is ours.
"""

import tensorflow as tf

from big_vit_lite.data import count
from big_vit_lite.data.pp.registry import register


def _internal(key):
  # Keys starting with "_" (the per-example seed, the eval mask) belong to
  # the pipeline, not to the user: keep() never drops them.
  return key.startswith("_")


@register("onehot")
def get_onehot(
    depth, key="label", key_result=None, multi=True, on=1.0, off=0.0
):
  """One-hot (or k-hot for a vector of labels when multi) float32 labels.

  `on`/`off` give label smoothing, e.g. on=0.9+0.1/K, off=0.1/K.
  """
  depth = count(depth, "depth", 1)
  key_result = key_result or key

  def op(data):
    labels = data[key]
    if not labels.dtype.is_integer:
      # A cast would truncate 2.7 to 2, and one-hot or soft labels would become
      # garbage.
      raise ValueError(
          f"needs integer class ids under {key!r}, got {labels.dtype.name} "
          f"(labels that are one-hot or soft already need no onehot)"
      )
    # (int32 would wrap a huge int64 id into range)
    labels = tf.cast(labels, tf.int64)
    # tf.one_hot silently maps a label outside [0, depth) to an all-`off`
    # vector: a depth below the class count, or the -1 ("no label") of some
    # test splits, would train or evaluate on wrong targets without a sign.
    below_depth = tf.debugging.Assert(
        tf.reduce_all(labels < depth),
        [
            f"onehot({depth}): a label is >= depth {depth}; set depth to the "
            f"number of classes; labels:",
            labels,
        ],
    )
    not_negative = tf.debugging.Assert(
        tf.reduce_all(labels >= 0),
        [
            f"onehot({depth}): a label is negative (-1 often means 'no label', "
            f"as in unlabelled test splits): use a labelled split; labels:",
            labels,
        ],
    )
    with tf.control_dependencies([below_depth, not_negative]):
      labels = tf.identity(labels)
    hot = tf.one_hot(
        labels,
        depth,
        on_value=float(on),
        off_value=float(off),
        dtype=tf.float32,
    )
    if multi and len(hot.shape) == 2:
      # k-hot: several labels per example collapse onto one vector.
      hot = tf.clip_by_value(tf.reduce_sum(hot - off, axis=0) + off, off, on)
    return {**data, key_result: hot}

  return op


@register("keep")
def get_keep(*keys):
  def op(data):
    missing = [k for k in keys if k not in data]
    if missing:
      have = sorted(k for k in data if not _internal(k))
      raise ValueError(f"keys {missing} not in the example (it has {have})")
    return {k: v for k, v in data.items() if k in keys or _internal(k)}

  return op


@register("drop")
def get_drop(*keys):
  return lambda data: {k: v for k, v in data.items() if k not in keys}


@register("copy")
def get_copy(inkey, outkey):
  return lambda data: {**data, outkey: data[inkey]}


@register("rename")
def get_rename(inkey, outkey):
  def op(data):
    out = dict(data)
    out[outkey] = out.pop(inkey)
    return out

  return op
