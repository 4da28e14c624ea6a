"""optim.make against optax's own transforms and schedules and hand-worked steps.

Each case is chosen so that a plausible wrong version disagrees: gradients that
change every step (a momentum that ignores its history or its dtype shows),
multipliers other than 1 on top of layer decay (a product turned into a
quotient shows), a schedule with a warm-up (an lr_fn that is not the first
group's schedule shows). Tiny hand-made params named like a ViT's, no model.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from big_vit_lite.config import config_loading
from big_vit_lite.trainer import optim
import checks

_cfg = checks.tracked_config


def _flat(tree):
  return dict(
      zip(jax.tree.leaves(optim.param_names(tree)), jax.tree.leaves(tree))
  )


def _vit_like_params(depth=3):
  """Zeros named like a ViT's params (depth blocks), one small leaf per group."""
  params = {
      "embedding": {"kernel": jnp.zeros((2, 2))},
      "cls": jnp.zeros((1, 1, 2)),
      "Transformer": {
          "encoder_norm": {"scale": jnp.zeros((2,))},
      },
      "head": {"kernel": jnp.zeros((2, 3))},
  }
  for i in range(depth):
    params["Transformer"][f"encoderblock_{i}"] = {"kernel": jnp.zeros((2, 2))}
  return params


def _plain_sgd(params, **config):
  """optim.make for plain SGD (no momentum), lr 0.1 on a constant schedule,
  10 steps; `config` adds keys or replaces those."""
  sgd = dict(
      lr=0.1,
      optax_name="sgd",
      optax=dict(momentum=None),
      schedule=dict(decay_type="constant"),
  )
  return optim.make(_cfg(**(sgd | config)), params, total_steps=10)


def _sgd_step_moves(params, **config):
  """{name: how far one plain-SGD step with gradients 1 moves each param}."""
  opt = _plain_sgd(params, **config)
  grads = jax.tree.map(jnp.ones_like, params)
  new, _ = opt.apply(params, grads, opt.tx.init(params))
  return _flat(new)


def test_momentum_hp_is_optax_trace_in_the_dtype_asked():
  """Guards: big_vision's momentum_hp `dtype` key not read (the default
  bfloat16 kept, or the key passed on and refused), or the momentum applied
  wrongly (no history, wrong decay): three steps with different gradients
  against optax.trace(0.9) then optax.scale(-lr), accumulator in float32."""
  params = {"w": jnp.zeros((3,))}
  opt = optim.make(
      _cfg(
          lr=0.1,
          optax_name="big_vision.momentum_hp",
          optax=dict(dtype="float32"),
          schedule=dict(decay_type="constant"),
      ),
      params,
      total_steps=10,
  )
  want_tx = optax.chain(
      optax.trace(decay=0.9, accumulator_dtype=jnp.float32), optax.scale(-0.1)
  )
  state, want_state = opt.tx.init(params), want_tx.init(params)
  traces = [x for x in jax.tree.leaves(state) if x.shape == (3,)]
  assert [x.dtype for x in traces] == [jnp.float32]
  got, want = params, params
  for g in ([1.0, -2.0, 0.5], [0.3, 0.0, -1.0], [-4.0, 1.0, 2.0]):
    grads = {"w": jnp.asarray(g)}
    got, state = opt.apply(got, grads, state)
    updates, want_state = want_tx.update(grads, want_state, want)
    want = optax.apply_updates(want, updates)
  np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)


def test_step_count_is_an_int32_like_optax_schedules():
  """Guards: the step counter the schedules read kept as a float (float32
  stops counting at 2**24 steps, and a checkpoint's count changes dtype):
  the same state as optax.scale_by_schedule's, counting the steps taken."""
  params = {"w": jnp.zeros((2,))}
  opt = optim.make(_cfg(lr=0.1), params, total_steps=10)
  want = optax.scale_by_schedule(lambda t: t).init(params)
  state = opt.tx.init(params)
  assert state[-1].count.dtype == want.count.dtype == jnp.int32
  grads = {"w": jnp.ones((2,))}
  for _ in range(2):
    params, state = opt.apply(params, grads, state)
  assert state[-1].count.dtype == jnp.int32
  assert int(state[-1].count) == 2


def test_lr_fn_is_lr_times_the_first_groups_optax_schedule():
  """Guards: the logged learning rate (lr_fn) missing, not scaled by lr, or
  taken from another group than the first: lr * optax's warm-up cosine at
  every step."""
  params = {"head": jnp.zeros((2,)), "body": jnp.zeros((2,))}
  opt = optim.make(
      _cfg(
          lr=0.3,
          schedule=[
              ("head", dict(decay_type="cosine", warmup_steps=4, min_lr=0.1)),
              (".*", dict(decay_type="constant")),
          ],
      ),
      params,
      total_steps=20,
  )
  want = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=1.0,
      warmup_steps=4,
      decay_steps=20,
      end_value=0.1,
  )
  steps = np.arange(21)
  np.testing.assert_allclose(
      [float(opt.lr_fn(t)) for t in steps],
      [0.3 * float(want(t)) for t in steps],
      rtol=1e-5,
      atol=1e-7,
  )


def test_layer_decay_multiplies_lr_mults_in_one_sgd_step():
  """Guards: layer decay and lr_mults combined other than by a product (a
  quotient, or one of them dropped), the embeddings' decay^(L+1) computed
  otherwise (decay * (L+1)), a block's exponent off by one. Plain SGD, grad 1,
  constant schedule: each param moves by -lr * lr_mult * decay^k, worked by
  hand for L = 3, decay 0.5 (BEiT's and timm's layer-wise decay)."""
  moves = _sgd_step_moves(
      _vit_like_params(depth=3),
      layer_decay=0.5,
      lr_mults=[("head/.*", 2.0), ("Transformer/encoderblock_1/.*", 3.0)],
  )
  moved = {k: float(np.asarray(v).ravel()[0]) for k, v in moves.items()}
  want = {
      "embedding/kernel": -0.1 * 0.0625,  # decay^(L + 1)
      "cls": -0.1 * 0.0625,
      "Transformer/encoderblock_0/kernel": -0.1 * 0.125,  # decay^(L - 0)
      "Transformer/encoderblock_1/kernel": -0.1 * 0.25 * 3.0,
      "Transformer/encoderblock_2/kernel": -0.1 * 0.5,
      "Transformer/encoder_norm/scale": -0.1,
      "head/kernel": -0.1 * 2.0,
  }
  assert moved.keys() == want.keys()
  for name, value in want.items():
    assert moved[name] == pytest.approx(value, rel=1e-6), name


def test_layer_decay_of_scan_stacked_blocks_one_sgd_step():
  """Guards: the stacked blocks' multipliers (one per slice of the layers
  axis) not shaped (L, 1, 1) to broadcast over it (a (L,) vector broadcasts
  over the last axis instead when it has L entries too), or in the wrong
  order. By hand: slice i moves by -lr * decay^(L - i)."""
  params = {
      "embedding": {"kernel": jnp.zeros((2, 2))},
      "Transformer": {"encoderblock": {"kernel": jnp.zeros((3, 2, 3))}},
      "head": {"kernel": jnp.zeros((2, 3))},
  }
  moves = _sgd_step_moves(params, layer_decay=0.5)
  want = -0.1 * np.array([0.125, 0.25, 0.5])[:, None, None] * np.ones((3, 2, 3))
  np.testing.assert_allclose(
      moves["Transformer/encoderblock/kernel"], want, rtol=1e-6
  )
  np.testing.assert_allclose(
      moves["embedding/kernel"], -0.1 * 0.0625, rtol=1e-6
  )


def test_config_errors_name_the_key_to_fix():
  """Guards: an error that names the wrong config key (a user fixes the wrong
  line), and an lr_mults regex that applies to no param accepted (the
  multiplier silently does nothing)."""
  params = {"head": {"kernel": jnp.zeros((2,))}}
  with pytest.raises(ValueError, match=r"matches no regex of config.schedule"):
    optim.make(_cfg(schedule=[("body/.*", dict())]), params, total_steps=10)
  with pytest.raises(
      ValueError,
      match=r"config.lr_mults: the regex 'heads/.\*' is the first match of no",
  ):
    optim.make(_cfg(lr_mults=[("heads/.*", 2.0)]), params, total_steps=10)
  with pytest.raises(ValueError, match="cooldown is -3 steps: it must be >= 0"):
    optim.make_schedule(
        _cfg(decay_type="constant", cooldown_steps=-3), total_steps=10
    )
  with pytest.raises(ValueError, match=r"config.lr=-1.0 must be a finite"):
    optim.make(_cfg(lr=-1.0), params, total_steps=10)
  with pytest.raises(
      ValueError,
      match=re.escape(
          "config.lr_mults: ('head/.*', -2.0) must be a (regex, multiplier) "
          "pair with a finite multiplier >= 0 (0 switches it off"
      ),
  ):
    optim.make(_cfg(lr_mults=[("head/.*", -2.0)]), params, total_steps=10)
  # wd_mults given: checked (while wd > 0); the default one is not (a model
  # without kernels has nothing it decays).
  with pytest.raises(
      ValueError, match=r"config.wd_mults: the regex 'body/.\*'"
  ):
    optim.make(
        _cfg(wd=0.1, wd_mults=[("body/.*", 1.0)]), params, total_steps=10
    )
  optim.make(_cfg(wd=0.1), {"head": {"bias": jnp.zeros((2,))}}, total_steps=10)


def test_a_typo_in_the_tracked_schedule_is_left_to_the_whole_config_check():
  """Guards: make() checking the keys of the trainer's own (tracked)
  config.schedule itself: it would refuse on the first typo alone, before the
  trainer's check of the whole config names every unread key at once."""
  params = {"w": jnp.zeros((2,))}
  config = _cfg(lr=0.1, schedule=dict(warmup_step=2), lr_mult=[])
  optim.make(config, params, total_steps=10)
  with pytest.raises(config_loading.UnreadConfigKeyError) as e:
    config.check_all_read()
  assert "'lr_mult'" in str(e.value)
  assert "schedule.warmup_step" in str(e.value)


def test_gradient_clip_is_optax_global_norm_of_the_trainable_grads():
  """Guards: the frozen params' gradients counted in the clip's global norm
  (a head fine-tuned on a frozen body clipped by the body's gradients), or
  the clip dropped. Oracle: optax.clip_by_global_norm on the trainable
  gradients alone, then plain SGD by hand."""
  params = {"body": jnp.zeros((3,)), "head": jnp.zeros((2,))}
  opt = _plain_sgd(
      params,
      lr=1.0,
      grad_clip_norm=1.0,
      schedule=[("body", None), ("head", dict(decay_type="constant"))],
  )
  grads = {"body": jnp.full((3,), 100.0), "head": jnp.array([3.0, 4.0])}
  new, _ = opt.apply(params, grads, opt.tx.init(params))
  clip = optax.clip_by_global_norm(1.0)
  clipped, _ = clip.update({"head": grads["head"]}, clip.init(None))
  np.testing.assert_allclose(new["head"], -clipped["head"], rtol=1e-6)
  np.testing.assert_allclose(new["head"], [-0.6, -0.8], rtol=1e-6)
  np.testing.assert_array_equal(new["body"], params["body"])


def test_bfloat16_params_get_bfloat16_updates_rounded_once_there():
  """Guards: the update of bfloat16 params left in float32 (twice the
  update tree's memory, and params rounded once at the sum instead of at
  the update, as optax's transforms keep the gradients' dtype). Oracle: the
  documented step in numpy: u = bf16(-lr * g) in float32, p + u rounded to
  bfloat16 (ml_dtypes), bit for bit."""
  rng = np.random.default_rng(0)
  p = rng.normal(size=(256,)).astype(ml_dtypes.bfloat16)
  g = rng.normal(size=(256,)).astype(ml_dtypes.bfloat16)
  params, grads = {"w": jnp.asarray(p)}, {"w": jnp.asarray(g)}
  opt = _plain_sgd(params)
  state = opt.tx.init(params)
  updates, _ = opt.tx.update(grads, state, params)
  assert updates["w"].dtype == jnp.bfloat16
  new, _ = opt.apply(params, grads, state)
  u = (np.float32(-0.1) * g.astype(np.float32)).astype(ml_dtypes.bfloat16)
  want = (p.astype(np.float32) + u.astype(np.float32)).astype(
      ml_dtypes.bfloat16
  )
  np.testing.assert_array_equal(
      np.asarray(new["w"]).view(np.uint16), want.view(np.uint16)
  )
