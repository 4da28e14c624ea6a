"""The lr schedules (optim.make_schedule) against optax's schedules and closed forms.

Every schedule is compared at every step of a short run (not at two or three
points where a wrong formula may happen to agree), with a non-zero end value
and a warm-up, so that progress measured from 0 instead of from the warm-up's
end, a missing (1 - end) factor or an off-by-one shows.
"""

import ml_collections
import numpy as np
import optax
import pytest

from big_vit_lite.config import config_loading
from big_vit_lite.trainer import optim
from big_vit_lite.trainer import train_setup

TOTAL = 50


def _sched(total=TOTAL, **kw):
  return optim.make_schedule(ml_collections.ConfigDict(kw), total_steps=total)


def _values(fn, total=TOTAL):
  return np.array([float(fn(t)) for t in range(total + 1)])


def test_cosine_is_optax_warmup_cosine_decay():
  """Guards: cosine decay's end value (min_lr) ignored or scaled wrongly,
  progress not measured from the warm-up's end, the warm-up not linear from 0.
  """
  f = _sched(decay_type="cosine", warmup_steps=10, min_lr=0.1)
  want = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=1.0,
      warmup_steps=10,
      decay_steps=TOTAL,
      end_value=0.1,
  )
  np.testing.assert_allclose(_values(f), _values(want), atol=1e-6)


def test_linear_is_optax_linear_after_warmup():
  """Guards: linear decay to linear_end wrong (to 0, or from the start of the
  run), the warm-up ramp misplaced."""
  f = _sched(decay_type="linear", warmup_steps=5, linear_end=0.2)
  want = optax.join_schedules(
      [
          optax.linear_schedule(0.0, 1.0, 5),
          optax.linear_schedule(1.0, 0.2, TOTAL - 5),
      ],
      [5],
  )
  np.testing.assert_allclose(_values(f), _values(want), atol=1e-6)


@pytest.mark.parametrize("power", [0.5, 3.0])
def test_polynomial_is_optax_polynomial(power):
  """Guards: the polynomial's power or end applied wrongly ((1 - p)^power
  vs 1 - p^power), or its default power not 1."""
  f = _sched(decay_type="polynomial", warmup_steps=4, end=0.05, power=power)
  want = optax.join_schedules(
      [
          optax.linear_schedule(0.0, 1.0, 4),
          optax.polynomial_schedule(1.0, 0.05, power, TOTAL - 4),
      ],
      [4],
  )
  np.testing.assert_allclose(_values(f), _values(want), atol=1e-6)


def test_rsqrt_with_shift_and_timescale_by_hand():
  """Guards: rsqrt's shift or timescale ignored, or counted from step 0
  instead of the warm-up's end: 1 / sqrt(1 + (t - w + shift) / timescale)."""
  f = _sched(decay_type="rsqrt", warmup_steps=4, timescale=8, shift=3)
  t = np.arange(TOTAL + 1)
  want = 1 / np.sqrt(1 + (np.maximum(t - 4, 0) + 3) / 8.0)
  want = want * np.minimum(1.0, t / 4)
  np.testing.assert_allclose(_values(f), want, rtol=1e-6)
  # Defaults: timescale 10,000, shift 0.
  g = _sched(decay_type="rsqrt")
  np.testing.assert_allclose(
      float(g(30_000)), 1 / np.sqrt(1 + 30_000 / 10_000), rtol=1e-6
  )


def test_cooldown_and_group_mult_by_hand():
  """Guards: the cooldown not linear to 0 over its last steps, or big_vision's
  `mult` not scaling the whole schedule."""
  f = _sched(decay_type="constant", cooldown_steps=10, mult=0.3)
  t = np.arange(TOTAL + 1)
  want = 0.3 * np.clip((TOTAL - t) / 10, 0, 1)
  np.testing.assert_allclose(_values(f), want, atol=1e-7)


def test_warmup_and_cooldown_longer_than_the_run_are_scaled_down():
  """Guards: phases longer than the run not scaled by total / (warmup +
  cooldown) (a short run that never reaches the peak lr, or a negative lr)."""
  f = _sched(total=10, decay_type="constant", warmup_steps=8, cooldown_steps=8)
  # Scaled by 10 / 16: warm-up 5 steps, cool-down 5 steps.
  t = np.arange(11)
  want = np.minimum(1.0, t / 5) * np.clip((10 - t) / 5, 0, 1)
  np.testing.assert_allclose(_values(f, total=10), want, atol=1e-7)


def test_default_decay_is_cosine_to_zero(caplog):
  """Guards: the documented default (cosine to 0, with a warning that
  big_vision's default is constant) changed silently."""
  f = _sched(warmup_steps=0)
  want = optax.cosine_decay_schedule(1.0, TOTAL)
  np.testing.assert_allclose(_values(f), _values(want), atol=1e-6)
  assert "sets no decay_type: cosine decay" in caplog.text


def test_bad_schedules_are_errors():
  """Guards: a negative warm-up or an unknown decay_type accepted (the run
  trains with a schedule nobody asked for)."""
  with pytest.raises(ValueError, match="warmup is -2 steps: it must be >= 0"):
    _sched(decay_type="linear", warmup_steps=-2)
  with pytest.raises(ValueError, match="Unknown schedule decay_type 'cosin'"):
    _sched(decay_type="cosin")


def test_durations_that_are_not_whole_steps_are_rounded_by_hand():
  """Guards: a duration in epochs or examples truncated (int() for ceil:
  total_epochs=1 at 10.5 steps an epoch gives 10 steps, and the run never
  reaches the epoch's last 50% of a batch; a fractional total_epochs of a
  small dataset gives 0 steps), or a percent rounded otherwise than to the
  nearest step. Oracle: worked by hand, at quotients that are not whole:
  epochs and examples rounded up (the run covers them), percent to the
  nearest step."""
  cases = [
      ("total", dict(total_epochs=1), dict(steps_per_epoch=10.5), 11),
      ("total", dict(total_epochs=0.25), dict(steps_per_epoch=3.0), 1),
      ("warmup", dict(warmup_examples=100), dict(batch_size=8), 13),
      ("warmup", dict(warmup_percent=17), dict(total_steps=10), 2),
      ("warmup", dict(warmup_percent=13), dict(total_steps=10), 1),
  ]
  for name, cfg, dur, want in cases:
    got = config_loading.get_steps(name, ml_collections.ConfigDict(cfg), **dur)
    assert got == want, (cfg, dur, got)


def test_a_percent_of_a_long_run_and_the_duration_errors_word_for_word():
  """Guards: a percent taken of the wrong whole (`value / 101`, or of 99
  steps) where a short run rounds it away (10% of 10 steps is 1 either way),
  and the one-line errors of a duration losing what they name (the keys set
  twice, the key to set instead, what a unit needs). Oracle: worked by hand;
  the messages as a user should read them."""
  cfg = ml_collections.ConfigDict(dict(warmup_percent=50))
  assert config_loading.get_steps("warmup", cfg, total_steps=1000) == 500
  both = ml_collections.ConfigDict(dict(warmup_steps=3, warmup_epochs=1))
  with pytest.raises(ValueError) as e:
    config_loading.get_steps("warmup", both, steps_per_epoch=10)
  assert str(e.value) == (
      "Set only one of warmup_steps, warmup_epochs: they are different ways"
      " to give the same duration."
  )
  with pytest.raises(ValueError) as e:
    config_loading.get_steps(
        "total", ml_collections.ConfigDict(), required=True
    )
  assert str(e.value) == "Set one of total_steps or total_epochs in the config."
  needs = [
      ("epochs", "the dataset size"),
      ("examples", "the batch size"),
      ("percent", "the total step count"),
  ]
  for unit, what in needs:
    cfg = ml_collections.ConfigDict({f"warmup_{unit}": 5})
    with pytest.raises(ValueError) as e:
      config_loading.get_steps("warmup", cfg)
    assert str(e.value) == (
        f"warmup_{unit} needs {what}; give warmup_steps instead."
    ), unit


def test_an_epoch_is_the_examples_over_the_batch_not_whole_batches():
  """Guards: the trainer's steps per epoch in whole batches (`//`: 1,000
  examples at batch 64 as 15 steps, not 15.625), which shortens every run
  given in epochs (10 epochs: 150 steps, 4% of the data never seen, and the
  schedule's warm-up and decay in epochs scaled alike) and makes the logged
  `epoch` run ahead. Oracle: worked by hand, ceil(10 * 1000 / 64) = 157
  steps, as big_vision (`ntrain_img / batch_size`); total_steps wins."""
  got = train_setup.read_duration(
      ml_collections.ConfigDict(dict(total_epochs=10)),
      batch_size=64,
      num_examples=1000,
  )
  assert got == dict(steps_per_epoch=15.625, batch_size=64, total_steps=157)
  both = ml_collections.ConfigDict(dict(total_epochs=10, total_steps=20))
  got = train_setup.read_duration(both, batch_size=64, num_examples=1000)
  assert got["total_steps"] == 20
