"""Mixup and CutMix, in jax, to run on device inside the jitted train step.

Both mix each example with its neighbour in the (global) batch -- the batch
rolled by one -- using one mixing ratio per batch drawn from
Beta(alpha, alpha), and mix the (one-hot / k-hot) labels by the same ratio.
Rolling the global batch pairs examples across devices; XLA inserts the
communication. Call with an rng that differs per step (e.g.
jax.random.fold_in(rng, step)) so resumes stay exact.
"""
import jax
import jax.numpy as jnp

from big_vit_lite.data import is_number


def _check_labels(labels):
  # Mixing integer class ids would average them into other, wrong, class ids.
  if labels.ndim != 2 or not jnp.issubdtype(labels.dtype, jnp.floating):
    raise ValueError(f"mixup/cutmix need one-hot float labels [batch, classes], got "
                     f"{labels.dtype} {tuple(labels.shape)}: end the pp with e.g. "
                     f"onehot(K, key='label', key_result='labels')")


def mixup(rng, images, labels, *, alpha=0.2):
  """images [B,H,W,C] float, labels [B,K] float -> mixed (images, labels)."""
  _check_labels(labels)
  lam = jax.random.beta(rng, alpha, alpha)
  lam = jnp.maximum(lam, 1.0 - lam)  # the original example dominates
  mix = lambda x: lam * x + (1.0 - lam) * jnp.roll(x, 1, axis=0)  # noqa: E731
  return mix(images).astype(images.dtype), mix(labels).astype(labels.dtype)


def cutmix(rng, images, labels, *, alpha=1.0):
  """Pastes a box of the neighbour's image; labels mixed by the box's true area."""
  _check_labels(labels)
  lam_rng, y_rng, x_rng = jax.random.split(rng, 3)
  lam = jax.random.beta(lam_rng, alpha, alpha)
  h, w = images.shape[1], images.shape[2]
  cut_h, cut_w = (jnp.floor(n * jnp.sqrt(1.0 - lam)).astype(jnp.int32) for n in (h, w))
  cy, cx = jax.random.randint(y_rng, (), 0, h), jax.random.randint(x_rng, (), 0, w)
  y0, y1 = jnp.clip(cy - cut_h // 2, 0, h), jnp.clip(cy + cut_h // 2, 0, h)
  x0, x1 = jnp.clip(cx - cut_w // 2, 0, w), jnp.clip(cx + cut_w // 2, 0, w)
  ys, xs = jnp.arange(h)[:, None], jnp.arange(w)[None, :]
  box = (ys >= y0) & (ys < y1) & (xs >= x0) & (xs < x1)  # [H, W]
  mixed = jnp.where(box[None, :, :, None], jnp.roll(images, 1, axis=0), images)
  kept = 1.0 - jnp.mean(box.astype(jnp.float32))  # exact after clipping
  labels = kept * labels + (1.0 - kept) * jnp.roll(labels, 1, axis=0)
  return mixed, labels.astype(labels.dtype)


# Keys of timm's mixup configs that are not ours: what to do instead.
_INSTEAD = {
    "prob": "every batch is mixed here (both alphas 0 turn mixing off)",
    "mixup_prob": "every batch is mixed here (both alphas 0 turn mixing off)",
    "label_smoothing": "for label smoothing use onehot(K, on=..., off=...) in the pp",
    "smoothing": "for label smoothing use onehot(K, on=..., off=...) in the pp",
    "mode": "one ratio mixes each whole global batch here",
    "num_classes": "not needed: the labels' width is the class count",
}


def _check_config(mixup_alpha, cutmix_alpha, switch_prob, fold_in, n, others):
  """One-line errors for a config.mixup that would fail in the step or mix silently wrong."""
  if others:
    key = sorted(others)[0]
    instead = _INSTEAD.get(key, "the keys are mixup_alpha, cutmix_alpha, switch_prob "
                                "(big_vision's p is mixup_alpha)")
    raise ValueError(f"config.mixup: unknown key {key!r}: {instead}")
  for key, value in (("mixup_alpha", mixup_alpha), ("cutmix_alpha", cutmix_alpha)):
    if not is_number(value) or value < 0:
      raise ValueError(f"config.mixup.{key} must be a number >= 0 (0: off), got {value!r}")
  if not is_number(switch_prob) or not 0 <= switch_prob <= 1:
    raise ValueError(f"config.mixup.switch_prob must be a probability in [0, 1], "
                     f"got {switch_prob!r}")
  if fold_in is not None:
    raise ValueError(f"config.mixup.fold_in={fold_in!r}: big_vision's per-device mixing is not "
                     f"supported (one ratio mixes the whole global batch, as its "
                     f"fold_in=None); remove fold_in")
  if n != 2:
    raise ValueError(f"config.mixup.n={n!r}: only pairs are mixed (big_vision's n=2)")


def mixup_or_cutmix(rng, images, labels, *, mixup_alpha=0.0, cutmix_alpha=0.0, switch_prob=0.5,
                    fold_in=None, n=2, **others):
  """timm-style: per batch, cutmix with probability `switch_prob` else mixup.

  An alpha of 0 disables that method; both 0 returns the inputs unchanged.
  big_vision's `fold_in=None` and `n=2` are accepted (they are what this
  does); other keys of big_vision's or timm's configs are one-line errors
  naming what to use instead.
  """
  _check_config(mixup_alpha, cutmix_alpha, switch_prob, fold_in, n, others)
  if mixup_alpha <= 0 and cutmix_alpha <= 0:
    return images, labels
  if cutmix_alpha <= 0:
    return mixup(rng, images, labels, alpha=mixup_alpha)
  if mixup_alpha <= 0:
    return cutmix(rng, images, labels, alpha=cutmix_alpha)
  pick_rng, rng = jax.random.split(rng)
  return jax.lax.cond(
      jax.random.bernoulli(pick_rng, switch_prob),
      lambda: cutmix(rng, images, labels, alpha=cutmix_alpha),
      lambda: mixup(rng, images, labels, alpha=mixup_alpha))
