"""decode's channel conversions (grey, alpha) against PIL's, on formats tf cannot convert itself."""

import io

import numpy as np
from PIL import Image
import tensorflow as tf

from big_vit_lite.data import pp

RGB = np.random.default_rng(0).integers(0, 256, (16, 24, 3), dtype=np.uint8)


def _encoded(fmt, image=RGB, mode=None):
  buf = io.BytesIO()
  Image.fromarray(image, mode).save(buf, fmt)
  return buf.getvalue()


def _decode(pp_string, image):
  return pp.get_preprocess_fn(pp_string)({"image": tf.constant(image)})[
      "image"
  ].numpy()


def test_grey_from_colour_rounds_as_pils_luminance():
  """Guards: the RGB -> grey conversion truncated (a cast without the round:
  every grey image half a level darker on average, a bias a model trained on
  grey decodes learns), or weighted other than ITU-R 601-2 luma. The path:
  decode(channels=1) of a colour GIF, BMP or WEBP (tf decodes those to RGB,
  then converts) and of an RGB tensor decoded upstream. Oracle: PIL's
  convert("L") (integer ITU-R 601-2, rounded): every pixel within one level
  and the mean difference near 0 (truncation's is -0.5)."""
  pil_grey = np.asarray(Image.fromarray(RGB).convert("L"), np.float64)
  for image in (_encoded("BMP"), _encoded("WEBP", mode=None), RGB):
    if isinstance(image, bytes) and image[:4] == b"RIFF":
      # WEBP is lossy: its own decoded colours are PIL's reference.
      reference = Image.open(io.BytesIO(image)).convert("RGB")
      expected = np.asarray(reference.convert("L"), np.float64)
    else:
      expected = pil_grey
    grey = _decode("decode(channels=1)", image)
    assert grey.shape == (16, 24, 1) and grey.dtype == np.uint8
    diff = grey[..., 0].astype(np.float64) - expected
    assert np.abs(diff).max() <= 1
    assert abs(diff.mean()) < 0.1


def test_alpha_added_to_an_opaque_image_is_opaque():
  """Guards: decode(channels=4) of an image without alpha (JPEG, GIF, WEBP:
  tf decodes them to RGB, the alpha is added) or an RGB tensor given an
  alpha of 0 (transparent) instead of 255; grey + alpha taken apart wrong.
  Oracle: PIL's convert("RGBA") of the same decoded pixels (alpha 255), and
  PIL's own RGBA and LA images kept as they are."""
  for raw in (_encoded("GIF"), _encoded("JPEG")):
    rgba = _decode("decode(channels=4)", raw)
    expected = np.asarray(Image.open(io.BytesIO(raw)).convert("RGBA"))
    assert rgba.shape == (16, 24, 4)
    np.testing.assert_array_equal(rgba[..., 3], expected[..., 3])
  rgba = _decode("decode(channels=4)", RGB)
  np.testing.assert_array_equal(
      rgba, np.asarray(Image.fromarray(RGB).convert("RGBA"))
  )
  # Grey + alpha (PIL's "LA") to RGBA: the grey thrice, its alpha kept.
  la = np.stack([RGB[..., 0], RGB[..., 1]], -1)
  np.testing.assert_array_equal(
      _decode("decode(channels=4)", la),
      np.asarray(Image.fromarray(la, "LA").convert("RGBA")),
  )
