"""Mixup and CutMix against closed forms and their distributions over many draws.

Each example of the batch is one constant value (1, 10, 100), so a mixed image
shows which examples went into it and by how much: mixup gives a blend, cutmix
gives each pixel exactly one example's value. The draws' statistics are
compared with scipy's Beta distribution or a numpy Monte Carlo of the
documented procedure, with tolerances of 5 standard errors of the sample.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate
from scipy import stats

from big_vit_lite.data import mixup as mixup_lib

DRAWS = 2000
VALUES = np.array([1.0, 10.0, 100.0], np.float32)
SIZE = 12


def _batch():
  images = np.broadcast_to(VALUES[:, None, None, None], (3, SIZE, SIZE, 1))
  return jnp.asarray(images), jnp.eye(3, dtype=jnp.float32)


def _draws(fn, draws=DRAWS, seed=0):
  images, labels = _batch()
  keys = jax.random.split(jax.random.PRNGKey(seed), draws)
  out = jax.jit(jax.vmap(lambda k: fn(k, images, labels)))(keys)
  return np.asarray(out[0]), np.asarray(out[1])


def _mean_max_beta(alpha):
  """E[max(b, 1 - b)] and its sd for b ~ Beta(alpha, alpha) (scipy)."""
  dist = stats.beta(alpha, alpha)
  m1 = 2 * integrate.quad(lambda x: x * dist.pdf(x), 0.5, 1)[0]
  m2 = 2 * integrate.quad(lambda x: x * x * dist.pdf(x), 0.5, 1)[0]
  return m1, np.sqrt(m2 - m1 * m1)


@pytest.mark.parametrize("alpha", [0.2, 1.0])
def test_mixup_blends_with_the_previous_example_by_a_beta_ratio(alpha):
  """Guards: mixup's ratio not max(b, 1 - b) of Beta(alpha, alpha) (alpha
  ignored, the neighbour dominating), images and labels mixed by different
  ratios, or the partner not the example before (roll direction)."""
  images, labels = _draws(
      functools.partial(mixup_lib.mixup, alpha=alpha), seed=1
  )
  lam = labels[:, 0, 0]  # example 0's own class
  assert np.all(lam >= 0.5)
  # Example 0 is mixed with example 2 (the batch rolled by one), by 1 - lam.
  np.testing.assert_allclose(labels[:, 0, 2], 1 - lam, atol=1e-6)
  np.testing.assert_allclose(labels[:, 0, 1], 0.0, atol=1e-6)
  np.testing.assert_allclose(
      images[:, 0, 0, 0, 0], lam * VALUES[0] + (1 - lam) * VALUES[2], rtol=1e-5
  )
  np.testing.assert_allclose(
      images[:, 1, 3, 5, 0], lam * VALUES[1] + (1 - lam) * VALUES[0], rtol=1e-5
  )
  want, sd = _mean_max_beta(alpha)
  assert abs(lam.mean() - want) < 5 * sd / np.sqrt(DRAWS), (lam.mean(), want)


def _numpy_cutmix_stats(alpha, draws=200_000):
  """A numpy Monte Carlo of the documented CutMix box: cut = floor(n sqrt(1 -
  lam)), centre uniform over the image, box [c - cut//2, c + cut//2) clipped."""
  rng = np.random.default_rng(0)
  lam = rng.beta(alpha, alpha, draws)
  cut = np.floor(SIZE * np.sqrt(1 - lam)).astype(int)
  cy, cx = rng.integers(0, SIZE, draws), rng.integers(0, SIZE, draws)
  y0, y1 = np.clip(cy - cut // 2, 0, SIZE), np.clip(cy + cut // 2, 0, SIZE)
  x0, x1 = np.clip(cx - cut // 2, 0, SIZE), np.clip(cx + cut // 2, 0, SIZE)
  area = (y1 - y0) * (x1 - x0) / SIZE**2
  has_box = area > 0
  mean_row = (y0 + y1 - 1)[has_box] / 2  # of the rows y0 .. y1 - 1
  return area.mean(), area.std(), mean_row.mean()


def test_cutmix_pastes_one_box_and_mixes_labels_by_its_area():
  """Guards: CutMix's box off by one (`>` for `>=`: odd sizes), not centred
  on a uniform point, not square on a square image, labels mixed by lam
  instead of the clipped box's true area, or a box area distribution other
  than the documented floor(n sqrt(1 - lam)) cut."""
  alpha = 1.0
  images, labels = _draws(
      functools.partial(mixup_lib.cutmix, alpha=alpha), seed=2
  )
  pasted = images[:, 0, :, :, 0] == VALUES[2]  # example 0 got example 2's box
  own = images[:, 0, :, :, 0] == VALUES[0]
  assert np.all(pasted | own)
  # The same box in every example: example 1 gets example 0's pixels there.
  np.testing.assert_array_equal(images[:, 1, :, :, 0] == VALUES[0], pasted)
  area = pasted.mean(axis=(1, 2))
  np.testing.assert_allclose(labels[:, 0, 2], area, atol=1e-6)
  np.testing.assert_allclose(labels[:, 0, 0], 1 - area, atol=1e-6)
  rows, cols = pasted.any(axis=2), pasted.any(axis=1)
  # A rectangle: the pasted set is the outer product of its rows and columns.
  np.testing.assert_array_equal(pasted, rows[:, :, None] & cols[:, None, :])
  heights, widths = rows.sum(1), cols.sum(1)
  inside = (
      ~rows[:, 0] & ~rows[:, -1] & ~cols[:, 0] & ~cols[:, -1] & (heights > 0)
  )
  assert inside.sum() > DRAWS // 10
  # An unclipped box is 2 * (cut // 2) on each side: even, and square.
  assert np.all(heights[inside] % 2 == 0)
  np.testing.assert_array_equal(heights[inside], widths[inside])
  want, sd, want_row = _numpy_cutmix_stats(alpha)
  assert abs(area.mean() - want) < 5 * sd / np.sqrt(DRAWS), (area.mean(), want)
  # The centre is uniform over the image: the pasted rows' mean is the Monte
  # Carlo's on average (a range shifted by one moves it by ~0.5).
  row_index = np.arange(SIZE)
  has_box = heights > 0
  mean_row = (rows[has_box] * row_index).sum(1) / heights[has_box]
  mean_col = (cols[has_box] * row_index).sum(1) / widths[has_box]
  for centre in (mean_row, mean_col):
    se = centre.std() / np.sqrt(len(centre))
    assert abs(centre.mean() - want_row) < 5 * se, (centre.mean(), want_row)


def _is_cutmix(images):
  """Per draw: every pixel one of the batch's values (mixup blends them)."""
  return np.all(np.isin(images, VALUES), axis=(1, 2, 3, 4))


@pytest.mark.parametrize("switch_prob", [None, 0.8])
def test_mixup_or_cutmix_picks_cutmix_with_switch_prob(switch_prob):
  """Guards: the cutmix/mixup choice inverted, or switch_prob's default (0.5,
  used when config.mixup does not set it) changed."""
  kwargs = dict(mixup_alpha=1.0, cutmix_alpha=1.0)
  if switch_prob is not None:
    kwargs["switch_prob"] = switch_prob
  images, _ = _draws(
      functools.partial(mixup_lib.mixup_or_cutmix, **kwargs), seed=3
  )
  p = 0.5 if switch_prob is None else switch_prob
  frac = _is_cutmix(images).mean()
  assert abs(frac - p) < 5 * np.sqrt(p * (1 - p) / DRAWS), frac


def test_mixup_or_cutmix_routes_each_alpha_to_its_method():
  """Guards: an alpha of 0 not switching its method off (cutmix run with
  alpha 0, or both off not returning the batch unchanged), or mixup_alpha
  passed to cutmix and vice versa."""
  images, labels = _batch()
  key = jax.random.PRNGKey(0)
  out = mixup_lib.mixup_or_cutmix(key, images, labels)
  assert out[0] is images and out[1] is labels
  # Alphas other than mixup()'s and cutmix()'s defaults (0.2, 1.0), so that
  # an alpha not passed through shows in the statistics.
  only_cutmix = functools.partial(
      mixup_lib.mixup_or_cutmix, mixup_alpha=0.0, cutmix_alpha=0.3
  )
  cut_images, cut_labels = _draws(only_cutmix, seed=5)
  assert _is_cutmix(cut_images).all()
  area = 1 - cut_labels[:, 0, 0]  # the label mass the box moved
  want, sd, _ = _numpy_cutmix_stats(0.3)
  assert abs(area.mean() - want) < 5 * sd / np.sqrt(DRAWS), (area.mean(), want)
  # The spread tells the alphas apart (sd 0.206 at 0.3, 0.171 at 1.0); the sd
  # of a sample sd is about sd / sqrt(2 n), 6 of them here.
  assert abs(area.std() - sd) < 6 * sd / np.sqrt(2 * DRAWS), (area.std(), sd)
  only_mixup = functools.partial(
      mixup_lib.mixup_or_cutmix, mixup_alpha=0.5, cutmix_alpha=0.0
  )
  mixed, mixed_labels = _draws(only_mixup, seed=4)
  # mixup keeps each (constant) image constant; a cutmix box would not.
  np.testing.assert_array_equal(mixed, mixed[:, :, :1, :1, :] + 0 * mixed)
  lam = mixed_labels[:, 0, 0]
  want, sd = _mean_max_beta(0.5)  # mixup_alpha's ratio, not a default's
  assert abs(lam.mean() - want) < 5 * sd / np.sqrt(DRAWS), lam.mean()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mixup_alpha=-0.1),
        dict(cutmix_alpha=-1.0),
        dict(fold_in=0),
        dict(n=3),
    ],
)
def test_mixup_or_cutmix_rejects_what_it_does_not_do(kwargs):
  """Guards: a negative alpha or big_vision's fold_in / n accepted silently
  (the run would mix differently from what the config asks)."""
  images, labels = _batch()
  with pytest.raises(ValueError, match="config.mixup: need mixup_alpha"):
    mixup_lib.mixup_or_cutmix(jax.random.PRNGKey(0), images, labels, **kwargs)


@pytest.mark.parametrize("fn", [mixup_lib.mixup, mixup_lib.cutmix])
def test_integer_or_flat_labels_are_rejected(fn):
  """Guards: integer class ids mixed into other (wrong) class ids."""
  images, labels = _batch()
  for bad in (jnp.arange(3), labels.astype(jnp.int32)):
    with pytest.raises(ValueError, match="one-hot float labels"):
      fn(jax.random.PRNGKey(0), images, bad)


def test_mixed_batches_keep_their_dtypes():
  """Guards: bfloat16 images (or labels) handed back as float32 after the
  float32 ratio multiplied them (cutmix did so with its labels, and
  mixup_or_cutmix's lax.cond then refused bfloat16 labels: its two branches
  disagreed). Oracle: the dtypes given, and mixup's float32 blend rounded
  to bfloat16."""
  images, labels = _batch()
  images, labels = images.astype(jnp.bfloat16), labels.astype(jnp.bfloat16)
  key = jax.random.PRNGKey(3)
  # lax.cond traces both methods and needs their outputs' types to agree.
  got = mixup_lib.mixup_or_cutmix(
      key, images, labels, mixup_alpha=0.2, cutmix_alpha=1.0
  )
  assert [x.dtype for x in got] == [jnp.bfloat16, jnp.bfloat16]
  want, _ = mixup_lib.mixup(key, images.astype(jnp.float32), labels)
  got, _ = mixup_lib.mixup(key, images, labels)
  np.testing.assert_array_equal(got, want.astype(jnp.bfloat16))
