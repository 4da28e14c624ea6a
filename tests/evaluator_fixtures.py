"""Test data for the evaluators: a small image folder with easy classes, a tiny ViT."""

import os

import numpy as np
from PIL import Image

CLASSES = ("bars", "disc", "corner")
TINY_VIT = dict(
    variant=None,
    width=32,
    depth=1,
    mlp_dim=64,
    num_heads=2,
    patch_size=7,
    pool_type="gap",
    remat_policy=None,
)


def save_tiny_npz(directory):
  """A random-init RGB TINY_VIT (5 classes) saved by vit.save_npz (no config alongside): its path."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from big_vit_lite.models import vit  # pylint: disable=import-outside-toplevel

  model = vit.Model(num_classes=5, **TINY_VIT)
  params = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 3)))["params"]
  path = os.path.join(str(directory), "tiny.npz")
  vit.save_npz(params, path)
  return path


def _pattern(cls, rng, size=28):
  """A grey uint8 image of class `cls` with random shift and noise."""
  y, x = np.mgrid[:size, :size]
  dy, dx = rng.integers(-3, 4, 2)
  if cls == "bars":
    img = ((x + dx) // 3) % 2 * 200.0
  elif cls == "disc":
    img = (((y - 14 - dy) ** 2 + (x - 14 - dx) ** 2) < 49) * 220.0
  else:
    img = ((y < 12 + dy) & (x < 12 + dx)) * 230.0
  img = img + rng.normal(0, 20, img.shape)
  return np.clip(img, 0, 255).astype(np.uint8)


def write_image_folder(root, n_train=12, n_test=8, seed=0):
  """ROOT/{train,test}/{bars,disc,corner}/*.png; returns ROOT."""
  rng = np.random.default_rng(seed)
  for split, n in (("train", n_train), ("test", n_test)):
    for cls in CLASSES:
      d = os.path.join(root, split, cls)
      os.makedirs(d, exist_ok=True)
      for i in range(n):
        Image.fromarray(_pattern(cls, rng)).save(os.path.join(d, f"{i}.png"))
  return root


def random_params(model):
  """Random params of `model` for 28x28 grey input (cheaper than an eager init)."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  abstract = jax.eval_shape(
      model.init, jax.random.key(0), jnp.zeros((1, 28, 28, 1))
  )
  rng = np.random.default_rng(0)
  return jax.tree.map(
      lambda a: jnp.asarray(rng.normal(0, 0.1, a.shape), a.dtype),
      nn.meta.unbox(abstract["params"]),
  )
