"""EMA of the weights: the update, and a real fine-tune with EMA killed and resumed bit-exactly.

The end-to-end test pretrains a tiny ViT in a real process, fine-tunes it with
configs/transfer.py at another resolution (posemb resampled) with EMA and
layer-wise lr decay, SIGKILLs that run and resumes it, and checks params and
EMA against an uninterrupted run; then evaluate (use_ema) and export
(--params=ema) read the EMA from the checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite.trainer import ema as ema_lib
from big_vit_lite.trainer import train_setup
import checks
from trainer_runs import ROOT, env_for, flatten, read_losses, run_train, start_train_to_kill, tiny_run, wait_for_step
import forkserver

TRANSFER = os.path.join(ROOT, "configs", "transfer.py")


def test_ema_update_follows_the_warmed_up_decay():
  # Changing params (p_t = t + 1), so that decay and 1 - decay give different
  # averages; with constant params both converge to the same value.
  # Hand-computed from the closed form ema_k = d^k ema_0 + sum_i (1 - d) d^(k -
  # i) p_i at a constant d = 0.9 (steps >= 80, past the warm-up): p = 1, 2, 3
  # from ema_0 = 0 give 0.1 * (0.81 * 1 + 0.9 * 2 + 3) = 0.561 (the swap would
  # give 0.9 * (0.01 * 1 + 0.1 * 2 + 3) = 2.889).
  ema = ema_lib.Ema(0.9)
  avg = {"w": jnp.zeros(3)}
  for i, step in enumerate(range(100, 103)):
    avg = ema.update(avg, {"w": jnp.full(3, i + 1.0)}, step)
  np.testing.assert_allclose(avg["w"], 0.561, rtol=1e-6)
  # The warm-up: at step 0 the decay is min(0.9, 1 / 10) = 0.1, at step 1 2 /
  # 11; from ema_0 = 10 with p = 0 then 22: 0.1 * 10 = 1, then (2 / 11) * 1 + (9
  # / 11) * 22 = 18.1818...
  avg = ema.update({"w": jnp.full(3, 10.0)}, {"w": jnp.zeros(3)}, 0)
  np.testing.assert_allclose(avg["w"], 1.0, rtol=1e-6)
  avg = ema.update(avg, {"w": jnp.full(3, 22.0)}, 1)
  np.testing.assert_allclose(avg["w"], 2 / 11 + 18.0, rtol=1e-6)
  assert avg["w"].dtype == jnp.float32
  bf16 = ema.update(
      {"w": jnp.zeros(3, jnp.bfloat16)}, {"w": jnp.ones(3, jnp.bfloat16)}, 5
  )
  # The state keeps its dtype (a jit output sharding).
  assert bf16["w"].dtype == jnp.bfloat16


def test_ema_config_errors_are_one_line():
  assert (
      ema_lib.from_config(ml_collections.ConfigDict(dict(ema_decay=None)))
      is None
  )
  config = checks.tracked_config(
      evals=ml_collections.ConfigDict({"val": {"use_ema": True}})
  )
  with pytest.raises(
      ValueError, match="evals.val.use_ema=True, but the run keeps no EMA"
  ):
    train_setup.make_evaluators(config, model=None, mesh=None, ema=None)


@pytest.fixture(scope="module")
def pretrained(tfds_data_dir):
  """A tiny ViT pretrained on Fashion-MNIST for a few steps, in a real process."""
  workdir, _ = tiny_run(tfds_data_dir)
  return workdir


STEPS = 120


def _args(pretrained):
  return (
      f"--config.total_steps={STEPS}",
      "--config.ckpt_steps=20",
      "--config.log_training_steps=1",
      "--config.ema_decay=0.99",
      "--config.layer_decay=0.8",
      "--config.evals.val.use_ema=True",
  )


def _config(pretrained):
  # res=42: a 6x6 patch grid instead of the checkpoint's 4x4 (posemb resampled).
  return f"{TRANSFER}:init={pretrained},data=mnist10k,res=42,runlocal"


def _flat_state(workdir, key):
  params, _ = checkpoint.load_params(workdir, key)
  return dict(flatten(params))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_finetune_with_ema_killed_and_resumed_is_bit_identical(
    pretrained, tfds_data_dir, tmp_path
):
  ref = str(tmp_path / "ref")
  r = run_train(
      tfds_data_dir, ref, *_args(pretrained), config=_config(pretrained)
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Initialising params from" in r.stderr
  ref_losses = read_losses(ref)
  assert sorted(ref_losses) == list(range(1, STEPS + 1))
  ref_params, ref_ema = _flat_state(ref, "params"), _flat_state(ref, "ema")
  # 6x6, gap pool
  assert ref_params["Transformer/posembed_input/pos_embedding"].shape[1] == 36
  assert not np.array_equal(ref_params["head/kernel"], ref_ema["head/kernel"])

  killed = str(tmp_path / "killed")
  proc, pid = start_train_to_kill(
      tfds_data_dir, killed, *_args(pretrained), config=_config(pretrained)
  )
  # Past the checkpoints of steps 20..60 (saved async).
  wait_for_step(proc, killed, 70)
  while not checkpoint.complete_steps(killed):
    time.sleep(0.05)
  os.kill(pid, signal.SIGKILL)
  proc.communicate(timeout=30)
  assert proc.returncode == -signal.SIGKILL
  r = run_train(
      tfds_data_dir, killed, *_args(pretrained), config=_config(pretrained)
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Resuming from" in r.stderr
  assert read_losses(killed) == ref_losses
  for key, want in (("params", ref_params), ("ema", ref_ema)):
    got = _flat_state(killed, key)
    assert got.keys() == want.keys()
    for k in want:
      np.testing.assert_array_equal(got[k], want[k], err_msg=f"{key}/{k}")

  # The run's val eval scored the EMA; evaluate with use_ema=True reads the same
  # weights.
  val = [
      json.loads(l)
      for l in open(os.path.join(ref, "metrics.jsonl"))
      if "val/prec@1" in l
  ]
  out = str(tmp_path / "classify")
  r = subprocess.run(
      forkserver.command(
          [
              sys.executable,
              "-m",
              "big_vit_lite.evaluate",
              "--config=configs/classify.py:data=mnist10k,res=42,runlocal",
              f"--workdir={out}",
              f"--config.model_init={ref}",
              "--config.use_ema=True",
          ]
      ),
      env=env_for(tfds_data_dir),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  row = json.loads(
      open(os.path.join(out, "metrics.jsonl")).read().splitlines()[-1]
  )
  assert row["classify/prec@1"] == val[-1]["val/prec@1"]

  npz = str(tmp_path / "ema.npz")
  r = subprocess.run(
      forkserver.command(
          [
              sys.executable,
              "-m",
              "big_vit_lite.export",
              f"--src={ref}",
              f"--out={npz}",
              "--params=ema",
          ]
      ),
      env=env_for(tfds_data_dir),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  exported = np.load(npz)
  np.testing.assert_array_equal(exported["head/kernel"], ref_ema["head/kernel"])
