"""Image augmentation on device, inside the jitted train step: random shifts and flips.

  config.device_aug = dict(translate=2, fill=-1.0, flip_lr=True)

The same augmentations as the pp ops "pad(2)|random_crop(28)|flip_lr", applied
to the whole (global, sharded) batch by a few XLA ops instead of per example
in tf.data. Use it when the host's CPU is what the step waits for (see
benchmarks/NOTES.md, section "Input pipeline (data/)").

Keys (all optional; unknown keys are errors):
  translate  shift each image by a uniform random whole number of pixels in
             [-translate, translate] along each axis, independently per
             example (= pad(translate) then a random crop back to size).
  fill       the value of the pixels shifted in, in the model's input range
             (after value_range: -1.0 is black for value_range(-1, 1)).
  flip_lr    mirror each example left-right with probability 1/2.

The randomness comes from the train step's key folded with the step number,
so resumed runs see exactly the same augmentations.
"""

import jax
import jax.numpy as jnp

from big_vit_lite.data import config_dict, count

KEYS = ("translate", "fill", "flip_lr")


def translate(rng, images, max_shift, fill=0.0):
  """images [B,H,W,C] -> each shifted by uniform [-max_shift, max_shift] px per axis."""
  if max_shift == 0:
    return images
  b, h, w, c = images.shape
  s = max_shift
  padded = jnp.pad(
      images,
      ((0, 0), (s, s), (s, s), (0, 0)),
      constant_values=jnp.asarray(fill, images.dtype),
  )
  offsets = jax.random.randint(rng, (b, 2), 0, 2 * s + 1)
  crop = lambda img, o: jax.lax.dynamic_slice(img, (o[0], o[1], 0), (h, w, c))  # noqa: E731
  return jax.vmap(crop)(padded, offsets)


def flip_lr(rng, images):
  """Mirrors each image of [B,H,W,C] left-right with probability 1/2."""
  flip = jax.random.bernoulli(rng, 0.5, (images.shape[0],))
  return jnp.where(flip[:, None, None, None], images[:, :, ::-1, :], images)


def make(cfg):
  """config.device_aug -> fn(rng, images) -> images, or None when not configured."""
  if not cfg:
    return None
  kw = config_dict(cfg, KEYS, "config.device_aug")
  shift = count(kw.get("translate", 0) or 0, "config.device_aug.translate", 0)
  fill = float(kw.get("fill", 0.0))
  flip = kw.get("flip_lr", False)
  if not shift and not flip:
    return None

  def augment(rng, images):
    rng_shift, rng_flip = jax.random.split(rng)
    if shift:
      images = translate(rng_shift, images, shift, fill)
    if flip:
      images = flip_lr(rng_flip, images)
    return images

  return augment
