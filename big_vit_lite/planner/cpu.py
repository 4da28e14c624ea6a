"""The trainer's step compiled by XLA:CPU for a mesh of simulated CPU devices (plan --compile).

  python -m big_vit_lite.plan --config=configs/demo.py --mesh=data:2,fsdp:2 --compile

XLA's memory analysis and FLOPs of the step (plan's compiled_* fields), what
tests/test_plan.py checks the analytic formulas against. The devices are this host's CPU
split into prod(mesh) by XLA_FLAGS, which jax reads when it starts: the compile runs in a
fresh python (compiled_stats_subprocess: plan --compiled_only).
"""

import json
import math
import os
import subprocess
import sys

import jax

from big_vit_lite.runtime import flops as flops_lib
from big_vit_lite.planner import assemble


def compiled_stats(config, mesh: dict, res: int) -> dict:
  """XLA memory analysis + FLOPs of the trainer's step compiled for `mesh` (CPU devices)."""
  n_dev = math.prod(mesh.values())
  _, traced, compiled, memory = assemble.compile_on(
      config, mesh, jax.devices()[:n_dev], res
  )
  return dict(
      {f"compiled_{k}_bytes": b for k, b in memory.items()},
      compiled_model_flops=float(flops_lib.model_flops(traced)),
      # XLA's count with the loops' (layer scan, microbatch scan) other
      # iterations added.
      compiled_flops_per_device=float(
          flops_lib.step_flops(traced, compiled, n_dev) or 0
      ),
  )


def compiled_stats_subprocess(
    config_arg: str, overrides: list[str], mesh: dict, res: int
):
  """plan --compile without a topology: compiled_stats (the step compiled by
  XLA:CPU) in a fresh python with prod(mesh) simulated CPU devices."""
  n_dev = math.prod(mesh.values())
  # The memory-minimising scheduler (not the default concurrency-optimised one)
  # is what accelerator backends approximate; its peak is the meaningful one to
  # compare with.
  env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=(
          os.environ.get("XLA_FLAGS", "")
          + f" --xla_force_host_platform_device_count={n_dev}"
          " --xla_cpu_enable_concurrency_optimized_scheduler=false"
      ).strip(),
  )
  mesh_str = ",".join(f"{k}:{v}" for k, v in mesh.items())
  cmd = [
      sys.executable,
      "-m",
      "big_vit_lite.plan",
      f"--config={config_arg}",
      *overrides,
      f"--mesh={mesh_str}",
      f"--res={res}",
      "--compiled_only",
      "--json",
  ]
  proc = subprocess.run(
      cmd, env=env, capture_output=True, text=True, timeout=1800, check=False
  )
  # Its last line: the "plan: ..." message, or the exception's.
  if proc.returncode != 0:
    last = ((proc.stderr or proc.stdout).strip().splitlines() or ["?"])[-1]
    raise ValueError(
        f"compiling the step on {n_dev} simulated CPU devices failed: {last}"
    )
  return json.loads(proc.stdout.strip().splitlines()[-1])
