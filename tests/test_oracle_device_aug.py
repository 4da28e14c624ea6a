"""On-device shifts and flips against TF's image ops and their draw statistics.

The oracle for a shift is the pp's own recipe in TensorFlow: pad by s with the
fill value, then crop back at an offset (tf.image.crop_to_bounding_box); for a
flip, tf.image.flip_left_right. Every pixel of the test images is distinct, so
each output matches exactly one candidate.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from big_vit_lite.data import device_aug

H, W, C = 5, 6, 2


def _images(b):
  # Distinct positive values: a shift, a flip and the fill (<= 0) all show.
  return np.arange(1, b * H * W * C + 1, dtype=np.float32).reshape(b, H, W, C)


def _candidates(images, s, fill, flips):
  """[(dy, dx, flipped)], [K, B, H, W, C]: every crop of the padded batch (TF)."""
  padded = tf.pad(
      images, [[0, 0], [s, s], [s, s], [0, 0]], constant_values=fill
  )
  keys, crops = [], []
  for dy in range(2 * s + 1):
    for dx in range(2 * s + 1):
      crop = tf.image.crop_to_bounding_box(padded, dy, dx, H, W)
      keys.append((dy, dx, False))
      crops.append(crop.numpy())
      if flips:
        keys.append((dy, dx, True))
        crops.append(tf.image.flip_left_right(crop).numpy())
  return keys, np.stack(crops)


def _which(images, outputs, s, fill, flips):
  """Per example, the one (dy, dx, flipped) whose TF result is its output."""
  keys, crops = _candidates(images, s, fill, flips)
  match = np.all(crops == outputs[None], axis=(2, 3, 4))  # [K, B]
  assert np.all(
      match.sum(0) == 1
  ), "an output is not one pad-and-crop of its input"
  return [keys[k] for k in match.argmax(0)]


def test_translate_offsets_are_uniform_and_independent_per_example():
  """Guards: offsets drawn from a narrower or shifted range (randint's bound
  off by one), one offset for the whole batch, or the same offset for both
  axes; the fill value not the one shifted in."""
  # b = 600: an off-by-one upper bound (offsets 0..3, the 3 clamped to 2 by
  # dynamic_slice) puts 300 draws on offset 2 against 200 +- 5 sd (58).
  s, fill, b = 1, -3.0, 600
  images = _images(b)
  out = np.asarray(
      device_aug.translate(jax.random.PRNGKey(0), jnp.asarray(images), s, fill)
  )
  found = np.array([k[:2] for k in _which(images, out, s, fill, False)])
  # 3 values per axis, uniform: each expected b/3 times, sd sqrt(b p (1-p)).
  sd = np.sqrt(b * (1 / 3) * (2 / 3))
  for axis in range(2):
    counts = np.bincount(found[:, axis], minlength=3)
    assert np.all(np.abs(counts - b / 3) < 5 * sd), counts
  # Independent axes: dy == dx about 1/3 of the time, not always.
  same = np.mean(found[:, 0] == found[:, 1])
  assert abs(same - 1 / 3) < 5 * np.sqrt(2 / 9 / b), same


def test_flip_lr_is_tf_flip_left_right_with_probability_half():
  """Guards: a flip of another axis (up-down, channels), a probability other
  than 1/2, or one coin for the whole batch."""
  b = 400
  images = _images(b)
  out = np.asarray(
      device_aug.flip_lr(jax.random.PRNGKey(1), jnp.asarray(images))
  )
  mirrored = tf.image.flip_left_right(images).numpy()
  flipped = np.all(out == mirrored, axis=(1, 2, 3))
  kept = np.all(out == images, axis=(1, 2, 3))
  assert np.all(flipped ^ kept)
  assert abs(flipped.mean() - 0.5) < 5 * np.sqrt(0.25 / b), flipped.mean()


def test_make_defaults_no_flip_and_zero_fill():
  """Guards: config.device_aug's defaults changed (fill 0.0, flip_lr off):
  translate alone must shift in zeros and never flip; flip alone must not
  shift."""
  b = 40
  images = _images(b)
  shift_only = device_aug.make({"translate": 1})
  out = np.asarray(shift_only(jax.random.PRNGKey(2), jnp.asarray(images)))
  found = _which(images, out, 1, 0.0, flips=True)
  assert not any(k[2] for k in found)  # never flipped
  assert any(k[:2] != (1, 1) for k in found)  # shifted
  flip_only = device_aug.make({"flip_lr": True})
  out = np.asarray(flip_only(jax.random.PRNGKey(3), jnp.asarray(images)))
  found = _which(images, out, 1, 0.0, flips=True)
  assert all(k[:2] == (1, 1) for k in found)  # never shifted
  assert 0 < sum(k[2] for k in found) < b  # some flipped, some not


def test_make_chains_shift_and_flip_with_the_configured_fill():
  """Guards: one of the two augmentations dropped when both are configured,
  or the fill value not passed through."""
  b = 60
  images = _images(b)
  fn = device_aug.make({"translate": 1, "fill": -1.0, "flip_lr": True})
  out = np.asarray(fn(jax.random.PRNGKey(4), jnp.asarray(images)))
  found = _which(images, out, 1, -1.0, flips=True)
  assert any(k[2] for k in found) and not all(k[2] for k in found)
  assert any(k[:2] != (1, 1) for k in found)
  assert np.any(out == -1.0)


@pytest.mark.parametrize(
    "cfg", [None, {}, {"translate": 0}, {"flip_lr": False}]
)
def test_make_is_none_when_nothing_is_on(cfg):
  """Guards: an identity augmentation (an extra split of the step's rng)
  where nothing is configured."""
  assert device_aug.make(cfg) is None


def test_config_errors_name_the_config_key():
  """Guards: an error that names another key than the one a user wrote
  (config.device_aug / config.device_aug.translate)."""
  with pytest.raises(ValueError) as e:
    device_aug.make({"translate": 2, "flip": True})
  assert str(e.value) == (
      "config.device_aug has unknown key(s) ['flip']; allowed: translate, fill,"
      " flip_lr"
  )
  with pytest.raises(ValueError) as e:
    device_aug.make({"translate": -1})
  assert str(e.value) == (
      "config.device_aug.translate must be an int >= 0, got -1"
  )
