"""Position embeddings: the fixed 2D sin-cos table, and resampling learned ones to a grid."""

import logging
import math

import jax
import numpy as np

PARAM = "Transformer/posembed_input/pos_embedding"  # the learned table's name


def sincos_2d(h: int, w: int, width: int, num_prefix: int = 0) -> np.ndarray:
  """Fixed 2D sin-cos position embedding, shape (1, num_prefix + h*w, width), raster order.

  Temperature 10,000, float32. The `num_prefix` rows first (a cls token's) are zeros: no
  position, as in big_vision. The width must be divisible by 4.
  """
  y, x = np.mgrid[:h, :w]
  # The width // 4 frequencies run from 1 to 1/10,000 (one frequency: just 1).
  last_index = max(width // 4 - 1, 1)
  omega = 1.0 / (10_000.0 ** (np.arange(width // 4) / last_index))
  y, x = np.einsum("m,d->md", y.flatten(), omega), np.einsum(
      "m,d->md", x.flatten(), omega
  )
  pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
  return np.concatenate(
      [np.zeros((num_prefix, width), np.float32), pe.astype(np.float32)]
  )[None]


def square_grid(n: int):
  """(s, s) when n tokens make an s x s grid, else None."""
  s = math.isqrt(n)
  return (s, s) if s * s == n else None


def resample(
    posemb: np.ndarray, new_hw: tuple[int, int], old_hw=None
) -> np.ndarray:
  """Bilinear resize of a grid posemb (1, N, D) to (1, h*w, D); no prefix rows.

  old_hw: the source's (h, w) grid; None for a square one.
  """
  _, n, d = posemb.shape
  old_hw = old_hw or square_grid(n)
  if old_hw is None:
    raise ValueError(
        f"Cannot resample a position embedding of {n} tokens: not a square grid."
    )
  if tuple(old_hw) == tuple(new_hw):
    return posemb
  grid = np.asarray(posemb[0], np.float32).reshape(*old_hw, d)
  # antialias matters only when shrinking; it avoids aliasing of the learned
  # field.
  new = jax.image.resize(grid, (*new_hw, d), method="bilinear", antialias=True)
  return np.asarray(new, posemb.dtype).reshape(1, -1, d)


def fit(
    src: np.ndarray,
    src_prefix: int,
    tgt_shape: tuple,
    tgt_prefix: int,
    grid_hw=None,
    src_grid_hw=None,
) -> np.ndarray:
  """Source posemb -> target shape: resample the grid part, keep/add/drop the cls row.

  grid_hw: the model's (h, w) patch grid. Without it the target grid is taken
  to be square, which is wrong for a non-square input whose token count
  happens to be square (4x9 = 36 tokens is not 6x6).
  src_grid_hw: the checkpoint's grid when known (a training checkpoint's pp
  says it); else it is taken to be square. Equal token counts keep their
  rows unless both grids are known to differ (a warning says when the rows
  of a square count go to a non-square grid: 36 rows may be 6x6 or 4x9).
  """
  prefix, grid = src[:, :src_prefix], src[:, src_prefix:]
  n_src, n_tgt = grid.shape[1], tgt_shape[1] - tgt_prefix
  if src_grid_hw is not None and src_grid_hw[0] * src_grid_hw[1] != n_src:
    src_grid_hw = None  # The saved config does not describe these params.
  if grid.shape[2] != tgt_shape[2]:
    # Another width: merge's shape check says so, naming both architectures.
    return src
  tgt_hw = square_grid(n_tgt)
  if grid_hw is not None:
    tgt_hw = tuple(grid_hw)
  src_hw = square_grid(n_src)
  if src_grid_hw is not None:
    src_hw = tuple(src_grid_hw)
  if n_src == n_tgt and (src_grid_hw is None or tgt_hw is None):
    # Nothing says the two grids differ: keep the rows.
    if src_hw is not None and tgt_hw is not None and src_hw != tgt_hw:
      logging.warning(
          "Took the checkpoint's %d posemb rows for the model's %dx%d grid as they "
          "are; if it was trained on another grid (e.g. %dx%d), load it from its "
          "training workdir, whose config says so.",
          n_src,
          *tgt_hw,
          *src_hw,
      )
  elif src_hw != tgt_hw:
    if tgt_hw is None:
      raise ValueError(
          f"param {PARAM!r}: cannot fit checkpoint shape {src.shape} to model "
          f"shape {tgt_shape}; add it to dont_load to re-initialise it."
      )
    grid = resample(grid, tgt_hw, src_hw)
    logging.info(
        "Resampled posemb from %d grid tokens to a %dx%d grid.", n_src, *tgt_hw
    )
  # Without a source cls row (big_vision, gap), the cls token had no posemb: a
  # zero row.
  if src_prefix:
    prefix = prefix[:, :tgt_prefix]
  else:
    prefix = np.zeros((1, tgt_prefix, src.shape[2]), src.dtype)
  return np.concatenate([prefix, grid], axis=1)
