"""Interop and evaluation as a user of big_vision, vision_transformer or timm meets them.

Damaged files, checkpoints of another size or head count, a workdir that a
training run writes meanwhile, non-square and non-divisible image sizes,
big_vision's two-tower and bfloat16 files, timm's own files, bad model
options: each either works or stops with one line saying what to do.
"""
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from big_vit_lite import checkpoint
from big_vit_lite import evaluate
from big_vit_lite import export
from big_vit_lite.evaluators import presets
from big_vit_lite.models import layout
from big_vit_lite.models import posemb
from big_vit_lite.models import timm
from big_vit_lite.models import vit

import checks
import evaluator_fixtures
import test_bucket_workdir

fake_bucket = test_bucket_workdir.fake_bucket  # gs:// served from a local folder

TINY = dict(variant=None, width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=4,
            head_zeroinit=False, remat_policy=None)
POSEMB = "Transformer/posembed_input/pos_embedding"


def _model(**kw):
  return vit.Model(**{"num_classes": 3, **TINY, **kw})


def _abstract(hw=(16, 16), channels=3, **kw):
  return jax.eval_shape(_model(**kw).init, jax.random.key(0),
                        jnp.zeros((1, *hw, channels)))["params"]


def _random(hw=(16, 16), seed=0, channels=3, **kw):
  """Plain params with random values (cheaper than an eager init)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: rng.normal(0, 0.1, a.shape).astype(a.dtype),
                      nn.meta.unbox(_abstract(hw, channels, **kw)))


def test_damaged_checkpoint_files_are_one_line_errors(tmp_path):
  # Each was a raw BadZipFile / EOFError / TypeError / SafetensorError traceback.
  vit.save_npz(_random(), tmp_path / "good.npz")
  data = (tmp_path / "good.npz").read_bytes()
  np.save(tmp_path / "a.npy", np.zeros(3))
  files = {
      "truncated.npz": (data[:len(data) // 2], "damaged or truncated"),
      "empty.npz": (b"", "not an .npz (zip) file"),
      "array.npz": ((tmp_path / "a.npy").read_bytes(), "not an .npz (zip) file"),
      "text.npz": (b"no zip here\n", "not an .npz (zip) file"),
      "empty.safetensors": (b"", "not a readable safetensors file"),
      "bad.safetensors": (b"\x10" + b"\x00" * 7 + b"{oops", "not a readable safetensors file"),
  }
  abstract = _abstract()
  for name, (content, message) in files.items():
    path = tmp_path / name
    path.write_bytes(content)
    for what, fn in (("vit.load", lambda: vit.load(abstract, path)),
                     ("export", lambda: export.export(str(path), str(tmp_path / "o.npz"))),
                     ("evaluate", lambda: evaluate.read_source(str(path)))):
      with pytest.raises(ValueError, match=re.escape(message)) as e:
        fn()
      assert "\n" not in str(e.value) and name in str(e.value), (what, str(e.value))


def test_checkpoint_of_another_size_names_both_architectures(tmp_path):
  # Was "param 'Transformer/encoder_norm/bias' has shape (32,) ...; add it to
  # dont_load": advice that leads through every param of one size in another.
  sizes = {k: None for k in ("width", "depth", "mlp_dim", "num_heads", "patch_size")}
  vit.save_npz(_random(hw=(32, 32), variant="mu/16", **sizes), tmp_path / "mu.npz")
  with pytest.raises(ValueError, match=r"a ViT-mu/16; checkpoint vs model: width 32 vs 192, "
                     r"depth 1 vs 12, heads 2 vs 3, mlp_dim 128 vs 768\); build the model to "
                     "match"):
    vit.load(_abstract(hw=(32, 32), variant="Ti/16", **sizes), tmp_path / "mu.npz")
  vit.save_npz(_random(), tmp_path / "d2.npz")
  with pytest.raises(ValueError, match=r"encoderblock_2.*depth 2 vs 3"):
    vit.load(_abstract(depth=3), tmp_path / "d2.npz")
  with pytest.raises(ValueError, match=r"'embedding/kernel'.*patch 4 vs 8"):
    vit.load(_abstract(patch_size=8), tmp_path / "d2.npz")
  # The same architecture at another resolution still just loads (posemb resampled).
  vit.load(_abstract(hw=(32, 32)), tmp_path / "d2.npz")


def test_evaluate_reads_a_workdir_that_training_writes_meanwhile(tmp_path, monkeypatch):
  # Training saves step 2 (here: diverged, NaN) while evaluate runs on step 1.
  # evaluate read step 1's params, then resolved the workdir again for the step
  # number and read it again for the model: step 2's NaNs were evaluated.
  root = evaluator_fixtures.write_image_folder(str(tmp_path / "shapes3"), n_train=2, n_test=4)
  kw = dict(evaluator_fixtures.TINY_VIT)
  params = _random(hw=(28, 28), channels=1, **kw)
  work = str(tmp_path / "work")
  ckpt = checkpoint.Checkpointer(work, async_save=False)
  ckpt.save(1, {"params": params}, {})
  load_params = checkpoint.load_params

  def load_while_training(src, *args, **kwargs):
    out = load_params(src, *args, **kwargs)
    if 2 not in ckpt.all_steps():
      ckpt.save(2, {"params": jax.tree.map(lambda a: np.full_like(a, np.nan), params)}, {})
    return out

  monkeypatch.setattr(checkpoint, "load_params", load_while_training)
  config = ml_collections.ConfigDict(dict(model_init=work, evals=dict(val=dict(
      type="classification", data=dict(name="imagefolder", data_dir=root, split="test"),
      pp=presets.eval_pp(28, channels=1), batch_size=8))))
  results = evaluate.evaluate(config, str(tmp_path / "eval"))
  ckpt.close()
  assert np.isfinite(results["val"]["loss"])
  with open(tmp_path / "eval" / "metrics.jsonl") as f:
    assert json.loads(f.readline())["step"] == 1


def test_evaluate_at_a_trained_size_the_patch_does_not_divide(tmp_path):
  # big_vision's So400m/14 runs at 384 (a 27x27 grid, 6 pixels dropped). A /7
  # model trained at 30 px was refused at 30 ("resize to 28").
  root = evaluator_fixtures.write_image_folder(str(tmp_path / "shapes3"), n_train=2, n_test=4)
  params = _random(hw=(30, 30), channels=1, **evaluator_fixtures.TINY_VIT)
  vit.save_npz(params, tmp_path / "p7.npz")

  def config(res):
    return ml_collections.ConfigDict(dict(model_init=str(tmp_path / "p7.npz"), evals=dict(
        val=dict(type="classification", data=dict(name="imagefolder", data_dir=root,
                                                   split="test"),
                 pp=presets.eval_pp(res, channels=1), batch_size=8))))

  for res in (28, 30):
    assert 0 <= evaluate.evaluate(config(res), str(tmp_path / f"e{res}"))["val"]["prec@1"] <= 1
  with pytest.raises(ValueError, match="model takes 28x28x1: resize to 28"):
    evaluate.evaluate(config(35), str(tmp_path / "e35"))  # a 5x5 grid, not 4x4
  # A workdir's saved pp says the size it was trained at: the message names that.
  flat = layout.to_numpy_flat(params)
  saved = ml_collections.ConfigDict(dict(input=dict(pp="decode(1)|resize(30)|keep('image')")))
  assert evaluate.native_input_shape(flat, saved) == (30, 1)


def test_timm_export_of_non_square_models(tmp_path):
  # A 3x5 grid (15 tokens) was written as timm img_size=16 (a 4x4 grid), and read
  # back as a "no_embed_class" posemb: a zero row in front, every row shifted.
  params = _random(hw=(12, 20))
  with pytest.raises(ValueError, match=r"15 grid tokens, not a square grid.*--res=HxW"):
    timm.write_timm(params, tmp_path / "x.safetensors")
  kwargs = timm.write_timm(params, tmp_path / "m.safetensors", image_size=(12, 20))
  assert kwargs["img_size"] == (12, 20)
  checks.assert_same_params(vit.load(_abstract(hw=(12, 20)), tmp_path / "m.safetensors"), params)
  with pytest.raises(ValueError, match=r"gives a 4x4 grid \(patch 4\) but the posemb has 15"):
    timm.write_timm(params, tmp_path / "y.safetensors", image_size=16)
  # 4x9 has the square count of 6x6: only the run's config knows. A workdir says
  # it (its training pp), so export writes img_size=(16, 36), not 24.
  params = _random(hw=(16, 36))
  ckpt = checkpoint.Checkpointer(str(tmp_path / "work"), async_save=False)
  ckpt.save(5, {"params": params}, {}, ml_collections.ConfigDict(dict(
      input=dict(pp="decode(3)|resize((16, 36))|value_range(-1, 1)|keep('image')"))))
  ckpt.close()
  summary = export.export(str(tmp_path / "work"), str(tmp_path / "w.safetensors"))
  assert summary["timm_kwargs"]["img_size"] == (16, 36)
  assert "img_size=(16, 36)" in summary["timm_usage"]
  checks.assert_same_params(vit.load(_abstract(hw=(16, 36)), tmp_path / "w.safetensors"), params)
  # timm -> timm keeps the size the file's metadata gives (was 24, from the 36 rows).
  summary = export.export(str(tmp_path / "w.safetensors"), str(tmp_path / "w2.safetensors"))
  assert summary["timm_kwargs"]["img_size"] == (16, 36)
  # The CLI's --res takes HxW.
  vit.save_npz(params, tmp_path / "ns.npz")
  summary = export.export(str(tmp_path / "ns.npz"), str(tmp_path / "n.safetensors"), res="16x36")
  assert summary["timm_kwargs"]["img_size"] == (16, 36)
  with pytest.raises(ValueError, match="use an image size N or HxW"):
    export.export(str(tmp_path / "ns.npz"), str(tmp_path / "n.safetensors"), res="16by36")


@pytest.mark.parametrize("pool_type", ["tok", "gap", "map"])
def test_timm_round_trip_at_sizes_the_patch_does_not_divide(tmp_path, pool_type):
  # /7 at 30 px (a 4x4 grid): timm's img_size was written as 28, so the timm
  # model refused the 30 px images the model was trained on.
  params = _random(hw=(30, 30), patch_size=7, pool_type=pool_type)
  kwargs = timm.write_timm(params, tmp_path / "m.safetensors", image_size=30)
  assert kwargs["img_size"] == 30 and kwargs["patch_size"] == 7
  back = vit.load(_abstract(hw=(30, 30), patch_size=7, pool_type=pool_type),
                  tmp_path / "m.safetensors")
  images = jax.random.uniform(jax.random.key(1), (2, 30, 30, 3), minval=-1, maxval=1)
  apply = jax.jit(_model(patch_size=7, pool_type=pool_type).apply)
  np.testing.assert_array_equal(apply({"params": nn.meta.unbox(back)}, images)[0],
                                apply({"params": params}, images)[0])


def test_big_vision_two_tower_image_tower_loads(tmp_path):
  # SigLIP / LiT .npz files keep the image ViT under "params/img/" next to the
  # text tower; they were "model_init holds no ViT params".
  params = _random(pool_type="map", scan=True)
  flat = layout.flatten(params)
  flat["pos_embedding"] = flat.pop(POSEMB)  # big_vision: top-level posemb
  np.savez(tmp_path / "siglip.npz", **{f"params/img/{k}": v for k, v in flat.items()},
           **{"params/txt/Embed_0/embedding": np.zeros((8, 4), np.float32),
              "params/t": np.zeros((1,), np.float32), "params/b": np.zeros((1,), np.float32)})
  checks.assert_same_params(vit.load(_abstract(pool_type="map", scan=True), tmp_path / "siglip.npz"), params)
  src, _, _ = evaluate.read_source(str(tmp_path / "siglip.npz"))
  cfg = evaluate.infer_model_cfg(src)
  assert (cfg["pool_type"], cfg["depth"], cfg["patch_size"]) == ("map", 2, 4)
  assert evaluate.native_input_shape(src, None) == (16, 3)


def test_bfloat16_npz_loads(tmp_path):
  # np.savez stores bfloat16 as a 2-byte void type (big_vision restores it on
  # reading); loading such a file failed with "setting an array element with a
  # sequence".
  params = _random()
  np.savez(tmp_path / "bf16.npz", **{k: v.astype(jnp.bfloat16)
                                     for k, v in layout.to_numpy_flat(params).items()})
  loaded = layout.to_numpy_flat(vit.load(_abstract(), tmp_path / "bf16.npz"))
  for k, v in layout.to_numpy_flat(params).items():
    assert loaded[k].dtype == np.float32
    np.testing.assert_array_equal(loaded[k], v.astype(jnp.bfloat16).astype(np.float32), err_msg=k)


def test_evaluate_refuses_a_non_square_timm_export(tmp_path):
  # A 4x9 grid has the token count of 6x6: evaluate took the file for a 24 px
  # model and ran it with its posemb rows on the wrong grid. Its metadata says 16x36.
  params = _random(hw=(16, 36))
  timm.write_timm(params, tmp_path / "ns.safetensors", image_size=(16, 36))
  config = ml_collections.ConfigDict(dict(model_init=str(tmp_path / "ns.safetensors"), evals=dict(
      val=dict(type="classification", data=dict(name="imagefolder", data_dir=str(tmp_path)),
               pp=presets.eval_pp(24), batch_size=8))))
  with pytest.raises(ValueError, match=r"trained on 16x36 images \(its timm metadata\): "
                     "evaluate runs square images only"):
    evaluate.evaluate(config, str(tmp_path / "eval"))
  # A square export at a size its patch does not divide runs at that size.
  timm.write_timm(_random(hw=(30, 30), patch_size=7), tmp_path / "p7.safetensors",
                     image_size=30)
  flat, saved, _ = evaluate.read_source(str(tmp_path / "p7.safetensors"))
  assert evaluate.native_input_shape(
      flat, saved, timm.timm_image_size(tmp_path / "p7.safetensors")) == (30, 3)


def _posemb_grid(params):
  return layout.to_numpy_flat(params)[POSEMB][:, 1:]


def test_posemb_of_a_workdir_is_resampled_from_the_grid_it_was_trained_on(tmp_path, caplog):
  # 6x6 and 4x9 grids both have 36 tokens: loading one into the other (fine-tuning
  # a square run on 16x36 images, or the reverse) kept the rows as they were,
  # laid out on the wrong grid. A training workdir's pp says its grid.
  def workdir(name, hw):
    params = _random(hw=hw)
    ckpt = checkpoint.Checkpointer(str(tmp_path / name), async_save=False)
    ckpt.save(1, {"params": params}, {}, ml_collections.ConfigDict(dict(
        input=dict(pp=f"decode(3)|resize({hw})|value_range(-1, 1)|keep('image', 'label')"))))
    ckpt.close()
    return params

  square = _posemb_grid(workdir("square", (24, 24)))
  got = _posemb_grid(vit.load(_abstract(hw=(16, 36)), tmp_path / "square", grid_hw=(4, 9)))
  np.testing.assert_array_equal(got, posemb.resample(square, (4, 9)))
  wide = _posemb_grid(workdir("wide", (16, 36)))
  got = _posemb_grid(vit.load(_abstract(hw=(24, 24)), tmp_path / "wide", grid_hw=(6, 6)))
  np.testing.assert_array_equal(got, posemb.resample(wide, (6, 6), (4, 9)))
  # Same grid: exact.
  got = _posemb_grid(vit.load(_abstract(hw=(16, 36)), tmp_path / "wide", grid_hw=(4, 9)))
  np.testing.assert_array_equal(got, wide)
  # An .npz does not say its grid: equal counts keep their rows, with a warning.
  vit.save_npz(_random(hw=(16, 36)), tmp_path / "wide.npz")
  with caplog.at_level("WARNING"):
    got = _posemb_grid(vit.load(_abstract(hw=(16, 36)), tmp_path / "wide.npz", grid_hw=(4, 9)))
  np.testing.assert_array_equal(got, wide)
  assert "36 posemb rows for the model's 4x9 grid as they are" in caplog.text


def test_timm_export_as_model_init_on_a_bucket(fake_bucket):
  # README: model_init may be on a bucket, and may be an exported .safetensors;
  # read_timm went by os.path, so gs://.../m.safetensors "did not exist".
  params = _random()
  timm.write_timm(params, fake_bucket / "m.safetensors")
  checks.assert_same_params(vit.load(_abstract(), "gs://m.safetensors"), params)
  flat, _, _ = evaluate.read_source("gs://m.safetensors")
  assert evaluate.native_input_shape(flat, None, timm.timm_image_size("gs://m.safetensors")) == (
      16, 3)
  export.export("gs://m.safetensors", str(fake_bucket.parent / "m.npz"))
  checks.assert_same_params(vit.load(_abstract(), fake_bucket.parent / "m.npz"), params)


def test_bad_model_options_are_one_line_errors():
  # Each was a raw TypeError or ZeroDivisionError from jnp/flax inside init
  # (evaluate's --config.model.dtype_mm=bf16 printed a traceback), or, for the
  # rates, a model that trained on nonsense.
  cases = {"dtype_mm": ("bf16", "Unknown dtype_mm='bf16'"), "patch_size": (0, "patch_size=0"),
           "num_classes": (-1, "num_classes=-1"), "rep_size": (-1, "rep_size=-1"),
           "stem_channels": ((0,), r"stem_channels\[0\]=0"), "depth": (2.0, "depth=2.0"),
           "drop_path": (1.5, r"drop_path=1.5: use a rate in \[0, 1\)")}
  for key, (value, message) in cases.items():
    with pytest.raises(ValueError, match=message) as e:
      _abstract(**{key: value})
    assert "\n" not in str(e.value)
  _abstract(dtype_mm="bfloat16", rep_size=True, num_classes=0, stem_channels=(4,))


def test_timm_file_into_a_model_with_another_head_count_is_refused(tmp_path):
  # timm fuses q, k and v over all heads: the file split into 4 heads where it
  # had 2 and loaded, a different model without a word. Our files say their heads.
  timm.write_timm(_random(), tmp_path / "h2.safetensors")
  with pytest.raises(ValueError, match="holds a ViT with 2 attention heads, the model has 4: "
                     "build the model with num_heads=2"):
    vit.load(_abstract(num_heads=4), tmp_path / "h2.safetensors")
  vit.load(_abstract(), tmp_path / "h2.safetensors")


def test_timm_hub_file_of_a_standard_size_reads_without_metadata(tmp_path):
  # timm's own model.safetensors has no metadata, and qkv does not say its
  # heads: evaluate and export refused every such file. A standard size's
  # width, depth and MLP size fix them (here ViT-mu/16: 2 heads).
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  size = dict(variant="mu/16", **{k: None for k in ("width", "depth", "mlp_dim", "num_heads",
                                                    "patch_size")})
  params = _random(hw=(32, 32), **size)
  sd, _ = timm.to_timm(params)
  save_file(sd, str(tmp_path / "hub.safetensors"))  # no metadata
  export.export(str(tmp_path / "hub.safetensors"), str(tmp_path / "hub.npz"))
  checks.assert_same_params(vit.load(_abstract(hw=(32, 32), **size), tmp_path / "hub.npz"), params)
  assert evaluate.infer_model_cfg(evaluate.read_source(str(tmp_path / "hub.safetensors"))[0])[
      "num_heads"] == 2
  # Not a standard size: still refused, saying why.
  sd, _ = timm.to_timm(_random())
  save_file(sd, str(tmp_path / "odd.safetensors"))
  with pytest.raises(ValueError, match="no timm_kwargs metadata.*not a standard ViT size"):
    export.export(str(tmp_path / "odd.safetensors"), str(tmp_path / "odd.npz"))


def test_timm_export_of_a_sincos_workdir_takes_the_trained_size(tmp_path):
  # A sincos2d model has no posemb param to size timm's pos_embed by: a training
  # workdir's pp says the size, where --res was demanded.
  params = _random(hw=(24, 24), posemb="sincos2d", pool_type="gap")
  ckpt = checkpoint.Checkpointer(str(tmp_path / "work"), async_save=False)
  ckpt.save(3, {"params": params}, {}, ml_collections.ConfigDict(dict(
      input=dict(pp="decode(3)|resize(24)|value_range(-1, 1)|keep('image', 'label')"))))
  ckpt.close()
  summary = export.export(str(tmp_path / "work"), str(tmp_path / "s.safetensors"))
  assert summary["timm_kwargs"]["img_size"] == 24
  images = jax.random.uniform(jax.random.key(1), (2, 24, 24, 3), minval=-1, maxval=1)
  back = vit.load(_abstract(hw=(24, 24), pool_type="gap"), tmp_path / "s.safetensors")
  np.testing.assert_allclose(
      jax.jit(_model(pool_type="gap").apply)({"params": nn.meta.unbox(back)}, images)[0],
      jax.jit(_model(pool_type="gap", posemb="sincos2d").apply)({"params": params}, images)[0],
      atol=1e-6)


def test_params_applied_to_images_they_do_not_fit_are_one_line_errors():
  # model.apply at another resolution or channel count raised flax's
  # ScopeParamShapeError, which does not say what to do.
  params = _random()
  apply = _model().apply
  with pytest.raises(ValueError, match=r"24x24 images give 37 tokens but the params' position "
                     r"embedding has 17: .*vit.load them into a model initialised at this size"):
    apply({"params": params}, jnp.zeros((1, 24, 24, 3)))
  with pytest.raises(ValueError, match="The params take 3-channel images, these have 1"):
    apply({"params": params}, jnp.zeros((1, 16, 16, 1)))
