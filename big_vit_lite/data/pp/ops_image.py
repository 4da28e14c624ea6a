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

from big_vit_lite.data.pp.registry import register_image_op


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


def _decoded(image, key, op_name):
  """Checks that `image` is decoded: encoded bytes there mean `decode` is missing."""
  if image.dtype == tf.string:
    raise ValueError(
        f"{op_name} got encoded image bytes under {key!r}: put 'decode' (or "
        f"'decode_jpeg_and_inception_crop') before it"
    )


def _spatial(image, key, op_name):
  """Checks that `image` is a decoded [H, W, C] image.

  Spatial ops (crops, resizes, flips, pads) need the channel axis: on a grey
  [H, W] image flip_lr would flip it upside down, without an error.
  """
  _decoded(image, key, op_name)
  if image.shape.rank is not None and image.shape.rank < 3:
    raise ValueError(
        f"{op_name} needs an image [H, W, C] under {key!r}, got shape {image.shape}: "
        f"put 'decode' before it (it gives a grey [H, W] image its channel axis)"
    )


def _encoded(raw, key, op_name):
  """Checks that `raw` holds encoded bytes (for ops that decode them)."""
  del op_name  # (the message starts with the op's text)
  if raw.dtype != tf.string:
    raise ValueError(
        f"needs the encoded image bytes under {key!r} (it decodes them "
        f"itself): remove the 'decode' before it, or use inception_crop"
    )


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
    def plain():
      return tf.io.decode_image(
          raw, channels=c, expand_animations=False, dtype=tf.uint8
      )

    def accurate_jpeg():
      return tf.io.decode_jpeg(raw, channels=c, dct_method="INTEGER_ACCURATE")

    if not precise:
      return plain()
    # The IDCT of PIL/cv2/PyTorch; other formats do not depend on it.
    return tf.cond(tf.io.is_jpeg(raw), accurate_jpeg, plain)

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

  def from_rgb():
    rgb = decode(3)
    if channels == 1:
      return _rgb_to_grey(rgb)
    return tf.pad(rgb, [[0, 0], [0, 0], [0, 1]], constant_values=255)

  return tf.cond(direct, lambda: decode(channels), from_rgb)


def _rgb_to_grey(image):
  grey = tf.image.rgb_to_grayscale(tf.cast(image, tf.float32))
  return tf.cast(tf.round(grey), image.dtype)


def _fix_channels(image, channels):
  """An image decoded upstream ([H, W] or [H, W, C], C in 1..4) -> `channels` (0: as it is)."""
  # grey without a channel axis (e.g. a tfds Tensor feature)
  if image.shape.rank == 2:
    image = image[..., None]
  have = image.shape[-1]
  if channels == 0 or have == channels:
    return image
  if channels == 1:
    if have <= 2:
      return image[..., :1]
    return _rgb_to_grey(image[..., :3])
  if have >= 3:
    rgb = image[..., :3]
  else:
    rgb = tf.tile(image[..., :1], [1, 1, 3])
  if channels == 3:
    return rgb
  if have in (2, 4):
    alpha = image[..., have - 1 :]
  else:
    opaque = image.dtype.max if image.dtype.is_integer else 1.0
    alpha_shape = tf.concat([tf.shape(image)[:2], [1]], 0)
    alpha = tf.fill(alpha_shape, tf.cast(opaque, image.dtype))
  return tf.concat([rgb, alpha], -1)


@register_image_op("decode")
def get_decode(channels=3, precise=False):
  """Decodes JPEG/PNG/GIF/BMP bytes to uint8 [H, W, channels].

  precise=True decodes JPEGs with the accurate integer IDCT (as PIL, cv2
  and PyTorch do) instead of tf's default. Tensors that are already images
  (e.g. tfds features decoded upstream, grey ones also as [H, W]) pass
  through, converted to `channels` as bytes are (grey, grey+alpha, RGB, RGBA).
  """

  def decode(image):
    if image.dtype == tf.string:
      return _decode_any(image, channels, bool(precise))
    return _fix_channels(image, channels)

  return decode


@register_image_op("to_rgb", check=_decoded)
def get_to_rgb():
  """Grey ([H, W] or 1 channel) -> RGB by repeating it; RGBA -> RGB by dropping alpha."""

  def to_rgb(image):
    rgb = _fix_channels(image, 3)
    return tf.ensure_shape(rgb, image.shape[:2] + [3])

  return to_rgb


def _inception(
    size, area_min, area_max, ratio_min, ratio_max, method, antialias
):
  """An inception crop -> (box, crop, finish).

  box(image shape, seed) -> (begin, size) of a random crop; crop(image,
  seed) -> that crop; finish(crop) -> the crop resized to `size`.
  """
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

  def crop(image, seed):
    begin, csize = box(tf.shape(image), seed)
    return tf.slice(image, begin, csize)

  def finish(cropped):
    if hw is None:
      return cropped
    return _resize_to(cropped, hw, method, antialias)

  return box, crop, finish


@register_image_op("inception_crop", check=_spatial, random=True)
def get_inception_crop(
    size=None,
    area_min=5,
    area_max=100,
    method="bilinear",
    antialias=False,
    ratio_min=3 / 4,
    ratio_max=4 / 3,
):
  """Random crop of `area_min..area_max` percent and ratio, resized to `size`.

  The positional order is big_vision's (its op has no ratio arguments).
  """
  _, crop, finish = _inception(
      size, area_min, area_max, ratio_min, ratio_max, method, antialias
  )

  def inception_crop(image, seed):
    return finish(crop(image, seed))

  return inception_crop


@register_image_op(
    "decode_jpeg_and_inception_crop", check=_encoded, random=True
)
def get_decode_jpeg_and_inception_crop(
    size=None,
    area_min=5,
    area_max=100,
    ratio_min=3 / 4,
    ratio_max=4 / 3,
    method="bilinear",
    antialias=False,
):
  """Fused decode + inception crop: decodes only the crop of a JPEG (faster).

  Non-JPEG bytes (PNG, ...) take the plain decode-then-crop path.
  """
  box, crop, finish = _inception(
      size, area_min, area_max, ratio_min, ratio_max, method, antialias
  )

  def decode_and_crop(raw, seed):
    def jpeg():
      begin, csize = box(tf.image.extract_jpeg_shape(raw), seed)
      window = tf.stack([begin[0], begin[1], csize[0], csize[1]])
      return tf.image.decode_and_crop_jpeg(raw, window, channels=3)

    def other():
      return crop(_decode_any(raw, 3), seed)

    cropped = tf.cond(tf.io.is_jpeg(raw), jpeg, other)
    cropped.set_shape([None, None, 3])
    return finish(cropped)

  return decode_and_crop


@register_image_op("resize", check=_spatial)
def get_resize(size, method="bilinear", antialias=False):
  hw = _hw(size)

  def resize(image):
    return _resize_to(image, hw, method, antialias)

  return resize


def _resize_side(side, method, antialias, shorter):
  """Resizes so that the shorter (or longer) side is `side`, keeping the aspect ratio."""

  def resize(image):
    hw = tf.shape(image)[:2]
    if shorter:
      old_side = tf.reduce_min(hw)
    else:
      old_side = tf.reduce_max(hw)
    ratio = side / tf.cast(old_side, tf.float32)
    new_hw = tf.cast(tf.round(tf.cast(hw, tf.float32) * ratio), tf.int32)
    # At least 1: a 1x50 banner's short side rounds to 0 in resize_long(4) (a tf
    # error).
    new_hw = tf.maximum(new_hw, 1)
    return _resize(image, new_hw, method, antialias)

  return resize


@register_image_op("resize_small", check=_spatial)
def get_resize_small(smaller_size, method="area", antialias=False):
  """Resizes so that the shorter side is `smaller_size`, keeping the aspect ratio."""
  return _resize_side(smaller_size, method, antialias, shorter=True)


@register_image_op("resize_long", check=_spatial)
def get_resize_long(longer_size, method="area", antialias=True):
  """Resizes so that the longer side is `longer_size`, keeping the aspect ratio.

  antialias defaults to True here, as in big_vision (resize_small's is False).
  """
  return _resize_side(longer_size, method, antialias, shorter=False)


@register_image_op("central_crop", check=_spatial)
def get_central_crop(crop_size=None):
  """Central crop of `crop_size`; None: the largest central square."""
  hw = _hw(crop_size) if crop_size is not None else None

  def central_crop(image):
    if hw is None:
      ch = cw = tf.reduce_min(tf.shape(image)[:2])
      shape = [None, None, image.shape[-1]]
    else:
      image = _fits(image, hw, "central_crop")
      ch, cw = hw
      shape = [ch, cw, image.shape[-1]]
    top = (tf.shape(image)[0] - ch) // 2
    left = (tf.shape(image)[1] - cw) // 2
    crop = image[top : top + ch, left : left + cw]
    return tf.ensure_shape(crop, shape)

  return central_crop


@register_image_op("random_crop", check=_spatial, random=True)
def get_random_crop(crop_size):
  hw = _hw(crop_size)

  def random_crop(image, seed):
    image = _fits(image, hw, "random_crop")
    size = tf.stack([*hw, tf.shape(image)[-1]])
    crop = tf.image.stateless_random_crop(image, size, seed=seed)
    return tf.ensure_shape(crop, [*hw, image.shape[-1]])

  return random_crop


@register_image_op("pad", check=_spatial)
def get_pad(pad, value=0):
  """Pads `pad` pixels (int, or (top/bottom, left/right)) of constant `value`.

  With random_crop back to the original size this is the usual translation
  augmentation for small images: "decode|pad(2)|random_crop(28)".
  """
  ph, pw = _hw(pad)

  def pad_image(image):
    padded = tf.pad(
        image,
        [[ph, ph], [pw, pw], [0, 0]],
        constant_values=tf.cast(value, image.dtype),
    )
    h, w, c = image.shape
    shape = [
        None if h is None else h + 2 * ph,
        None if w is None else w + 2 * pw,
        c,
    ]
    return tf.ensure_shape(padded, shape)

  return pad_image


@register_image_op("flip_lr", check=_spatial, random=True)
def get_flip_lr():
  def flip_lr(image, seed):
    # tf.cond, not tf.image's where(): only flipped images pay for the copy.
    flip = tf.random.stateless_uniform([], seed) < 0.5
    return tf.cond(flip, lambda: tf.reverse(image, [-2]), lambda: image)

  return flip_lr


@register_image_op("value_range", check=_decoded)
def get_value_range(vmin=-1, vmax=1, in_min=0, in_max=255.0, clip_values=False):
  """Maps [in_min, in_max] linearly to [vmin, vmax] as float32.

  in_min/in_max may be per-channel lists (as in big_vision).
  """
  lo, hi = np.broadcast_arrays(
      np.asarray(in_min, float), np.asarray(in_max, float)
  )
  # One multiply-add: each elementwise op is a full pass over the image.
  scale = (vmax - vmin) / (hi - lo)
  offset = tf.constant(vmin - lo * scale, tf.float32)
  scale = tf.constant(scale, tf.float32)

  def value_range(image):
    x = tf.cast(image, tf.float32) * scale + offset
    if clip_values:
      x = tf.clip_by_value(x, min(vmin, vmax), max(vmin, vmax))
    return x

  return value_range


@register_image_op("standardize", check=_decoded)
@register_image_op("vgg_value_range", check=_decoded)  # big_vision's name
def get_standardize(
    mean=(123.675, 116.28, 103.53), std=(58.395, 57.12, 57.375)
):
  """(x - mean) / std per channel as float32; defaults: ImageNet stats on 0..255."""
  mean, std = np.atleast_1d(mean), np.atleast_1d(std)

  def standardize(image):
    # Constants made here, inside the traced function: made outside (captured
    # inputs), the results differ in the last bit from what they always were.
    centred = tf.cast(image, tf.float32) - tf.constant(mean, tf.float32)
    return centred / tf.constant(std, tf.float32)

  return standardize
