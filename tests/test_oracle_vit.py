"""models/vit.py's Model methods outside its @nn.compact __call__ (which
mutation testing cannot reach): the attention and dtype choices by backend,
the architecture a variant resolves to, the option checks, the classifier
head's initial values and DeiT's two heads, against hand-worked tables (the
docstrings' rules, the paper's Table 1), statistics of the initialiser's draw
and a numpy recomputation of the heads from the encoder's output.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite.models import blocks
from big_vit_lite.models import layout
from big_vit_lite.models import vit

import checks

TINY = dict(
    variant=None, width=16, depth=1, mlp_dim=32, num_heads=2, patch_size=8
)
IMAGES = np.asarray(
    jax.random.uniform(jax.random.key(3), (3, 16, 16, 3), minval=-1, maxval=1)
)


def _shapes(**kw):
  model = vit.Model(**{"num_classes": 4, **TINY, **kw})
  return jax.eval_shape(model.init, jax.random.key(0), IMAGES[:1])["params"]


def test_resolved_attention_is_the_docstring_table():
  """Guards: cuDNN flash attention chosen off a CUDA GPU (or never on one),
  for float32 matmuls, for a head dim outside 8, 16, ..., 256 (the bounds
  and the step of the range), the platform argument ignored, an explicit
  kind overridden by "auto"'s rule. Oracle: the rule of resolved_attention's
  docstring, written out per case."""
  cases = [
      # (attention, platform, dtype_mm, width, heads, expected)
      ("auto", "tpu", "float32", 64, 2, "xla"),
      ("auto", "cpu", "bfloat16", 64, 2, "custom"),
      ("auto", None, "bfloat16", 64, 2, "custom"),  # the tests' CPU
      ("auto", "gpu", "bfloat16", 64, 2, "cudnn"),
      ("auto", "gpu", "float16", 64, 2, "cudnn"),
      ("auto", "gpu", "auto", 64, 2, "cudnn"),  # "auto" is bf16 on a GPU
      ("auto", "gpu", "float32", 64, 2, "custom"),
      ("auto", "gpu", "bfloat16", 16, 2, "cudnn"),  # head dim 8
      ("auto", "gpu", "bfloat16", 512, 2, "cudnn"),  # head dim 256
      ("auto", "gpu", "bfloat16", 528, 2, "custom"),  # head dim 264
      ("auto", "gpu", "bfloat16", 24, 2, "custom"),  # head dim 12
      ("auto", "gpu", "bfloat16", 8, 2, "custom"),  # head dim 4
      ("xla", "gpu", "bfloat16", 64, 2, "xla"),
      ("custom", "tpu", "float32", 64, 2, "custom"),
      ("cudnn", "cpu", "float32", 64, 2, "cudnn"),
  ]
  for attention, platform, dtype_mm, width, heads, expected in cases:
    model = vit.Model(
        num_classes=1,
        variant="S/16",
        width=width,
        num_heads=heads,
        attention=attention,
        dtype_mm=dtype_mm,
    )
    got = model.resolved_attention(platform)
    assert got == expected, (attention, platform, dtype_mm, width, got)


def test_resolved_dtypes_and_block_options_are_the_models_own():
  """Guards: the backend not passed on to the dtype rules ("auto" decided for
  jax's default backend instead of the one asked about), a block option not
  handed to the blocks (qk_norm, layer scale, register tokens dropped on the
  way). Oracle: the rules' table (blocks.py's docstrings) and the fields
  set here."""
  model = vit.Model(num_classes=1, dtype_mm="auto", dtype_act="auto")
  assert model.resolved_dtype_mm("gpu") == "bfloat16"
  assert model.resolved_dtype_mm("cpu") == "float32"
  assert model.resolved_dtype_act("tpu") == "bfloat16"
  assert model.resolved_dtype_act("gpu") == "float32"
  assert model.resolved_dtype_mm() == "float32"
  opts = dict(
      reg_tokens=3,
      qk_norm=True,
      layerscale_init=0.25,
      mlp="swiglu",
      norm="rmsnorm",
      parallel_block=True,
      use_bias=False,
  )
  got = vit.Model(num_classes=1, **opts).block_options()
  del opts["reg_tokens"]  # the model's own, not the blocks'
  assert got == blocks.BlockOptions(**opts)
  assert vit.Model(num_classes=1).block_options() == blocks.BlockOptions()


def test_arch_is_the_papers_table_with_overrides():
  """Guards: a variant's table row replaced or ignored, an explicit width
  (or any of the five) not overriding it, the patch size dropped. Oracle:
  ViT-B/16 and L/16 in Table 1 of Dosovitskiy et al. (2021)."""
  assert vit.Model(num_classes=1, variant="B/16").arch() == dict(
      width=768, depth=12, mlp_dim=3072, num_heads=12, patch_size=16
  )
  assert vit.Model(num_classes=1, variant="L/16", patch_size=14).arch() == (
      dict(width=1024, depth=24, mlp_dim=4096, num_heads=16, patch_size=14)
  )
  got = vit.Model(num_classes=1, variant="B/32", width=384, depth=2).arch()
  assert got == dict(
      width=384, depth=2, mlp_dim=3072, num_heads=12, patch_size=32
  )
  assert vit.Model(num_classes=1, **TINY).arch() == {
      k: v for k, v in TINY.items() if k != "variant"
  }


def test_every_allowed_option_value_builds_and_the_rest_fail_in_one_line():
  """Guards: an allowed value refused (a typo in a list of names, a check
  that fires for any pool type or any remat policy, a rate of 0 out of
  range), a bad value let through (a rate of 1, a negative or fractional
  register count, the distillation token with another pooling or a
  pre-logits layer). Oracle: the options' lists in Model's docstring."""
  allowed = [
      dict(posemb="sincos2d"),
      dict(pool_type="gap"),
      dict(pool_type="map"),
      dict(pool_type="tok", rep_size=8),
      dict(pool_type="gap", rep_size=True),
      dict(gelu="tanh"),
      dict(dtype_act="bfloat16"),
      dict(dtype_act="auto"),
      dict(attention="custom"),
      dict(attention="xla"),
      dict(mlp="swiglu"),
      dict(norm="rmsnorm"),
      dict(norm="layernorm"),
      dict(dropout=0.0, drop_path=0.0),
      dict(dropout=0.5, drop_path=0.99),
      dict(reg_tokens=0),
      dict(reg_tokens=2),
      dict(distill_token=True),
      dict(remat_policy="none"),
      dict(remat_policy="nothing_saveable"),
  ]
  for kw in allowed:
    _shapes(**kw)
  for kind in ("cudnn", "splash"):
    # They compile for a GPU / a TPU only; the option check lets them by.
    model = vit.Model(num_classes=1, **TINY, attention=kind)
    try:
      jax.eval_shape(model.init, jax.random.key(0), IMAGES[:1])
    except Exception as e:  # pylint: disable=broad-exception-caught
      assert "Unknown ViT" not in str(e), e
  refused = [
      (dict(attention="AUTO"), ("attention='AUTO'", "auto, custom")),
      (dict(pool_type="cls"), ("pool_type='cls'", "tok, gap, map")),
      (dict(norm="RMSNorm"), ("norm='RMSNorm'", "rmsnorm")),
      (dict(dtype_act="float16"), ("dtype_act='float16'", "bfloat16")),
      (dict(dropout=1.0), ("dropout=1.0", "[0, 1)", "config.model.dropout")),
      (dict(dropout=-0.1), ("dropout=-0.1",)),
      (dict(drop_path=1.0), ("drop_path=1.0", "stochastic-depth")),
      (dict(reg_tokens=1.5), ("reg_tokens=1.5", ">= 0")),
      (dict(reg_tokens=-2), ("reg_tokens=-2",)),
      (dict(distill_token=True, pool_type="map"), ("pool_type='map'",)),
      (dict(distill_token=True, rep_size=True), ("rep_size=True",)),
      (dict(remat_policy="everything"), ("remat_policy='everything'",)),
  ]
  for kw, words in refused:
    checks.one_line_error(lambda kw=kw: _shapes(**kw), *words)


def test_head_initial_values_are_zero_or_lecun_normal():
  """Guards: head_zeroinit=False drawing zeros (or head_zeroinit=True
  drawing), a default other than big_vision's zero head (a config that does
  not set head_zeroinit starts from a random head), another initialiser's scale (1/fan_out, 2/fan_in, a standard
  normal), a nonzero bias, the head's width not num_classes. Oracle:
  LeCun normal's variance 1/fan_in (LeCun et al. 1998; flax's truncated
  normal is rescaled to it); the sample std of 32 x 500 draws is within 3%
  of sqrt(1/32) at > 5 standard errors (its standard error ~ 0.6%)."""
  model = vit.Model(
      num_classes=500, **{**TINY, "width": 32}, head_zeroinit=False
  )
  init = jax.jit(model.init)
  params = nn.meta.unbox(init(jax.random.key(1), IMAGES[:1])["params"])
  kernel = np.asarray(params["head"]["kernel"], np.float64)
  assert kernel.shape == (32, 500)
  assert not np.any(params["head"]["bias"])
  np.testing.assert_allclose(kernel.std(), math.sqrt(1 / 32), rtol=0.03)
  assert abs(kernel.mean()) < 0.01
  # Unset: zeros, big_vision's default (vit.py's `head_zeroinit=True`).
  default = vit.Model(num_classes=500, **{**TINY, "width": 32})
  params = nn.meta.unbox(jax.jit(default.init)(jax.random.key(1), IMAGES[:1]))
  assert not np.any(params["params"]["head"]["kernel"])


def test_tokens_initial_values_are_timms():
  """Guards: register tokens drawn as zeros or one value (identical
  registers get identical updates forever: reg_tokens=8 trains as one),
  drawn at another scale, or the class token drawn instead of zero. Oracle:
  timm's init (VisionTransformer.init_weights: reg_token normal, std 1e-6;
  DeiT's dist_token std 0.02) and big_vision's (a zero cls token);
  8 x 32 register draws: the sample std within 25% of 1e-6 (> 5 standard
  errors of ~4.4%), 32 dist draws within a factor of 2."""
  model = vit.Model(
      num_classes=4, **{**TINY, "width": 32}, reg_tokens=8, distill_token=True
  )
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(2), IMAGES[:1]))
  params = params["params"]
  reg = np.asarray(params["reg"], np.float64)[0]
  assert reg.shape == (8, 32)
  np.testing.assert_allclose(reg.std(), 1e-6, rtol=0.25)
  assert len(np.unique(reg[:, 0])) == 8  # eight different registers
  assert not np.any(params["cls"])
  assert 0.01 < np.asarray(params["dist"]).std() < 0.04


def test_distilled_heads_by_hand_with_and_without_classes():
  """Guards: DeiT's logits not the mean of the two heads (their sum or
  difference, one head only), the heads swapped between the tokens, the
  pooled features of a headless distilled model not the mean of the two
  tokens, the named outputs dropped. Oracle: numpy on the encoder's output
  (timm's VisionTransformerDistilled: (head(x[:, 0]) + head_dist(x[:, 1])) / 2
  at inference)."""
  params = checks.vit_params(seed=4, distill_token=True, num_classes=3)
  model = checks.tiny_vit(distill_token=True, num_classes=3)
  logits, out = jax.jit(model.apply)({"params": params}, IMAGES)
  enc = np.asarray(out["encoded"], np.float64)
  flat = layout.to_numpy_flat(params)
  cls = enc[:, 0] @ flat["head/kernel"] + flat["head/bias"]
  dist = enc[:, 1] @ flat["head_dist/kernel"] + flat["head_dist/bias"]
  np.testing.assert_allclose(out["logits_cls"], cls, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out["logits_dist"], dist, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logits, (cls + dist) / 2, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out["logits"], logits)
  mean = (enc[:, 0] + enc[:, 1]) / 2
  np.testing.assert_allclose(out["pre_logits"], mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["head_input"], mean, rtol=1e-5, atol=1e-6)
  assert np.abs(cls - dist).min() > 1e-3  # heads that differ everywhere

  headless = checks.tiny_vit(distill_token=True, num_classes=0)
  params = checks.vit_params(seed=4, distill_token=True, num_classes=0)
  logits, out = jax.jit(headless.apply)({"params": params}, IMAGES)
  enc = np.asarray(out["encoded"], np.float64)
  mean = (enc[:, 0] + enc[:, 1]) / 2
  np.testing.assert_allclose(logits, mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(out["logits"], logits)
  assert "logits_cls" not in out and "head" not in params


def test_save_npz_and_load_pass_their_arguments_on(tmp_path):
  """Guards: load's dont_load or grid_hw not passed on (a head that should
  keep its init values overwritten; a non-square posemb resampled square),
  save_npz writing another file or nothing. Oracle: the saved arrays read
  back with numpy, the kept head compared with the init values."""
  params = checks.vit_params(seed=5)
  vit.save_npz(params, tmp_path / "p.npz")
  saved = dict(np.load(tmp_path / "p.npz"))
  flat = layout.to_numpy_flat(params)
  np.testing.assert_array_equal(saved["head/kernel"], flat["head/kernel"])
  init = checks.vit_params(seed=6)
  loaded = vit.load(init, tmp_path / "p.npz", None, dont_load=("head/.*",))
  np.testing.assert_array_equal(
      loaded["head"]["kernel"], init["head"]["kernel"]
  )
  np.testing.assert_array_equal(
      loaded["embedding"]["kernel"], params["embedding"]["kernel"]
  )
  # A 4 x 8 grid from the 4 x 4 one (16 x 16 images, patch 4): rows kept,
  # columns resampled; square resampling would refuse the 32 entries.
  wide = checks.vit_shapes(hw=(16, 32))
  loaded = vit.load(wide, tmp_path / "p.npz", grid_hw=(4, 8))
  posemb = nn.meta.unbox(loaded)["Transformer"]["posembed_input"][
      "pos_embedding"
  ]
  assert posemb.shape == (1, 1 + 32, flat[checks.POSEMB].shape[-1])
  np.testing.assert_array_equal(posemb[:, :1], flat[checks.POSEMB][:, :1])
