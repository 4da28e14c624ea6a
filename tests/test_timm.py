"""timm safetensors checkpoints (models/timm.py).

Export checked against a numpy transcription of timm's forward and against real timm (torch,
CPU; tests/timm_reference.py), import, timm's model names, non-square and non-divisible sizes,
head counts, timm's own files, files on a bucket.
"""

import os
import subprocess
import sys

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest
from safetensors.numpy import load_file

from big_vit_lite.trainer import checkpoint
from big_vit_lite import evaluate
from big_vit_lite import export
from big_vit_lite.evaluators import presets
from big_vit_lite.models import timm
from big_vit_lite.models import vit
from big_vit_lite.models import loading

import checks
import test_bucket_workdir
import timm_reference

# gs:// served from a local folder
fake_bucket = test_bucket_workdir.fake_bucket
IMAGES = jax.random.uniform(
    jax.random.key(7), (2, 16, 16, 3), minval=-1, maxval=1
)


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
  t = (
      np.einsum("bcipjq,dcpq->bijd", patches, wgt).reshape(b, -1, d)
      + sd["patch_embed.proj.bias"]
  )
  if kw["class_token"]:
    t = np.concatenate([np.broadcast_to(sd["cls_token"], (b, 1, d)), t], 1)
  t = t + sd["pos_embed"]

  def attn(xq, xkv, pre, fused):
    n = xkv.shape[1]
    if fused:
      qkv = (xq @ sd[f"{pre}.qkv.weight"].T + sd[f"{pre}.qkv.bias"]).reshape(
          b, n, 3, nh, d // nh
      )
      q, k, v = qkv.transpose(2, 0, 3, 1, 4)
    else:
      q = xq @ sd[f"{pre}.q.weight"].T + sd[f"{pre}.q.bias"]
      q = q.reshape(b, xq.shape[1], nh, d // nh).transpose(0, 2, 1, 3)
      kv = (xkv @ sd[f"{pre}.kv.weight"].T + sd[f"{pre}.kv.bias"]).reshape(
          b, n, 2, nh, d // nh
      )
      k, v = kv.transpose(2, 0, 3, 1, 4)
    o = _softmax_attn(q, k, v).transpose(0, 2, 1, 3).reshape(b, -1, d)
    return o @ sd[f"{pre}.proj.weight"].T + sd[f"{pre}.proj.bias"]

  def mlp(y, pre):
    y = _gelu(y @ sd[f"{pre}.fc1.weight"].T + sd[f"{pre}.fc1.bias"])
    return y @ sd[f"{pre}.fc2.weight"].T + sd[f"{pre}.fc2.bias"]

  for i in range(kw["depth"]):
    y = _ln(t, sd[f"blocks.{i}.norm1.weight"], sd[f"blocks.{i}.norm1.bias"])
    t = t + attn(y, y, f"blocks.{i}.attn", True)
    t = t + mlp(
        _ln(t, sd[f"blocks.{i}.norm2.weight"], sd[f"blocks.{i}.norm2.bias"]),
        f"blocks.{i}.mlp",
    )
  t = _ln(t, sd["norm.weight"], sd["norm.bias"])
  if kw["global_pool"] == "token":
    t = t[:, 0]
  elif kw["global_pool"] == "avg":
    t = t.mean(1)
  else:
    lat = np.broadcast_to(sd["attn_pool.latent"], (b, 1, d))
    t = attn(lat, t, "attn_pool", False)
    t = t + mlp(
        _ln(t, sd["attn_pool.norm.weight"], sd["attn_pool.norm.bias"]),
        "attn_pool.mlp",
    )
    t = t[:, 0]
  return t @ sd["head.weight"].T + sd["head.bias"]


@pytest.mark.parametrize(
    "pool_type,posemb",
    [("tok", "learn"), ("gap", "sincos2d"), ("map", "learn")],
)
def test_timm_export_matches_timm_forward_and_round_trips(
    tmp_path, pool_type, posemb
):
  model = checks.tiny_vit(pool_type=pool_type, posemb=posemb)
  params = checks.vit_params(boxed=True, pool_type=pool_type, posemb=posemb)
  path = tmp_path / "m.safetensors"
  kw = timm.write_timm(params, path, image_size=16)
  assert (
      kw["global_pool"]
      == {"tok": "token", "gap": "avg", "map": "map"}[pool_type]
  )
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
  back = vit.load(
      checks.vit_params(boxed=True, seed=5, pool_type=pool_type, posemb=posemb),
      path,
  )
  checks.assert_same_params(back, params)


def test_timm_export_refusals():
  with pytest.raises(ValueError, match="rep_size"):
    timm.to_timm(checks.vit_params(boxed=True, rep_size=True))
  with pytest.raises(ValueError, match="image_size"):
    timm.to_timm(checks.vit_params(boxed=True, posemb="sincos2d"))
  sd, _ = timm.to_timm(checks.vit_params(boxed=True, pool_type="gap"))
  sd["fc_norm.weight"] = sd["fc_norm.bias"] = np.ones(32, np.float32)
  with pytest.raises(ValueError, match="fc_norm"):
    timm.from_timm(sd, num_heads=2)


def test_timm_no_embed_class_posemb_gets_a_zero_class_row():
  # timm's no_embed_class models (e.g. DeiT III) have pos_embed for the grid
  # only; its first grid row used to be taken as the class token's.
  sd, _ = timm.to_timm(checks.vit_params())
  sd["pos_embed"][:, :1] = 0.0
  want = timm.from_timm(sd, num_heads=2)
  got = timm.from_timm(dict(sd, pos_embed=sd["pos_embed"][:, 1:]), num_heads=2)
  np.testing.assert_array_equal(got[checks.POSEMB], want[checks.POSEMB])


def test_export_reads_our_timm_file_back(tmp_path):
  # timm -> npz (e.g. for big_vision) used to fail reading the .safetensors as
  # an .npz.
  params = checks.vit_params(pool_type="map")
  timm.write_timm(params, tmp_path / "m.safetensors")
  export.export(str(tmp_path / "m.safetensors"), str(tmp_path / "m.npz"), "npz")
  checks.assert_same_params(
      vit.load(checks.vit_shapes(pool_type="map"), tmp_path / "m.npz"), params
  )
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  save_file(
      load_file(tmp_path / "m.safetensors"), str(tmp_path / "bare.safetensors")
  )
  with pytest.raises(ValueError, match="number of attention heads"):
    export.export(
        str(tmp_path / "bare.safetensors"), str(tmp_path / "x.npz"), "npz"
    )
  # The format follows the suffix; a suffix the loaders would misread is refused
  # (an npz named .safetensors was written when --format was left out).
  assert (
      export.export(str(tmp_path / "m.npz"), str(tmp_path / "t.safetensors"))[
          "format"
      ]
      == "timm"
  )
  with pytest.raises(ValueError, match=r"name it \*\.npz for --format=npz"):
    export.export(
        str(tmp_path / "m.npz"), str(tmp_path / "y.safetensors"), "npz"
    )
  # A missing output directory was a SafetensorError traceback.
  with pytest.raises(ValueError, match="does not exist"):
    export.export(
        str(tmp_path / "m.npz"), str(tmp_path / "no" / "m.safetensors")
    )


def test_timm_usage_names_registered_models_and_keeps_the_head():
  kw = dict(
      img_size=224,
      patch_size=16,
      in_chans=3,
      embed_dim=768,
      depth=12,
      num_heads=12,
      mlp_ratio=4.0,
      num_classes=10,
      global_pool="token",
      class_token=True,
      fc_norm=False,
  )
  assert timm.timm_model_name(kw) == "vit_base_patch16_224"
  assert (
      timm.timm_model_name(
          dict(kw, embed_dim=192, num_heads=3, patch_size=16, img_size=384)
      )
      == "vit_tiny_patch16_384"
  )
  # timm's pretrained loading drops a head whose size differs from the
  # registered model's unless the overlay says num_classes: the line must say
  # it.
  assert (
      'pretrained_cfg_overlay=dict(file="/x/m.safetensors", num_classes=10)'
      in (timm.timm_usage(kw, "/x/m.safetensors"))
  )
  for other in (
      dict(in_chans=1),
      dict(global_pool="avg", class_token=False),
      dict(patch_size=14),
      dict(depth=6),
      dict(img_size=256),
  ):
    assert timm.timm_model_name(dict(kw, **other)) is None, other
  assert timm.timm_usage(dict(kw, depth=6), "m.safetensors").startswith(
      "m = timm.models.vision_transformer.VisionTransformer(img_size=224"
  )


def test_timm_export_of_non_square_models(tmp_path):
  # A 3x5 grid (15 tokens) was written as timm img_size=16 (a 4x4 grid), and
  # read back as a "no_embed_class" posemb: a zero row in front, every row
  # shifted.
  params = checks.vit_params(hw=(12, 20))
  with pytest.raises(
      ValueError, match=r"15 grid tokens: not a square grid.*--res=HxW"
  ):
    timm.write_timm(params, tmp_path / "x.safetensors")
  kwargs = timm.write_timm(
      params, tmp_path / "m.safetensors", image_size=(12, 20)
  )
  assert kwargs["img_size"] == (12, 20)
  checks.assert_same_params(
      vit.load(checks.vit_shapes(hw=(12, 20)), tmp_path / "m.safetensors"),
      params,
  )
  with pytest.raises(
      ValueError,
      match=r"15 grid tokens: not the 4x4 grid of image_size=16 \(patch 4\)",
  ):
    timm.write_timm(params, tmp_path / "y.safetensors", image_size=16)
  # 4x9 has the square count of 6x6: only the run's config knows. A workdir says
  # it (its training pp), so export writes img_size=(16, 36), not 24.
  params = checks.vit_params(hw=(16, 36))
  ckpt = checkpoint.Checkpointer(str(tmp_path / "work"), async_save=False)
  ckpt.save(
      5,
      {"params": params},
      {},
      ml_collections.ConfigDict(
          dict(
              input=dict(
                  pp="decode(3)|resize((16, 36))|value_range(-1, 1)|keep('image')"
              )
          )
      ),
  )
  ckpt.close()
  summary = export.export(
      str(tmp_path / "work"), str(tmp_path / "w.safetensors")
  )
  assert summary["timm_kwargs"]["img_size"] == (16, 36)
  assert "img_size=(16, 36)" in summary["timm_usage"]
  checks.assert_same_params(
      vit.load(checks.vit_shapes(hw=(16, 36)), tmp_path / "w.safetensors"),
      params,
  )
  # timm -> timm keeps the size the file's metadata gives (was 24, from the 36
  # rows).
  summary = export.export(
      str(tmp_path / "w.safetensors"), str(tmp_path / "w2.safetensors")
  )
  assert summary["timm_kwargs"]["img_size"] == (16, 36)
  # The CLI's --res takes HxW.
  vit.save_npz(params, tmp_path / "ns.npz")
  summary = export.export(
      str(tmp_path / "ns.npz"), str(tmp_path / "n.safetensors"), res="16x36"
  )
  assert summary["timm_kwargs"]["img_size"] == (16, 36)
  with pytest.raises(ValueError, match="use an image size N or HxW"):
    export.export(
        str(tmp_path / "ns.npz"), str(tmp_path / "n.safetensors"), res="16by36"
    )


@pytest.mark.parametrize("pool_type", ["tok", "gap", "map"])
def test_timm_round_trip_at_sizes_the_patch_does_not_divide(
    tmp_path, pool_type
):
  # /7 at 30 px (a 4x4 grid): timm's img_size was written as 28, so the timm
  # model refused the 30 px images the model was trained on.
  params = checks.vit_params(hw=(30, 30), patch_size=7, pool_type=pool_type)
  kwargs = timm.write_timm(params, tmp_path / "m.safetensors", image_size=30)
  assert kwargs["img_size"] == 30 and kwargs["patch_size"] == 7
  back = vit.load(
      checks.vit_shapes(hw=(30, 30), patch_size=7, pool_type=pool_type),
      tmp_path / "m.safetensors",
  )
  images = jax.random.uniform(
      jax.random.key(1), (2, 30, 30, 3), minval=-1, maxval=1
  )
  apply = jax.jit(checks.tiny_vit(patch_size=7, pool_type=pool_type).apply)
  np.testing.assert_array_equal(
      apply({"params": nn.meta.unbox(back)}, images)[0],
      apply({"params": params}, images)[0],
  )


def test_evaluate_refuses_a_non_square_timm_export(tmp_path):
  # A 4x9 grid has the token count of 6x6: evaluate took the file for a 24 px
  # model and ran it with its posemb rows on the wrong grid. Its metadata says
  # 16x36.
  params = checks.vit_params(hw=(16, 36))
  timm.write_timm(params, tmp_path / "ns.safetensors", image_size=(16, 36))
  config = ml_collections.ConfigDict(
      dict(
          model_init=str(tmp_path / "ns.safetensors"),
          evals=dict(
              val=dict(
                  type="classification",
                  data=dict(name="imagefolder", data_dir=str(tmp_path)),
                  pp=presets.eval_pp(24),
                  batch_size=8,
              )
          ),
      )
  )
  with pytest.raises(
      ValueError,
      match=r"trained on 16x36 images \(its timm metadata\): "
      "evaluate runs square images only",
  ):
    evaluate.evaluate(config, str(tmp_path / "eval"))
  # A square export at a size its patch does not divide runs at that size.
  timm.write_timm(
      checks.vit_params(hw=(30, 30), patch_size=7),
      tmp_path / "p7.safetensors",
      image_size=30,
  )
  flat, saved, _ = loading.read_source(str(tmp_path / "p7.safetensors"))
  assert loading.native_input_shape(
      flat, saved, timm.timm_image_size(tmp_path / "p7.safetensors")
  ) == (30, 3)


def test_timm_export_as_model_init_on_a_bucket(fake_bucket):
  # README: model_init may be on a bucket, and may be an exported .safetensors;
  # read_timm went by os.path, so gs://.../m.safetensors "did not exist".
  params = checks.vit_params()
  timm.write_timm(params, fake_bucket / "m.safetensors")
  checks.assert_same_params(
      vit.load(checks.vit_shapes(), "gs://m.safetensors"), params
  )
  flat, _, _ = loading.read_source("gs://m.safetensors")
  assert loading.native_input_shape(
      flat, None, timm.timm_image_size("gs://m.safetensors")
  ) == (16, 3)
  export.export("gs://m.safetensors", str(fake_bucket.parent / "m.npz"))
  checks.assert_same_params(
      vit.load(checks.vit_shapes(), fake_bucket.parent / "m.npz"), params
  )


def test_timm_file_into_a_model_with_another_head_count_is_refused(tmp_path):
  # timm fuses q, k and v over all heads: the file split into 4 heads where it
  # had 2 and loaded, a different model without a word. Our files say their
  # heads.
  timm.write_timm(checks.vit_params(), tmp_path / "h2.safetensors")
  with pytest.raises(
      ValueError,
      match="holds a ViT with 2 attention heads, the model has 4: "
      "build the model with num_heads=2",
  ):
    vit.load(checks.vit_shapes(num_heads=4), tmp_path / "h2.safetensors")
  vit.load(checks.vit_shapes(), tmp_path / "h2.safetensors")


def test_timm_hub_file_of_a_standard_size_reads_without_metadata(tmp_path):
  # timm's own model.safetensors has no metadata, and qkv does not say its
  # heads: evaluate and export refused every such file. A standard size's
  # width, depth and MLP size fix them (here ViT-mu/16: 2 heads).
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  size = dict(
      variant="mu/16",
      **{
          k: None
          for k in ("width", "depth", "mlp_dim", "num_heads", "patch_size")
      },
  )
  params = checks.vit_params(hw=(32, 32), **size)
  sd, _ = timm.to_timm(params)
  save_file(sd, str(tmp_path / "hub.safetensors"))  # no metadata
  export.export(str(tmp_path / "hub.safetensors"), str(tmp_path / "hub.npz"))
  checks.assert_same_params(
      vit.load(checks.vit_shapes(hw=(32, 32), **size), tmp_path / "hub.npz"),
      params,
  )
  assert (
      loading.infer_model_cfg(
          loading.read_source(str(tmp_path / "hub.safetensors"))[0]
      )["num_heads"]
      == 2
  )
  # Not a standard size: still refused, saying why.
  sd, _ = timm.to_timm(checks.vit_params())
  save_file(sd, str(tmp_path / "odd.safetensors"))
  with pytest.raises(
      ValueError, match="no timm_kwargs metadata.*not a standard ViT size"
  ):
    export.export(str(tmp_path / "odd.safetensors"), str(tmp_path / "odd.npz"))


@pytest.mark.parametrize("pool_type", ["tok", "gap", "map"])
@pytest.mark.parametrize("posemb", ["learn", "sincos2d"])
def test_timm_parity_with_real_timm(tmp_path, pool_type, posemb):
  """Real timm loads our export with strict=True and gives our logits (torch, CPU)."""
  timm_reference.require()  # Skips where torch/timm are missing, except in CI.
  model = checks.tiny_vit(pool_type=pool_type, posemb=posemb)
  params = checks.vit_params(pool_type=pool_type, posemb=posemb)
  path = tmp_path / "m.safetensors"
  timm.write_timm(params, path, image_size=16)
  ours = np.asarray(model.apply({"params": params}, IMAGES)[0])
  theirs = timm_reference.logits(path, IMAGES)
  assert theirs.shape == ours.shape == (2, 10)
  # (a zero head would make any two models agree)
  assert np.abs(ours).max() > 0.1
  np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_timm_usage_line_runs_in_real_timm(tmp_path):
  """The printed timm line, run in real timm, gives our logits (Ti/16, 10 classes)."""
  sys.path.insert(
      0, os.path.join(os.path.dirname(__file__), "..", "benchmarks")
  )
  try:
    import timm_parity  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  timm_reference.require()  # Skips where torch/timm are missing, except in CI.
  python = sys.executable
  model = vit.Model(
      num_classes=10, variant="Ti/16", head_zeroinit=False, remat_policy=None
  )
  images = np.asarray(
      jax.random.uniform(
          jax.random.key(0), (1, 224, 224, 3), minval=-1, maxval=1
      )
  )
  rng = np.random.default_rng(1)
  params = jax.tree.map(
      lambda a: rng.normal(0, 0.05, a.shape).astype(a.dtype),
      nn.meta.unbox(
          jax.eval_shape(model.init, jax.random.key(1), images)["params"]
      ),
  )
  np.save(tmp_path / "x.npy", images)
  np.save(
      tmp_path / "ours.npy",
      np.asarray(jax.jit(model.apply)({"params": params}, images)[0]),
  )
  summary = export.export(
      _npz(tmp_path, params), str(tmp_path / "m.safetensors"), "timm"
  )
  assert summary["timm_name"] == "vit_tiny_patch16_224"
  script = (
      f"import sys; sys.path.insert(0, {os.path.dirname(timm_parity.__file__)!r}); "
      "import timm_parity; timm_parity._install_torchvision_standin(); "
      "import numpy as np, torch, timm; m = " + summary["timm_usage"] + "; "
      f"x = torch.from_numpy(np.load({str(tmp_path / 'x.npy')!r})).permute(0, 3, 1, 2); "
      f"ours = np.load({str(tmp_path / 'ours.npy')!r}); "
      "print(float(np.abs(m.eval()(x).detach().numpy() - ours).max()))"
  )
  run = subprocess.run(
      [python, "-c", script], capture_output=True, text=True, timeout=280
  )
  assert run.returncode == 0, run.stderr[-2000:]
  assert float(run.stdout.split()[-1]) < 1e-4, run.stdout


def _npz(tmp_path, params):
  vit.save_npz(params, tmp_path / "src.npz")
  return str(tmp_path / "src.npz")
