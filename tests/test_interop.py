"""Checkpoint interop: npz layouts, posemb resampling, dont_load, timm export/import, export CLI."""
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from big_vit_lite import export
from big_vit_lite.models import layout
from big_vit_lite.models import posemb
from big_vit_lite.models import timm
from big_vit_lite.models import vit

import checks

TINY = dict(variant=None, width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=4)
IMAGES = jax.random.uniform(jax.random.key(7), (2, 16, 16, 3), minval=-1, maxval=1)
POSEMB = "Transformer/posembed_input/pos_embedding"


def _model(**kw):
  return vit.Model(**{"num_classes": 10, **TINY, "head_zeroinit": False, **kw})


def _init(seed=0, **kw):
  """Boxed params as init returns them, with random values (an eager init takes seconds)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda box: box.replace_boxed(rng.normal(0, 0.1, box.value.shape).astype(box.value.dtype)),
      _abstract(**kw), is_leaf=lambda x: isinstance(x, nn.Partitioned))


def _flat(params):
  return layout.to_numpy_flat(params)


def _abstract(**kw):
  return jax.eval_shape(_model(**kw).init, jax.random.key(0), IMAGES)["params"]


def _random(seed=0, **kw):
  """Plain (unboxed) random params of the model's shapes."""
  return nn.meta.unbox(_init(seed, **kw))


def test_npz_round_trip_keeps_boxing_and_layout(tmp_path):
  params = _init()
  vit.save_npz(params, tmp_path / "p.npz")
  with np.load(tmp_path / "p.npz", allow_pickle=False) as f:
    assert set(f.files) == set(_flat(params))
    assert f["Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel"].shape == (32, 2, 16)
  other = _init(seed=1)
  loaded = vit.load(other, tmp_path / "p.npz", {})
  assert isinstance(loaded["head"]["kernel"], nn.Partitioned)  # boxed in, boxed out
  assert loaded["head"]["kernel"].names == ("embed", "classes")
  checks.assert_same_params(loaded, params)
  plain = vit.load(nn.meta.unbox(other), tmp_path / "p.npz")  # plain in, plain out
  assert isinstance(plain["head"]["kernel"], np.ndarray)
  checks.assert_same_params(plain, params)
  # Abstract init params (jax.eval_shape) are enough when nothing is kept from init.
  abstract = jax.eval_shape(_model().init, jax.random.key(0), IMAGES)["params"]
  checks.assert_same_params(vit.load(abstract, tmp_path / "p.npz"), params)


def test_pickled_npz_is_refused(tmp_path):
  np.savez(tmp_path / "evil.npz", cls=np.array([{"a": 1}], dtype=object))
  with pytest.raises(ValueError, match="pickle") as e:
    vit.load(_init(), tmp_path / "evil.npz")
  assert "\n" not in str(e.value)


def test_wrong_shape_and_missing_param_name_the_path(tmp_path):
  flat = _flat(_init())
  bad = dict(flat)
  key = "Transformer/encoderblock_1/MlpBlock_0/Dense_0/kernel"
  bad[key] = np.zeros((32, 65), np.float32)
  np.savez(tmp_path / "bad.npz", **bad)
  with pytest.raises(ValueError, match=key) as e:
    vit.load(_init(), tmp_path / "bad.npz")
  assert "\n" not in str(e.value) and "(32, 65)" in str(e.value)
  missing = {k: v for k, v in flat.items() if k != "Transformer/encoder_norm/scale"}
  np.savez(tmp_path / "missing.npz", **missing)
  with pytest.raises(ValueError, match="Transformer/encoder_norm/scale"):
    vit.load(_init(), tmp_path / "missing.npz")
  # Into a scan model the message still names the single block.
  with pytest.raises(ValueError, match=key):
    vit.load(_init(scan=True), tmp_path / "bad.npz")


def test_dont_load_reinitialises_new_head(tmp_path):
  vit.save_npz(_init(), tmp_path / "p.npz")
  init = _init(seed=3, num_classes=5)
  with pytest.raises(ValueError, match="'head/(bias|kernel)' has shape"):
    vit.load(init, tmp_path / "p.npz")
  loaded = vit.load(init, tmp_path / "p.npz", dont_load=["head/.*"])
  np.testing.assert_array_equal(loaded["head"]["kernel"].value, init["head"]["kernel"].value)
  np.testing.assert_array_equal(loaded["cls"].value, _flat(_init())["cls"])
  with pytest.raises(ValueError, match="matches no model param"):
    vit.load(init, tmp_path / "p.npz", dont_load=["head/.*", "no_such/.*"])


def test_posemb_resample_14_to_24_smooth_with_exact_cls(tmp_path):
  d = 8
  # A smooth field over the image, sampled at the 14x14 patch centres.
  def field(n):
    c = (np.arange(n) + 0.5) / n
    y, x = np.meshgrid(c, c, indexing="ij")
    chans = [np.sin(np.pi * (k + 1) * x / 8) * np.cos(np.pi * (k % 3) * y / 4) for k in range(d)]
    return np.stack(chans, -1).reshape(1, n * n, d).astype(np.float32)

  cls_row = np.random.default_rng(0).normal(size=(1, 1, d)).astype(np.float32)
  kw = dict(variant=None, width=d, depth=1, mlp_dim=16, num_heads=2, patch_size=2, num_classes=3)
  src = jax.eval_shape(vit.Model(**kw).init, jax.random.key(0), jnp.zeros((1, 28, 28, 3)))["params"]
  flat = {k: np.ones(v.shape, v.dtype) for k, v in _flat(jax.tree.map(
      lambda s: np.zeros(s.shape, s.dtype), nn.meta.unbox(src))).items()}
  flat[POSEMB] = np.concatenate([cls_row, field(14)], axis=1)
  np.savez(tmp_path / "g14.npz", **flat)
  tgt = jax.eval_shape(vit.Model(**kw).init, jax.random.key(0), jnp.zeros((1, 48, 48, 3)))["params"]
  pe = vit.load(tgt, tmp_path / "g14.npz")["Transformer"]["posembed_input"]["pos_embedding"].value
  assert pe.shape == (1, 1 + 24 * 24, d)
  np.testing.assert_array_equal(pe[:, :1], cls_row)  # class token kept apart, exact
  grid = pe[0, 1:].reshape(24, 24, d)
  want = field(24)[0].reshape(24, 24, d)
  # Bilinear: close inside; the outermost ring is clamped to the source's edge centres.
  np.testing.assert_allclose(grid[1:-1, 1:-1], want[1:-1, 1:-1], atol=0.01)
  np.testing.assert_allclose(grid, want, atol=0.06)
  # Smooth: neighbours differ by no more than the source field's own steps.
  assert np.abs(np.diff(grid, axis=0)).max() < np.abs(np.diff(field(14)[0].reshape(14, 14, d), axis=0)).max()


def test_posemb_resample_to_non_square_grid_with_square_token_count(tmp_path):
  # A 5x5 checkpoint into a 4x9 input grid: 36 tokens, also the count of a 6x6 grid.
  kw = dict(variant=None, width=8, depth=1, mlp_dim=16, num_heads=2, patch_size=4, num_classes=3)
  src = _flat(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), nn.meta.unbox(jax.eval_shape(
      vit.Model(**kw).init, jax.random.key(0), jnp.zeros((1, 20, 20, 3)))["params"])))
  grid5 = np.random.default_rng(0).normal(size=(1, 25, 8)).astype(np.float32)
  src[POSEMB] = np.concatenate([np.full((1, 1, 8), 7.0, np.float32), grid5], axis=1)
  np.savez(tmp_path / "g5.npz", **src)
  tgt = jax.eval_shape(vit.Model(**kw).init, jax.random.key(0), jnp.zeros((1, 16, 36, 3)))["params"]
  pe = vit.load(tgt, tmp_path / "g5.npz", grid_hw=(4, 9))["Transformer"]["posembed_input"]
  pe = pe["pos_embedding"].value
  np.testing.assert_array_equal(pe[:, 1:], posemb.resample(grid5, (4, 9)))
  np.testing.assert_array_equal(pe[:, :1], 7.0)
  assert not np.allclose(pe[:, 1:], posemb.resample(grid5, (6, 6)))
  with pytest.raises(ValueError, match="grid 5x9 does not match the model's 36 grid tokens"):
    vit.load(tgt, tmp_path / "g5.npz", grid_hw=(5, 9))


def test_big_vision_layout_loads(tmp_path):
  params = _init()
  flat = _flat(params)
  pe = flat.pop(POSEMB)
  flat["pos_embedding"] = pe[:, 1:]  # big_vision: no cls entry, cls gets no posemb
  # A big_vision train checkpoint: params under "params/", optimizer state beside them.
  np.savez(tmp_path / "bv.npz", **{f"params/{k}": v for k, v in flat.items()},
           **{"opt/1/mu/cls": flat["cls"]})
  loaded = _flat(vit.load(_init(seed=1), tmp_path / "bv.npz"))
  np.testing.assert_array_equal(loaded[POSEMB][:, 1:], pe[:, 1:])
  np.testing.assert_array_equal(loaded[POSEMB][:, 0], 0)
  # big_vision's scan layout (stacked encoderblock) into a loop model, and a gap model.
  scan_flat = layout.flatten(_flat(_init(scan=True, pool_type="gap")))
  scan_flat["pos_embedding"] = scan_flat.pop(POSEMB)
  np.savez(tmp_path / "bv_scan.npz", **scan_flat)
  loaded = _flat(vit.load(_init(seed=2, pool_type="gap"), tmp_path / "bv_scan.npz"))
  np.testing.assert_array_equal(loaded["Transformer/encoderblock_1/LayerNorm_1/scale"],
                                scan_flat["Transformer/encoderblock/LayerNorm_1/scale"][1])
  np.testing.assert_array_equal(loaded[POSEMB], scan_flat["pos_embedding"])


def test_pre_linen_layout_loads(tmp_path):
  params = _init()
  old = {}
  for k, v in _flat(params).items():
    for new, orig in (("MultiHeadDotProductAttention_0", "MultiHeadDotProductAttention_1"),
                      ("LayerNorm_1", "LayerNorm_2"), ("MlpBlock_0", "MlpBlock_3")):
      if "encoderblock_" in k:
        k = k.replace(f"/{new}/", f"/{orig}/")
    old[k] = v
  assert "Transformer/encoderblock_0/LayerNorm_2/scale" in old
  np.savez(tmp_path / "old.npz", **old)
  checks.assert_same_params(vit.load(_init(seed=1), tmp_path / "old.npz"), params)


# ---------------------------------------------------------------------------- timm


def _ln(x, w, b):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + 1e-6) * w + b


def _gelu(x):
  from scipy.special import erf  # pylint: disable=g-import-not-at-top
  return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def _softmax_attn(q, k, v):  # (B, H, N, hd)
  a = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
  a = np.exp(a - a.max(-1, keepdims=True))
  return (a / a.sum(-1, keepdims=True)) @ v


def _timm_forward(sd, kw, x):
  """timm VisionTransformer.forward, transcribed in numpy (float64), NCHW weights."""
  x = np.asarray(x, np.float64).transpose(0, 3, 1, 2)  # timm takes NCHW
  b, c, h, w = x.shape
  p, d, nh = kw["patch_size"], kw["embed_dim"], kw["num_heads"]
  wgt = sd["patch_embed.proj.weight"]  # (D, C, P, P): Conv2d, stride P
  patches = x.reshape(b, c, h // p, p, w // p, p)
  t = np.einsum("bcipjq,dcpq->bijd", patches, wgt).reshape(b, -1, d) + sd["patch_embed.proj.bias"]
  if kw["class_token"]:
    t = np.concatenate([np.broadcast_to(sd["cls_token"], (b, 1, d)), t], 1)
  t = t + sd["pos_embed"]

  def attn(xq, xkv, pre, fused):
    n = xkv.shape[1]
    if fused:
      qkv = (xq @ sd[f"{pre}.qkv.weight"].T + sd[f"{pre}.qkv.bias"]).reshape(b, n, 3, nh, d // nh)
      q, k, v = qkv.transpose(2, 0, 3, 1, 4)
    else:
      q = (xq @ sd[f"{pre}.q.weight"].T + sd[f"{pre}.q.bias"])
      q = q.reshape(b, xq.shape[1], nh, d // nh).transpose(0, 2, 1, 3)
      kv = (xkv @ sd[f"{pre}.kv.weight"].T + sd[f"{pre}.kv.bias"]).reshape(b, n, 2, nh, d // nh)
      k, v = kv.transpose(2, 0, 3, 1, 4)
    o = _softmax_attn(q, k, v).transpose(0, 2, 1, 3).reshape(b, -1, d)
    return o @ sd[f"{pre}.proj.weight"].T + sd[f"{pre}.proj.bias"]

  def mlp(y, pre):
    y = _gelu(y @ sd[f"{pre}.fc1.weight"].T + sd[f"{pre}.fc1.bias"])
    return y @ sd[f"{pre}.fc2.weight"].T + sd[f"{pre}.fc2.bias"]

  for i in range(kw["depth"]):
    y = _ln(t, sd[f"blocks.{i}.norm1.weight"], sd[f"blocks.{i}.norm1.bias"])
    t = t + attn(y, y, f"blocks.{i}.attn", True)
    t = t + mlp(_ln(t, sd[f"blocks.{i}.norm2.weight"], sd[f"blocks.{i}.norm2.bias"]), f"blocks.{i}.mlp")
  t = _ln(t, sd["norm.weight"], sd["norm.bias"])
  if kw["global_pool"] == "token":
    t = t[:, 0]
  elif kw["global_pool"] == "avg":
    t = t.mean(1)
  else:
    lat = np.broadcast_to(sd["attn_pool.latent"], (b, 1, d))
    t = attn(lat, t, "attn_pool", False)
    t = t + mlp(_ln(t, sd["attn_pool.norm.weight"], sd["attn_pool.norm.bias"]), "attn_pool.mlp")
    t = t[:, 0]
  return t @ sd["head.weight"].T + sd["head.bias"]


@pytest.mark.parametrize("pool_type,posemb", [("tok", "learn"), ("gap", "sincos2d"), ("map", "learn")])
def test_timm_export_matches_timm_forward_and_round_trips(tmp_path, pool_type, posemb):
  model = _model(pool_type=pool_type, posemb=posemb)
  params = _init(pool_type=pool_type, posemb=posemb)
  path = tmp_path / "m.safetensors"
  kw = timm.write_timm(params, path, image_size=16)
  assert kw["global_pool"] == {"tok": "token", "gap": "avg", "map": "map"}[pool_type]
  assert kw["fc_norm"] is False and kw["img_size"] == 16
  sd = load_file(path)
  assert sd["blocks.1.attn.qkv.weight"].shape == (96, 32)
  assert sd["patch_embed.proj.weight"].shape == (32, 3, 4, 4)
  assert sd["pos_embed"].shape == (1, 16 + (pool_type == "tok"), 32)
  assert "fc_norm.weight" not in sd
  ours, _ = model.apply({"params": params}, IMAGES)
  theirs = _timm_forward(sd, kw, IMAGES)
  np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
  # ours -> timm -> ours is exact.
  checks.assert_same_params(vit.load(_init(seed=5, pool_type=pool_type, posemb=posemb), path), params)


def test_timm_export_refusals():
  with pytest.raises(ValueError, match="rep_size"):
    timm.to_timm(_init(rep_size=True))
  with pytest.raises(ValueError, match="image_size"):
    timm.to_timm(_init(posemb="sincos2d"))
  sd, _ = timm.to_timm(_init(pool_type="gap"))
  sd["fc_norm.weight"] = sd["fc_norm.bias"] = np.ones(32, np.float32)
  with pytest.raises(ValueError, match="fc_norm"):
    timm.from_timm(sd, num_heads=2)


@pytest.mark.timeout(180)
def test_export_cli(tmp_path):
  params = _init()
  vit.save_npz(params, tmp_path / "src.npz")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-m", "big_vit_lite.export", f"--src={tmp_path / 'src.npz'}",
                        f"--out={tmp_path / 'm.safetensors'}", "--format=timm"],
                       capture_output=True, text=True, env=env, timeout=170)
  assert run.returncode == 0, run.stderr
  assert '"global_pool": "token"' in run.stdout
  checks.assert_same_params(vit.load(_init(seed=1), tmp_path / "m.safetensors"), params)
  # In process for the npz format and the error path (saves a second interpreter start).
  export.export(str(tmp_path / "src.npz"), str(tmp_path / "copy.npz"), "npz")
  checks.assert_same_params(vit.load(_init(seed=1), tmp_path / "copy.npz"), params)
  bad = subprocess.run([sys.executable, "-m", "big_vit_lite.export", "--src=/nonexistent.npz",
                        f"--out={tmp_path / 'x.npz'}"], capture_output=True, text=True, env=env,
                       timeout=170)
  assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0
  assert "does not exist" in bad.stderr


@pytest.mark.timeout(120)
def test_load_and_export_from_training_checkpoint(tmp_path):
  checkpoint = pytest.importorskip("big_vit_lite.checkpoint")
  params = _init(scan=True)  # the trainer may train with scan: load/export convert it
  ckpt = checkpoint.Checkpointer(str(tmp_path / "work"), async_save=False)
  ckpt.save(3, {"params": nn.meta.unbox(params)}, {"epoch": 0})
  ckpt.close()
  loop = vit.load(_init(seed=1), tmp_path / "work")  # workdir -> newest step
  want = layout.unstack_layers(_flat(params))
  assert set(_flat(loop)) == set(want)
  for k, v in _flat(loop).items():
    np.testing.assert_array_equal(v, want[k], err_msg=k)
  summary = export.export(str(tmp_path / "work" / "checkpoints" / "3"), str(tmp_path / "m.npz"), "npz")
  assert summary["format"] == "npz"
  checks.assert_same_params(vit.load(_init(seed=2), tmp_path / "m.npz"), loop)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_timm_parity_with_real_timm():
  """Optional: runs only where torch+timm are importable or $TIMM_PYTHON names such a python."""
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
  try:
    import timm_parity  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  if timm_parity.timm_python() is None:
    pytest.skip("torch/timm not available (set TIMM_PYTHON to run the parity check)")
  script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "timm_parity.py")
  run = subprocess.run([sys.executable, script, "--cases=tiny_tok_learn,tiny_gap_sincos2d,tiny_map_learn"],
                       capture_output=True, text=True, timeout=280)
  assert run.returncode == 0, run.stdout + run.stderr
  assert run.stdout.count('"max_abs_diff"') == 3


def test_checkpoint_of_another_architecture_is_refused(tmp_path, caplog):
  # A deeper model, or a class token the model lacks, used to load with the extra
  # params silently dropped: a different model than the checkpoint's.
  abstract = _abstract
  deep = _random(depth=3)
  vit.save_npz(deep, tmp_path / "deep.npz")
  with pytest.raises(ValueError, match="encoderblock_2.*another architecture"):
    vit.load(abstract(), tmp_path / "deep.npz")
  with pytest.raises(ValueError, match="'cls'"):
    vit.load(abstract(pool_type="gap"), tmp_path / "deep.npz",
             dont_load=["Transformer/encoderblock_2/.*"])
  # Leaving them out on purpose: dont_load may name checkpoint-only params (big_vision).
  two = vit.load(abstract(), tmp_path / "deep.npz", dont_load=["Transformer/encoderblock_2/.*"])
  np.testing.assert_array_equal(_flat(two)["Transformer/encoderblock_1/LayerNorm_0/scale"],
                                _flat(deep)["Transformer/encoderblock_1/LayerNorm_0/scale"])
  # Routine drops still load, with a warning: the head (feature model) and the
  # pre-logits layer (vision_transformer fine-tuning without representation_size).
  vit.save_npz(dict(_flat(deep), **{"pre_logits/kernel": np.ones((32, 16), np.float32)}),
               tmp_path / "rep.npz")
  with caplog.at_level("WARNING"):
    headless = vit.load(abstract(num_classes=0, depth=3), tmp_path / "rep.npz")
  assert "head" not in headless and "pre_logits/kernel" in caplog.text


def test_export_reads_our_timm_file_back(tmp_path):
  # timm -> npz (e.g. for big_vision) used to fail reading the .safetensors as an .npz.
  params = _random(pool_type="map")
  timm.write_timm(params, tmp_path / "m.safetensors")
  export.export(str(tmp_path / "m.safetensors"), str(tmp_path / "m.npz"), "npz")
  checks.assert_same_params(vit.load(_abstract(pool_type="map"), tmp_path / "m.npz"), params)
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  save_file(load_file(tmp_path / "m.safetensors"), str(tmp_path / "bare.safetensors"))
  with pytest.raises(ValueError, match="number of attention heads"):
    export.export(str(tmp_path / "bare.safetensors"), str(tmp_path / "x.npz"), "npz")
  # The format follows the suffix; a suffix the loaders would misread is refused
  # (an npz named .safetensors was written when --format was left out).
  assert export.export(str(tmp_path / "m.npz"), str(tmp_path / "t.safetensors"))["format"] == "timm"
  with pytest.raises(ValueError, match=r"name it \*\.npz for --format=npz"):
    export.export(str(tmp_path / "m.npz"), str(tmp_path / "y.safetensors"), "npz")
  # A missing output directory was a SafetensorError traceback.
  with pytest.raises(ValueError, match="does not exist"):
    export.export(str(tmp_path / "m.npz"), str(tmp_path / "no" / "m.safetensors"))


def test_timm_usage_names_registered_models_and_keeps_the_head():
  kw = dict(img_size=224, patch_size=16, in_chans=3, embed_dim=768, depth=12, num_heads=12,
            mlp_ratio=4.0, num_classes=10, global_pool="token", class_token=True, fc_norm=False)
  assert timm.timm_model_name(kw) == "vit_base_patch16_224"
  assert timm.timm_model_name(dict(kw, embed_dim=192, num_heads=3, patch_size=16,
                                      img_size=384)) == "vit_tiny_patch16_384"
  # timm's pretrained loading drops a head whose size differs from the registered
  # model's unless the overlay says num_classes: the line must say it.
  assert "pretrained_cfg_overlay=dict(file=\"/x/m.safetensors\", num_classes=10)" in (
      timm.timm_usage(kw, "/x/m.safetensors"))
  for other in (dict(in_chans=1), dict(global_pool="avg", class_token=False), dict(patch_size=14),
                dict(depth=6), dict(img_size=256)):
    assert timm.timm_model_name(dict(kw, **other)) is None, other
  assert timm.timm_usage(dict(kw, depth=6), "m.safetensors").startswith(
      "m = timm.models.vision_transformer.VisionTransformer(img_size=224")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_timm_usage_line_runs_in_real_timm(tmp_path):
  """Optional: the printed timm line, run in $TIMM_PYTHON, gives our logits (Ti/16, 10 classes)."""
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
  try:
    import timm_parity  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  python = timm_parity.timm_python()
  if python is None:
    pytest.skip("torch/timm not available (set TIMM_PYTHON to run it)")
  model = vit.Model(num_classes=10, variant="Ti/16", head_zeroinit=False, remat_policy=None)
  images = np.asarray(jax.random.uniform(jax.random.key(0), (1, 224, 224, 3), minval=-1, maxval=1))
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda a: rng.normal(0, 0.05, a.shape).astype(a.dtype), nn.meta.unbox(
      jax.eval_shape(model.init, jax.random.key(1), images)["params"]))
  np.save(tmp_path / "x.npy", images)
  np.save(tmp_path / "ours.npy", np.asarray(jax.jit(model.apply)({"params": params}, images)[0]))
  summary = export.export(_npz(tmp_path, params), str(tmp_path / "m.safetensors"), "timm")
  assert summary["timm_name"] == "vit_tiny_patch16_224"
  script = (f"import sys; sys.path.insert(0, {os.path.dirname(timm_parity.__file__)!r}); "
            "import timm_parity; timm_parity._install_torchvision_standin(); "
            "import numpy as np, torch, timm; m = " + summary["timm_usage"] + "; "
            f"x = torch.from_numpy(np.load({str(tmp_path / 'x.npy')!r})).permute(0, 3, 1, 2); "
            f"ours = np.load({str(tmp_path / 'ours.npy')!r}); "
            "print(float(np.abs(m.eval()(x).detach().numpy() - ours).max()))")
  run = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=280)
  assert run.returncode == 0, run.stderr[-2000:]
  assert float(run.stdout.split()[-1]) < 1e-4, run.stdout


def _npz(tmp_path, params):
  vit.save_npz(params, tmp_path / "src.npz")
  return str(tmp_path / "src.npz")


def test_timm_no_embed_class_posemb_gets_a_zero_class_row():
  # timm's no_embed_class models (e.g. DeiT III) have pos_embed for the grid only;
  # its first grid row used to be taken as the class token's.
  sd, _ = timm.to_timm(_random())
  sd["pos_embed"][:, :1] = 0.0
  want = timm.from_timm(sd, num_heads=2)
  got = timm.from_timm(dict(sd, pos_embed=sd["pos_embed"][:, 1:]), num_heads=2)
  np.testing.assert_array_equal(got[POSEMB], want[POSEMB])
