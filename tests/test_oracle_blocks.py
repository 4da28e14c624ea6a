"""models/blocks.py's helpers against hand-worked values: the dtype choices
by backend, the MLP's two GELUs against their closed forms in float64, and
stochastic depth (drop path) in train mode against its definition: a whole
example's branch kept with probability 1 - rate and then scaled by
1 / (1 - rate), as timm's DropPath does.
"""

import functools
import math
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import scipy.special

from big_vit_lite.models import blocks
from big_vit_lite.models import vit


def test_auto_dtypes_by_backend():
  """Guards: bfloat16 matmuls on the CPU (slow, and not the float32 the CPU
  tests assume), float32 on a GPU, a bfloat16 residual stream off a TPU, an
  explicit dtype overridden by "auto"'s rule. Oracle: the docstrings' table."""
  mm = {"cpu": "float32", "gpu": "bfloat16", "tpu": "bfloat16"}
  act = {"cpu": "float32", "gpu": "float32", "tpu": "bfloat16"}
  for platform in ("cpu", "gpu", "tpu"):
    assert blocks.resolve_dtype_mm("auto", platform) == mm[platform]
    assert blocks.resolve_dtype_act("auto", platform) == act[platform]
    assert blocks.resolve_dtype_mm("float16", platform) == "float16"
    assert blocks.resolve_dtype_act("float16", platform) == "float16"
  # No platform: jax's default backend, the CPU in the tests.
  assert blocks.resolve_dtype_mm("auto") == "float32"
  assert blocks.resolve_dtype_act("auto") == "float32"
  assert not blocks.on_cuda()


def _mlp_by_hand(params, x, gelu):
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  h = x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]
  if gelu == "exact":
    h = 0.5 * h * (1 + scipy.special.erf(h / math.sqrt(2)))
  else:
    c = math.sqrt(2 / math.pi)
    h = 0.5 * h * (1 + np.tanh(c * (h + 0.044715 * h**3)))
  return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def test_mlp_gelus_are_their_closed_forms():
  """Guards: the two GELUs swapped ("exact" running the tanh approximation or
  the other way round: 1e-3 apart at |x| ~ 2), the approximation flag
  dropped. Oracle: erf and tanh formulas in float64 numpy."""
  x = np.linspace(-3, 3, 24).reshape(1, 4, 6)
  for gelu in ("exact", "tanh"):
    mlp = blocks.MlpBlock(mlp_dim=16, gelu=gelu)
    params = mlp.init(jax.random.PRNGKey(0), jnp.asarray(x, jnp.float32))
    params = jax.tree.map(lambda a: a * 3.0, nn.meta.unbox(params["params"]))
    got = mlp.apply({"params": params}, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(
        got, _mlp_by_hand(params, x, gelu), rtol=1e-5, atol=1e-5
    )
    other = _mlp_by_hand(params, x, {"exact": "tanh", "tanh": "exact"}[gelu])
    assert np.abs(np.asarray(got) - other).max() > 1e-3


def _block(deterministic, **opts):
  return blocks.Encoder1DBlock(
      mlp_dim=8,
      num_heads=2,
      drop_path=True,
      deterministic=deterministic,
      opts=blocks.BlockOptions(parallel_block=True, **opts),
  )


def test_drop_path_drops_whole_examples_and_rescales_the_rest():
  """Guards: stochastic depth off in train mode, a keep rate of `rate`
  instead of 1 - rate, kept branches not scaled by 1 / keep (or scaled by
  1 / rate), one decision per token instead of per example, the same mask
  whatever the dropout key. Oracle: a parallel block's output is x +
  branch, the branch (eval mode) is kept whole or dropped whole per example;
  the dropped share is Binomial(n, rate), within 4 standard deviations."""
  n, rate = 400, 0.25
  x = jax.random.normal(jax.random.PRNGKey(0), (n, 3, 4))
  params = _block(True).init(jax.random.PRNGKey(1), x, rate)
  eval_out, _ = jax.jit(_block(True).apply)(params, x, rate)
  branch = np.asarray(eval_out - x, np.float64)
  train = jax.jit(
      lambda key: _block(False).apply(params, x, rate, rngs={"dropout": key})
  )
  train_out, _ = train(jax.random.PRNGKey(2))
  got = np.asarray(train_out - x, np.float64)
  dropped = np.all(np.abs(got) < 1e-6, axis=(1, 2))
  kept = np.all(
      np.abs(got - branch / (1 - rate)) < 1e-4 * (1 + np.abs(branch)),
      axis=(1, 2),
  )
  assert np.all(dropped | kept)  # whole examples, nothing in between
  sd = math.sqrt(n * rate * (1 - rate))
  assert abs(dropped.sum() - n * rate) < 4 * sd, dropped.sum()
  again, _ = train(jax.random.PRNGKey(3))
  assert not np.allclose(again, train_out)


def test_drop_path_rate_rises_linearly_from_zero_at_the_first_block():
  """Guards: the per-block stochastic-depth rates off by one (linspace over
  depth + 1 points, the first block dropped too), reversed (the last block
  never dropped), or one rate for every block. Oracle: the documented rule (timm's and
  big_vision's), rates 0, 0.3, 0.6 for depth 3 and drop_path 0.6; with
  parallel blocks a block's output equals its input exactly when its one
  branch is dropped. 300 examples: sd 0.026 at 0.3 and 0.028 at 0.6, the
  bound 4 sd; the first block is never dropped."""
  n = 300
  x = jax.random.normal(jax.random.PRNGKey(0), (n, 2, 4))
  encoder = blocks.Encoder(
      depth=3,
      mlp_dim=8,
      num_heads=2,
      drop_path=0.6,
      opts=blocks.BlockOptions(parallel_block=True),
  )
  params = encoder.init(jax.random.PRNGKey(1), x[:1], None, 0, train=False)
  _, out = jax.jit(
      lambda p: encoder.apply(
          p, x, None, 0, train=True, rngs={"dropout": jax.random.PRNGKey(2)}
      )
  )(params)
  block_input = out["with_posemb"]
  for i, rate in enumerate([0.0, 0.3, 0.6]):
    block_output = out[f"block{i:02d}"]
    dropped = np.all(np.asarray(block_output == block_input), axis=(1, 2))
    sd = math.sqrt(rate * (1 - rate) / n)
    assert abs(dropped.mean() - rate) <= 4 * sd, (i, dropped.mean())
    block_input = block_output


def test_layerscale_scales_the_branch_before_drop_path():
  """Guards: LayerScale left out when layerscale_init is set, or its init
  value not used. Oracle: the block is x + scale * branch, so with the same
  other params the branch of layerscale_init=0.1 is 0.1 times the plain
  one's."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 4))
  params = nn.meta.unbox(_block(True).init(jax.random.PRNGKey(1), x, 0.0))
  scaled = _block(True, layerscale_init=0.1)
  scaled_params = nn.meta.unbox(scaled.init(jax.random.PRNGKey(1), x, 0.0))
  np.testing.assert_allclose(
      scaled_params["params"]["LayerScale_0"]["scale"], np.full(4, 0.1)
  )
  plain_out, _ = _block(True).apply(params, x, 0.0)
  scaled_params["params"].update(params["params"])
  scaled_out, _ = scaled.apply(scaled_params, x, 0.0)
  np.testing.assert_allclose(
      scaled_out - x, 0.1 * (plain_out - x), rtol=1e-4, atol=1e-6
  )


def test_on_cuda_needs_a_gpu_backend_and_a_cuda_platform(monkeypatch):
  """Guards: cuDNN attention picked on a ROCm GPU (the `and` of the two checks
  turned into `or`) or on a CPU host whose jaxlib was built with CUDA (the
  backend check negated). Oracle: the four cases worked by hand, with the
  backend and its platform version faked."""
  for backend, version, want in [
      ("gpu", "cuda 12.4", True),
      ("gpu", "rocm 6.0", False),
      ("cpu", "cuda 12.4", False),
      ("cpu", "<unknown>", False),
  ]:
    monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
    monkeypatch.setattr(
        blocks.jex_backend,
        "get_backend",
        lambda v=version: types.SimpleNamespace(platform_version=v),
    )
    assert blocks.on_cuda() == want, (backend, version)


def _norm_by_hand(x, scale, bias, kind):
  x = np.asarray(x, np.float64)
  if kind == "rmsnorm":
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * scale
  centred = x - x.mean(axis=-1, keepdims=True)
  var = np.mean(centred**2, axis=-1, keepdims=True)
  return centred / np.sqrt(var + 1e-6) * scale + bias


def test_norms_use_big_visions_epsilon_on_small_activations():
  """Guards: the norms' epsilon off big_vision's and timm's 1e-6 (e.g. torch's
  nn.LayerNorm default, 1e-5), in the module's default or passed wrong to
  the kernel. On unit-variance activations the two differ by 1e-5 relative,
  below every model-level tolerance; on inputs of variance 1e-6 (as here)
  eps is half the denominator. Oracle: LayerNorm and timm's RmsNorm in
  float64 numpy with eps=1e-6."""
  rng = np.random.default_rng(0)
  # Small rows around 0 (a large mean would test float32's cancellation in
  # the fast variance, flax's formula too, not eps).
  x = rng.normal(0.0, 1e-3, (2, 3, 8))
  scale, bias = rng.normal(1.0, 0.5, 8), rng.normal(0.0, 0.5, 8)
  for kind in ("layernorm", "rmsnorm"):
    params = {"scale": jnp.asarray(scale, jnp.float32)}
    if kind == "layernorm":
      params["bias"] = jnp.asarray(bias, jnp.float32)
    got = blocks.LayerNorm(kind=kind).apply(
        {"params": params}, jnp.asarray(x, jnp.float32)
    )
    np.testing.assert_allclose(
        got, _norm_by_hand(x, scale, bias, kind), rtol=1e-3, atol=1e-3
    )


def test_every_norm_of_the_model_gets_the_epsilon(monkeypatch):
  """Guards: one of the model's norms (a block's two, the q/k norms, the
  encoder's final norm, the MAP head's) built with an epsilon other than
  1e-6 at its call site. Oracle: big_vision's and timm's ViTs, whose every
  LayerNorm (and timm's RmsNorm) has eps=1e-6; the kernels' eps arguments
  are recorded while a tiny model with all of these norms is traced."""
  seen = []

  def recording(kernel):
    def record(*args):
      seen.append(args[-1])
      return kernel(*args)

    return record

  monkeypatch.setattr(blocks, "layer_norm", recording(blocks.layer_norm))
  monkeypatch.setattr(blocks, "rms_norm", recording(blocks.rms_norm))
  images = jnp.zeros((1, 16, 16, 3))
  for norm in ("layernorm", "rmsnorm"):
    seen.clear()
    model = vit.Model(
        num_classes=2,
        variant=None,
        width=16,
        depth=1,
        mlp_dim=32,
        num_heads=2,
        patch_size=8,
        pool_type="map",
        qk_norm=True,
        norm=norm,
    )
    jax.eval_shape(model.init, jax.random.key(0), images)
    # A block's two, q's and k's, the encoder's, the MAP head's.
    assert len(seen) == 6, (norm, seen)
    assert all(eps == 1e-6 for eps in seen), (norm, seen)


def test_every_dropout_site_is_on_in_training_and_off_in_eval():
  """Guards: one dropout of the model never active in training (e.g. the
  sequential block's MLP called without `deterministic`: its default, True,
  keeps it off, while the other sites still make train mode differ from
  eval, all test_vit.py's dropout test checks), or one active in eval, or
  at another rate. Oracle: vision_transformer's dropout sites, at
  config.model.dropout: after the position embedding, after each block's
  attention, and the MLP's two (after the GELU, after Dense_1): 1 + 3 *
  depth calls, recorded while a tiny model is traced in each mode and
  block kind."""
  calls = []

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, nn.Dropout) and context.module.rate > 0:
      if len(args) > 1:
        deterministic = args[1]
      else:
        deterministic = kwargs.get("deterministic")
      calls.append((context.module.rate, deterministic))
    return next_fun(*args, **kwargs)

  images = jnp.zeros((1, 16, 16, 3))
  for parallel_block in (False, True):
    model = vit.Model(
        num_classes=2,
        variant=None,
        width=16,
        depth=2,
        mlp_dim=32,
        num_heads=2,
        patch_size=8,
        dropout=0.25,
        parallel_block=parallel_block,
    )
    params = jax.eval_shape(model.init, jax.random.key(0), images)
    for train in (True, False):
      calls.clear()
      with nn.intercept_methods(record):
        jax.eval_shape(
            functools.partial(model.apply, train=train),
            params,
            images,
            rngs={"dropout": jax.random.key(1)},
        )
      want = [(0.25, not train)] * (1 + 3 * 2)
      assert calls == want, (parallel_block, train, calls)
