"""Helpers shared by the test files (not tests themselves)."""

import numpy as np
import pytest

from big_vit_lite.models import layout


def one_line_error(fn, *words, error=ValueError):
  """Calls fn, which must raise `error` with a one-line message holding every word; returns it."""
  with pytest.raises(error) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg, msg
  for w in words:
    assert w in msg, msg
  return msg


def padded_batches(label_rows, key, batch_size):
  """Eval batches of row ids and their labels under `key`, the last one padded
  as the eval pipeline pads: row 0 repeated with `_mask` False."""
  n = len(label_rows)
  batches = []
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size)
    valid = idx < n
    rows = np.where(valid, idx, 0)
    batches.append({"image": rows, key: label_rows[rows], "_mask": valid})
  return batches


def record_eval_reads(monkeypatch):
  """The splits input_pipeline.make_eval_iterator is asked for, in order (a
  list that grows as the code under test reads); the reads still happen."""
  # Here: it loads TensorFlow, which most users of these helpers never need.
  from big_vit_lite.data import input_pipeline  # pylint: disable=import-outside-toplevel

  reads = []
  real = input_pipeline.make_eval_iterator

  def recording(*args, **kwargs):
    reads.append(args[0]["split"])
    return real(*args, **kwargs)

  monkeypatch.setattr(input_pipeline, "make_eval_iterator", recording)
  return reads


def set_dotted(config, overrides):
  """config["a"]["b"] = v for each "a.b": v of `overrides`, as --config.a.b=v would."""
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def assert_same_params(a, b):
  """Two param trees (boxed or plain, any device) hold the same names, in order, and bits."""
  fa, fb = layout.to_numpy_flat(a), layout.to_numpy_flat(b)
  assert list(fa) == list(fb)
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


# A tiny ViT for the model and checkpoint-format tests (test_vit, test_npz,
# test_timm, ...).
TINY_VIT = dict(
    variant=None,
    width=32,
    depth=2,
    mlp_dim=64,
    num_heads=2,
    patch_size=4,
    head_zeroinit=False,
    remat_policy=None,
)
POSEMB = "Transformer/posembed_input/pos_embedding"


def tiny_vit(**kw):
  """vit.Model of TINY_VIT with 10 classes; kw override."""
  from big_vit_lite.models import vit  # pylint: disable=import-outside-toplevel

  return vit.Model(**{"num_classes": 10, **TINY_VIT, **kw})


def vit_shapes(hw=(16, 16), channels=3, **kw):
  """tiny_vit(**kw)'s abstract params (jax.ShapeDtypeStruct leaves, boxed) for hw images."""
  import jax  # pylint: disable=import-outside-toplevel

  return jax.eval_shape(
      tiny_vit(**kw).init,
      jax.random.key(0),
      jax.numpy.zeros((1, *hw, channels)),
  )["params"]


def vit_params(hw=(16, 16), seed=0, channels=3, boxed=False, **kw):
  """tiny_vit(**kw)'s params with random values (an eager init takes seconds): plain, or boxed
  as init returns them."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(seed)
  params = jax.tree.map(
      lambda box: box.replace_boxed(
          rng.normal(0, 0.1, box.value.shape).astype(box.value.dtype)
      ),
      vit_shapes(hw, channels, **kw),
      is_leaf=lambda x: isinstance(x, nn.Partitioned),
  )
  return params if boxed else nn.meta.unbox(params)


def tracked_config(**kw):
  """config_loading.TrackedConfig of a ConfigDict of kw (a config that reports unread keys)."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from big_vit_lite.config import config_loading  # pylint: disable=import-outside-toplevel

  return config_loading.TrackedConfig(ml_collections.ConfigDict(kw))


def tiny_train_params():
  """The ViT params of tests/train_config_tiny.py's model (28x28x1 images), every value 0.5."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from big_vit_lite.models import vit  # pylint: disable=import-outside-toplevel
  import train_config_tiny  # pylint: disable=import-outside-toplevel

  model = vit.Model(**train_config_tiny.get_config().model)
  shapes = jax.eval_shape(
      model.init, jax.random.key(0), jax.numpy.zeros((1, 28, 28, 1))
  )["params"]
  return jax.tree.map(
      lambda s: jax.numpy.full(s.shape, 0.5, s.dtype), nn.meta.unbox(shapes)
  )


def _linear_weights(old, new):
  """(new, old) matrix of 1-D linear interpolation at half-pixel centres, as an image resize
  samples: output i sits at input coordinate (i + 0.5) * old / new - 0.5; when shrinking, the
  triangle kernel widens by old / new (antialiasing); weights falling outside are dropped and
  each row renormalised (the edge rows then take the edge values)."""
  widen = max(old / new, 1.0)
  centres = (np.arange(new) + 0.5) * old / new - 0.5
  distance = np.abs(np.arange(old)[None, :] - centres[:, None]) / widen
  weights = np.maximum(0.0, 1.0 - distance)
  return weights / weights.sum(axis=1, keepdims=True)


def posemb_resized(posemb, old_hw, new_hw):
  """A second implementation of posemb.resample (numpy, separable, float64), its test oracle:
  (1, h*w, D) rows in raster order -> (1, new_h*new_w, D)."""
  d = posemb.shape[-1]
  grid = np.asarray(posemb, np.float64).reshape(*old_hw, d)
  rows = _linear_weights(old_hw[0], new_hw[0])
  cols = _linear_weights(old_hw[1], new_hw[1])
  return np.einsum("yh,xw,hwd->yxd", rows, cols, grid).reshape(1, -1, d)
