"""RandAugment (Cubuk et al. 2019) as a stateless pp op: randaug(num_layers, magnitude).

Each of `num_layers` layers picks one of the 16 ops below uniformly and
applies it at strength `magnitude` (0..30 on the usual 0..10 = "full" scale
of the EfficientNet/big_vision implementation, whose op set and ranges this
follows), negating the direction of geometric ops at random. Sizes of
translations and cutouts are relative to the image (the reference values
100 px and 40 px are for 224 px images). Every random choice draws from the
example's `_rng`, so augmentation is reproducible per example (exact resume).
Pixel values can differ from big_vision's by a level: blends here round
where it truncates, and posterize keeps at least 1 bit.
Input: uint8 RGB [H, W, 3]; output the same shape and dtype.
"""

import math

import tensorflow as tf

from big_vit_lite.data.pp.registry import register_image_op

_MAX_LEVEL = 10.0
_FILL = 128  # grey, for pixels that geometric ops move in


def _blend(degenerate, image, factor):
  """image + factor * (image - degenerate), i.e. factor 0 -> degenerate, 1 -> image."""
  d, x = tf.cast(degenerate, tf.float32), tf.cast(image, tf.float32)
  return tf.saturate_cast(tf.round(d + factor * (x - d)), tf.uint8)


def _grey(image):
  return tf.image.grayscale_to_rgb(tf.image.rgb_to_grayscale(image))


def _transform(image, transform):
  out = tf.raw_ops.ImageProjectiveTransformV3(
      images=image[None],
      transforms=tf.cast(tf.reshape(transform, [1, 8]), tf.float32),
      output_shape=tf.shape(image)[:2],
      fill_value=float(_FILL),
      interpolation="NEAREST",
      fill_mode="CONSTANT",
  )
  return out[0]


def _rotate(image, degrees):
  h, w = tf.unstack(tf.cast(tf.shape(image)[:2], tf.float32))
  a = degrees * math.pi / 180.0
  cos, sin = tf.cos(a), tf.sin(a)
  x_off = ((w - 1) - (cos * (w - 1) - sin * (h - 1))) / 2.0
  y_off = ((h - 1) - (sin * (w - 1) + cos * (h - 1))) / 2.0
  return _transform(
      image, tf.stack([cos, -sin, x_off, sin, cos, y_off, 0.0, 0.0])
  )


def _autocontrast(image):
  x = tf.cast(image, tf.float32)
  lo = tf.reduce_min(x, axis=[0, 1], keepdims=True)
  hi = tf.reduce_max(x, axis=[0, 1], keepdims=True)
  scaled = (x - lo) * 255.0 / tf.maximum(hi - lo, 1.0)
  return tf.saturate_cast(tf.where(hi > lo, scaled, x), tf.uint8)


def _equalize_channel(ch):
  """Histogram equalisation of one uint8 channel [H, W] (PIL's algorithm)."""
  ch = tf.cast(ch, tf.int32)
  hist = tf.math.bincount(tf.reshape(ch, [-1]), minlength=256, maxlength=256)
  # count of the top value
  last = tf.gather(hist, tf.reduce_max(tf.where(hist > 0)))
  step = (tf.reduce_sum(hist) - tf.cast(last, tf.int32)) // 255

  def equalised():
    lut = (tf.cumsum(hist) + step // 2) // step
    lut = tf.clip_by_value(tf.concat([[0], lut[:-1]], 0), 0, 255)
    return tf.gather(lut, ch)

  return tf.cast(tf.cond(step > 0, equalised, lambda: ch), tf.uint8)


def _sharpness(image, factor):
  def sharpened():
    x = tf.cast(image, tf.float32)[None]
    k = tf.constant([[1, 1, 1], [1, 5, 1], [1, 1, 1]], tf.float32) / 13.0
    k = tf.tile(k[:, :, None, None], [1, 1, 3, 1])
    smooth = tf.nn.depthwise_conv2d(x, k, [1, 1, 1, 1], "VALID")[0]
    # Borders keep their original pixels (as PIL's ImageEnhance.Sharpness).
    smooth = tf.pad(smooth, [[1, 1], [1, 1], [0, 0]])
    mask = tf.pad(tf.ones_like(smooth[1:-1, 1:-1]), [[1, 1], [1, 1], [0, 0]])
    degenerate = tf.where(mask > 0, smooth, x[0])
    return _blend(degenerate, image, factor)

  # Under 3 pixels a side every pixel is border, so unchanged (the 3x3 filter
  # failed there).
  return tf.cond(
      tf.reduce_all(tf.shape(image)[:2] >= 3), sharpened, lambda: image
  )


def _cutout(image, frac, seed):
  h, w = tf.shape(image)[0], tf.shape(image)[1]
  half = tf.cast(frac * tf.cast(tf.minimum(h, w), tf.float32), tf.int32)
  cy = tf.random.stateless_uniform([], seed, 0, h, dtype=tf.int32)
  cx = tf.random.stateless_uniform(
      [], tf.reverse(seed, [0]), 0, w, dtype=tf.int32
  )
  ys, xs = tf.range(h)[:, None], tf.range(w)[None, :]
  box = (tf.abs(ys - cy) < half) & (tf.abs(xs - cx) < half)
  return tf.where(box[:, :, None], tf.cast(_FILL, tf.uint8), image)


def _ops(image, level, sign, seed):
  """The 16 ops, each a thunk (for tf.switch_case). `level` in [0, 3]."""
  h, w = tf.unstack(tf.cast(tf.shape(image)[:2], tf.float32))
  enhance = level * 1.8 + 0.1
  shear = sign * level * 0.3
  tx, ty = sign * level * (100 / 224) * w, sign * level * (100 / 224) * h
  # bits kept
  bits = tf.cast(tf.clip_by_value(tf.floor(level * 4.0), 1.0, 8.0), tf.uint8)
  # The order is the op's index: changing it changes every augmentation.
  return [
      lambda: _autocontrast(image),
      # equalize
      lambda: tf.stack(
          [_equalize_channel(image[..., c]) for c in range(3)], -1
      ),
      lambda: 255 - image,  # invert
      lambda: _rotate(image, sign * level * 30.0),
      lambda: _posterize(image, bits),
      # big_vision's threshold is int(level * 256): 179 at magnitude 7 (179.2
      # would keep the 179s that it inverts).
      lambda: _solarize(image, tf.floor(level * 256.0)),
      lambda: _blend(_grey(image), image, enhance),  # color
      lambda: _contrast(image, enhance),
      lambda: _blend(tf.zeros_like(image), image, enhance),  # brightness
      lambda: _sharpness(image, enhance),
      lambda: _affine(image, [1.0, shear, 0.0, 0.0, 1.0, 0.0]),  # shear_x
      lambda: _affine(image, [1.0, 0.0, 0.0, shear, 1.0, 0.0]),  # shear_y
      lambda: _affine(image, [1.0, 0.0, -tx, 0.0, 1.0, 0.0]),  # translate_x
      lambda: _affine(image, [1.0, 0.0, 0.0, 0.0, 1.0, -ty]),  # translate_y
      lambda: _cutout(image, level * (40 / 224), seed),
      lambda: _solarize_add(image, level * 110.0),
  ]


def _posterize(image, bits):
  """Keeps the top `bits` bits of each value."""
  shift = 8 - bits
  return tf.bitwise.left_shift(tf.bitwise.right_shift(image, shift), shift)


def _solarize(image, threshold):
  """Inverts the values at or above `threshold`."""
  below = tf.cast(image, tf.float32) < threshold
  return tf.where(below, image, 255 - image)


def _solarize_add(image, addition):
  """Adds `addition` to the values below 128."""
  added = tf.saturate_cast(tf.cast(image, tf.float32) + addition, tf.uint8)
  return tf.where(image < 128, added, image)


def _contrast(image, factor):
  """Blends with the image's mean grey level."""
  grey = tf.cast(tf.image.rgb_to_grayscale(image), tf.float32)
  mean = tf.cast(tf.reduce_mean(grey), tf.uint8)
  return _blend(tf.fill(tf.shape(image), mean), image, factor)


def _affine(image, row_major_2x3):
  """The affine map (of output to input pixel) given by its first two rows."""
  return _transform(image, tf.stack([*row_major_2x3, 0.0, 0.0]))


NUM_OPS = 16


def _check_rgb_uint8(image, key, op_name):
  del key  # (the message shows what the op found)
  if (
      image.dtype != tf.uint8
      or image.shape.rank != 3
      or image.shape[-1] not in (None, 3)
  ):
    raise ValueError(
        f"{op_name} needs uint8 RGB images [H, W, 3] (decode(channels=3) "
        f"or to_rgb before it), got {image.dtype} {image.shape}"
    )


@register_image_op("randaug", check=_check_rgb_uint8, random=True)
def get_randaug(num_layers=2, magnitude=10):
  level = magnitude / _MAX_LEVEL

  def randaug(image, seed):
    def layer(i, img):
      # A while_loop, not a Python loop: the 16-branch graph is built once
      # whatever num_layers is (building it dominates pipeline start-up).
      layer_seed = tf.random.experimental.stateless_fold_in(seed, i)
      u = tf.random.stateless_uniform([2], layer_seed)
      index = tf.minimum(tf.cast(u[0] * NUM_OPS, tf.int32), NUM_OPS - 1)
      sign = tf.where(u[1] < 0.5, -1.0, 1.0)
      op_seed = tf.random.experimental.stateless_fold_in(layer_seed, 1)
      branches = _ops(img, tf.constant(level, tf.float32), sign, op_seed)
      out = tf.switch_case(index, branches)
      return i + 1, tf.ensure_shape(out, [None, None, 3])

    _, out = tf.while_loop(
        lambda i, _: i < num_layers,
        layer,
        [tf.constant(0), image],
        shape_invariants=[tf.TensorShape([]), tf.TensorShape([None, None, 3])],
    )
    return tf.ensure_shape(out, image.shape)

  return randaug
