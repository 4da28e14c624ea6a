"""pp ops on images: decoding, crops, resizes, flips, value ranges.

All ops take `key` (default "image"), and big_vision's `inkey`/`outkey`
(see registry.py). Ops big_vision also has take its arguments in its order
with its defaults (inception crops' aspect ratios: 3/4..4/3 for its
0.75..1.33) and give its values: a resized integer image is truncated (not
rounded) back to its dtype, as big_vision does. Random ops (inception
crops, random_crop, flip_lr) are stateless: their seed comes from the
example's `_rng` (see rng.py), so the same example at the same position
always gets the same augmentation, also after a resume; they draw from
big_vision's distributions, not its samples. Deliberate differences:
`decode` also takes images decoded upstream, CMYK JPEGs and 4 channels from
any format; `decode_jpeg_and_inception_crop` also takes non-JPEG bytes; an
image smaller than a crop is a one-line error; value_range is one
multiply-add (within 1 ulp of big_vision's two steps).
"""

import numpy as np
import tensorflow as tf

from big_vit_lite.data.pp.registry import register
from big_vit_lite.data.pp.rng import take_seed


def _hw(size):
  """int or (h, w) -> (h, w)."""
  return (size, size) if isinstance(size, int) else tuple(size)


# Resizes that interpolate convexly stay inside the input's value range, so
# their integer results need no clipping (an elementwise op is a full pass over
# the image).
_CONVEX = ("bilinear", "nearest", "area")


def _resize(image, hw, method, antialias=False):
  """Resizes keeping the input dtype: uint8 stays uint8, truncated as big_vision does."""
  out = tf.image.resize(image, hw, method=method, antialias=antialias)
  if image.dtype.is_integer and (method not in _CONVEX or antialias):
    return tf.saturate_cast(out, image.dtype)  # = big_vision's clip, then cast
  # (a convex resize's values are in range already, to float error, which
  # truncates)
  return tf.cast(out, image.dtype)


def _resize_to(image, hw, method, antialias):
  return tf.ensure_shape(
      _resize(image, hw, method, antialias), [*hw, image.shape[-1]]
  )


def _image(data, key, op_name, spatial=True):
  """The decoded image under `key`; encoded bytes there mean `decode` is missing.

  `spatial` ops (crops, resizes, flips, pads) need [H, W, C]: on a grey
  [H, W] image flip_lr would flip it upside down, without an error.
  """
  img = data[key]
  if img.dtype == tf.string:
    raise ValueError(
        f"{op_name} got encoded image bytes under {key!r}: put 'decode' (or "
        f"'decode_jpeg_and_inception_crop') before it"
    )
  if spatial and img.shape.rank is not None and img.shape.rank < 3:
    raise ValueError(
        f"{op_name} needs an image [H, W, C] under {key!r}, got shape {img.shape}: "
        f"put 'decode' before it (it gives a grey [H, W] image its channel axis)"
    )
  return img


def _fits(img, hw, op_name):
  """Checks an image is at least hw: when traced if the size is known, else per example."""
  if img.shape.rank == 3 and img.shape[:2].is_fully_defined():
    h, w = img.shape[:2]
    if h < hw[0] or w < hw[1]:
      raise ValueError(
          f"{op_name}: the {h}x{w} images are smaller than the crop {hw[0]}x{hw[1]}; "
          f"resize (e.g. resize_small({max(hw)})) before it"
      )
    return img
  big_enough = tf.reduce_all(tf.shape(img)[:2] >= tf.constant(hw))
  with tf.control_dependencies(
      [
          tf.debugging.Assert(
              big_enough,
              [
                  f"{op_name}: an image is smaller than the crop {hw[0]}x{hw[1]}; resize (e.g. "
                  f"resize_small({max(hw)})) before it; image size:",
                  tf.shape(img)[:2],
              ],
          )
      ]
  ):
    return tf.identity(img)


def _decode_any(raw, channels, precise=False):
  # expand_animations=False: a GIF gives its first frame (rank 3), so every
  # decoded image has the same rank whatever the file format.
  def decode(c):
    plain = lambda: tf.io.decode_image(
        raw, channels=c, expand_animations=False, dtype=tf.uint8  # noqa: E731
    )
    if not precise:
      return plain()
    # The IDCT of PIL/cv2/PyTorch; other formats do not depend on it.
    return tf.cond(
        tf.io.is_jpeg(raw),
        lambda: tf.io.decode_jpeg(
            raw, channels=c, dct_method="INTEGER_ACCURATE"
        ),
        plain,
    )

  if channels not in (1, 4):
    return decode(channels)
  # tf decodes GIF/WEBP/BMP to 1 and JPEG/GIF/WEBP to 4 channels not at all, and
  # CMYK JPEGs not to 1: those decode to RGB and are converted here (a grey JPEG
  # comes back exactly); PNG (and BMP to 4), and other JPEGs to 1 (libjpeg's own
  # grey, as big_vision's), decode directly.
  direct = tf.strings.substr(raw, 0, 4) == b"\x89PNG"
  if channels == 4:
    direct |= tf.strings.substr(raw, 0, 2) == b"BM"
  else:
    direct |= tf.cond(
        tf.io.is_jpeg(raw),
        lambda: tf.image.extract_jpeg_shape(raw)[2] != 4,
        lambda: tf.constant(False),
    )
  convert = (
      (lambda: _rgb_to_grey(decode(3)))
      if channels == 1
      else (
          lambda: tf.pad(
              decode(3), [[0, 0], [0, 0], [0, 1]], constant_values=255
          )
      )
  )
  return tf.cond(direct, lambda: decode(channels), convert)


def _rgb_to_grey(image):
  return tf.cast(
      tf.round(tf.image.rgb_to_grayscale(tf.cast(image, tf.float32))),
      image.dtype,
  )


def _fix_channels(image, channels):
  """An image decoded upstream ([H, W] or [H, W, C], C in 1..4) -> `channels` (0: as it is)."""
  # grey without a channel axis (e.g. a tfds Tensor feature)
  if image.shape.rank == 2:
    image = image[..., None]
  have = image.shape[-1]
  if channels == 0 or have == channels:
    return image
  if channels == 1:
    return image[..., :1] if have <= 2 else _rgb_to_grey(image[..., :3])
  rgb = image[..., :3] if have >= 3 else tf.tile(image[..., :1], [1, 1, 3])
  if channels == 3:
    return rgb
  alpha = image.dtype.max if image.dtype.is_integer else 1.0  # opaque
  opaque = tf.fill(
      tf.concat([tf.shape(image)[:2], [1]], 0), tf.cast(alpha, image.dtype)
  )
  return tf.concat(
      [rgb, image[..., have - 1 :] if have in (2, 4) else opaque], -1
  )


@register("decode")
def get_decode(channels=3, precise=False, key="image"):
  """Decodes JPEG/PNG/GIF/BMP bytes to uint8 [H, W, channels].

  precise=True decodes JPEGs with the accurate integer IDCT (as PIL, cv2
  and PyTorch do) instead of tf's default. Tensors that are already images
  (e.g. tfds features decoded upstream, grey ones also as [H, W]) pass
  through, converted to `channels` as bytes are (grey, grey+alpha, RGB, RGBA).
  """

  def op(data):
    x = data[key]
    if x.dtype == tf.string:
      img = _decode_any(x, channels, bool(precise))
    else:
      img = _fix_channels(x, channels)
    return {**data, key: img}

  return op


@register("to_rgb")
def get_to_rgb(key="image"):
  """Grey ([H, W] or 1 channel) -> RGB by repeating it; RGBA -> RGB by dropping alpha."""

  def op(data):
    img = _image(data, key, "to_rgb", spatial=False)
    return {
        **data,
        key: tf.ensure_shape(_fix_channels(img, 3), img.shape[:2] + [3]),
    }

  return op


def _inception(
    size, area_min, area_max, ratio_min, ratio_max, method, antialias
):
  """An inception crop -> (box, crop, finish): box(image shape, seed) -> (begin, size) of a
  random crop, crop(image, seed) that crop, finish(crop) resized to `size`."""
  hw = _hw(size) if size is not None else None

  def box(shape, seed):
    begin, csize, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape,
        tf.zeros([0, 0, 4], tf.float32),
        seed=seed,
        area_range=(area_min / 100, area_max / 100),
        aspect_ratio_range=(ratio_min, ratio_max),
        min_object_covered=0.0,
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    return begin, csize

  def crop(img, seed):
    return tf.slice(img, *box(tf.shape(img), seed))

  return (
      box,
      crop,
      lambda c: c if hw is None else _resize_to(c, hw, method, antialias),
  )


@register("inception_crop")
def get_inception_crop(
    size=None,
    area_min=5,
    area_max=100,
    method="bilinear",
    antialias=False,
    ratio_min=3 / 4,
    ratio_max=4 / 3,
    key="image",
):
  """Random crop of `area_min..area_max` percent and ratio, resized to `size`.

  The positional order is big_vision's (its op has no ratio arguments).
  """
  _, crop, finish = _inception(
      size, area_min, area_max, ratio_min, ratio_max, method, antialias
  )

  def op(data):
    img = _image(data, key, "inception_crop")
    data, seed = take_seed(data, "inception_crop")
    return {**data, key: finish(crop(img, seed))}

  return op


@register("decode_jpeg_and_inception_crop")
def get_decode_jpeg_and_inception_crop(
    size=None,
    area_min=5,
    area_max=100,
    ratio_min=3 / 4,
    ratio_max=4 / 3,
    method="bilinear",
    antialias=False,
    key="image",
):
  """Fused decode + inception crop: decodes only the crop of a JPEG (faster).

  Non-JPEG bytes (PNG, ...) take the plain decode-then-crop path.
  """
  box, crop, finish = _inception(
      size, area_min, area_max, ratio_min, ratio_max, method, antialias
  )

  def op(data):
    raw = data[key]
    if raw.dtype != tf.string:
      raise ValueError(
          f"needs the encoded image bytes under {key!r} (it decodes them "
          f"itself): remove the 'decode' before it, or use inception_crop"
      )
    data, seed = take_seed(data, "decode_jpeg_and_inception_crop")

    def jpeg():
      begin, csize = box(tf.image.extract_jpeg_shape(raw), seed)
      window = tf.stack([begin[0], begin[1], csize[0], csize[1]])
      return tf.image.decode_and_crop_jpeg(raw, window, channels=3)

    out = tf.cond(
        tf.io.is_jpeg(raw), jpeg, lambda: crop(_decode_any(raw, 3), seed)
    )
    out.set_shape([None, None, 3])
    return {**data, key: finish(out)}

  return op


@register("resize")
def get_resize(size, method="bilinear", antialias=False, key="image"):
  hw = _hw(size)
  return lambda data: {
      **data,
      key: _resize_to(_image(data, key, "resize"), hw, method, antialias),
  }


def _get_resize_side(side, method, antialias, key, name, shorter):
  """Resizes so that the shorter (or longer) side is `side`, keeping the aspect ratio."""

  def op(data):
    img = _image(data, key, name)
    hw = tf.shape(img)[:2]
    ratio = side / tf.cast(
        tf.reduce_min(hw) if shorter else tf.reduce_max(hw), tf.float32
    )
    # At least 1: a 1x50 banner's short side rounds to 0 in resize_long(4) (a tf
    # error).
    hw = tf.maximum(
        tf.cast(tf.round(tf.cast(hw, tf.float32) * ratio), tf.int32), 1
    )
    return {**data, key: _resize(img, hw, method, antialias)}

  return op


@register("resize_small")
def get_resize_small(smaller_size, method="area", antialias=False, key="image"):
  """Resizes so that the shorter side is `smaller_size`, keeping the aspect ratio."""
  return _get_resize_side(
      smaller_size, method, antialias, key, "resize_small", shorter=True
  )


@register("resize_long")
def get_resize_long(longer_size, method="area", antialias=True, key="image"):
  """Resizes so that the longer side is `longer_size`, keeping the aspect ratio.

  antialias defaults to True here, as in big_vision (resize_small's is False).
  """
  return _get_resize_side(
      longer_size, method, antialias, key, "resize_long", shorter=False
  )


@register("central_crop")
def get_central_crop(crop_size=None, key="image"):
  """Central crop of `crop_size`; None: the largest central square."""
  hw = _hw(crop_size) if crop_size is not None else None

  def op(data):
    img = _image(data, key, "central_crop")
    if hw is None:
      ch = cw = tf.reduce_min(tf.shape(img)[:2])
    else:
      img = _fits(img, hw, "central_crop")
      ch, cw = hw
    top, left = (tf.shape(img)[0] - ch) // 2, (tf.shape(img)[1] - cw) // 2
    crop = img[top : top + ch, left : left + cw]
    return {
        **data,
        key: tf.ensure_shape(crop, [*(hw or (None, None)), img.shape[-1]]),
    }

  return op


@register("random_crop")
def get_random_crop(crop_size, key="image"):
  hw = _hw(crop_size)

  def op(data):
    img = _fits(_image(data, key, "random_crop"), hw, "random_crop")
    data, seed = take_seed(data, "random_crop")
    crop = tf.image.stateless_random_crop(
        img, tf.stack([*hw, tf.shape(img)[-1]]), seed=seed
    )
    return {**data, key: tf.ensure_shape(crop, [*hw, img.shape[-1]])}

  return op


@register("pad")
def get_pad(pad, value=0, key="image"):
  """Pads `pad` pixels (int, or (top/bottom, left/right)) of constant `value`.

  With random_crop back to the original size this is the usual translation
  augmentation for small images: "decode|pad(2)|random_crop(28)".
  """
  ph, pw = _hw(pad)

  def op(data):
    img = _image(data, key, "pad")
    out = tf.pad(
        img,
        [[ph, ph], [pw, pw], [0, 0]],
        constant_values=tf.cast(value, img.dtype),
    )
    h, w, c = img.shape
    shape = [
        None if h is None else h + 2 * ph,
        None if w is None else w + 2 * pw,
        c,
    ]
    return {**data, key: tf.ensure_shape(out, shape)}

  return op


@register("flip_lr")
def get_flip_lr(key="image"):
  def op(data):
    img = _image(data, key, "flip_lr")
    data, seed = take_seed(data, "flip_lr")
    # tf.cond, not tf.image's where(): only flipped images pay for the copy.
    flip = tf.random.stateless_uniform([], seed) < 0.5
    return {
        **data,
        key: tf.cond(flip, lambda: tf.reverse(img, [-2]), lambda: img),
    }

  return op


@register("value_range")
def get_value_range(
    vmin=-1, vmax=1, in_min=0, in_max=255.0, clip_values=False, key="image"
):
  """Maps [in_min, in_max] linearly to [vmin, vmax] as float32.

  in_min/in_max may be per-channel lists (as in big_vision).
  """
  lo, hi = np.broadcast_arrays(
      np.asarray(in_min, float), np.asarray(in_max, float)
  )
  # One multiply-add: each elementwise op is a full pass over the image.
  scale = (vmax - vmin) / (hi - lo)
  scale, offset = tf.constant(scale, tf.float32), tf.constant(
      vmin - lo * scale, tf.float32
  )

  def op(data):
    img = _image(data, key, "value_range", spatial=False)
    x = tf.cast(img, tf.float32) * scale + offset
    if clip_values:
      x = tf.clip_by_value(x, min(vmin, vmax), max(vmin, vmax))
    return {**data, key: x}

  return op


@register("standardize")
@register("vgg_value_range")  # big_vision's name, with the same defaults
def get_standardize(
    mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375), key="image"
):
  """(x - mean) / std per channel as float32; defaults: ImageNet stats on 0..255."""
  mean, std = np.atleast_1d(mean), np.atleast_1d(std)

  def op(data):
    img = _image(data, key, "standardize", spatial=False)
    x = tf.cast(img, tf.float32) - tf.constant(mean, tf.float32)
    return {**data, key: x / tf.constant(std, tf.float32)}

  return op
