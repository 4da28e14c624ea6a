"""The key and label pp ops (ops_general.py) against hand-worked values.

mutmut does not mutate decorated functions, and every op here is a
registered (decorated) factory, so these tests are what stands between a
slip in them and a run's labels. Oracle: numpy's identity matrix and label
sets written out by hand, with label smoothing on (off > 0), where the
plausible wrong versions (the smoothing added once per label, duplicate
labels summed past `on`, `on` and `off` swapped) disagree with the right one.
"""

import numpy as np
import pytest
import tensorflow as tf

from big_vit_lite.data import pp


def _run(pp_string, **data):
  fn = pp.get_preprocess_fn(pp_string)
  example = {k: tf.constant(v) for k, v in data.items()}
  example["_rng"] = tf.constant([0, 7], tf.int64)
  return {k: v.numpy() for k, v in fn(example).items()}


def test_onehot_with_smoothing_by_hand():
  """Guards: on/off swapped or ignored, the wrong depth, the result under the
  wrong key or not float32, int labels cast to float (values, not positions).
  Oracle: numpy's identity matrix, smoothed by hand: 0.1 / 4 = 0.025."""
  on, off = 0.9 + 0.025, 0.025
  for label in range(4):
    out = _run(f"onehot(4, on={on}, off={off}, key_result='y')", label=label)
    assert out["y"].dtype == np.float32
    np.testing.assert_allclose(out["y"], np.eye(4)[label] * 0.9 + off)
    assert out["label"] == label  # the input stays under its own key
  out = _run("onehot(3)", label=np.int64(2))
  np.testing.assert_array_equal(out["label"], [0, 0, 1])  # in place


def test_khot_with_smoothing_counts_each_class_once():
  """Guards: k-hot that adds `off` once per label (two labels: 2 x off on the
  other classes), duplicate labels summed past `on`, multi=False ignored (or
  multi=True ignored: one row per label). By hand: labels [0, 3, 3] of 5
  classes, on 0.9, off 0.02."""
  out = _run("onehot(5, on=0.9, off=0.02)", label=np.array([0, 3, 3]))
  np.testing.assert_allclose(out["label"], [0.9, 0.02, 0.02, 0.9, 0.02])
  out = _run("onehot(5, multi=False)", label=np.array([0, 3, 3]))
  np.testing.assert_array_equal(out["label"], np.eye(5)[[0, 3, 3]])


@pytest.mark.parametrize(
    "label, words",
    [
        (4, "a label is >= depth 4"),
        (-1, "a label is negative"),
        # int32 would wrap 2**32 + 1 to 1, a valid class
        (np.int64(2**32 + 1), "a label is >= depth 4"),
        (np.array([1, 4]), "a label is >= depth 4"),
    ],
)
def test_onehot_labels_outside_the_depth_stop(label, words):
  """Guards: a label outside [0, depth) turned silently into an all-`off`
  row (tf.one_hot's behaviour), a bound off by one (depth itself let
  through, 0 refused), an int64 label wrapped into range by an int32 cast."""
  with pytest.raises(tf.errors.InvalidArgumentError, match=words):
    _run("onehot(4)", label=label)
  np.testing.assert_array_equal(
      _run("onehot(4)", label=0)["label"], [1, 0, 0, 0]
  )


def test_onehot_of_float_labels_is_a_one_line_error():
  """Guards: float labels (soft or one-hot already) truncated to class ids."""
  with pytest.raises(ValueError, match="needs integer class ids under 'label'"):
    _run("onehot(4)", label=np.float32(2.7))


def test_keep_drop_copy_rename_by_hand():
  """Guards: keep dropping the pipeline's "_" keys (the example's seed) or
  keeping keys it was not given, drop removing other keys, copy or rename
  writing the wrong key or (rename) keeping the old one, a missing key in
  keep passed silently."""
  data = dict(image=np.uint8(1), label=2, extra=3)
  assert sorted(_run("keep('label')", **data)) == ["_rng", "label"]
  assert sorted(_run("drop('extra', 'image')", **data)) == ["_rng", "label"]
  out = _run("copy('label', 'y')", **data)
  assert sorted(out) == ["_rng", "extra", "image", "label", "y"]
  assert out["y"] == 2 and out["label"] == 2
  out = _run("rename('label', 'y')", **data)
  assert sorted(out) == ["_rng", "extra", "image", "y"] and out["y"] == 2
  with pytest.raises(ValueError, match=r"keys \['nope'\] not in the example"):
    _run("keep('label', 'nope')", **data)
