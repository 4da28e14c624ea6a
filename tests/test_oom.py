"""Out-of-memory errors become one line with the knobs that help (oom.py)."""

import jax
import jax.numpy as jnp
import pytest

from big_vit_lite.runtime import oom


def _real_cpu_oom():
  # 80 GB of float32 temporaries: more than any CI machine has, so malloc
  # refuses at once.
  f = jax.jit(
      lambda x: jnp.sort(x * jnp.arange(20_000_000_000, dtype=jnp.float32))[:3]
  )
  with pytest.raises(jax.errors.JaxRuntimeError) as e:
    f(jnp.ones(())).block_until_ready()
  return e.value


def test_a_real_xla_oom_is_recognised_and_sized():
  err = _real_cpu_oom()
  assert oom.is_oom(err)
  assert oom.requested_bytes(err) == pytest.approx(8e10)
  msg = oom.message(
      err, what="the train step", batch_size=64, devices=2, grad_accum_steps=4
  )
  assert "\n" not in msg
  assert msg.startswith(
      "out of memory during the train step at input.batch_size=64 (32 per "
      "device, 4 microbatches) (an allocation of 74.51 GiB failed)"
  )
  assert "grad_accum_steps" in msg and "big_vit_lite.plan" in msg


def test_other_errors_are_not_oom_and_gpu_wording_parses():
  # only XLA's runtime errors
  assert not oom.is_oom(ValueError("Out of memory"))
  assert (
      oom.requested_bytes(
          RuntimeError(
              "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 16106127360 bytes."
          )
      )
      == 16106127360
  )
  assert (
      oom.requested_bytes(
          RuntimeError("Out of memory while trying to allocate 1.50GiB")
      )
      == 1.5 * 2**30
  )
  assert oom.requested_bytes(RuntimeError("Out of memory")) is None


@pytest.mark.timeout(120)
def test_train_cli_out_of_memory_is_one_line(tfds_data_dir, tmp_path):
  from trainer_runs import run_train  # pylint: disable=g-import-not-at-top
  # A 16 x 4e9 MLP kernel: the sharded init asks XLA for 256 GB at once.
  r = run_train(
      tfds_data_dir,
      str(tmp_path / "run"),
      "--config.model.mlp_dim=4000000000",
      timeout=100,
  )
  assert r.returncode == 1
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith(
      "big_vit_lite.train: error: out of memory during training at "
      "input.batch_size=16 (an allocation of 238.42 GiB failed)"
  ), last
  assert "Checkpoints already written are intact." in last
  assert "Traceback" not in r.stderr
