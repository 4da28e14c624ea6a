"""Data parallel and FSDP on 8 simulated CPU devices match 1 device; FSDP checkpoints restore on 1.

Each run is a subprocess (the device count is fixed when jax starts) with
XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

import os
import re
import shutil

import numpy as np
import pytest

from big_vit_lite.trainer import checkpoint
from trainer_runs import read_losses, run_train, tiny_run

STEPS = 12


def _per_device_param_bytes(stderr):
  return int(
      re.search(r"per-device bytes: params ([\d,]+)", stderr)
      .group(1)
      .replace(",", "")
  )


@pytest.fixture(scope="module")
def one_device(tfds_data_dir):
  # The tiny config's own total_steps.
  workdir, log = tiny_run(tfds_data_dir)
  assert f"[{STEPS}/{STEPS}]" in log
  return workdir, read_losses(workdir), _per_device_param_bytes(log)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh", ["data", "fsdp", "model"])
def test_eight_devices_match_one(mesh, one_device, tfds_data_dir, tmp_path):
  ref_dir, ref_losses, ref_bytes = one_device
  workdir = str(tmp_path / mesh)
  r = run_train(
      tfds_data_dir,
      workdir,
      config=f"tests/train_config_tiny.py:mesh={mesh}",
      devices=8,
      *[f"--config.total_steps={STEPS}"],
  )
  assert r.returncode == 0, r.stderr[-3000:]
  # Really ran on an 8-device mesh.
  assert (
      "{'data': 4, 'model': 2}" if mesh == "model" else "{'%s': 8}" % mesh
  ) in r.stderr
  losses = read_losses(workdir)
  assert sorted(losses) == sorted(ref_losses)
  np.testing.assert_allclose(
      [losses[s] for s in sorted(losses)],
      [ref_losses[s] for s in sorted(ref_losses)],
      rtol=2e-5,
  )
  params, _ = checkpoint.load_params(workdir)
  ref_params, _ = checkpoint.load_params(ref_dir)
  np.testing.assert_allclose(
      params["head"]["kernel"],
      ref_params["head"]["kernel"],
      rtol=1e-3,
      atol=1e-5,
  )
  per_device = _per_device_param_bytes(r.stderr)
  if mesh == "fsdp":  # Params split 8 ways (all but small unsplittable ones).
    assert per_device < ref_bytes / 4, (per_device, ref_bytes)
  elif mesh == "model":  # MLP and attention-head weights split 2 ways.
    assert per_device < ref_bytes * 0.8, (per_device, ref_bytes)
  else:  # Data parallel: params replicated.
    assert per_device == ref_bytes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_num_cpu_devices_splits_the_cpu_and_matches_one(
    one_device, tfds_data_dir, tmp_path
):
  """config.num_cpu_devices=2 in a process started with one CPU device: data parallel on 2."""
  _, ref_losses, _ = one_device
  workdir = str(tmp_path / "split")
  r = run_train(
      tfds_data_dir,
      workdir,
      f"--config.total_steps={STEPS}",
      "--config.num_cpu_devices=2",
      devices=1,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "devices: 2 x cpu" in r.stderr and "{'data': 2}" in r.stderr
  losses = read_losses(workdir)
  np.testing.assert_allclose(
      [losses[s] for s in sorted(losses)],
      [ref_losses[s] for s in sorted(ref_losses)],
      rtol=2e-5,
  )


def test_num_cpu_devices_errors():
  import jax  # pylint: disable=import-outside-toplevel
  from big_vit_lite.runtime import distributed  # pylint: disable=import-outside-toplevel

  distributed.set_cpu_devices(None)  # Unset: nothing happens.
  for bad in (0, -2, 1.5, "2", True):
    with pytest.raises(ValueError, match="positive integer"):
      distributed.set_cpu_devices(bad)
  jax.devices()  # The backend is running now, with its device count fixed.
  with pytest.raises(ValueError, match="fresh process"):
    distributed.set_cpu_devices(jax.local_device_count() + 3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_checkpoint_resumes_on_one_device(
    one_device, tfds_data_dir, tmp_path
):
  _, ref_losses, _ = one_device
  workdir = str(tmp_path / "fsdp_then_one")
  half = STEPS // 2
  r = run_train(
      tfds_data_dir,
      workdir,
      f"--config.total_steps={STEPS}",
      f"--config.ckpt_steps={half}",
      config="tests/train_config_tiny.py:mesh=fsdp",
      devices=8,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  # As if the 8-device job had died after step `half`: drop the final
  # checkpoint.
  shutil.rmtree(os.path.join(workdir, "checkpoints", str(STEPS)))
  # Same run continued on 1 device (default data mesh): restores the 8-way
  # sharded state.
  r = run_train(
      tfds_data_dir, workdir, f"--config.total_steps={STEPS}", devices=1
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"checkpoints/{half}" in r.stderr  # "Resuming from .../checkpoints/6"
  losses = read_losses(workdir)
  np.testing.assert_allclose(
      [losses[s] for s in range(half + 1, STEPS + 1)],
      [ref_losses[s] for s in range(half + 1, STEPS + 1)],
      rtol=2e-5,
  )
