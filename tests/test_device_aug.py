"""On-device shifts and flips (data/device_aug.py, config.device_aug)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite.data import device_aug


def _shifted(img, dy, dx, fill):
  """img [H,W,C] moved down by dy and right by dx, `fill` shifted in (numpy reference)."""
  h, w, _ = img.shape
  out = np.full_like(img, fill)
  out[max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = img[
      max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
  ]
  return out


def test_translate_is_a_whole_pixel_shift_with_every_offset_drawn():
  s, fill = 2, -1.0
  images = (
      np.random.RandomState(0).normal(size=(300, 7, 6, 2)).astype(np.float32)
  )
  out = np.asarray(
      jax.jit(lambda r, x: device_aug.translate(r, x, s, fill))(
          jax.random.PRNGKey(1), images
      )
  )
  assert out.shape == images.shape and out.dtype == images.dtype
  seen = set()
  for img, got in zip(images, out):
    matches = [
        (dy, dx)
        for dy in range(-s, s + 1)
        for dx in range(-s, s + 1)
        if np.array_equal(got, _shifted(img, dy, dx, fill))
    ]
    assert (
        len(matches) == 1
    ), "each output must be exactly one shift of its own input"
    seen.add(matches[0])
  assert len(seen) == (2 * s + 1) ** 2  # all 25 offsets occur in 300 draws


def test_flip_lr_mirrors_about_half_the_batch():
  images = (
      np.random.RandomState(0).normal(size=(200, 4, 5, 3)).astype(np.float32)
  )
  out = np.asarray(
      device_aug.flip_lr(jax.random.PRNGKey(0), jnp.asarray(images))
  )
  flipped = [np.array_equal(o, i[:, ::-1]) for o, i in zip(out, images)]
  kept = [np.array_equal(o, i) for o, i in zip(out, images)]
  assert all(f != k for f, k in zip(flipped, kept))
  assert 70 < sum(flipped) < 130


def test_make_builds_the_configured_chain_deterministically():
  fn = device_aug.make({"translate": 1, "fill": 0.5, "flip_lr": True})
  images = jnp.asarray(
      np.random.RandomState(0).normal(size=(64, 5, 5, 1)), jnp.float32
  )
  a, b = fn(jax.random.PRNGKey(3), images), fn(jax.random.PRNGKey(3), images)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  c = fn(jax.random.PRNGKey(4), images)
  assert not np.array_equal(np.asarray(a), np.asarray(c))
  assert np.any(np.asarray(a) == 0.5)  # the fill value was shifted in somewhere
  assert device_aug.make(None) is None and device_aug.make({}) is None
  assert device_aug.make({"translate": 0, "flip_lr": False}) is None


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"translate": 2, "flip": True}, r"unknown key\(s\) \['flip'\]"),
        ({"translate": -1}, "translate must be an int >= 0"),
        ({"translate": "2"}, "translate must be an int >= 0"),
        ({"translate": True}, "translate must be an int >= 0"),
        (
            {"translate": 1, "fill": "black"},
            "could not convert string to float: 'black'",
        ),
    ],
)
def test_bad_config_is_a_one_line_error(cfg, match):
  with pytest.raises(ValueError, match=match) as e:
    device_aug.make(cfg)
  assert "\n" not in str(e.value)


def test_fill_of_integer_images():
  images = jnp.zeros((2, 6, 6, 1), jnp.uint8)
  out = device_aug.translate(jax.random.PRNGKey(0), images, 2, 7)
  assert out.dtype == jnp.uint8 and set(np.unique(np.asarray(out))) <= {0, 7}
