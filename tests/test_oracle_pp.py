"""The shipped pp ops against hand-worked values, TF's own image ops and draw statistics.

Oracles: value_range and pad worked by hand; inception_crop's output equals
tf.image.resize of the very crop its box names (the pixels encode their own
coordinates, so the crop's place is read from its content); random ops'
statistics over many seeded draws, with bounds a few standard errors wide
for that many draws (flip_lr: 400 draws, p = 0.5, SE 0.025; random_crop:
offsets uniform over every position).
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from big_vit_lite.data import pp

H, W = 40, 50
# Each pixel holds (row, column, 7): a crop tells where it came from.
ROW, COL = np.meshgrid(np.arange(H), np.arange(W), indexing="ij")
COORDS = np.stack([ROW, COL, np.full((H, W), 7)], axis=-1).astype(np.uint8)


def _run(pp_string, image, seed=0):
  fn = pp.get_preprocess_fn(pp_string)
  example = {
      "image": tf.constant(image),
      "_rng": tf.constant([seed, 7], tf.int64),
  }
  return fn(example)["image"].numpy()


def test_value_range_by_hand():
  """Guards: the map's scale or offset (0 -> vmin, 255 -> vmax), in_min/in_max
  per channel, clipping only when asked and to [min, max] of the range."""
  img = np.array([[[0, 255, 51]]], np.uint8)
  np.testing.assert_allclose(_run("value_range(-1, 1)", img), [[[-1, 1, -0.6]]])
  np.testing.assert_allclose(_run("value_range(0, 1)", img), [[[0, 1, 0.2]]])
  np.testing.assert_allclose(
      _run("value_range(0, 1, (0, 0, 51), (255, 255, 102))", img),
      [[[0, 1, 0]]],
      atol=1e-6,
  )
  np.testing.assert_allclose(
      _run("value_range(0, 2, 51, 102)", img), [[[-2, 8, 0]]], atol=1e-5
  )
  np.testing.assert_allclose(
      _run("value_range(2, 0, 51, 102, clip_values=True)", img),
      [[[2, 0, 2]]],
      atol=1e-5,
  )


def test_pad_by_hand():
  """Guards: pad's (top/bottom, left/right) order, its fill value and the
  output shape (both sides padded)."""
  img = np.arange(6, dtype=np.uint8).reshape(2, 3, 1) + 1
  out = _run("pad((1, 2), value=9)", img)
  assert out.shape == (4, 7, 1)
  want = np.full((4, 7, 1), 9, np.uint8)
  want[1:3, 2:5] = img
  np.testing.assert_array_equal(out, want)


def test_flip_lr_flips_half_the_time_and_only_left_right():
  """Guards: the flip's probability (0.5: 400 draws within 4 standard errors,
  0.4 to 0.6), flipping up-down instead, or flipping every image."""
  flipped = 0
  for seed in range(400):
    out = _run("flip_lr", COORDS[:4, :6], seed)
    if np.array_equal(out, COORDS[:4, ::-1][:, -6:]):
      flipped += 1
    else:
      np.testing.assert_array_equal(out, COORDS[:4, :6])
  assert 0.4 <= flipped / 400 <= 0.6, flipped


def test_random_crop_offsets_are_uniform_and_the_crop_is_contiguous():
  """Guards: a crop that is always at the corner or centre, offsets that never
  reach the last position, a crop of the wrong size, a non-contiguous crop.
  300 draws over 11 x 21 offsets: each row offset ~27 times."""
  rows, cols = [], []
  for seed in range(300):
    out = _run("random_crop((30, 30))", COORDS, seed)
    assert out.shape == (30, 30, 3)
    top, left = int(out[0, 0, 0]), int(out[0, 0, 1])
    np.testing.assert_array_equal(out, COORDS[top : top + 30, left : left + 30])
    rows.append(top)
    cols.append(left)
  assert set(rows) == set(range(11))
  assert set(cols) == set(range(21))
  # Uniform: mean 5 (SE 3.2 / sqrt(300) = 0.18) and 10 (SE 0.35).
  assert abs(np.mean(rows) - 5) < 0.8 and abs(np.mean(cols) - 10) < 1.5


def test_inception_crop_is_a_resized_random_crop_of_the_right_area_and_ratio():
  """Guards: the op turned into a plain resize (the whole image every time),
  area or ratio bounds off (percent vs fraction, swapped min/max), the crop
  not what gets resized (another region, another method). Oracle: the crop's
  corner pixels name its box; tf.image.resize of that box is the output."""
  areas, ratios = [], []
  for seed in range(120):
    crop = _run("inception_crop", COORDS, seed)
    h, w = crop.shape[:2]
    top, left = int(crop[0, 0, 0]), int(crop[0, 0, 1])
    np.testing.assert_array_equal(crop, COORDS[top : top + h, left : left + w])
    areas.append(h * w / (H * W))
    ratios.append(w / h)
    out = _run("inception_crop(16)", COORDS, seed)
    want = tf.image.resize(COORDS[top : top + h, left : left + w], (16, 16))
    # uint8 in, uint8 out, truncated (as big_vision's resize).
    np.testing.assert_array_equal(out, tf.cast(want, tf.uint8).numpy())
  areas = np.array(areas)
  # Whole-image fallbacks aside, areas 5%..100%, ratios 3/4..4/3 (+ rounding
  # to whole pixels).
  assert np.all(areas >= 0.05 - 0.01)
  assert np.all((np.array(ratios) > 0.7) & (np.array(ratios) < 1.4)), ratios
  assert np.mean(areas < 0.99) > 0.7  # mostly real crops
  # Both ends of the ratio range are drawn (not one fixed ratio).
  ratios = np.array(ratios)[areas < 0.99]
  assert ratios.min() < 0.85 and ratios.max() > 1.18, (
      ratios.min(),
      ratios.max(),
  )
  assert areas.min() < 0.2 and np.median(areas) < 0.8
  # A narrower range is honoured too.
  for seed in range(30):
    crop = _run("inception_crop(area_min=50, area_max=60)", COORDS, seed)
    area = crop.shape[0] * crop.shape[1] / (H * W)
    assert 0.47 <= area <= 0.63 or area == 1.0, area


def test_inception_crops_default_to_big_visions_area_and_ratio_ranges():
  """Guards: an inception crop's default area range off big_vision's 5% to
  100% (e.g. timm's 8%) or its aspect ratios off 3/4 to 4/3, in either op:
  decode_jpeg_and_inception_crop (the flagship configs', on JPEG and PNG
  bytes) and inception_crop (configs/transfer.py's). The area test above
  bounds areas from below at 4% only, which an 8% minimum passes. Oracle:
  TF's box sampler called as big_vision's inception_crop calls it
  (min_object_covered=0, the whole image when no box fits; this module's
  documented 3/4..4/3 for big_vision's 0.75..1.33), with the op's seed: the
  very box, read from the crop's coordinate pixels."""
  png = tf.io.encode_png(COORDS).numpy()
  jpeg = tf.io.encode_jpeg(COORDS).numpy()
  fused = pp.get_preprocess_fn("decode_jpeg_and_inception_crop")
  for seed in range(8):
    rng = tf.constant([seed, 7], tf.int64)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        (H, W, 3),
        tf.zeros([0, 0, 4], tf.float32),
        seed=rng,
        area_range=(0.05, 1.0),
        aspect_ratio_range=(3 / 4, 4 / 3),
        min_object_covered=0.0,
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    (top, left), (h, w) = begin.numpy()[:2], size.numpy()[:2]
    want = COORDS[top : top + h, left : left + w]
    np.testing.assert_array_equal(_run("inception_crop", COORDS, seed), want)
    got = fused({"image": tf.constant(png), "_rng": rng})["image"]
    np.testing.assert_array_equal(got, want)
    got = fused({"image": tf.constant(jpeg), "_rng": rng})["image"]
    assert got.shape == want.shape, (seed, got.shape, want.shape)


def test_central_crop_rounds_its_offset_down_as_tfs_crop():
  """Guards: the central crop's offset rounded up where the margin is odd (a
  one-pixel shift of every eval image: (h - ch + 1) // 2 for (h - ch) // 2),
  in either axis, with a size or without (the largest square). Oracle: TF's
  own tf.image.resize_with_crop_or_pad, whose crop is big_vision's central
  crop (the margin // 2 above and left); COORDS' 40 x 50 pixels with odd and
  even margins."""
  for size, image in [
      ((21, 30), COORDS),
      ((20, 31), COORDS),
      ((23, 23), COORDS),
      (None, COORDS[:39]),
      (None, COORDS[:, :39]),
  ]:
    if size is None:
      side = min(image.shape[:2])
      want = tf.image.resize_with_crop_or_pad(image, side, side)
      got = _run("central_crop", image)
    else:
      want = tf.image.resize_with_crop_or_pad(image, *size)
      got = _run(f"central_crop({size})", image)
    np.testing.assert_array_equal(got, want.numpy(), err_msg=str(size))


@pytest.mark.parametrize("op", ["central_crop", "random_crop"])
def test_a_crop_larger_than_images_of_known_size_is_one_line(op):
  """Guards: the error for images of a known size smaller than the crop
  turned into another exception, or naming the wrong sizes or the wrong
  resize (the crop's larger side is what resize_small must reach). By hand:
  4x5 images, a 3x6 crop."""
  message = (
      f"{op}: the 4x5 images are smaller than the crop 3x6; resize (e.g. "
      "resize_small(6)) before it"
  )
  with pytest.raises(ValueError, match=re.escape(message)):
    _run(f"{op}((3, 6))", np.zeros((4, 5, 3), np.uint8))
