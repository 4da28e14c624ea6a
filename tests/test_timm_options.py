"""timm interop of the ViT block options (models/timm.py, export.py, evaluate's model inference).

Parity with real timm (benchmarks/timm_parity.py's opt_* cases) runs wherever torch+timm are
installed (scripts/setup.sh installs them) and fails in CI when they are not (timm_reference).
"""

import os
import sys

import jax
import numpy as np
import pytest

from big_vit_lite import export
from big_vit_lite.models import layout
from big_vit_lite.models import timm
from big_vit_lite.models import vit
from big_vit_lite.models import loading

import checks
import timm_reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
try:
  import timm_parity  # pylint: disable=g-import-not-at-top
finally:
  sys.path.pop(0)

ALL_SERIAL = timm_parity.OPTIONS["all_serial"]
ALL_PARALLEL = timm_parity.OPTIONS["all_parallel_map"]
# Each option alone, then together (serial, parallel, DeiT's).
CASES = list(timm_parity.OPTIONS.values())
IDS = list(timm_parity.OPTIONS)
IMAGES = np.asarray(
    jax.random.uniform(jax.random.key(7), (2, 16, 16, 3), minval=-1, maxval=1)
)


@pytest.mark.parametrize("opts", CASES, ids=IDS)
def test_timm_state_dict_round_trips_every_option(opts):
  params = checks.vit_params(**opts)
  sd, kwargs = timm.to_timm(params)
  flat = layout.to_numpy_flat(params)
  checks.assert_same_params(
      timm.from_timm(sd, num_heads=2, grid_tokens=16), flat
  )
  # Each option is said to timm, and only then; and it is no registered plain
  # ViT.
  said = {
      "reg_tokens": kwargs.get("reg_tokens"),
      "qk_norm": kwargs.get("qk_norm"),
      "layerscale_init": kwargs.get("init_values"),
      "mlp": kwargs.get("mlp_layer"),
      "norm": kwargs.get("norm_layer"),
      "parallel_block": kwargs.get("block_fn"),
      "use_bias": kwargs.get("qkv_bias"),
      "distill_token": kwargs.get("distilled"),
  }
  assert {k for k, v in said.items() if v is not None} == set(opts) - {
      "pool_type"
  }
  assert timm.timm_model_name(kwargs) is None
  # And the model options evaluate infers from the params are the ones it was
  # built with.
  inferred = loading.infer_model_cfg(flat)
  assert {k: inferred.get(k) for k in opts if k != "layerscale_init"} == {
      k: v for k, v in opts.items() if k != "layerscale_init"
  }


def test_timm_names_of_the_options():
  sd, kwargs = timm.to_timm(checks.vit_params(**ALL_SERIAL))
  for name in (
      "reg_token",
      "blocks.1.attn.q_norm.weight",
      "blocks.1.attn.k_norm.weight",
      "blocks.1.ls1.gamma",
      "blocks.1.ls2.gamma",
      "blocks.1.mlp.fc1_g.weight",
      "blocks.1.mlp.fc1_x.weight",
  ):
    assert name in sd, name
  assert not any(k.endswith("bias") for k in sd if k.startswith("blocks."))
  assert "norm.bias" not in sd
  assert (kwargs["mlp_layer"], kwargs["act_layer"], kwargs["norm_layer"]) == (
      "SwiGLU",
      "silu",
      "rmsnorm",
  )
  # pos_embed: cls row, a zero row per register, the grid (timm adds it to the
  # registers too).
  assert sd["pos_embed"].shape == (1, 1 + 2 + 16, 32)
  np.testing.assert_array_equal(sd["pos_embed"][0, 1:3], 0)
  sd, kwargs = timm.to_timm(checks.vit_params(**ALL_PARALLEL))
  mlp_dim, d = 64, 32
  assert sd["blocks.0.in_proj.weight"].shape == (mlp_dim + 3 * d, d)
  np.testing.assert_array_equal(sd["blocks.0.mlp_bias"], np.zeros(mlp_dim))
  assert (
      "blocks.0.ls.gamma" in sd and kwargs["block_fn"] == "ParallelScalingBlock"
  )
  usage = timm.timm_usage(kwargs, "m.safetensors")
  assert "block_fn=timm.models.vision_transformer.ParallelScalingBlock" in usage


def test_timm_register_posemb_rows_fold_into_the_registers():
  """A timm file whose registers have pos_embed rows (no_embed_class=False, non-zero): a
  register is a constant token, so reg_token + its row is the same model."""
  params = checks.vit_params(reg_tokens=2)
  sd, _ = timm.to_timm(params)
  shift = np.random.default_rng(0).normal(size=(1, 2, 32)).astype(np.float32)
  sd = dict(sd, reg_token=sd["reg_token"] - shift)
  sd["pos_embed"] = sd["pos_embed"].copy()
  sd["pos_embed"][:, 1:3] += shift
  back = timm.from_timm(sd, num_heads=2, grid_tokens=16)
  np.testing.assert_allclose(
      back["reg"], layout.to_numpy_flat(params)["reg"], atol=1e-6
  )
  # timm's reg models (no_embed_class=True): the grid rows only; the cls row is
  # zero.
  sd = dict(sd, pos_embed=sd["pos_embed"][:, 3:])
  assert timm.from_timm(sd, num_heads=2, grid_tokens=16)[
      checks.POSEMB
  ].shape == (1, 17, 32)


def test_timm_refusals_of_the_options():
  checks.one_line_error(
      lambda: timm.to_timm(
          checks.vit_params(parallel_block=True, mlp="swiglu")
      ),
      "ParallelScalingBlock",
      "mlp='gelu'",
  )
  checks.one_line_error(
      lambda: timm.to_timm(checks.vit_params(distill_token=True, reg_tokens=1)),
      "VisionTransformerDistilled has no register tokens",
      "reg_tokens=0",
  )
  sd, _ = timm.to_timm(checks.vit_params(parallel_block=True, use_bias=False))
  sd["blocks.1.mlp_bias"] = sd["blocks.1.mlp_bias"] + 1
  checks.one_line_error(
      lambda: timm.from_timm(sd, 2, 16), "blocks.1.mlp_bias", "use_bias=False"
  )


def test_export_timm_file_evaluates_as_the_same_model(tmp_path):
  params = checks.vit_params(**ALL_SERIAL)
  want = checks.tiny_vit(**ALL_SERIAL).apply({"params": params}, IMAGES)[0]
  vit.save_npz(params, tmp_path / "m.npz")
  summary = export.export(
      str(tmp_path / "m.npz"), str(tmp_path / "m.safetensors")
  )
  assert "mlp_layer=timm.layers.SwiGLU" in summary["timm_usage"]
  flat, _, _ = loading.read_source(str(tmp_path / "m.safetensors"))
  cfg = loading.infer_model_cfg(flat)
  model = vit.Model(num_classes=10, **cfg)
  loaded = vit.load(
      jax.eval_shape(model.init, jax.random.key(0), IMAGES)["params"],
      tmp_path / "m.safetensors",
      cfg,
  )
  got = model.apply({"params": loaded}, IMAGES)[0]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(300)
def test_option_parity_with_real_timm(tmp_path):
  """Each option's export gives real timm's logits within 1e-5 (skipped without timm, not in CI).

  Guards against an export that names, transposes, splits or scales an option's params wrong
  (or builds the wrong timm class): benchmarks/timm_parity.py's opt_* cases (its models, its
  perturbed random params, its timm loader) in this process; our logits op by op rather than
  jitted, which spares a compile per case.
  """
  timm_reference.require()  # Skips where torch/timm are missing, except in CI.
  for i, name in enumerate(timm_parity.OPTION_CASES):
    model, params, images = timm_parity.our_case(name, i)
    ours = np.asarray(model.apply({"params": params}, images)[0])
    path = tmp_path / f"{name}.safetensors"
    timm.write_timm(params, path, image_size=images.shape[1])
    theirs = timm_parity.timm_logits(path, images)
    # (a zero head would make any two models agree)
    assert np.abs(ours).max() > 0.1, name
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0, err_msg=name)


def test_timm_distill_token_names_posemb_and_class():
  """DeiT's layout: dist_token after cls_token, a pos_embed row for each, head_dist; built by
  VisionTransformerDistilled. timm's no_embed_class files (grid rows only) load with zero
  rows for both tokens."""
  params = checks.vit_params(distill_token=True)
  flat = layout.to_numpy_flat(params)
  sd, kwargs = timm.to_timm(params)
  np.testing.assert_array_equal(sd["dist_token"], flat["dist"])
  np.testing.assert_array_equal(
      sd["head_dist.weight"], flat["head_dist/kernel"].T
  )
  assert sd["pos_embed"].shape == (1, 2 + 16, 32)
  usage = timm.timm_usage(kwargs, "m.safetensors")
  assert usage.startswith("m = timm.models.deit.VisionTransformerDistilled(")
  assert "distilled" not in usage
  grid_only = dict(sd, pos_embed=sd["pos_embed"][:, 2:])
  back = timm.from_timm(grid_only, num_heads=2, grid_tokens=16)
  np.testing.assert_array_equal(back[checks.POSEMB][:, :2], 0)
  np.testing.assert_array_equal(
      back[checks.POSEMB][:, 2:], flat[checks.POSEMB][:, 2:]
  )
