"""`plan --gpu=HOST --compile`: the trainer's step compiled by XLA's GPU compiler, no GPU here.

Needs the CUDA plugin (the gpu-compile extra; scripts/setup.sh puts it in .venv/gpu-compiler,
apart from the venv, so that other tests' jax processes do not load it). The compile runs in
a subprocess: the plugin must be found when jax starts its backends.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from big_vit_lite.planner import gpu
from big_vit_lite.models import vit

import train_config_tiny

REPO = pathlib.Path(__file__).resolve().parents[1]
PLUGIN_DIR = pathlib.Path(
    os.environ.get("BVL_GPU_COMPILER", REPO / ".venv" / "gpu-compiler")
)

_SCRIPT = """
import json, sys
from big_vit_lite.planner import gpu, plan
gpu.prepare_environment()
sys.path.insert(0, {tests!r})
import train_config_tiny
out = []
# XLA's attention, a batch too big, and "auto" (cuDNN's: bf16, head dim 8).
for batch, attention in ((16, "xla"), (2**24, "xla"), (16, "auto")):
  config = train_config_tiny.get_config()
  config.model.attention = attention
  config.model.dtype_mm = "auto"  # bfloat16 on a GPU
  config.input.batch_size = batch
  try:
    p = plan.plan_on_gpus(config, "data:-1", "h100x2", res=28, compile_step=True)
  except ValueError as e:
    p = dict(error=str(e))
  out.append(p)
print(json.dumps(out))
"""


def _plugin_path():
  if (PLUGIN_DIR / "jax_plugins").is_dir():
    return str(PLUGIN_DIR)
  try:
    import jax_plugins.xla_cuda12  # pylint: disable=import-outside-toplevel,unused-import

    return ""
  except ImportError:
    pytest.skip(
        "no CUDA plugin: bash scripts/setup.sh installs it in .venv/gpu-compiler"
    )


@pytest.fixture(scope="module")
def compiled_plans():
  extra = _plugin_path()
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (env.get("PYTHONPATH", ""), extra) if p
  )
  env.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
  proc = subprocess.run(
      [
          sys.executable,
          "-c",
          _SCRIPT.format(tests=str(REPO / "tests")),
      ],
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
      check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(700)
def test_tiny_vit_compiles_for_an_abstract_2_gpu_h100_host(compiled_plans):
  """Guards the GPU target's report: a wrong memory reading (peak not args + outputs +
  temps - aliased), arguments that are not the replicated AdamW state plus the batch
  shard, a host of the wrong GPU or size, or no gradient all-reduce over data:2.
  """
  p = compiled_plans[0]
  assert p["gpu_name"] == "NVIDIA H100 80GB HBM3"
  assert p["devices"] == 2 and p["mesh"] == {"data": 2}
  assert p["gpu_memory_bytes"] == 80 * 10**9
  assert p["gpu_attention"] == "xla"
  assert p["gpu_peak_bytes"] == (
      p["gpu_argument_bytes"]
      + p["gpu_output_bytes"]
      + p["gpu_temp_bytes"]
      - p["gpu_alias_bytes"]
  )
  # The oracle: the tiny ViT's param count from its own init, x3 (params, Adam's
  # mu and nu) in float32, replicated, plus this GPU's half of the batch
  # (8 images of 28x28x1 and 8 one-hot labels of 10, float32).
  config = train_config_tiny.get_config()
  params = jax.eval_shape(
      vit.Model(**config.model.to_dict()).init,
      jax.random.PRNGKey(0),
      jnp.zeros((1, 28, 28, 1)),
  )["params"]
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  state_and_batch = 3 * 4 * n + 8 * (28 * 28 + 10) * 4
  # (+ the step counters and the rng: a few bytes)
  assert state_and_batch <= p["gpu_argument_bytes"] <= state_and_batch + 64
  assert p["gpu_temp_bytes"] > 0
  assert p["gpu_fits"] is True
  assert p["gpu_collectives"]["all-reduce"]["count"] >= 1


@pytest.mark.timeout(700)
def test_a_batch_too_big_for_the_gpu_reports_fits_false(compiled_plans):
  """Guards against `fits` read from the wrong figure (or against the wrong memory): a
  batch whose images alone outgrow an H100 must not fit."""
  p = compiled_plans[1]
  # 2**23 images of 28x28x1 float32 per GPU: 26 GB of inputs alone.
  assert p["gpu_argument_bytes"] > 2**23 * 28 * 28 * 4
  assert p["gpu_peak_bytes"] > 80 * 10**9
  assert p["gpu_fits"] is False
  assert p["gpu_spare"] < 0


@pytest.mark.timeout(700)
def test_auto_attention_compiles_cudnns_where_the_library_is(compiled_plans):
  """Guards the GPU target's "auto" attention: a GPU takes cuDNN's for bf16 matmuls and
  head dims in 8..256 (not the CPU's custom one), and it compiles with cuDNN installed;
  without it, one line saying what to install."""
  p = compiled_plans[2]
  if not (PLUGIN_DIR / "nvidia" / "cudnn").is_dir():
    assert p["error"].startswith("attention 'cudnn' needs the cuDNN library")
    return
  assert p["gpu_attention"] == "cudnn"
  assert p["dtype_mm"] == "bfloat16"
  assert p["gpu_fits"] is True


def test_unknown_gpu_and_mismatched_mesh_are_one_line():
  """Guards the one-line errors: an unknown GPU name, a mesh the host's GPUs cannot fill."""
  with pytest.raises(
      ValueError, match=r"unknown GPU host; use one of a100-80gb"
  ):
    gpu.parse_host("v100x8")
  from big_vit_lite.planner import plan  # pylint: disable=import-outside-toplevel

  with pytest.raises(ValueError, match=r"does not match .* \(16 devices\)"):
    plan.plan_on_gpus(
        train_config_tiny.get_config(), "data:3", "h100x8", hosts=2
    )
