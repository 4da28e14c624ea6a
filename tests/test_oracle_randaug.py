"""RandAugment against PIL's own image ops, numpy and its draw statistics.

Oracles: PIL's ImageOps (autocontrast, equalize, posterize, solarize) and
ImageEnhance (color, contrast, brightness, sharpness: the same degenerate
images and blend as big_vision's ops, which follow PIL's), PIL's rotate with
nearest resampling, and numpy's nearest-neighbour affine map written from
TF's documented ImageProjectiveTransform (output pixel (x, y) reads input
pixel round(a x + b y + c), round(d x + e y + f)) for shear and translate.
The magnitude's arguments are worked by hand from the EfficientNet/big_vision
ranges at magnitude 7 (level 0.7: enhance 0.7 * 1.8 + 0.1 = 1.36, rotate
21 degrees, shear 0.21, translate 0.7 * 100 / 224 of the side, posterize 2
bits, solarize at int(179.2) = 179 as big_vision truncates it, solarize_add
77, cutout half-side 0.7 * 40 / 224 of the short side): no op is the
identity there, unlike magnitude 5
(enhance 1.0) or 10 (solarize's threshold 256).

A 32x44 image of random pixels makes every op's output unlike every other's
and keeps the translations off pixel-rounding ties (0.3125 * 44 = 13.75,
0.3125 * 32 = 10). Blends round where PIL truncates (randaug.py's
docstring), so they match PIL within one level; the rest match exactly.
"""

import collections

import numpy as np
import tensorflow as tf
from PIL import Image
from PIL import ImageEnhance
from PIL import ImageOps

from big_vit_lite.data import pp

H, W = 32, 44
IMG = np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)
LEVEL = 0.7  # magnitude 7 of 10
ENHANCE = LEVEL * 1.8 + 0.1
GEOMETRIC = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
CUTOUT_HALF = int(LEVEL * 40 / 224 * min(H, W))  # 4: a 7x7 box


def _pil(image, fn):
  return np.asarray(fn(Image.fromarray(image)))


def _affine(image, a, b, c, d, e, f):
  """Nearest-neighbour: output (x, y) reads input (a x + b y + c, d x + e y + f),
  grey (128) outside the image."""
  h, w = image.shape[:2]
  ys, xs = np.mgrid[0:h, 0:w]
  xi = np.round(a * xs + b * ys + c).astype(int)
  yi = np.round(d * xs + e * ys + f).astype(int)
  inside = (xi >= 0) & (xi < w) & (yi >= 0) & (yi < h)
  out = np.full_like(image, 128)
  out[inside] = image[yi[inside], xi[inside]]
  return out


def _oracle_outputs(image):
  """{(op, sign): output} of every op but cutout (random: checked by its box)."""
  h, w = image.shape[:2]
  shear, tx, ty = LEVEL * 0.3, LEVEL * 100 / 224 * w, LEVEL * 100 / 224 * h
  added = np.minimum(image.astype(int) + 77, 255).astype(np.uint8)
  out = {
      ("autocontrast", 1): _pil(image, ImageOps.autocontrast),
      ("equalize", 1): _pil(image, ImageOps.equalize),
      ("invert", 1): 255 - image,
      ("posterize", 1): _pil(image, lambda i: ImageOps.posterize(i, 2)),
      # Values >= 179.2, i.e. >= 180, are inverted.
      ("solarize", 1): _pil(image, lambda i: ImageOps.solarize(i, 179)),
      ("color", 1): _pil(
          image, lambda i: ImageEnhance.Color(i).enhance(ENHANCE)
      ),
      ("contrast", 1): _pil(
          image, lambda i: ImageEnhance.Contrast(i).enhance(ENHANCE)
      ),
      ("brightness", 1): _pil(
          image, lambda i: ImageEnhance.Brightness(i).enhance(ENHANCE)
      ),
      ("sharpness", 1): _pil(
          image, lambda i: ImageEnhance.Sharpness(i).enhance(ENHANCE)
      ),
      ("solarize_add", 1): np.where(image < 128, added, image),
  }
  for sign in (1, -1):
    grey = (128, 128, 128)
    out["rotate", sign] = _pil(
        image,
        lambda i, s=sign: i.rotate(
            s * LEVEL * 30, resample=Image.NEAREST, fillcolor=grey
        ),
    )
    out["shear_x", sign] = _affine(image, 1, sign * shear, 0, 0, 1, 0)
    out["shear_y", sign] = _affine(image, 1, 0, 0, sign * shear, 1, 0)
    out["translate_x", sign] = _affine(image, 1, 0, sign * tx, 0, 1, 0)
    out["translate_y", sign] = _affine(image, 1, 0, 0, 0, 1, sign * ty)
  return out


def _cutout_center(image, out):
  """(cy, cx) of the grey box cutout drew, or None if `out` is not a cutout.

  A cutout changes pixels to 128 inside |y - cy| < half, |x - cx| < half
  (clipped to the image) and nothing else.
  """
  changed = np.argwhere(np.any(out != image, axis=-1))
  if not len(changed) or np.any(out[tuple(changed.T)] != 128):
    return None
  (top, left), (bottom, right) = changed.min(0), changed.max(0)
  side = 2 * CUTOUT_HALF - 1
  if bottom - top >= side or right - left >= side:
    return None
  if np.any(out[top : bottom + 1, left : right + 1] != 128):
    return None
  # An unclipped side is the whole box; a clipped one ends at the border.
  cy = bottom - CUTOUT_HALF + 1 if top == 0 else top + CUTOUT_HALF - 1
  cx = right - CUTOUT_HALF + 1 if left == 0 else left + CUTOUT_HALF - 1
  return cy, cx


def _matches(image, out, oracles):
  """The (op, sign)s whose oracle output `out` is (within a level)."""
  found = []
  for name, want in oracles.items():
    if np.abs(out.astype(int) - want).max() <= 1:
      found.append(name)
  if _cutout_center(image, out) is not None:
    found.append(("cutout", 1))
  return found


def _randaug(num_layers, images, seeds):
  """randaug(num_layers, 7) of images[i] with the example seed [seeds[i], 7]."""
  fn = pp.get_preprocess_fn(f"randaug({num_layers}, 7)")
  ds = tf.data.Dataset.from_tensor_slices((images, seeds)).map(
      lambda image, seed: fn({"image": image, "_rng": tf.stack([seed, 7])})
  )
  return np.stack([d["image"] for d in ds.as_numpy_iterator()])


def test_each_layer_is_one_of_the_16_ops_drawn_uniformly_at_pils_values():
  """Guards: an op's arithmetic or argument off (a sharpness kernel not PIL's
  SMOOTH, the enhance factor's scale, posterize's bits, solarize's threshold,
  the rotation's centre or direction, a shear or translation applied to the
  wrong axis or by the wrong amount, the fill colour), an op that does
  nothing, op choice not uniform (a branch never or always drawn, an
  off-by-one in the index), the geometric sign never negated, cutout's box
  at a fixed place or its rows and columns drawn from one seed.

  640 draws of one layer: each op 40 times expected, sd 6.1, bound 4 sd;
  the sign of the 200 geometric draws 0.5, sd 0.035, bound 4 sd."""
  draws = 640
  out = _randaug(1, np.broadcast_to(IMG, (draws, H, W, 3)), np.arange(draws))
  oracles = _oracle_outputs(IMG)
  ops, signs, centers = collections.Counter(), [], []
  for image in out:
    # IMG tells every op apart: exactly one matches.
    (found,) = _matches(IMG, image, oracles)
    ops[found[0]] += 1
    if found[0] in GEOMETRIC:
      signs.append(found[1])
    if found[0] == "cutout":
      centers.append(_cutout_center(IMG, image))
  assert len(ops) == 16, ops
  assert all(16 <= n <= 64 for n in ops.values()), ops
  assert 0.36 <= np.mean(np.array(signs) > 0) <= 0.64, signs
  # Cutout's centre: uniform over the rows (mean 15.5, sd 9.2 / sqrt(40))
  # and columns (21.5, sd 12.7 / sqrt(40)), drawn independently.
  cy, cx = np.array(centers).T
  assert abs(cy.mean() - (H - 1) / 2) < 4 * 9.2 / np.sqrt(len(cy)), cy
  assert abs(cx.mean() - (W - 1) / 2) < 4 * 12.7 / np.sqrt(len(cx)), cx
  assert abs(np.corrcoef(cy, cx)[0, 1]) < 4 / np.sqrt(len(cy))


def test_layers_apply_in_sequence_with_their_own_draws():
  """Guards: num_layers ignored or off by one (a loop that stops early or
  runs once more), every layer reusing the first layer's draw (the same op
  twice), a layer applied to the input image instead of the previous
  layer's output. The first layer's draw does not depend on num_layers, so
  randaug(2)'s output is one op of the oracle applied to randaug(1)'s; over
  64 draws the second op equals the first about 4 times (1/16, sd 1.9),
  at most 14 (5 sd), never all."""
  draws = 64
  seeds = np.arange(draws)
  images = np.broadcast_to(IMG, (draws, H, W, 3))
  np.testing.assert_array_equal(_randaug(0, images[:2], seeds[:2]), images[:2])
  first = _randaug(1, images, seeds)
  second = _randaug(2, images, seeds)
  same = 0
  for image, after_one, after_two in zip(images, first, second):
    (op_one,) = _matches(image, after_one, _oracle_outputs(image))
    # (An op may be the identity on the first op's output, e.g. posterize
    # after posterize: then several match.)
    ops_two = _matches(after_one, after_two, _oracle_outputs(after_one))
    assert ops_two, "the second layer's output is none of the 16 ops"
    same += op_one in ops_two
  assert same <= 14, same


def test_the_draw_does_not_depend_on_the_image_and_small_images_match_pil():
  """Guards: ops that skip or break on small images (sharpness's 3x3
  filter left off at a side of exactly 3 pixels, where PIL smooths the
  middle row), a draw that depends on the image's size. The op a seed draws
  is read from IMG's output; the 3x5 image's output with the same seed is
  that op's oracle output (cutout's half-side, 0.7 * 40 / 224 * 3, rounds
  to 0 pixels there: no box)."""
  draws = 96
  small = IMG[5:8, 10:15]
  seeds = np.arange(draws)
  big_out = _randaug(1, np.broadcast_to(IMG, (draws, H, W, 3)), seeds)
  small_out = _randaug(1, np.broadcast_to(small, (draws, 3, 5, 3)), seeds)
  oracles, small_oracles = _oracle_outputs(IMG), _oracle_outputs(small)
  small_oracles["cutout", 1] = small
  drawn = set()
  for big, out in zip(big_out, small_out):
    (op,) = _matches(IMG, big, oracles)
    drawn.add(op[0])
    np.testing.assert_allclose(out, small_oracles[op], atol=1, err_msg=op)
  assert "sharpness" in drawn and len(drawn) >= 14, drawn
