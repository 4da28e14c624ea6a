"""planner/formulas.py (plan's memory, FLOPs and time formulas) against
counts worked by hand on a tiny ViT: width 8, depth 2, MLP 16, 2 heads,
patch 4, 8 x 8 RGB images (4 patches + the class token = 5 tokens), 10
classes. Sizes are chosen so that the plausible slips (width for MLP width,
tokens for patches, a tensor-parallel split that does not divide, a factor of
2 on one term) change the number; every expected value is written out from
the formula's documented terms, not computed by the module.
"""

import types

import pytest

from big_vit_lite.planner import formulas

TINY = dict(width=8, depth=2, mlp_dim=16, num_heads=2, patch_size=4)
T = 5  # tokens


def test_activation_bytes_by_hand():
  """Guards: a coefficient's term on the wrong size (T*D for T*M, H*T for
  H*T^2), the matmul dtype's bytes ignored, dropout's masks missing or
  counted without dropout, remat keeping every block (or none), the tensor
  split applied where it does not divide (3 into 16 and 2) or to the width,
  the image, embeddings and logits outside the blocks left out. Oracle: the
  docstring's per-block formula, evaluated by hand."""
  # Per block and example, mm 2 bytes, tp 1:
  #   T*D*(3.4*4 + 2*2) = 40*17.6 = 704; T*M*(1.9*4 + 1.85*2) = 80*11.3 = 904;
  #   1.85*4*H*T^2 = 7.4*2*25 = 370  -> 1978.
  # Outside: image 192*4 = 768, 6*T*D*4 = 960, 10 classes * 8 = 80 -> 1808.
  kw = dict(
      local_batch=3, tokens=T, mm_bytes=2, num_classes=10, image_numel=192
  )

  def got(**more):
    return formulas.activation_bytes(TINY, **{"remat": False, **kw, **more})

  assert abs(got() - 3 * (2 * 1978 + 1808)) <= 1
  bare = formulas.activation_bytes(
      TINY, local_batch=3, tokens=T, mm_bytes=2, remat=False
  )
  assert abs(bare - 3 * (2 * 1978 + 960)) <= 1
  # Dropout: 8 bytes per element of T*M + 2*T*D = 160 elements: +1280 a block.
  assert abs(got(dropout=True) - 3 * (2 * (1978 + 1280) + 1808)) <= 1
  # Remat: each block's input (T*D f32 = 160) plus one block recomputed.
  assert abs(got(remat=True) - 3 * (2 * 160 + 1978 + 1808)) <= 1
  # tp=2 divides M=16 and H=2: 704 + 40*11.3 + 7.4*1*25 = 1341.
  assert abs(got(tp=2) - 3 * (2 * 1341 + 1808)) <= 1
  # tp=4 divides M (4 each) but not the 2 heads: 704 + 20*11.3 + 370 = 1300.
  assert abs(got(tp=4) - 3 * (2 * 1300 + 1808)) <= 1
  # tp=3 divides neither: whole.
  assert got(tp=3) == got()
  # float32 matmuls: T*D*(13.6 + 8) = 864; T*M*(7.6 + 7.4) = 1200; 370.
  assert abs(got(mm_bytes=4) - 3 * (2 * 2434 + 1808)) <= 1


def test_train_flops_by_hand():
  """Guards: the patch count from the tokens (the class token has no
  patch), the image's channels ignored, the embedding's input gradient
  counted, remat's recomputation missing, counted without remat, or the
  wrong share per policy (all of the blocks' forward; the attention's two
  batched matmuls; none). Oracle: 2 x multiply-adds by hand."""
  # Forward per image: blocks 2 * 2 * (4*T*D^2 + 2*T*D*M + 2*T^2*D)
  #   = 4 * (1280 + 1280 + 400) = 11840; embed 2 * 4 patches * 16*3*8 = 3072;
  #   head 2*8*10 = 160. Train: 3 x forward - embed = 42144 per image.
  kw = dict(batch=2, res=8, num_classes=10, tokens=T)
  assert formulas.train_flops(TINY, remat=False, **kw) == (84288.0, 84288.0)
  assert formulas.train_flops(TINY, remat=True, **kw) == (
      84288.0,
      84288.0 + 2 * 11840,
  )
  # dots_with_no_batch_dims_saveable: scores and weighted sum,
  # 2 blocks * 2 * 2*T^2*D = 1600 per image.
  policy = formulas.train_flops(
      TINY, remat=True, remat_policy="dots_with_no_batch_dims_saveable", **kw
  )
  assert policy == (84288.0, 84288.0 + 2 * 1600)
  assert formulas.train_flops(
      TINY, remat=True, remat_policy="dots_saveable", **kw
  ) == (84288.0, 84288.0)
  # One channel: the embedding is 2 * 4 * 16 * 1 * 8 = 1024 a forward.
  gray = formulas.train_flops(TINY, remat=False, channels=1, **kw)[0]
  assert gray == 2 * (3 * (11840 + 1024 + 160) - 1024)


def test_tpu_weight_bytes_by_hand():
  """Guards: the replicated bf16 weights not counted twice per block,
  FSDP's two gathered blocks, float32 matmuls needing no copy, tp ignored.
  Oracle: by hand."""
  # 1200 block params over 4 blocks, bf16, tp 2: 300 bytes a block.
  weights = lambda fsdp, mm: formulas.tpu_weight_bytes(
      1200, 4, 2, fsdp, True, mm_bytes=mm
  )
  assert weights(2, 2) == 600
  assert weights(1, 2) == 2 * 4 * 300
  assert weights(1, 4) == 0
  assert weights(8, 4) == 2 * 1200 // 4 * 4 // 2


def test_tpu_activation_bytes_by_hand():
  """Guards: remat keeping every block's residuals, the live blocks of the
  backward pass (3 with the custom attention, 1.6 with XLA's; one more
  block without remat), the bytes a remat policy saves (q/k/v split by tp,
  the out projection, the MLP's; the f32 logits only for dots_saveable;
  nothing for another policy), the outside terms. Oracle: by hand, from
  tpu_block_bytes (checked against the compiled program in test_plan.py and
  by hand below)."""
  kw = dict(tokens=T, mm_bytes=2)
  block = formulas.tpu_block_bytes(TINY, **kw)
  xla_block = formulas.tpu_block_bytes(TINY, opts=dict(attention="xla"), **kw)
  outside = 192 * 4 + 6 * T * 8 * 4 + 10 * 8

  def got(remat, tp=1, **opts):
    return formulas.tpu_activation_bytes(
        TINY,
        local_batch=3,
        remat=remat,
        tp=tp,
        num_classes=10,
        image_numel=192,
        opts=opts,
        **kw,
    )

  assert got(False) == 3 * (3 * block + outside)
  # Without an image or classes (their defaults 0): the embeddings only.
  bare = formulas.tpu_activation_bytes(TINY, local_batch=3, remat=False, **kw)
  assert bare == 3 * (3 * block + 6 * T * 8 * 4)
  # A (5, 8) f32 block input is one 8 x 128 tile: 4096 bytes; bf16 the same
  # tile of 16 rows x 128 lanes x 2 bytes.
  assert got(True) == 3 * (2 * 4096 + 3 * block + outside)
  policy = "dots_with_no_batch_dims_saveable"
  # tp=1: (3*T*D + 2*T*D + T*M) * 2 = (120 + 80 + 80) * 2 = 560 a block.
  assert got(True, remat_policy=policy) == 3 * (
      2 * (4096 + 560) + 3 * block + outside
  )
  for other in ("checkpoint_dots_with_no_batch_dims",):
    assert got(True, remat_policy=other) == got(True, remat_policy=policy)
  assert got(True, remat_policy="nothing_saveable") == got(True)
  # tp=2: (3*T*D // 2 + 2*T*D + T*M/2) * 2 bytes = (60 + 80 + 40) * 2 = 360;
  # dots_saveable adds 1 head's (5, 5) f32 logits, one 8 x 128 x 4 B tile.
  tp_block = formulas.tpu_block_bytes(TINY, tp=2, **kw)
  for name, saved in (
      (policy, 360),
      ("dots_saveable", 360 + 4096),
      ("checkpoint_dots", 360 + 4096),
  ):
    assert got(True, tp=2, remat_policy=name) == 3 * (
        2 * (4096 + saved) + 3 * tp_block + outside
    )
  assert got(True, attention="xla") == int(
      3 * (2 * 4096 + 1.6 * xla_block + outside)
  )


def test_tpu_block_bytes_of_a_partial_tile_by_hand():
  """Guards: the tile sizes (8 f32 rows, 16 bf16 rows, 128 lanes) or their
  order, the heads' arrays with the tokens minor, the probabilities' T x T,
  the MLP's two arrays, the LayerNorm statistics, dropout's bool masks.
  Oracle: the docstring's list of residuals, tiled by hand, for T = 20
  tokens of width 40, MLP 136 and 4 heads of 10."""
  arch = dict(width=40, depth=1, mlp_dim=136, num_heads=4, patch_size=4)
  # f32 (20, 40): 24 rows x 128 = 12288 B; bf16 (20, 40): 32 rows x 128 x 2 =
  # 8192; stats 2 * 4 * 128 = 1024 -> two streams: 2 * 21504 = 43008.
  # Per head: q, k, v, out bf16 (10, 20): 16 x 128 x 2 = 4096, x4 = 16384;
  # probabilities bf16 (20, 20): 32 x 128 x 2 = 8192 -> 4 heads: 98304.
  # MLP: 2 x bf16 (20, 136): 32 rows x 256 lanes x 2 = 16384 -> 32768.
  want = 43008 + 98304 + 32768
  assert formulas.tpu_block_bytes(arch, tokens=20, mm_bytes=2) == want
  # Dropout: bool (20, 40) x 2 (32 rows x 128) and (20, 136) (32 x 256).
  assert (
      formulas.tpu_block_bytes(arch, tokens=20, mm_bytes=2, dropout=True)
      == want + 2 * 4096 + 8192
  )
  # tp=2: 2 heads, MLP 68 (bf16 (20, 68): 32 rows x 128 lanes x 2 = 8192):
  # a whole number of bytes (the int the -> int promises).
  got = formulas.tpu_block_bytes(arch, tokens=20, mm_bytes=2, tp=2)
  assert isinstance(got, int)
  assert got == 43008 + 98304 // 2 + 2 * 8192


def test_gather_bytes_and_step_time_by_hand():
  """Guards: FSDP's gathered weights counted without FSDP, all of them
  under remat (two blocks' worth), not divided by tp; a step's collectives
  without the all-gathers or the reduce-scatter per microbatch, the
  data-parallel all-reduce over the wrong axis, compute not divided by the
  devices. Oracle: by hand."""
  assert formulas.gather_bytes(1000, 4, 2, 1, True) == 0
  assert formulas.gather_bytes(1000, 4, 2, 4, True) == 2 * 1000 // 4 * 4 // 2
  assert formulas.gather_bytes(1000, 4, 2, 4, False) == 1000 * 4 // 2
  spec = types.SimpleNamespace(link_bytes_per_s=100.0)
  compute, comm = formulas.step_time(
      spec,
      peak=1e3,
      hw_flops=8e6,
      n_dev=16,
      n_params=1000,
      mesh={"data": 2, "fsdp": 4, "model": 2},
      tp=2,
      fsdp=4,
      accum=3,
  )
  assert compute == pytest.approx(8e6 / 16 / 1e3)
  # Full params / tp = 2000 bytes: (2 + 3) * 2000 * 3/4 = 7500 gathered and
  # reduce-scattered; 3 * 2 * (2000 / 4) * 1/2 = 1500 all-reduced over data.
  assert comm == pytest.approx((7500 + 1500) / 100.0)
  _, no_data = formulas.step_time(
      spec, 1e3, 8e6, 8, 1000, {"fsdp": 4, "model": 2}, 2, 4, 3
  )
  assert no_data == pytest.approx(7500 / 100.0)
