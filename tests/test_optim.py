"""Optimizer and schedules (optim.py): values users rely on, in-process, no model."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from big_vit_lite.config import config_loading
from big_vit_lite.trainer import optim


def _cfg(**kw):
  return config_loading.TrackedConfig(ml_collections.ConfigDict(kw))


def _sched(total=100, **kw):
  return optim.make_schedule(
      _cfg(**kw), total_steps=total, steps_per_epoch=10, batch_size=8
  )


def test_warmup_then_cosine_values():
  f = _sched(total=110, warmup_steps=10, decay_type="cosine")
  np.testing.assert_allclose([f(0), f(5), f(10)], [0.0, 0.5, 1.0], atol=1e-6)
  # Half way through the decay.
  np.testing.assert_allclose(f(60), 0.5, atol=1e-6)
  np.testing.assert_allclose(f(110), 0.0, atol=1e-6)


def test_linear_rsqrt_constant_and_cooldown():
  lin = _sched(total=100, decay_type="linear", linear_end=0.1)
  np.testing.assert_allclose(
      [lin(0), lin(50), lin(100)], [1.0, 0.55, 0.1], atol=1e-6
  )
  rs = _sched(total=1000, warmup_steps=100, decay_type="rsqrt", timescale=100)
  np.testing.assert_allclose([rs(100), rs(400)], [1.0, 0.5], atol=1e-6)
  const = _sched(total=100, decay_type="constant", cooldown_steps=20)
  np.testing.assert_allclose(
      [const(50), const(80), const(90), const(100)],
      [1.0, 1.0, 0.5, 0.0],
      atol=1e-6,
  )


def test_polynomial_and_stair():
  poly = _sched(total=100, decay_type="polynomial", power=2.0, linear_end=0.1)
  np.testing.assert_allclose(
      [poly(0), poly(50), poly(100)], [1.0, 0.1 + 0.9 * 0.25, 0.1], atol=1e-6
  )
  lin = _sched(total=100, decay_type="linear")
  poly1 = _sched(total=100, decay_type="polynomial")  # power 1 is linear
  np.testing.assert_allclose(
      [poly1(t) for t in (0, 30, 100)],
      [lin(t) for t in (0, 30, 100)],
      atol=1e-6,
  )
  stair = _sched(
      total=100,
      warmup_steps=10,
      decay_type="stair",
      steps=[30, 60],
      mults=[0.1, 0.01],
  )
  np.testing.assert_allclose(
      [stair(5), stair(29), stair(30), stair(59), stair(60), stair(99)],
      [0.5, 1.0, 0.1, 0.1, 0.01, 0.01],
      atol=1e-7,
  )
  for bad in (
      dict(steps=[30]),
      dict(steps=[60, 30], mults=[0.1, 0.01]),
      dict(steps=[30], mults=[0.1, 0.01]),
  ):
    with pytest.raises(ValueError, match="decay_type='stair' needs steps"):
      _sched(total=100, decay_type="stair", **bad)


def test_durations_in_epochs_examples_percent():
  # steps_per_epoch=10, batch_size=8 (see _sched).
  assert float(
      _sched(total=100, warmup_epochs=2, decay_type="constant")(10)
  ) == pytest.approx(0.5)
  assert float(
      _sched(total=100, warmup_examples=160, decay_type="constant")(10)
  ) == pytest.approx(0.5)
  assert float(
      _sched(total=100, warmup_percent=20, decay_type="constant")(10)
  ) == pytest.approx(0.5)
  with pytest.raises(ValueError, match="only one of"):
    _sched(total=100, warmup_steps=3, warmup_epochs=1)


def test_total_steps_wins_over_epochs():
  cfg = _cfg(total_steps=7, total_epochs=90)
  assert config_loading.get_steps("total", cfg, steps_per_epoch=100) == 7
  # total_epochs counts as read: no unused-key error.
  assert cfg.unread_keys() == []
  assert (
      config_loading.get_steps(
          "total", _cfg(total_steps=None, total_epochs=2), steps_per_epoch=10.5
      )
      == 21
  )


def _params():
  return {
      "head": {"kernel": jnp.full((3, 2), 0.5), "bias": jnp.full((2,), -0.0)},
      "body": {"kernel": jnp.full((4, 3), 1.0), "bias": jnp.full((3,), 1.0)},
  }


def _run(opt, params, steps=3):
  state = opt.tx.init(params)
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.1, params)
  step = jax.jit(opt.apply)
  for _ in range(steps):
    params, state = step(params, grads, state)
  return params, state


def test_freezing_keeps_params_bit_identical_and_stateless():
  cfg = _cfg(
      lr=0.1,
      wd=0.01,
      optax_name="scale_by_adam",
      schedule=[("head/.*", None), (".*", dict(decay_type="constant"))],
  )
  params = _params()
  opt = optim.make(cfg, params, total_steps=10)
  new, state = _run(opt, params)
  for k in ("kernel", "bias"):
    np.testing.assert_array_equal(
        np.asarray(new["head"][k]).view(np.uint32),
        np.asarray(params["head"][k]).view(np.uint32),
    )
  assert not np.allclose(new["body"]["kernel"], params["body"]["kernel"])
  # No Adam moments for the frozen head.
  adam_state = state[0].inner_state
  assert isinstance(adam_state.mu["head"]["kernel"], optax.MaskedNode)


def test_decoupled_weight_decay_and_multipliers():
  # sgd without momentum, zero grads: only weight decay moves the params.
  cfg = _cfg(
      lr=0.5,
      wd=0.1,
      optax_name="sgd",
      optax=dict(momentum=None),
      schedule=dict(decay_type="constant"),
      wd_mults=[(".*/kernel", 1.0)],
      lr_mults=[("head/.*", 0.0)],
  )
  params = _params()
  opt = optim.make(cfg, params, total_steps=10)
  state = opt.tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  new, _ = opt.apply(params, zeros, state)
  # p <- p - wd * p (not lr * wd * p): decoupled from lr, as in big_vision.
  np.testing.assert_allclose(new["body"]["kernel"], 0.9, rtol=1e-6)
  # No decay on biases.
  np.testing.assert_array_equal(new["body"]["bias"], params["body"]["bias"])
  # lr_mult 0 on the head: gradients do not move it (decay still does).
  grads = jax.tree.map(jnp.ones_like, params)
  new, _ = opt.apply(params, grads, state)
  np.testing.assert_allclose(new["head"]["kernel"], 0.5 * 0.9, rtol=1e-6)
  np.testing.assert_allclose(new["body"]["bias"], 1.0 - 0.5, rtol=1e-6)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("scale_by_adam", dict(mu_dtype="bfloat16")),
        ("momentum", dict(momentum=0.9)),
        ("adafactor", dict(min_dim_size_to_factor=2, clipping_threshold=1.0)),
    ],
)
def test_optimizers_minimise_a_quadratic(name, kw):
  cfg = _cfg(
      lr=0.05,
      optax_name=name,
      optax=kw,
      grad_clip_norm=10.0,
      schedule=dict(warmup_steps=2, decay_type="cosine"),
  )
  target = {"w": jnp.arange(12.0).reshape(4, 3) / 10}
  params = {"w": jnp.zeros((4, 3))}
  opt = optim.make(cfg, params, total_steps=200)
  loss = lambda p: jnp.sum((p["w"] - target["w"]) ** 2)  # noqa: E731
  state = opt.tx.init(params)

  @jax.jit
  def step(p, s):
    return opt.apply(p, jax.grad(loss)(p), s)

  start = loss(params)
  for _ in range(200):
    params, state = step(params, state)
  assert loss(params) < 0.05 * start
  if name == "scale_by_adam":
    assert state[1].inner_state.mu["w"].dtype == jnp.bfloat16


def test_bad_optimizer_and_schedule_keys_are_errors():
  with pytest.raises(ValueError, match="optax_name"):
    optim.make(_cfg(optax_name="adamx"), _params(), total_steps=10)
  with pytest.raises(ValueError, match="warmup_step"):
    optim.make(
        _cfg(schedule=[(".*", dict(warmup_step=3))]), _params(), total_steps=10
    )
  with pytest.raises(ValueError, match="matches no regex"):
    optim.make(_cfg(schedule=[("head/.*", dict())]), _params(), total_steps=10)
