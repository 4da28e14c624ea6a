"""ViT model family: param counts and names, outputs, scan/loop, dropout, bf16."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite.models import layout
from big_vit_lite.models import timm
from big_vit_lite.models import vit

import checks

TINY = dict(
    variant=None, width=32, depth=2, mlp_dim=64, num_heads=2, patch_size=4
)
IMAGES = jax.random.uniform(
    jax.random.key(7), (2, 16, 16, 3), minval=-1, maxval=1
)


def _init(seed=0, images=IMAGES, **kw):
  model = vit.Model(**{"num_classes": 10, **TINY, **kw})
  return model, model.init(jax.random.key(seed), images)["params"]


_JITTED = {}


def _apply(model, params, train=False, seed=0):
  """model.apply under one cached jit per (model config, train): eager scan recompiles per call."""
  key = (repr(model), train)
  if key not in _JITTED:
    _JITTED[key] = jax.jit(
        lambda p, x, k: model.apply(
            {"params": p}, x, train=train, rngs={"dropout": k}
        )
    )
  return _JITTED[key](params, IMAGES, jax.random.key(seed))


def _count(tree):
  return sum(
      int(np.prod(x.shape)) for x in jax.tree.leaves(nn.meta.unbox(tree))
  )


def _abstract_params(res=224, **kw):
  model = vit.Model(**kw)
  return jax.eval_shape(
      model.init, jax.random.key(0), jnp.zeros((1, res, res, 3))
  )["params"]


def _expected_count(variant, num_classes=1000, res=224):
  """Closed-form count of a tok/learn ViT, written independently of the model code."""
  a = vit.decode_variant(variant)
  d, m, p = a["width"], a["mlp_dim"], a["patch_size"]
  block = 4 * (d * d + d) + (d * m + m) + (m * d + d) + 2 * 2 * d
  tokens = (res // p) ** 2 + 1
  return (
      (p * p * 3 * d + d)
      + d
      + tokens * d
      + a["depth"] * block
      + 2 * d
      + (d * num_classes + num_classes)
  )


def test_exact_param_counts_b16_l16():
  assert (
      _count(_abstract_params(num_classes=1000, variant="B/16")) == 86_567_656
  )
  assert (
      _count(_abstract_params(num_classes=1000, variant="L/16", scan=True))
      == 304_326_632
  )


@pytest.mark.parametrize(
    "variant",
    [
        "mu/16",
        "Ti/16",
        "S/16",
        "M/16",
        "B/32",
        "H/14",
        "g/14",
        "G/14",
        "So400m/14",
    ],
)
def test_family_param_counts(variant):
  got = _count(_abstract_params(num_classes=1000, variant=variant, scan=True))
  assert got == _expected_count(variant)
  if variant == "Ti/16":
    assert got == 5_717_416  # timm's vit_tiny_patch16_224
  if variant == "S/16":
    assert got == 22_050_664  # timm's vit_small_patch16_224


def test_param_tree_is_vision_transformer_layout():
  params = _abstract_params(num_classes=1000, variant="B/16")
  shapes = {
      k: v.shape for k, v in layout.flatten(nn.meta.unbox(params)).items()
  }
  att = "Transformer/encoderblock_11/MultiHeadDotProductAttention_0"
  expected = {
      "embedding/kernel": (16, 16, 3, 768),
      "embedding/bias": (768,),
      "cls": (1, 1, 768),
      "Transformer/posembed_input/pos_embedding": (1, 197, 768),
      f"{att}/query/kernel": (768, 12, 64),
      f"{att}/key/bias": (12, 64),
      f"{att}/value/kernel": (768, 12, 64),
      f"{att}/out/kernel": (12, 64, 768),
      f"{att}/out/bias": (768,),
      "Transformer/encoderblock_0/LayerNorm_0/scale": (768,),
      "Transformer/encoderblock_0/LayerNorm_1/bias": (768,),
      "Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel": (768, 3072),
      "Transformer/encoderblock_0/MlpBlock_0/Dense_1/kernel": (3072, 768),
      "Transformer/encoder_norm/scale": (768,),
      "head/kernel": (768, 1000),
      "head/bias": (1000,),
  }
  for k, shape in expected.items():
    assert shapes[k] == shape, k
  # embedding 2, cls, posemb, 12 blocks x 16, encoder_norm 2, head 2: nothing
  # else.
  assert len(shapes) == 2 + 1 + 1 + 12 * 16 + 2 + 2


def test_params_are_boxed_with_logical_names():
  params = _abstract_params(num_classes=10, variant="mu/16", scan=True)
  boxes = layout.flatten(params)
  assert all(isinstance(b, nn.Partitioned) for b in boxes.values())
  assert boxes["Transformer/encoderblock/MlpBlock_0/Dense_0/kernel"].names == (
      "layers",
      "embed",
      "mlp",
  )
  att = "Transformer/encoderblock/MultiHeadDotProductAttention_0"
  assert boxes[f"{att}/query/kernel"].names == (
      "layers",
      "embed",
      "heads",
      "kv",
  )
  assert boxes[f"{att}/out/kernel"].names == ("layers", "heads", "kv", "embed")
  assert boxes["head/kernel"].names == ("embed", "classes")


def test_bad_options_are_one_line_errors():
  for kw in (
      dict(variant="X/16"),
      dict(variant="B16"),
      dict(pool_type="max"),
      dict(posemb="rope"),
      dict(gelu="relu"),
      dict(remat_policy="no_such_policy"),
      dict(attention="flash"),
      dict(dtype_act="int8"),
  ):
    with pytest.raises(ValueError) as e:
      _abstract_params(num_classes=10, **{"variant": "mu/16", **kw})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("pool_type", ["tok", "gap", "map"])
@pytest.mark.parametrize("posemb", ["learn", "sincos2d"])
def test_output_shapes(pool_type, posemb):
  model, params = _init(pool_type=pool_type, posemb=posemb, head_zeroinit=False)
  logits, out = model.apply({"params": params}, IMAGES)
  n_tok = 16 + (pool_type == "tok")
  assert logits.shape == (2, 10)
  assert out["pre_logits"].shape == out["head_input"].shape == (2, 32)
  assert (
      out["encoded"].shape
      == out["block00"].shape
      == out["block01"].shape
      == (2, n_tok, 32)
  )
  assert out["stem"].shape == (2, 16, 32)
  assert np.isfinite(logits).all() and np.abs(logits).max() > 0
  names = layout.flatten(nn.meta.unbox(params))
  assert ("cls" in names) == (pool_type == "tok")
  assert ("MAPHead_0/probe" in names) == (pool_type == "map")
  assert ("Transformer/posembed_input/pos_embedding" in names) == (
      posemb == "learn"
  )


def test_no_head_and_rep_size():
  model, params = _init(num_classes=0, rep_size=16)
  logits, out = model.apply({"params": params}, IMAGES)
  assert "head" not in params and params["pre_logits"][
      "kernel"
  ].value.shape == (32, 16)
  assert logits.shape == (2, 16)
  np.testing.assert_array_equal(logits, out["pre_logits"])
  assert np.abs(logits).max() < 1  # tanh


def test_head_zeroinit():
  _, params = _init()
  assert not np.any(params["head"]["kernel"].value)
  _, params = _init(head_zeroinit=False)
  assert np.any(params["head"]["kernel"].value)


def test_scan_and_loop_give_same_outputs(tmp_path):
  loop_model, loop_params = _init(head_zeroinit=False)
  scan_model, scan_init = _init(seed=1, scan=True, head_zeroinit=False)
  vit.save_npz(loop_params, tmp_path / "loop.npz")
  scan_params = vit.load(scan_init, tmp_path / "loop.npz")
  assert scan_params["Transformer"]["encoderblock"]["LayerNorm_0"][
      "scale"
  ].value.shape == (2, 32)
  a, out_a = loop_model.apply({"params": loop_params}, IMAGES)
  b, out_b = scan_model.apply({"params": scan_params}, IMAGES)
  np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(
      out_a["block01"], out_b["block01"], atol=1e-5, rtol=1e-5
  )
  # And back: a scan model saves in the loop layout.
  vit.save_npz(scan_params, tmp_path / "scan.npz")
  with np.load(tmp_path / "scan.npz") as f:
    assert "Transformer/encoderblock_1/MlpBlock_0/Dense_0/kernel" in f.files
    np.testing.assert_array_equal(
        f["Transformer/encoderblock_1/MlpBlock_0/Dense_0/kernel"],
        loop_params["Transformer"]["encoderblock_1"]["MlpBlock_0"]["Dense_0"][
            "kernel"
        ].value,
    )


@pytest.mark.parametrize("scan", [False, True])
def test_dropout_and_drop_path_only_with_train(scan):
  model, params = _init(
      dropout=0.2, drop_path=0.5, scan=scan, head_zeroinit=False
  )
  plain = vit.Model(num_classes=10, **TINY, scan=scan)
  ref, _ = _apply(plain, params)
  evaluated, _ = _apply(model, params, train=False, seed=1)
  np.testing.assert_array_equal(evaluated, ref)
  t1, _ = _apply(model, params, train=True, seed=1)
  t2, _ = _apply(model, params, train=True, seed=2)
  assert np.abs(t1 - ref).max() > 1e-3 and np.abs(t1 - t2).max() > 1e-3
  # Drop path alone is active in training too: some examples lose whole
  # branches.
  dp = vit.Model(num_classes=10, **TINY, scan=scan, drop_path=0.9)
  outs = [
      np.asarray(_apply(dp, params, train=True, seed=s)[0]) for s in range(4)
  ]
  assert max(np.abs(o - ref).max() for o in outs) > 1e-3
  assert max(np.abs(o - outs[0]).max() for o in outs) > 1e-3


def test_bf16_matmuls():
  model, params = _init(head_zeroinit=False)
  model16 = vit.Model(num_classes=10, **TINY, dtype_mm="bfloat16")
  ref, _ = model.apply({"params": params}, IMAGES)
  lo, out = jax.jit(lambda p, x: model16.apply({"params": p}, x))(
      params, IMAGES
  )
  assert all(
      x.dtype == jnp.float32 for x in jax.tree.leaves(nn.meta.unbox(params))
  )
  assert np.isfinite(lo).all()
  np.testing.assert_allclose(lo, ref, atol=0.1, rtol=0.1)
  assert np.abs(lo - ref).max() > 0  # it really ran in lower precision


def test_gelu_tanh_differs_slightly():
  model, params = _init(head_zeroinit=False)
  tanh_model = vit.Model(num_classes=10, **TINY, gelu="tanh")
  a, _ = model.apply({"params": params}, IMAGES)
  b, _ = tanh_model.apply({"params": params}, IMAGES)
  assert 0 < np.abs(a - b).max() < 1e-2


def test_grad_with_remat_scan_and_drop_path():
  model, params = _init(
      scan=True,
      drop_path=0.1,
      dropout=0.1,
      remat_policy="nothing_saveable",
      head_zeroinit=False,
  )

  def loss(p):
    logits, _ = model.apply(
        {"params": p}, IMAGES, train=True, rngs={"dropout": jax.random.key(0)}
    )
    return jnp.mean(logits**2)

  grads = jax.jit(jax.grad(loss))(nn.meta.unbox(params))
  norms = [float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grads)]
  assert all(np.isfinite(norms)) and sum(norms) > 0


def test_conv_stem_sees_across_patch_borders(tmp_path):
  """stem_channels adds 3x3 convs before patchify: a pixel on a patch border then
  reaches the neighbouring patch's token, which plain patchify never does."""

  def stem_tokens(model, params, images):
    return model.apply({"params": params}, images)[1]["stem"]

  # last column of patch (0, 0), next to patch (0, 1)
  poked = IMAGES.at[:, 0, 3, :].add(1.0)
  for stem, crosses in (((), False), ((8, 4), True)):
    model, params = _init(stem_channels=stem)
    delta = np.abs(
        stem_tokens(model, params, poked) - stem_tokens(model, params, IMAGES)
    )
    assert delta[:, 0].max() > 0
    assert (delta[:, 1].max() > 0) == crosses
    assert delta[:, 2:].max() == 0

  names = layout.flatten(nn.meta.unbox(params))
  assert names["stem/conv_0/kernel"].shape == (3, 3, 3, 8)
  assert names["stem/conv_1/kernel"].shape == (3, 3, 8, 4)
  assert names["embedding/kernel"].shape == (4, 4, 4, 32)
  # The stem travels through .npz like any other param.
  vit.save_npz(params, tmp_path / "stem.npz")
  _, fresh = _init(seed=1, stem_channels=(8, 4))
  loaded = vit.load(fresh, tmp_path / "stem.npz")
  np.testing.assert_array_equal(
      nn.meta.unbox(loaded)["stem"]["conv_1"]["kernel"],
      names["stem/conv_1/kernel"],
  )
  with pytest.raises(ValueError, match="convolutional stem"):
    timm.to_timm(params)


@pytest.mark.parametrize(
    "dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)]
)
def test_attention_matches_jax_reference_values_and_grads(dtype, tol):
  """Our attention (hand-written backward) against jax.nn.dot_product_attention + autodiff."""
  q, k, v, g = (
      jax.random.normal(kk, (2, 10, 3, 8)).astype(dtype)
      for kk in jax.random.split(jax.random.key(3), 4)
  )

  def loss(fn):
    return lambda q, k, v: jnp.sum(
        fn(q, k, v).astype(jnp.float32) * g.astype(jnp.float32)
    )

  ours = jax.value_and_grad(loss(vit.dot_product_attention), argnums=(0, 1, 2))(
      q, k, v
  )
  ref = jax.value_and_grad(
      loss(jax.nn.dot_product_attention), argnums=(0, 1, 2)
  )(q, k, v)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol
    )


@pytest.mark.parametrize(
    "dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)]
)
@pytest.mark.parametrize("cotangent", ["random", "broadcast"])
def test_layer_norm_matches_flax_values_and_grads(dtype, tol, cotangent):
  """Our LayerNorm (hand-written backward) against flax.linen.LayerNorm + autodiff, under jit."""
  kx, ks, kb, kg = jax.random.split(jax.random.key(4), 4)
  # non-zero mean
  x = (3.0 * jax.random.normal(kx, (2, 7, 24)) + 1.5).astype(dtype)
  scale = 1.0 + 0.3 * jax.random.normal(ks, (24,))
  bias = 0.3 * jax.random.normal(kb, (24,))
  g = jax.random.normal(kg, (2, 7, 24) if cotangent == "random" else (24,))
  ref_ln = nn.LayerNorm(epsilon=1e-6)

  def loss(fn):
    return lambda x, s, b: jnp.sum(fn(x, s, b).astype(jnp.float32) * g)

  ours = jax.jit(jax.value_and_grad(loss(vit.layer_norm), argnums=(0, 1, 2)))(
      x, scale, bias
  )
  ref = jax.jit(
      jax.value_and_grad(
          loss(
              lambda x, s, b: ref_ln.apply(
                  {"params": {"scale": s, "bias": b}}, x
              )
          ),
          argnums=(0, 1, 2),
      )
  )(x, scale, bias)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(
        np.asarray(a, np.float32),
        np.asarray(b, np.float32),
        atol=tol * max(1.0, float(np.abs(np.asarray(b, np.float32)).max())),
        rtol=tol,
    )
  # The module form keeps flax's param names and logical axes.
  params = vit.LayerNorm().init(jax.random.key(0), x)["params"]
  assert set(params) == {"scale", "bias"} and params["scale"].names == (
      "embed",
  )


def test_gelu_exact_matches_jax_values_and_grads():
  """gelu_exact (hand-written backward) against jax.nn.gelu(approximate=False) + autodiff."""
  x = 4.0 * jax.random.normal(jax.random.key(5), (3, 50))
  g = jax.random.normal(jax.random.key(6), (3, 50))

  def loss(fn):
    return lambda x: jnp.sum(fn(x) * g)

  ours = jax.jit(jax.value_and_grad(loss(vit.gelu_exact)))(x)
  ref = jax.jit(
      jax.value_and_grad(loss(lambda x: jax.nn.gelu(x, approximate=False)))
  )(x)
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tq,tk", [(13, 13), (1, 13), (16, 16)])
def test_padded_attention_is_the_unpadded_one(tq, tk):
  """cuDNN's input layout (tokens padded, padded keys masked, padded rows dropped), on CPU
  with jax's XLA implementation: the same values and gradients as no padding at all.
  """
  kq, kk, kv, kg = jax.random.split(jax.random.key(5), 4)
  q = jax.random.normal(kq, (2, tq, 3, 8))
  k, v = (jax.random.normal(r, (2, tk, 3, 8)) for r in (kk, kv))
  g = jax.random.normal(kg, (2, tq, 3, 8))

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * g)

  padded = lambda q, k, v: vit.padded_attention(
      q, k, v, implementation="xla", multiple=8
  )
  got = jax.value_and_grad(loss(padded), argnums=(0, 1, 2))(q, k, v)
  want = jax.value_and_grad(loss(vit.dot_product_attention), argnums=(0, 1, 2))(
      q, k, v
  )
  assert padded(q, k, v).shape == q.shape
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def test_attention_kinds_give_one_model():
  """attention=custom|xla|auto: the same params (checkpoints load either way) and logits."""
  model, params = _init(attention="custom")
  # (the logits of a zero-init head are 0)
  encoded = _apply(model, params)[1]["encoded"]
  assert model.resolved_attention() == "custom"
  for kind in ("xla", "auto"):
    other, other_params = _init(attention=kind)
    assert jax.tree.structure(other_params) == jax.tree.structure(params)
    np.testing.assert_allclose(
        _apply(other, params)[1]["encoded"], encoded, atol=2e-5, rtol=2e-5
    )
  # CPU
  assert (
      vit.Model(num_classes=1, variant="B/16").resolved_attention() == "custom"
  )
  # no remat by default
  assert vit.Model(num_classes=1, variant="B/16").remat_policy is None


def test_bf16_residual_stream_is_close():
  model, params = _init(dtype_mm="bfloat16")
  out = _apply(model, params)[1]
  act, _ = _init(dtype_mm="bfloat16", dtype_act="bfloat16")
  out_bf16 = _apply(act, params)[1]
  assert (
      out["block00"].dtype == jnp.float32
      and out_bf16["block00"].dtype == jnp.bfloat16
  )
  np.testing.assert_allclose(
      out_bf16["encoded"], out["encoded"], atol=6e-2, rtol=6e-2
  )
  assert not np.array_equal(out_bf16["encoded"], out["encoded"])


def test_uncommon_options_build():
  # bf16 matmuls, a pre_logits layer, no head and a conv stem, together.
  model, params = _init(
      dtype_mm="bfloat16", rep_size=True, num_classes=0, stem_channels=(4,)
  )
  shapes = {
      k: v.shape for k, v in layout.to_numpy_flat(nn.meta.unbox(params)).items()
  }
  assert shapes["stem/conv_0/kernel"] == (3, 3, 3, 4)  # RGB in, 4 channels out
  # patchifies the stem's 4 channels
  assert shapes["embedding/kernel"] == (4, 4, 4, 32)
  assert shapes["pre_logits/kernel"] == (32, 32)  # rep_size=True: the width
  # num_classes=0: no head
  assert not any(k.startswith("head/") for k in shapes)
  logits, out = _apply(model, nn.meta.unbox(params))
  assert logits.shape == (2, 32)
  # params stay float32
  assert params["pre_logits"]["kernel"].value.dtype == jnp.float32
  # The logits are the pre-logits: tanh(pooled @ kernel + bias), recomputed here
  # in float32 from the pooled tokens (bf16 matmul inputs: to bf16's precision).
  rep = nn.meta.unbox(params)["pre_logits"]
  want = np.tanh(
      np.asarray(out["head_input"], np.float32) @ np.asarray(rep["kernel"])
      + np.asarray(rep["bias"])
  )
  np.testing.assert_allclose(np.asarray(logits, np.float32), want, atol=2e-2)
  np.testing.assert_array_equal(logits, out["pre_logits"])
  # (not a vacuous comparison of near-zero values)
  assert np.abs(want).max() > 0.1
