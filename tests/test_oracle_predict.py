"""predict in-process on a tiny random model: its probabilities against the model applied by hand."""

import flax.linen as nn
import jax
import numpy as np
from PIL import Image

from big_vit_lite import predict
from big_vit_lite.models import vit


def test_predict_is_the_softmax_of_the_model_on_pixels_scaled_to_minus_1_1(
    tmp_path,
):
  """Guards: predict's default preprocessing other than the models' input
  range (value_range(0, 1), or no value_range: every prediction made on
  inputs the model never saw), the top-k not sorted or not the largest,
  probabilities of logits without the softmax, a class's label from the
  wrong line of --labels. Oracle: the tiny model applied here with flax to
  pixels / 127.5 - 1 (the ViT's [-1, 1] input range), softmax and sort in
  numpy; the labels file's line i for class i. The image is the model's size,
  so the resize is the identity."""
  model = vit.Model(
      num_classes=5,
      variant=None,
      width=16,
      depth=1,
      mlp_dim=32,
      num_heads=2,
      patch_size=8,
      head_zeroinit=False,
  )
  pixels = np.random.default_rng(0).integers(0, 256, (16, 16, 3), np.uint8)
  params = nn.meta.unbox(
      model.init(jax.random.key(0), np.zeros((1, 16, 16, 3), np.float32))
  )["params"]
  vit.save_npz(params, tmp_path / "model.npz")
  Image.fromarray(pixels).save(tmp_path / "a.png")
  (tmp_path / "labels.txt").write_text("".join(f"c{i}\n" for i in range(5)))

  logits, _ = model.apply(
      {"params": params}, pixels[None].astype(np.float32) / 127.5 - 1.0
  )
  probs = np.exp(np.float64(logits[0]) - np.max(logits[0]))
  probs /= probs.sum()
  top3 = np.argsort(-probs)[:3]

  [(path, got)] = predict.predict(
      str(tmp_path / "model.npz"),
      [str(tmp_path / "a.png")],
      top_k=3,
      labels_file=str(tmp_path / "labels.txt"),
  )
  assert path.endswith("a.png")
  assert [(c, label) for c, label, _ in got] == [(c, f"c{c}") for c in top3]
  np.testing.assert_allclose([p for *_, p in got], probs[top3], atol=1e-5)
