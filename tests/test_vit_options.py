"""ViT block options (reg_tokens, qk_norm, layerscale_init, mlp, norm, parallel_block, use_bias)
and DeiT's distillation token (distill_token).

The oracle is a float64 numpy transcription of the model written from the papers' formulas
(`_np_forward`), not the flax code; scan/loop, remat, attention kinds, bf16, .npz round trips
and logical axis names are checked against the loop/f32/custom model.
"""

import flax.linen as nn
import jax
import numpy as np
import pytest
from scipy.special import erf

from big_vit_lite.models import layout
from big_vit_lite.models import ops
from big_vit_lite.models import vit
from big_vit_lite.models import loading

import checks

IMAGES = np.asarray(
    jax.random.uniform(jax.random.key(7), (2, 16, 16, 3), minval=-1, maxval=1)
)
HEADS = 2
ALL = dict(
    reg_tokens=3,
    qk_norm=True,
    layerscale_init=0.1,
    mlp="swiglu",
    norm="rmsnorm",
    parallel_block=True,
    use_bias=False,
)
ONE_BY_ONE = [
    dict(reg_tokens=2),
    dict(qk_norm=True),
    dict(layerscale_init=0.5),
    dict(mlp="swiglu"),
    dict(norm="rmsnorm"),
    dict(parallel_block=True),
    dict(use_bias=False),
]


def _np_norm(x, f, name, kind):
  if kind == "rmsnorm":  # x / sqrt(mean(x^2) + eps) * scale
    return (
        x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * f[f"{name}/scale"]
    )
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + 1e-6) * f[f"{name}/scale"] + f[f"{name}/bias"]


def _np_dense(x, f, name, spec):
  y = np.einsum(spec, x, f[f"{name}/kernel"])
  return y + f[f"{name}/bias"] if f"{name}/bias" in f else y


def _np_attention(y, f, pre, kind, qk_norm):
  q, k, v = (
      _np_dense(y, f, f"{pre}/{n}", "btd,dnh->btnh")
      for n in ("query", "key", "value")
  )
  if qk_norm:  # over each head's D/H features
    q, k = _np_norm(q, f, f"{pre}/query_norm", kind), _np_norm(
        k, f, f"{pre}/key_norm", kind
    )
  logits = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return _np_dense(
      np.einsum("bnqk,bknh->bqnh", probs, v), f, f"{pre}/out", "btnh,nhd->btd"
  )


def _np_mlp(y, f, pre, mlp):
  h = _np_dense(y, f, f"{pre}/Dense_0", "btd,dm->btm")
  if mlp == "swiglu":  # silu(x W_gate) * (x W_0)
    g = _np_dense(y, f, f"{pre}/Dense_gate", "btd,dm->btm")
    h = g / (1 + np.exp(-g)) * h
  else:
    h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
  return _np_dense(h, f, f"{pre}/Dense_1", "btm,md->btd")


def _np_forward(
    f,
    x,
    reg_tokens=0,
    qk_norm=False,
    layerscale_init=None,
    mlp="gelu",
    norm="layernorm",
    parallel_block=False,
    use_bias=True,
    pool_type="tok",
    distill_token=False,
):
  """(logits, tokens seen by the first block) of loop-layout params `f` (float64).

  distill_token: DeiT's second token after the class token, with its own posemb row and
  head; the logits are the mean of the two heads' (written from the paper, not the code).
  """
  del use_bias  # (absent biases are absent params)
  f = {k: np.asarray(v, np.float64) for k, v in f.items()}
  p = f["embedding/kernel"].shape[0]
  b, h, w, c = x.shape
  patches = np.asarray(x, np.float64).reshape(b, h // p, p, w // p, p, c)
  t = (
      np.einsum("bhpwqc,pqcd->bhwd", patches, f["embedding/kernel"])
      + f["embedding/bias"]
  )
  t = t.reshape(b, (h // p) * (w // p), -1)
  n_cls = int("cls" in f)
  if n_cls:
    t = np.concatenate([np.broadcast_to(f["cls"], (b, 1, t.shape[-1])), t], 1)
  if distill_token:  # after the class token
    dist = np.broadcast_to(f["dist"], (b, 1, t.shape[-1]))
    t = np.concatenate([t[:, :1], dist, t[:, 1:]], 1)
    n_cls = 2
  t = t + f["Transformer/posembed_input/pos_embedding"]
  if reg_tokens:  # registers after the class token, no posemb
    regs = np.broadcast_to(f["reg"], (b, reg_tokens, t.shape[-1]))
    t = np.concatenate([t[:, :n_cls], regs, t[:, n_cls:]], 1)
  first_block_input = t
  depth = len(
      {k.split("/")[1] for k in f if k.startswith("Transformer/encoderblock_")}
  )
  ls = (
      (lambda y, pre, i: y * f[f"{pre}/LayerScale_{i}/scale"])
      if layerscale_init
      else (lambda y, pre, i: y)
  )
  for i in range(depth):
    pre = f"Transformer/encoderblock_{i}"
    y = _np_norm(t, f, f"{pre}/LayerNorm_0", norm)
    attn = _np_attention(
        y, f, f"{pre}/MultiHeadDotProductAttention_0", norm, qk_norm
    )
    if parallel_block:  # x + ls(attn(norm(x)) + mlp(norm(x)))
      t = t + ls(attn + _np_mlp(y, f, f"{pre}/MlpBlock_0", mlp), pre, 0)
    else:
      t = t + ls(attn, pre, 0)
      y = _np_norm(t, f, f"{pre}/LayerNorm_1", norm)
      t = t + ls(_np_mlp(y, f, f"{pre}/MlpBlock_0", mlp), pre, 1)
  t = _np_norm(t, f, "Transformer/encoder_norm", norm)
  # registers dropped
  t = np.concatenate([t[:, :n_cls], t[:, n_cls + reg_tokens :]], 1)
  pooled = t[:, 0] if pool_type == "tok" else t.mean(1)
  logits = pooled @ f["head/kernel"] + f["head/bias"]
  if distill_token:
    dist_logits = t[:, 1] @ f["head_dist/kernel"] + f["head_dist/bias"]
    logits = (logits + dist_logits) / 2
  return logits, first_block_input


def _params(**kw):
  return layout.to_numpy_flat(checks.vit_params(**kw))


def _apply(params, images=IMAGES, **kw):
  model = checks.tiny_vit(**kw)
  return jax.jit(lambda p, x: model.apply({"params": p}, x))(params, images)


def test_rms_norm_by_hand():
  x = np.array([[3.0, -4.0, 0.0, 0.0]])  # mean square 25/4: rms 2.5
  scale = np.array([1.0, 2.0, 3.0, 4.0])
  want = np.array([[3 / 2.5, -4 / 2.5 * 2, 0.0, 0.0]])
  np.testing.assert_allclose(ops.rms_norm(x, scale, eps=0.0), want, rtol=1e-6)


@pytest.mark.parametrize(
    "opts",
    ONE_BY_ONE
    + [
        ALL,
        dict(ALL, parallel_block=False),
        dict(ALL, pool_type="gap", mlp="gelu"),
        dict(distill_token=True),
        dict(ALL, distill_token=True),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_each_option_matches_the_numpy_transcription(opts):
  flat = _params(**opts)
  logits, out = _apply(layout.unflatten(flat), **opts)
  want, first_input = _np_forward(flat, IMAGES, **opts)
  np.testing.assert_allclose(logits, want, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(
      out["with_posemb"], first_input, atol=1e-5, rtol=1e-5
  )


def test_register_tokens_count_in_the_sequence_and_pooling_ignores_them():
  n_reg, patches = 3, 16
  flat = _params(reg_tokens=n_reg, pool_type="gap")
  logits, out = _apply(
      layout.unflatten(flat), reg_tokens=n_reg, pool_type="gap"
  )
  assert out["block00"].shape == (2, patches + n_reg, 32)
  assert out["encoded"].shape == (2, patches, 32)
  np.testing.assert_allclose(
      out["head_input"], out["encoded"].mean(1), atol=1e-6
  )
  # The registers take part in attention: other register values, other logits.
  other = dict(
      flat, reg=np.random.default_rng(1).normal(size=flat["reg"].shape)
  )
  assert (
      np.abs(
          _apply(layout.unflatten(other), reg_tokens=n_reg, pool_type="gap")[0]
          - logits
      ).max()
      > 1e-4
  )
  # A class token stays first and is what "tok" pools.
  _, out = _apply(checks.vit_params(reg_tokens=n_reg), reg_tokens=n_reg)
  assert out["block00"].shape == (2, 1 + n_reg + patches, 32)
  np.testing.assert_array_equal(out["head_input"], out["encoded"][:, 0])


@pytest.mark.slow
@pytest.mark.parametrize(
    "opts",
    [ALL, dict(ALL, parallel_block=False, pool_type="map")],
    ids=["parallel", "serial_map"],
)
def test_options_under_scan_remat_attention_kinds_and_npz(tmp_path, opts):
  loop_params = checks.vit_params(**opts)
  want, _ = _apply(loop_params, **opts)
  vit.save_npz(loop_params, tmp_path / "p.npz")
  for kw in (
      dict(scan=True),
      dict(scan=True, remat_policy="nothing_saveable"),
      dict(attention="xla"),
      dict(remat_policy="nothing_saveable"),
  ):
    init = checks.vit_shapes(**opts, **kw)
    params = nn.meta.unbox(vit.load(init, tmp_path / "p.npz"))
    np.testing.assert_allclose(
        _apply(params, **opts, **kw)[0],
        want,
        atol=1e-5,
        rtol=1e-5,
        err_msg=str(kw),
    )
    # Gradients flow to every param (remat and scan included).
    model = checks.tiny_vit(**opts, **kw)
    grads = jax.jit(
        jax.grad(lambda p: model.apply({"params": p}, IMAGES)[0].sum())
    )(params)
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads)), kw
  bf16 = _apply(loop_params, **opts, dtype_mm="bfloat16", dtype_act="bfloat16")[
      0
  ]
  np.testing.assert_allclose(bf16, want, atol=0.1 * np.abs(want).max())
  # And back from the scan layout: .npz round trips every option bit for bit.
  scan_params = vit.load(
      checks.vit_shapes(**opts, scan=True), tmp_path / "p.npz"
  )
  vit.save_npz(scan_params, tmp_path / "back.npz")
  with np.load(tmp_path / "back.npz") as f:
    checks.assert_same_params(
        {k: f[k] for k in f.files}, layout.to_numpy_flat(loop_params)
    )


@pytest.mark.parametrize("scan", [False, True])
def test_new_params_carry_logical_axis_names(scan):
  boxed = checks.vit_shapes(**ALL, scan=scan)
  names = {k: v.names for k, v in layout.flatten(boxed).items()}
  lead = ("layers",) if scan else ()
  block = "Transformer/encoderblock" + ("" if scan else "_0")
  assert names[
      f"{block}/MultiHeadDotProductAttention_0/query_norm/scale"
  ] == lead + ("kv",)
  assert names[f"{block}/LayerScale_0/scale"] == lead + ("embed",)
  assert names[f"{block}/MlpBlock_0/Dense_gate/kernel"] == lead + (
      "embed",
      "mlp",
  )
  assert names["reg"] == (None, None, "embed")
  shapes = layout.flatten(nn.meta.unbox(boxed))
  assert all(len(names[k]) == len(shapes[k].shape) for k in names)
  # use_bias=False: no bias in the blocks' projections; rmsnorm: no norm bias
  # anywhere.
  assert not any(
      k.endswith("bias") for k in names if k.startswith("Transformer/")
  )


def test_options_leave_the_tree_they_do_not_touch():
  base = set(layout.flatten(checks.vit_shapes()))
  added = {
      "reg_tokens": ("reg",),
      "layerscale_init": ("/LayerScale_0/scale", "/LayerScale_1/scale"),
      "qk_norm": (
          "/query_norm/scale",
          "/query_norm/bias",
          "/key_norm/scale",
          "/key_norm/bias",
      ),
      "mlp": ("/Dense_gate/kernel", "/Dense_gate/bias"),
  }
  for opts in ONE_BY_ONE:
    ((name, _),) = opts.items()
    tree = set(layout.flatten(checks.vit_shapes(**opts)))
    if name in added:
      assert tree > base and all(
          k.endswith(added[name]) for k in tree - base
      ), name
    else:  # norm, parallel_block and use_bias only remove params
      assert tree < base, name
  tree = set(layout.flatten(checks.vit_shapes(distill_token=True)))
  assert tree - base == {"dist", "head_dist/kernel", "head_dist/bias"}


def test_bad_option_values_are_one_line_errors():
  for kw, words in (
      (dict(mlp="relu"), ("mlp='relu'", "swiglu")),
      (dict(norm="batchnorm"), ("norm='batchnorm'", "rmsnorm")),
      (dict(reg_tokens=-1), ("reg_tokens=-1",)),
      (
          dict(distill_token=True, pool_type="gap"),
          ("distill_token=True with pool_type='gap'", "'tok'"),
      ),
      (dict(distill_token=True, rep_size=8), ("rep_size=8", "no rep_size")),
  ):
    checks.one_line_error(lambda: checks.vit_shapes(**kw), *words)


def _hand_train_flops(
    *, batch, res, patch, width, depth, mlp_dim, classes, tokens, mlp_mats
):
  """2 x multiply-adds of a train step (forward, and backward 2x it less the image's gradient):
  per block q/k/v/out 4 T D^2, MLP mlp_mats T D M (SwiGLU: gate, value and out: 3), scores and
  weighted sum 2 T^2 D; patch embedding P^2 C D per patch; head D K."""
  block = 2 * (
      4 * tokens * width**2
      + mlp_mats * tokens * width * mlp_dim
      + 2 * tokens**2 * width
  )
  embed = 2 * (res // patch) ** 2 * patch * patch * 3 * width
  return batch * (3 * (depth * block + embed + 2 * width * classes) - embed)


@pytest.mark.parametrize(
    "opts", ONE_BY_ONE + [dict(ALL, pool_type="gap")], ids=lambda o: ",".join(o)
)
def test_model_flops_of_each_option_are_the_hand_count(opts):
  import test_flops  # pylint: disable=import-outside-toplevel
  from big_vit_lite.runtime import flops  # pylint: disable=import-outside-toplevel

  model = checks.tiny_vit(**opts)
  jaxpr, _ = test_flops._train_step_jaxpr(model, 2, 16, 10)  # pylint: disable=protected-access
  tokens = (
      16 + (opts.get("pool_type", "tok") == "tok") + opts.get("reg_tokens", 0)
  )
  want = _hand_train_flops(
      batch=2,
      res=16,
      patch=4,
      width=32,
      depth=2,
      mlp_dim=64,
      classes=10,
      tokens=tokens,
      mlp_mats=3 if opts.get("mlp") == "swiglu" else 2,
  )
  # what bench and the trainer count for MFU
  assert flops.matmul_flops(jaxpr)[0] == want
  arch = dict(model.arch(), mlp=model.mlp)
  assert (
      flops.vit_train_flops(
          arch, batch=2, tokens=tokens, patches=16, num_classes=10
      )
      == want
  )


def test_plan_counts_registers_and_swiglu():
  import test_plan  # pylint: disable=import-outside-toplevel
  from big_vit_lite.planner import plan  # pylint: disable=import-outside-toplevel

  config = test_plan._big_config("mu/16", 8)  # pylint: disable=protected-access
  config.model.update(reg_tokens=4, mlp="swiglu", remat_policy=None)
  p = plan.plan(config, {"data": 1}, "h100")
  assert p["tokens"] == 196 + 1 + 4
  assert p["flops_per_step"] == _hand_train_flops(
      batch=8,
      res=224,
      patch=16,
      width=32,
      depth=1,
      mlp_dim=128,
      classes=1000,
      tokens=201,
      mlp_mats=3,
  )


def test_distill_token_heads_npz_round_trip_and_inference(tmp_path):
  """The two heads apart in `out`, the logits their mean; .npz and the param-name reader
  (what evaluate builds a teacher from) keep the token."""

  params = checks.vit_params(distill_token=True)
  logits, out = _apply(params, distill_token=True)
  flat = layout.to_numpy_flat(params)
  encoded = np.asarray(out["encoded"], np.float64)
  for key, token, head in (
      ("logits_cls", 0, "head"),
      ("logits_dist", 1, "head_dist"),
  ):
    want = encoded[:, token] @ flat[f"{head}/kernel"] + flat[f"{head}/bias"]
    np.testing.assert_allclose(out[key], want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(
      logits, (out["logits_cls"] + out["logits_dist"]) / 2, atol=1e-6
  )
  vit.save_npz(params, tmp_path / "p.npz")
  for kw in (dict(), dict(scan=True)):
    loaded = vit.load(
        checks.vit_shapes(distill_token=True, **kw), tmp_path / "p.npz"
    )
    np.testing.assert_allclose(
        _apply(nn.meta.unbox(loaded), distill_token=True, **kw)[0],
        logits,
        atol=1e-5,
    )
  cfg = loading.infer_model_cfg(flat)
  assert cfg["distill_token"] is True and cfg["pool_type"] == "tok"
  assert loading.native_input_shape(flat, None) == (16, 3)
  # A model without the token refuses the file in one line (it is another
  # model).
  checks.one_line_error(
      lambda: vit.load(checks.vit_shapes(), tmp_path / "p.npz"),
      "'dist'",
      "dont_load",
  )
