"""The eval presets' pp against hand-worked pixels: the model's [-1, 1] input, at its size."""

import io

import numpy as np
from PIL import Image
import tensorflow as tf

from big_vit_lite.data import pp
from big_vit_lite.evaluators import presets


def test_eval_pp_is_the_models_input_range_at_its_size():
  """Guards: the presets' pp (configs/fewshot.py's, linear_probe.py's and
  classify.py's evals) mapping pixels to [0, 1] or leaving them 0-255, where the
  model was trained on [-1, 1] (its few-shot numbers then measure inputs it
  never saw); the label key or channels not passed through. Oracle: a
  3x3 PNG whose pixels 0, 51 and 255 are -1, -0.6 and 1 by hand (the image
  is the preset's size, so the resize is the identity), in RGB and grey."""
  pixels = np.array([[0, 51, 255], [255, 0, 51], [51, 255, 0]], np.uint8)
  rgb = np.stack([pixels, pixels.T, pixels[::-1]], -1)
  by_hand = np.vectorize({0: -1.0, 51: -0.6, 255: 1.0}.get)
  for channels, image in ((3, rgb), (1, pixels)):
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, "PNG")
    fn = pp.get_preprocess_fn(
        presets.eval_pp(3, channels=channels, label_key="y")
    )
    got = fn(
        {"image": tf.constant(buf.getvalue()), "y": tf.constant(2), "z": 0}
    )
    assert sorted(got) == ["image", "y"] and int(got["y"]) == 2
    expected = by_hand(image).reshape(3, 3, channels)
    np.testing.assert_allclose(got["image"].numpy(), expected, atol=1e-6)
