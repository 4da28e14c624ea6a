"""Mixup and CutMix, in jax, to run on device inside the jitted train step.

Both mix each example with its neighbour in the (global) batch -- the batch
rolled by one -- using one mixing ratio per batch drawn from
Beta(alpha, alpha), and mix the (one-hot / k-hot) labels by the same ratio.
Rolling the global batch pairs examples across devices; XLA inserts the
communication. Call with an rng that differs per step (e.g.
jax.random.fold_in(rng, step)) so resumes stay exact.
"""

import functools

import jax
import jax.numpy as jnp


def _check_labels(labels):
  # Mixing integer class ids would average them into other, wrong, class ids.
  if labels.ndim != 2 or not jnp.issubdtype(labels.dtype, jnp.floating):
    raise ValueError(
        f"mixup/cutmix need one-hot float labels [batch, classes], got "
        f"{labels.dtype} {tuple(labels.shape)}: end the pp with e.g. "
        f"onehot(K, key='label', key_result='labels')"
    )


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
  cut_h, cut_w = (
      jnp.floor(n * jnp.sqrt(1.0 - lam)).astype(jnp.int32) for n in (h, w)
  )
  cy, cx = jax.random.randint(y_rng, (), 0, h), jax.random.randint(
      x_rng, (), 0, w
  )
  y0, y1 = jnp.clip(cy - cut_h // 2, 0, h), jnp.clip(cy + cut_h // 2, 0, h)
  x0, x1 = jnp.clip(cx - cut_w // 2, 0, w), jnp.clip(cx + cut_w // 2, 0, w)
  ys, xs = jnp.arange(h)[:, None], jnp.arange(w)[None, :]
  box = (ys >= y0) & (ys < y1) & (xs >= x0) & (xs < x1)  # [H, W]
  mixed = jnp.where(box[None, :, :, None], jnp.roll(images, 1, axis=0), images)
  kept = 1.0 - jnp.mean(box.astype(jnp.float32))  # exact after clipping
  # (in the labels' own dtype, as mixup's: lax.cond in mixup_or_cutmix needs
  # both branches to agree)
  mixed_labels = kept * labels + (1.0 - kept) * jnp.roll(labels, 1, axis=0)
  return mixed, mixed_labels.astype(labels.dtype)


def mixup_or_cutmix(
    rng,
    images,
    labels,
    *,
    mixup_alpha=0.0,
    cutmix_alpha=0.0,
    switch_prob=0.5,
    fold_in=None,
    n=2,
):
  """timm-style: per batch, cutmix with probability `switch_prob` else mixup.

  An alpha of 0 disables that method; both 0 returns the inputs unchanged.
  big_vision's `fold_in=None` and `n=2` are accepted (they are what this
  does); other keys are a TypeError (train_setup reports it as config.mixup's).
  """
  if min(mixup_alpha, cutmix_alpha) < 0 or fold_in is not None or n != 2:
    raise ValueError(
        f"config.mixup: need mixup_alpha and cutmix_alpha >= 0 (0: off), and of "
        f"big_vision's keys only fold_in=None and n=2 (one ratio mixes pairs of "
        f"the whole global batch); got {mixup_alpha=}, {cutmix_alpha=}, "
        f"{fold_in=}, {n=}"
    )
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
      lambda: mixup(rng, images, labels, alpha=mixup_alpha),
  )


def make_mixup(mixup_cfg):
  """mixup/cutmix applied in the jitted step, or None when not configured.

  config.mixup = dict(mixup_alpha=0.2, cutmix_alpha=0.0, switch_prob=0.5)
  (mixup_or_cutmix below; big_vision's `p` is accepted for mixup_alpha).
  """
  if not mixup_cfg:
    return None
  if hasattr(mixup_cfg, "to_dict"):  # a ConfigDict
    mixup_cfg = mixup_cfg.to_dict()
  kw = dict(mixup_cfg)
  if "p" in kw:
    kw["mixup_alpha"] = kw.pop("p")
  mix = functools.partial(mixup_or_cutmix, **kw)
  try:  # Checks the keys now, before the compile.
    mix(jax.random.PRNGKey(0), jnp.zeros((2, 1, 1, 1)), jnp.zeros((2, 2)))
  except TypeError as e:  # An unknown key.
    raise ValueError(f"config.mixup: {e}") from None
  return mix
