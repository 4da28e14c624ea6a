"""Gradient accumulation (config.grad_accum_steps): same training as one big batch.

Real trainer subprocesses on the tiny ViT over the offline Fashion-MNIST, dropout
off (each microbatch draws its own dropout masks by design, so with dropout the
runs differ). Also the loop-aware FLOP count the trainer logs.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite.runtime import flops
from big_vit_lite.trainer import grad_accum
from big_vit_lite.trainer import losses
from big_vit_lite.runtime import sharding
from big_vit_lite import train
from big_vit_lite.models import vit
from trainer_runs import (
    KILL_ARGS,
    assert_same_params,
    read_losses,
    run_train,
    tiny_kill_reference,
    tiny_killed_twice,
)

import train_config_tiny

STEPS = 8
NO_DROPOUT = ("--config.model.dropout=0.", f"--config.total_steps={STEPS}")


def _logged_gflop(stderr):
  return float(
      re.search(
          r"Train step: ([\d.e+-]+) model GFLOP per device", stderr
      ).group(1)
  )


@pytest.fixture(scope="module")
def big_batch(tfds_data_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("accum1"))
  r = run_train(tfds_data_dir, workdir, *NO_DROPOUT)
  assert r.returncode == 0, r.stderr[-3000:]
  return workdir, read_losses(workdir), _logged_gflop(r.stderr)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("steps,mesh,devices", [(2, "data", 1), (4, "fsdp", 2)])
def test_microbatches_train_like_one_batch(
    steps, mesh, devices, big_batch, tfds_data_dir, tmp_path
):
  ref_dir, ref_losses, ref_gflop = big_batch
  workdir = str(tmp_path / "accum")
  r = run_train(
      tfds_data_dir,
      workdir,
      *NO_DROPOUT,
      f"--config.grad_accum_steps={steps}",
      config=f"tests/train_config_tiny.py:mesh={mesh}",
      devices=devices,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"batch 16 in {steps} microbatches of {16 // steps}" in r.stderr
  losses_ = read_losses(workdir)
  assert sorted(losses_) == sorted(ref_losses) == list(range(1, STEPS + 1))
  np.testing.assert_allclose(
      [losses_[s] for s in sorted(losses_)],
      [ref_losses[s] for s in sorted(ref_losses)],
      rtol=2e-5,
  )
  params, _ = checkpoint.load_params(workdir)
  ref_params, _ = checkpoint.load_params(ref_dir)
  # Adam divides by sqrt(v): params whose gradients are ~0 move by noise-sized
  # steps.
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # The step does the same work (model FLOPs from the jaxpr count every
  # microbatch).
  assert _logged_gflop(r.stderr) * devices == pytest.approx(ref_gflop, rel=0.05)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_and_resume_with_microbatches_is_bit_identical(tfds_data_dir):
  """The kill/resume runs of the suite take 2 microbatches a step (trainer_runs.KILL_ARGS): the
  run SIGKILLed twice (one kill right after a checkpoint step) and finished logs the losses of
  the uninterrupted run and ends with its params (shared with test_train.py)."""
  assert "--config.grad_accum_steps=2" in KILL_ARGS
  ref, ref_losses = tiny_kill_reference(tfds_data_dir)
  killed, resumed_from, log = tiny_killed_twice(tfds_data_dir)
  assert len(resumed_from) == 2 and "Resuming from" in log
  assert read_losses(killed) == ref_losses
  assert_same_params(ref, killed)


@pytest.mark.timeout(300)
def test_indivisible_batch_is_a_one_line_error(tfds_data_dir, tmp_path):
  """In process: the command line prints a ValueError of train() as its last line
  (test_console.py's test_an_error_is_said_once)."""
  config = train_config_tiny.get_config()
  config.input.data.data_dir = tfds_data_dir
  config.grad_accum_steps = 3
  with pytest.raises(ValueError) as e:
    train.train(config, str(tmp_path))
  message = str(e.value)
  assert "\n" not in message, message
  assert message.startswith("grad_accum_steps=3 does not divide"), message
  assert "16 per device" in message, message


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_check_rejects_non_positive_integers(bad):
  with pytest.raises(ValueError, match="grad_accum_steps"):
    grad_accum.check(bad, 16, 1)


@pytest.mark.parametrize("batch", [0, -8])
def test_check_rejects_an_empty_batch(batch):
  with pytest.raises(
      ValueError, match=f"input.batch_size={batch}: use a positive integer"
  ):
    grad_accum.check(1, batch, 1)


def test_split_interleaves_rows():
  x = jnp.arange(12).reshape(12, 1)
  micro = grad_accum.split({"x": x}, 3)["x"]
  assert micro.shape == (3, 4, 1)
  np.testing.assert_array_equal(micro[1, :, 0], [1, 4, 7, 10])


def test_value_and_grad_matches_full_batch_in_bfloat16_params():
  """Accumulators are float32 even when params are bfloat16; the result keeps the dtype."""
  params = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.bfloat16).reshape(3, 4)}
  batch = {
      "x": jax.random.normal(jax.random.PRNGKey(0), (8, 3)),
      "y": jax.random.normal(jax.random.PRNGKey(1), (8, 4)),
  }

  def loss_fn(p, b, rng):
    del rng
    return jnp.mean((b["x"] @ p["w"].astype(jnp.float32) - b["y"]) ** 2)

  rng = jax.random.PRNGKey(2)
  loss1, g1 = grad_accum.value_and_grad(loss_fn, params, batch, rng, 1)
  loss4, g4 = jax.jit(
      lambda p, b: grad_accum.value_and_grad(loss_fn, p, b, rng, 4)
  )(params, batch)
  assert g4["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(loss4, loss1, rtol=1e-6)
  # Each microbatch's gradient is rounded to bfloat16 by autodiff before it is
  # summed: errors of bfloat16's resolution (2^-8) relative to the largest
  # entry.
  np.testing.assert_allclose(
      g4["w"].astype(np.float32),
      g1["w"].astype(np.float32),
      rtol=1e-2,
      atol=5e-3,
  )


@pytest.mark.parametrize("scan", [False, True])
def test_step_flops_counts_every_scanned_block(scan):
  """nn.scan over 3 blocks: XLA counts the body once; step_flops matches the unrolled model."""
  kw = dict(
      variant=None,
      width=32,
      depth=3,
      mlp_dim=64,
      num_heads=2,
      patch_size=8,
      num_classes=10,
      remat_policy=None,
  )
  x, y = jnp.ones((4, 32, 32, 3)), jnp.ones((4, 10))

  def traced_for(scan_blocks):
    model = vit.Model(scan=scan_blocks, **kw)
    p = jax.eval_shape(
        lambda: sharding.unbox(model.init(jax.random.PRNGKey(0), x)["params"])
    )
    return jax.jit(
        jax.value_and_grad(
            lambda p: losses.softmax_xent(
                model.apply({"params": p}, x, train=True)[0], y
            )
        )
    ).trace(p)

  unrolled = traced_for(False)
  unrolled_xla = unrolled.lower().compile().cost_analysis()["flops"]
  traced = traced_for(scan)
  compiled = traced.lower().compile()
  xla = compiled.cost_analysis()["flops"]
  counted = flops.step_flops(traced, compiled)
  if scan:
    assert xla < 0.6 * unrolled_xla  # what the correction is for
    assert counted == pytest.approx(unrolled_xla, rel=0.02)
  else:
    assert counted == xla  # nothing to correct: XLA's own figure


@pytest.mark.parametrize("unroll", [1, 2, 3, True])
def test_step_flops_of_partly_unrolled_scans(unroll):
  """XLA's loop holds `unroll` bodies (+ the remainder): each iteration still counts once."""
  w, x = jnp.ones((64, 64)), jnp.ones((8, 16, 64))

  def f(w, x):
    return jax.lax.scan(
        lambda c, xi: (c + jnp.sum(xi @ w), None), 0.0, x, unroll=unroll
    )[0]

  traced = jax.jit(f).trace(w, x)
  assert flops.step_flops(traced, traced.lower().compile()) == pytest.approx(
      8 * 2 * 16 * 64 * 64, rel=0.01
  )


def test_step_flops_of_scanned_grouped_convolutions():
  w = jnp.ones((3, 3, 4, 16))  # HWIO, 2 groups of 4 input features each

  def conv(x):
    return jax.lax.conv_general_dilated(
        x,
        w,
        (1, 1),
        "SAME",
        feature_group_count=2,
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )

  x = jnp.ones((5, 2, 8, 8, 8))
  plain = jax.jit(lambda x: conv(x).sum()).trace(x[0])
  scanned = jax.jit(
      lambda x: jax.lax.scan(lambda c, xi: (c + conv(xi).sum(), None), 0.0, x)[
          0
      ]
  ).trace(x)
  one = plain.lower().compile().cost_analysis()["flops"]
  assert flops.step_flops(scanned, scanned.lower().compile()) == pytest.approx(
      5 * one, rel=0.01
  )


def test_batch_not_divisible_by_the_devices_is_not_blamed_on_grad_accum():
  with pytest.raises(
      ValueError, match=r"input.batch_size=6 is not divisible by the 4 devices"
  ):
    grad_accum.check(1, 6, 4)
  with pytest.raises(
      ValueError,
      match="grad_accum_steps=4 does not divide the per-device batch",
  ):
    grad_accum.check(4, 8, 4)
