"""optim.make and optim.make_schedule read config keys: one-line errors for settings that would
be ignored or harm the run, big_vision's spellings, which params decay and clip.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from big_vit_lite.trainer import optim
import checks

_cfg = checks.tracked_config
_tiny_params = checks.tiny_train_params


def _flat(tree):
  return dict(
      zip(jax.tree.leaves(optim.param_names(tree)), jax.tree.leaves(tree))
  )


@pytest.mark.parametrize(
    "key,value,match",
    [
        # Regexes that apply to no parameter were ignored without a word.
        (
            "schedule",
            [(".*", dict(decay_type="cosine")), ("head/.*", None)],
            r"config.schedule: the regex 'head/.\*' is the first match of no parameter \(names look "
            r"like '.*'; a regex matches whole names and the first match wins\): fix, move or remove it",
        ),
        (
            "schedule",
            [("/head/.*", None), (".*", dict())],
            r"the regex '/head/.\*' is the first match of no parameter",
        ),
        (
            "wd_mults",
            [(".*/kernel", 1.0), ("pos_embedding", 0.1)],
            r"config.wd_mults: the regex 'pos_embedding' is the first match of no parameter",
        ),
        (
            "lr_mults",
            [("head/(", 2.0)],
            r"config.lr_mults: 'head/\(' is not a valid regex",
        ),
        (
            "schedule",
            dict(warmup_steps=-5),
            r"The schedule's warmup is -5 steps: it must be >= 0",
        ),
        # A negative lr would ascend, a NaN wd end in a NaN loss blamed on the lr.
        ("lr", -1e-3, r"config.lr=-0.001 must be a finite number >= 0"),
        ("wd", float("nan"), r"config.wd=nan must be a finite number >= 0"),
        (
            "grad_clip_norm",
            -1.0,
            r"config.grad_clip_norm=-1.0 must be a finite number >= 0",
        ),
        # (As a dict schedule's typo is told.)
        (
            "schedule",
            [(".*", dict(warmup_step=3))],
            r"'warmup_step' in the schedule for '.\*' is not a schedule key \(did you mean 'warmup_steps'",
        ),
        # Negative multipliers trained their blocks by gradient ascent, without a
        # word.
        ("layer_decay", -0.5, r"config.layer_decay=-0.5 must be >= 0"),
        (
            "lr_mults",
            [("head/.*", -1.0)],
            r"config.lr_mults: \('head/.\*', -1.0\) must be a "
            r"\(regex, multiplier\) pair with a finite multiplier >= 0",
        ),
        (
            "wd_mults",
            [(".*/kernel", -0.1)],
            r"config.wd_mults: \('.\*/kernel', -0.1\) must be",
        ),
        (
            "lr_mults",
            [("head/.*", float("inf"))],
            r"config.lr_mults: \('head/.\*', inf\) must be",
        ),
    ],
)
def test_ignored_or_harmful_optimizer_settings_are_one_line_errors(
    key, value, match
):
  with pytest.raises(ValueError, match=match) as e:
    optim.make(
        _cfg(**{"lr": 1e-3, "wd": 1e-4, key: value}),
        _tiny_params(),
        total_steps=10,
    )
  assert "\n" not in str(e.value)


def test_big_vision_optimizer_and_schedule_keys():
  params = _tiny_params()
  # big_vision's schedule keys: `end` (= linear_end), `shift` (rsqrt), `mult`
  # (per group).
  lin = optim.make_schedule(_cfg(decay_type="linear", end=0.1), total_steps=100)
  np.testing.assert_allclose(lin(100), 0.1, atol=1e-6)
  rs = optim.make_schedule(
      _cfg(decay_type="rsqrt", timescale=100, shift=300), total_steps=10**6
  )
  np.testing.assert_allclose([rs(0), rs(100)], [0.5, 1 / np.sqrt(5)], rtol=1e-6)
  opt = optim.make(
      _cfg(
          lr=1.0,
          schedule=[
              ("head/.*", dict(decay_type="constant", mult=0.1)),
              (".*", dict(decay_type="constant")),
          ],
      ),
      params,
      total_steps=10,
  )
  np.testing.assert_allclose(opt.lr_fn(3), 0.1, rtol=1e-6)  # The first group's.
  # big_vision's optimizer names.
  for name, kw in (
      ("big_vision.momentum_hp", {}),
      ("big_vision.sgd", {}),
      ("big_vision.scale_by_adafactor", dict(dtype_momentum=jnp.bfloat16)),
      ("scale_by_adam", dict(mu_dtype=jnp.bfloat16)),
  ):
    opt = optim.make(
        _cfg(lr=1e-3, optax_name=name, optax=kw), params, total_steps=10
    )
    leaves = jax.tree.leaves(opt.tx.init(params))
    if name == "big_vision.sgd":
      assert len(leaves) == 1  # The schedule's step count: no optimizer state.
    # Momentum in bf16 (big_vision's default for momentum_hp and adafactor).
    else:
      assert jnp.dtype(jnp.bfloat16) in {x.dtype for x in leaves}, name


def test_schedule_without_decay_type_says_it_decays(caplog):
  """big_vision's default decay_type is a constant; here cosine: a ported config must hear it."""
  caplog.set_level(logging.WARNING, logger="absl")
  f = optim.make_schedule(_cfg(warmup_steps=2), total_steps=10)
  np.testing.assert_allclose([f(2), f(10)], [1.0, 0.0], atol=1e-6)
  assert any(
      "sets no decay_type: cosine decay (big_vision's default is a constant"
      in r.getMessage()
      for r in caplog.records
  )


def test_weight_decay_reaches_weight_matrices_only_by_default():
  """The README's `wd_mults` default: kernels decay; biases, LayerNorm, cls, posemb do not."""
  params = _tiny_params()
  opt = optim.make(
      _cfg(lr=0.0, wd=0.1, optax_name="sgd"), params, total_steps=10
  )
  new, _ = jax.jit(opt.apply)(
      params, jax.tree.map(jnp.zeros_like, params), opt.tx.init(params)
  )
  decayed = sorted(
      k
      for k, v in _flat(new).items()
      if not np.array_equal(v, _flat(params)[k])
  )
  assert decayed == sorted(
      k for k in _flat(params) if k.endswith("/kernel")
  ), decayed
  assert (
      "head/bias" not in decayed
      and "Transformer/encoder_norm/scale" not in decayed
  )


def test_gradient_clip_ignores_the_gradients_of_frozen_params():
  """A head fine-tuned on a frozen body: the body's gradients clipped the head's steps away."""
  params = {
      "head": {"kernel": jnp.ones((3, 2))},
      "body": {"kernel": jnp.ones((4, 3))},
  }
  grads = {
      "head": {"kernel": jnp.full((3, 2), 0.01)},
      "body": {"kernel": jnp.full((4, 3), 100.0)},
  }
  heads = []
  for clip in (1.0, 0.0):
    opt = optim.make(
        _cfg(
            lr=1.0,
            optax_name="sgd",
            grad_clip_norm=clip,
            schedule=[("body/.*", None), (".*", dict(decay_type="constant"))],
        ),
        params,
        total_steps=10,
    )
    state = opt.tx.init(params)
    # The layout resumes rely on.
    assert isinstance(state[0], optax.EmptyState) == bool(clip)
    new, _ = opt.apply(params, grads, state)
    heads.append(np.asarray(new["head"]["kernel"]))
    np.testing.assert_array_equal(
        new["body"]["kernel"], params["body"]["kernel"]
    )
  # |head grad| < 1: the clip does nothing.
  np.testing.assert_array_equal(heads[0], heads[1])
  np.testing.assert_allclose(heads[0], 0.99, rtol=1e-6)


def test_clip_relayout_round_trips_the_optimizer_state():
  params = _tiny_params()
  clipped = optim.make(_cfg(grad_clip_norm=1.0), params, total_steps=10)
  plain = optim.make(_cfg(), params, total_steps=10)
  state = clipped.tx.init(params)
  as_plain = optim.clip_relayout(state, True, False)
  assert jax.tree.structure(as_plain) == jax.tree.structure(
      plain.tx.init(params)
  )
  back = optim.clip_relayout(as_plain, False, True)
  assert jax.tree.structure(back) == jax.tree.structure(state)


@pytest.mark.parametrize("decay", [1.0, 1.5, -0.1, float("nan")])
def test_ema_decay_out_of_range_is_a_one_line_error(decay):
  from big_vit_lite.trainer import ema  # pylint: disable=import-outside-toplevel

  checks.one_line_error(
      lambda: ema.from_config(_cfg(ema_decay=decay)),
      f"config.ema_decay={decay} must be in [0, 1)",
  )


def test_edge_values_of_the_ranges_are_accepted():
  from big_vit_lite.trainer import ema  # pylint: disable=import-outside-toplevel

  assert ema.from_config(_cfg(ema_decay=0.0)).decay == 0.0
  # layer_decay 0 freezes all but the head; multipliers of 0 switch a group off.
  config = _cfg(
      lr=1e-3,
      wd=1e-4,
      layer_decay=0.0,
      lr_mults=[("head/.*", 0.0)],
      wd_mults=[(".*/kernel", 0.0)],
  )
  optim.make(config, _tiny_params(), total_steps=10)
