"""Position embeddings against closed forms worked by hand and TF's resize.

sincos_2d: big_vision's table, written out for a 2x3 grid of width 8, where
omega = [1, 1/10000], so every entry is sin/cos of a small integer (or 1e-4
times it) and a swapped axis, sin/cos order or temperature shows.
resample: TensorFlow's bilinear resize (antialiased when shrinking), a second
implementation of the same filter.
fit: the cls/prefix rows and the grid part on small tables with distinct rows.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

from big_vit_lite.models import posemb


def _by_hand_row(y, x):
  """The width-8 row of grid position (y, x): omega = (1, 1e-4)."""
  return [
      np.sin(x),
      np.sin(x * 1e-4),
      np.cos(x),
      np.cos(x * 1e-4),
      np.sin(y),
      np.sin(y * 1e-4),
      np.cos(y),
      np.cos(y * 1e-4),
  ]


def test_sincos_2d_is_the_big_vision_table():
  """Guards: y and x swapped, sin/cos order changed, temperature or the
  omega exponent's denominator (width/4 - 1) wrong, column-major instead of
  raster order, prefix rows not zeros, not float32."""
  table = posemb.sincos_2d(2, 3, 8, num_prefix=1)
  assert table.shape == (1, 1 + 6, 8) and table.dtype == np.float32
  np.testing.assert_array_equal(table[0, 0], np.zeros(8))
  want = [_by_hand_row(y, x) for y in range(2) for x in range(3)]
  np.testing.assert_allclose(table[0, 1:], want, rtol=1e-6, atol=1e-7)


def test_sincos_2d_frequencies_span_1_to_1e_4():
  """Guards: the frequencies' exponent off (arange/(n-1) so the last is
  exactly 1/10000), for width 16: omega = 10000^(-k/3), k = 0..3."""
  table = posemb.sincos_2d(1, 2, 16)
  omega = 10_000.0 ** (-np.arange(4) / 3)
  # Position (0, 1): x = 1, y = 0.
  want = np.concatenate([np.sin(omega), np.cos(omega), np.zeros(4), np.ones(4)])
  np.testing.assert_allclose(table[0, 1], want, rtol=1e-6, atol=1e-7)
  # Width 4: a single frequency of 1 (the width // 4 - 1 == 0 guard).
  np.testing.assert_allclose(
      posemb.sincos_2d(1, 2, 4)[0, 1],
      [np.sin(1), np.cos(1), 0, 1],
      rtol=1e-6,
      atol=1e-7,
  )


@pytest.mark.parametrize(
    "old_hw, new_hw", [((2, 3), (4, 5)), ((4, 4), (2, 2)), ((3, 3), (3, 5))]
)
def test_resample_is_tf_bilinear_resize(old_hw, new_hw):
  """Guards: another interpolation (nearest, no antialias when shrinking),
  h and w swapped, or the rows reshaped in another order."""
  rng = np.random.default_rng(0)
  d = 3
  table = rng.normal(size=(1, old_hw[0] * old_hw[1], d)).astype(np.float32)
  got = posemb.resample(table, new_hw, old_hw)
  grid = table[0].reshape(*old_hw, d)
  want = tf.image.resize(
      grid, new_hw, method="bilinear", antialias=True
  ).numpy()
  assert got.shape == (1, new_hw[0] * new_hw[1], d) and got.dtype == np.float32
  np.testing.assert_allclose(got[0].reshape(*new_hw, d), want, atol=1e-5)


def test_resample_keeps_the_dtype_and_same_grid_is_unchanged():
  """Guards: a same-size resample not the identity, or the table's dtype
  lost (bfloat16/float16 checkpoints)."""
  table = np.arange(2 * 4 * 2, dtype=np.float16).reshape(1, 8, 2)
  assert posemb.resample(table, (2, 4), (2, 4)) is table
  assert posemb.resample(table, (4, 2), (2, 4)).dtype == np.float16
  square = np.zeros((1, 9, 2), np.float32)
  assert posemb.resample(square, (3, 3)) is square  # old_hw None: square
  with pytest.raises(
      ValueError,
      match="Cannot resample a position embedding of 8 tokens: not a square grid",
  ):
    posemb.resample(np.zeros((1, 8, 2)), (3, 3))


def test_square_grid():
  """Guards: a non-square count taken as square (rounding isqrt)."""
  assert posemb.square_grid(36) == (6, 6)
  assert posemb.square_grid(1) == (1, 1)
  assert posemb.square_grid(35) is None and posemb.square_grid(37) is None


def _table(prefix, n, d=2):
  """Rows 100 + i for prefix rows, i for grid rows: every row tells its origin."""
  rows = [np.full(d, 100.0 + i) for i in range(prefix)]
  rows += [np.full(d, float(i)) for i in range(n)]
  return np.asarray(rows, np.float32)[None]


def test_fit_keeps_drops_or_zero_fills_the_cls_row():
  """Guards: the checkpoint's cls row dropped when both have one, kept when
  the model has none, or a missing one filled with anything but zeros."""
  src = _table(1, 4)
  same = posemb.fit(src, 1, (1, 5, 2), 1)
  np.testing.assert_array_equal(same, src)
  no_cls = posemb.fit(src, 1, (1, 4, 2), 0)
  np.testing.assert_array_equal(no_cls, src[:, 1:])
  src_gap = _table(0, 4)
  added = posemb.fit(src_gap, 0, (1, 5, 2), 1)
  np.testing.assert_array_equal(added[0, 0], [0, 0])
  np.testing.assert_array_equal(added[:, 1:], src_gap)
  assert added.dtype == np.float32


def test_fit_resamples_the_grid_part_to_the_model_grid():
  """Guards: the grid resampled to the wrong (h, w) (a non-square model grid
  taken as square, the source grid ignored), or the cls row resampled with
  the grid."""
  src = _table(1, 6)  # a 2x3 grid
  out = posemb.fit(src, 1, (1, 1 + 8, 2), 1, grid_hw=(2, 4), src_grid_hw=(2, 3))
  np.testing.assert_array_equal(out[:, :1], src[:, :1])
  want = posemb.resample(src[:, 1:], (2, 4), (2, 3))
  np.testing.assert_allclose(out[:, 1:], want)
  # Equal counts on different known grids (4x9 vs 6x6) are resampled too.
  src36 = _table(0, 36)
  out = posemb.fit(src36, 0, (1, 36, 2), 0, grid_hw=(6, 6), src_grid_hw=(4, 9))
  np.testing.assert_allclose(out, posemb.resample(src36, (6, 6), (4, 9)))
  # ...but kept when nothing says the source grid differs.
  kept = posemb.fit(src36, 0, (1, 36, 2), 0, grid_hw=(4, 9))
  np.testing.assert_array_equal(kept, src36)


def test_fit_ignores_a_src_grid_that_does_not_match_the_rows():
  """Guards: a saved config's grid trusted for params of another size."""
  src = _table(0, 16)  # 4x4
  out = posemb.fit(src, 0, (1, 4, 2), 0, src_grid_hw=(3, 3))
  np.testing.assert_allclose(out, posemb.resample(src, (2, 2), (4, 4)))


def test_fit_width_mismatch_and_non_square_target():
  """Guards: another width silently cut or padded, or a grid that cannot be
  inferred resampled to a guess instead of the documented error."""
  src = _table(1, 4, d=2)
  assert posemb.fit(src, 1, (1, 5, 3), 1) is src
  with pytest.raises(
      ValueError,
      match="cannot fit checkpoint shape .1, 5, 2. to model shape .1, 9, 2.",
  ):
    posemb.fit(src, 1, (1, 9, 2), 1)


def test_fit_warns_only_when_square_rows_go_to_another_grid(caplog):
  """Guards: the warning about a square row count taken for a non-square
  grid given when nothing is in doubt (the same square grid on both sides: a
  false alarm on every plain fine-tune), or a crash formatting it for a
  source grid that is not square (12 rows: no square grid to name). Oracle:
  the three cases worked by hand."""
  src36 = _table(0, 36)
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(posemb.fit(src36, 0, (1, 36, 2), 0), src36)
    np.testing.assert_array_equal(
        posemb.fit(_table(0, 12), 0, (1, 12, 2), 0, grid_hw=(3, 4)),
        _table(0, 12),
    )
  assert not caplog.records
  with caplog.at_level(logging.WARNING):
    posemb.fit(src36, 0, (1, 36, 2), 0, grid_hw=(4, 9))
  [record] = caplog.records
  assert record.getMessage().startswith(
      "Took the checkpoint's 36 posemb rows for the model's 4x9 grid as they"
      " are; if it was trained on another grid (e.g. 6x6)"
  )
