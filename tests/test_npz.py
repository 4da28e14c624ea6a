"""Vision_transformer / big_vision .npz checkpoints (models/npz.py, layout.py, posemb.py).

Layouts (loop, scan, big_vision, pre-linen, two-tower, bfloat16), dont_load, position
embedding resampling, files of another architecture, and the reader's one-line errors.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from big_vit_lite import evaluate
from big_vit_lite.evaluators import presets
from big_vit_lite.models import layout
from big_vit_lite.models import posemb
from big_vit_lite.models import vit
from big_vit_lite.models import loading

import checks
import evaluator_fixtures

IMAGES = jax.random.uniform(
    jax.random.key(7), (2, 16, 16, 3), minval=-1, maxval=1
)


def test_npz_round_trip_keeps_boxing_and_layout(tmp_path):
  params = checks.vit_params(boxed=True)
  vit.save_npz(params, tmp_path / "p.npz")
  with np.load(tmp_path / "p.npz", allow_pickle=False) as f:
    assert set(f.files) == set(layout.to_numpy_flat(params))
    assert f[
        "Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel"
    ].shape == (32, 2, 16)
  other = checks.vit_params(boxed=True, seed=1)
  loaded = vit.load(other, tmp_path / "p.npz", {})
  # boxed in, boxed out
  assert isinstance(loaded["head"]["kernel"], nn.Partitioned)
  assert loaded["head"]["kernel"].names == ("embed", "classes")
  checks.assert_same_params(loaded, params)
  # plain in, plain out
  plain = vit.load(nn.meta.unbox(other), tmp_path / "p.npz")
  assert isinstance(plain["head"]["kernel"], np.ndarray)
  checks.assert_same_params(plain, params)
  # Abstract init params (jax.eval_shape) are enough when nothing is kept from
  # init.
  abstract = jax.eval_shape(checks.tiny_vit().init, jax.random.key(0), IMAGES)[
      "params"
  ]
  checks.assert_same_params(vit.load(abstract, tmp_path / "p.npz"), params)


def test_pickled_npz_is_refused(tmp_path):
  np.savez(tmp_path / "evil.npz", cls=np.array([{"a": 1}], dtype=object))
  with pytest.raises(ValueError, match="pickle") as e:
    vit.load(checks.vit_params(boxed=True), tmp_path / "evil.npz")
  assert "\n" not in str(e.value)


def test_wrong_shape_and_missing_param_name_the_path(tmp_path):
  flat = layout.to_numpy_flat(checks.vit_params(boxed=True))
  bad = dict(flat)
  key = "Transformer/encoderblock_1/MlpBlock_0/Dense_0/kernel"
  bad[key] = np.zeros((32, 65), np.float32)
  np.savez(tmp_path / "bad.npz", **bad)
  with pytest.raises(ValueError, match=key) as e:
    vit.load(checks.vit_params(boxed=True), tmp_path / "bad.npz")
  assert "\n" not in str(e.value) and "(32, 65)" in str(e.value)
  missing = {
      k: v for k, v in flat.items() if k != "Transformer/encoder_norm/scale"
  }
  np.savez(tmp_path / "missing.npz", **missing)
  with pytest.raises(ValueError, match="Transformer/encoder_norm/scale"):
    vit.load(checks.vit_params(boxed=True), tmp_path / "missing.npz")
  # Into a scan model the message still names the single block.
  with pytest.raises(ValueError, match=key):
    vit.load(checks.vit_params(boxed=True, scan=True), tmp_path / "bad.npz")


def test_dont_load_reinitialises_new_head(tmp_path):
  vit.save_npz(checks.vit_params(boxed=True), tmp_path / "p.npz")
  init = checks.vit_params(boxed=True, seed=3, num_classes=5)
  with pytest.raises(ValueError, match="'head/(bias|kernel)' has shape"):
    vit.load(init, tmp_path / "p.npz")
  loaded = vit.load(init, tmp_path / "p.npz", dont_load=["head/.*"])
  np.testing.assert_array_equal(
      loaded["head"]["kernel"].value, init["head"]["kernel"].value
  )
  np.testing.assert_array_equal(
      loaded["cls"].value,
      layout.to_numpy_flat(checks.vit_params(boxed=True))["cls"],
  )
  with pytest.raises(ValueError, match="matches no model param"):
    vit.load(init, tmp_path / "p.npz", dont_load=["head/.*", "no_such/.*"])


def test_posemb_resample_14_to_24_smooth_with_exact_cls(tmp_path):
  d = 8

  # A smooth field over the image, sampled at the 14x14 patch centres.
  def field(n):
    c = (np.arange(n) + 0.5) / n
    y, x = np.meshgrid(c, c, indexing="ij")
    chans = [
        np.sin(np.pi * (k + 1) * x / 8) * np.cos(np.pi * (k % 3) * y / 4)
        for k in range(d)
    ]
    return np.stack(chans, -1).reshape(1, n * n, d).astype(np.float32)

  cls_row = np.random.default_rng(0).normal(size=(1, 1, d)).astype(np.float32)
  kw = dict(
      variant=None,
      width=d,
      depth=1,
      mlp_dim=16,
      num_heads=2,
      patch_size=2,
      num_classes=3,
  )
  src = jax.eval_shape(
      vit.Model(**kw).init, jax.random.key(0), jnp.zeros((1, 28, 28, 3))
  )["params"]
  flat = {
      k: np.ones(v.shape, v.dtype)
      for k, v in layout.to_numpy_flat(
          jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), nn.meta.unbox(src))
      ).items()
  }
  flat[checks.POSEMB] = np.concatenate([cls_row, field(14)], axis=1)
  np.savez(tmp_path / "g14.npz", **flat)
  tgt = jax.eval_shape(
      vit.Model(**kw).init, jax.random.key(0), jnp.zeros((1, 48, 48, 3))
  )["params"]
  pe = vit.load(tgt, tmp_path / "g14.npz")["Transformer"]["posembed_input"][
      "pos_embedding"
  ].value
  assert pe.shape == (1, 1 + 24 * 24, d)
  # class token kept apart, exact
  np.testing.assert_array_equal(pe[:, :1], cls_row)
  grid = pe[0, 1:].reshape(24, 24, d)
  want = field(24)[0].reshape(24, 24, d)
  # Bilinear: close inside; the outermost ring is clamped to the source's edge
  # centres.
  np.testing.assert_allclose(grid[1:-1, 1:-1], want[1:-1, 1:-1], atol=0.01)
  np.testing.assert_allclose(grid, want, atol=0.06)
  # Smooth: neighbours differ by no more than the source field's own steps.
  assert (
      np.abs(np.diff(grid, axis=0)).max()
      < np.abs(np.diff(field(14)[0].reshape(14, 14, d), axis=0)).max()
  )


def test_posemb_resample_to_non_square_grid_with_square_token_count(tmp_path):
  # A 5x5 checkpoint into a 4x9 input grid: 36 tokens, also the count of a 6x6
  # grid.
  kw = dict(
      variant=None,
      width=8,
      depth=1,
      mlp_dim=16,
      num_heads=2,
      patch_size=4,
      num_classes=3,
  )
  src = layout.to_numpy_flat(
      jax.tree.map(
          lambda s: np.zeros(s.shape, s.dtype),
          nn.meta.unbox(
              jax.eval_shape(
                  vit.Model(**kw).init,
                  jax.random.key(0),
                  jnp.zeros((1, 20, 20, 3)),
              )["params"]
          ),
      )
  )
  grid5 = np.random.default_rng(0).normal(size=(1, 25, 8)).astype(np.float32)
  src[checks.POSEMB] = np.concatenate(
      [np.full((1, 1, 8), 7.0, np.float32), grid5], axis=1
  )
  np.savez(tmp_path / "g5.npz", **src)
  tgt = jax.eval_shape(
      vit.Model(**kw).init, jax.random.key(0), jnp.zeros((1, 16, 36, 3))
  )["params"]
  pe = vit.load(tgt, tmp_path / "g5.npz", grid_hw=(4, 9))["Transformer"][
      "posembed_input"
  ]
  pe = pe["pos_embedding"].value
  # A second implementation as the oracle (resample itself would hide a
  # transposed grid).
  np.testing.assert_allclose(
      pe[:, 1:], checks.posemb_resized(grid5, (5, 5), (4, 9)), atol=1e-5
  )
  np.testing.assert_array_equal(pe[:, :1], 7.0)
  assert not np.allclose(
      pe[:, 1:], checks.posemb_resized(grid5, (5, 5), (6, 6)), atol=0.1
  )


def test_posemb_resample_to_a_non_square_grid_by_hand():
  # 2x2 rows [[0, 1], [2, 3]] to 2x4: the rows stay, each widens to samples at
  # input columns -0.25 (clamped to 0), 0.25, 0.75, 1.25 (clamped to 1). A 4x2
  # grid read as 2x4 (the grid transposed) would give [0, 1, .5, 1.5, 1.5, 2.5,
  # 2, 3].
  grid = np.arange(4, dtype=np.float32).reshape(1, 4, 1)
  want = [0, 0.25, 0.75, 1, 2, 2.25, 2.75, 3]
  np.testing.assert_allclose(
      posemb.resample(grid, (2, 4))[0, :, 0], want, atol=1e-6
  )
  # fit: the cls row kept, the grid part resampled to the model's (h, w).
  with_cls = np.concatenate([np.full((1, 1, 1), 9.0, np.float32), grid], axis=1)
  fitted = posemb.fit(with_cls, 1, (1, 9, 1), 1, grid_hw=(2, 4))
  np.testing.assert_allclose(fitted[0, :, 0], [9] + want, atol=1e-6)
  # Tall: columns stay, rows interpolate.
  tall = posemb.resample(grid, (4, 2))[0, :, 0]
  np.testing.assert_allclose(tall, [0, 1, 0.5, 1.5, 1.5, 2.5, 2, 3], atol=1e-6)


def test_big_vision_layout_loads(tmp_path):
  params = checks.vit_params(boxed=True)
  flat = layout.to_numpy_flat(params)
  pe = flat.pop(checks.POSEMB)
  # big_vision: no cls entry, cls gets no posemb
  flat["pos_embedding"] = pe[:, 1:]
  # A big_vision train checkpoint: params under "params/", optimizer state
  # beside them.
  np.savez(
      tmp_path / "bv.npz",
      **{f"params/{k}": v for k, v in flat.items()},
      **{"opt/1/mu/cls": flat["cls"]},
  )
  loaded = layout.to_numpy_flat(
      vit.load(checks.vit_params(boxed=True, seed=1), tmp_path / "bv.npz")
  )
  np.testing.assert_array_equal(loaded[checks.POSEMB][:, 1:], pe[:, 1:])
  np.testing.assert_array_equal(loaded[checks.POSEMB][:, 0], 0)
  # big_vision's scan layout (stacked encoderblock) into a loop model, and a gap
  # model.
  scan_flat = layout.to_numpy_flat(
      checks.vit_params(scan=True, pool_type="gap")
  )
  scan_flat["pos_embedding"] = scan_flat.pop(checks.POSEMB)
  np.savez(tmp_path / "bv_scan.npz", **scan_flat)
  loaded = layout.to_numpy_flat(
      vit.load(
          checks.vit_params(boxed=True, seed=2, pool_type="gap"),
          tmp_path / "bv_scan.npz",
      )
  )
  np.testing.assert_array_equal(
      loaded["Transformer/encoderblock_1/LayerNorm_1/scale"],
      scan_flat["Transformer/encoderblock/LayerNorm_1/scale"][1],
  )
  np.testing.assert_array_equal(
      loaded[checks.POSEMB], scan_flat["pos_embedding"]
  )


def test_pre_linen_layout_loads(tmp_path):
  params = checks.vit_params(boxed=True)
  old = {}
  for k, v in layout.to_numpy_flat(params).items():
    for new, orig in (
        ("MultiHeadDotProductAttention_0", "MultiHeadDotProductAttention_1"),
        ("LayerNorm_1", "LayerNorm_2"),
        ("MlpBlock_0", "MlpBlock_3"),
    ):
      if "encoderblock_" in k:
        k = k.replace(f"/{new}/", f"/{orig}/")
    old[k] = v
  assert "Transformer/encoderblock_0/LayerNorm_2/scale" in old
  np.savez(tmp_path / "old.npz", **old)
  checks.assert_same_params(
      vit.load(checks.vit_params(boxed=True, seed=1), tmp_path / "old.npz"),
      params,
  )


def test_big_vision_two_tower_image_tower_loads(tmp_path):
  # SigLIP / LiT .npz files keep the image ViT under "params/img/" next to the
  # text tower; they were "model_init holds no ViT params".
  params = checks.vit_params(pool_type="map", scan=True)
  flat = layout.flatten(params)
  # big_vision: top-level posemb
  flat["pos_embedding"] = flat.pop(checks.POSEMB)
  np.savez(
      tmp_path / "siglip.npz",
      **{f"params/img/{k}": v for k, v in flat.items()},
      **{
          "params/txt/Embed_0/embedding": np.zeros((8, 4), np.float32),
          "params/t": np.zeros((1,), np.float32),
          "params/b": np.zeros((1,), np.float32),
      },
  )
  checks.assert_same_params(
      vit.load(
          checks.vit_shapes(pool_type="map", scan=True), tmp_path / "siglip.npz"
      ),
      params,
  )
  src, _, _ = loading.read_source(str(tmp_path / "siglip.npz"))
  cfg = loading.infer_model_cfg(src)
  assert (cfg["pool_type"], cfg["depth"], cfg["patch_size"]) == ("map", 2, 4)
  assert loading.native_input_shape(src, None) == (16, 3)


def test_bfloat16_npz_loads(tmp_path):
  # np.savez stores bfloat16 as a 2-byte void type (big_vision restores it on
  # reading); loading such a file failed with "setting an array element with a
  # sequence".
  params = checks.vit_params()
  np.savez(
      tmp_path / "bf16.npz",
      **{
          k: v.astype(jnp.bfloat16)
          for k, v in layout.to_numpy_flat(params).items()
      },
  )
  loaded = layout.to_numpy_flat(
      vit.load(checks.vit_shapes(), tmp_path / "bf16.npz")
  )
  for k, v in layout.to_numpy_flat(params).items():
    assert loaded[k].dtype == np.float32
    np.testing.assert_array_equal(
        loaded[k], v.astype(jnp.bfloat16).astype(np.float32), err_msg=k
    )


def test_checkpoint_of_another_architecture_is_refused(tmp_path, caplog):
  # A deeper model, or a class token the model lacks, used to load with the
  # extra params silently dropped: a different model than the checkpoint's.
  abstract = checks.vit_shapes
  deep = checks.vit_params(depth=3)
  vit.save_npz(deep, tmp_path / "deep.npz")
  with pytest.raises(ValueError, match="encoderblock_2.*another architecture"):
    vit.load(abstract(), tmp_path / "deep.npz")
  with pytest.raises(ValueError, match="'cls'"):
    vit.load(
        abstract(pool_type="gap"),
        tmp_path / "deep.npz",
        dont_load=["Transformer/encoderblock_2/.*"],
    )
  # Leaving them out on purpose: dont_load may name checkpoint-only params
  # (big_vision).
  two = vit.load(
      abstract(),
      tmp_path / "deep.npz",
      dont_load=["Transformer/encoderblock_2/.*"],
  )
  scale = "Transformer/encoderblock_1/LayerNorm_0/scale"
  np.testing.assert_array_equal(
      layout.to_numpy_flat(two)[scale], layout.to_numpy_flat(deep)[scale]
  )
  # Routine drops still load, with a warning: the head (feature model) and the
  # pre-logits layer (vision_transformer fine-tuning without
  # representation_size).
  vit.save_npz(
      dict(
          layout.to_numpy_flat(deep),
          **{"pre_logits/kernel": np.ones((32, 16), np.float32)},
      ),
      tmp_path / "rep.npz",
  )
  with caplog.at_level("WARNING"):
    headless = vit.load(abstract(num_classes=0, depth=3), tmp_path / "rep.npz")
  assert "head" not in headless and "pre_logits/kernel" in caplog.text


def test_checkpoint_of_another_size_names_both_architectures(tmp_path):
  # Was "param 'Transformer/encoder_norm/bias' has shape (32,) ...; add it to
  # dont_load": advice that leads through every param of one size in another.
  sizes = {
      k: None for k in ("width", "depth", "mlp_dim", "num_heads", "patch_size")
  }
  vit.save_npz(
      checks.vit_params(hw=(32, 32), variant="mu/16", **sizes),
      tmp_path / "mu.npz",
  )
  with pytest.raises(
      ValueError,
      match=r"a ViT-mu/16; checkpoint vs model: width 32 vs 192, "
      r"depth 1 vs 12, heads 2 vs 3, mlp_dim 128 vs 768\); build the model to "
      "match",
  ):
    vit.load(
        checks.vit_shapes(hw=(32, 32), variant="Ti/16", **sizes),
        tmp_path / "mu.npz",
    )
  vit.save_npz(checks.vit_params(), tmp_path / "d2.npz")
  with pytest.raises(ValueError, match=r"encoderblock_2.*depth 2 vs 3"):
    vit.load(checks.vit_shapes(depth=3), tmp_path / "d2.npz")
  with pytest.raises(ValueError, match=r"'embedding/kernel'.*patch 4 vs 8"):
    vit.load(checks.vit_shapes(patch_size=8), tmp_path / "d2.npz")
  # The same architecture at another resolution still just loads (posemb
  # resampled).
  vit.load(checks.vit_shapes(hw=(32, 32)), tmp_path / "d2.npz")


def test_evaluate_at_a_trained_size_the_patch_does_not_divide(tmp_path):
  # big_vision's So400m/14 runs at 384 (a 27x27 grid, 6 pixels dropped). A /7
  # model trained at 30 px was refused at 30 ("resize to 28").
  root = evaluator_fixtures.write_image_folder(
      str(tmp_path / "shapes3"), n_train=2, n_test=4
  )
  params = checks.vit_params(
      hw=(30, 30), channels=1, num_classes=3, **evaluator_fixtures.TINY_VIT
  )
  vit.save_npz(params, tmp_path / "p7.npz")

  def config(res):
    return ml_collections.ConfigDict(
        dict(
            model_init=str(tmp_path / "p7.npz"),
            evals=dict(
                val=dict(
                    type="classification",
                    data=dict(name="imagefolder", data_dir=root, split="test"),
                    pp=presets.eval_pp(res, channels=1),
                    batch_size=8,
                )
            ),
        )
    )

  for res in (28, 30):
    assert (
        0
        <= evaluate.evaluate(config(res), str(tmp_path / f"e{res}"))["val"][
            "prec@1"
        ]
        <= 1
    )
  with pytest.raises(ValueError, match="model takes 28x28x1: resize to 28"):
    evaluate.evaluate(config(35), str(tmp_path / "e35"))  # a 5x5 grid, not 4x4
  # A workdir's saved pp says the size it was trained at: the message names
  # that.
  flat = layout.to_numpy_flat(params)
  saved = ml_collections.ConfigDict(
      dict(input=dict(pp="decode(1)|resize(30)|keep('image')"))
  )
  assert loading.native_input_shape(flat, saved) == (30, 1)
