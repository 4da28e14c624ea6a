"""docs/tpu.md's slice table: each shipped pretraining config on the slices people rent.

  python benchmarks/slice_table.py

For each config and slice, plan (the TPU formulas, no compile) tries the layouts in
order, the config's own mesh, data parallel, FSDP, then each with a remat policy (the
one that saves most first), then gradient accumulation, and keeps the first that fits with at least 10% of the HBM spare, with the
config's "auto" model settings as a TPU takes them. Prints a markdown row
per cell: mesh, HBM per chip, the step time at the chips' bf16 peak (a bound: plan's
roofline, not an estimate of the compiler's) with its img/s per chip, and the chip-hours
of the full recipe at that bound. The TPU compiler's estimates for the cells it
compiled are in benchmarks/NOTES.md, "TPU compiler".
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top
from big_vit_lite.config import config_loading
from big_vit_lite.planner import plan as plan_lib
from big_vit_lite.planner import tpu as tpu_compile
from big_vit_lite.runtime.devices import GIB

SLICES = (
    "v4-32",
    "v4-256",
    "v5litepod-16",
    "v5litepod-256",
    "v5p-128",
    "v5p-512",
    "v6e-256",
)
# name -> (config, training images seen by the full recipe)
CONFIGS_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"
)


def _get_config(name):
  """configs/NAME.py's get_config, loaded as --config loads it."""
  path = os.path.join(CONFIGS_DIR, f"{name}.py")
  return config_loading.config_module(path).get_config


CONFIGS = {
    "vit_l16": (_get_config("vit_l16"), 90 * 14_197_122),
    "vit_b16": (_get_config("vit_b16"), 90 * 14_197_122),
    "vit_s16_i1k": (_get_config("vit_s16_i1k"), 90 * 1_281_167),
}
# The remat policies, fastest first by the TPU compiler's cost model (L/16 and
# B/16 at 256 images per chip, benchmarks/NOTES.md): the more a policy saves,
# the less it recomputes.
REMAT_POLICIES = (
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "nothing_saveable",
)
TRIES = (
    ("data:-1", "none", 1),
    ("fsdp:-1", "none", 1),
    *[
        (mesh, policy, 1)
        for policy in REMAT_POLICIES
        for mesh in ("data:-1", "fsdp:-1")
    ],
    ("fsdp:-1", "nothing_saveable", 2),
    ("fsdp:-1", "nothing_saveable", 4),
)


def _tries(get_config):
  """TRIES, after the config's own mesh without remat (its default layout)."""
  own_mesh = ",".join(f"{axis}:{size}" for axis, size in get_config().mesh)
  own = (own_mesh, "none", 1)
  return (own,) + tuple(t for t in TRIES if t != own)


def cell(get_config, topology, images):
  """The first layout of _tries that fits with 10% spare: (try, plan) or None."""
  for mesh, remat, accum in _tries(get_config):
    config = get_config()
    config.model.scan = True
    config.model.remat_policy = remat
    config.grad_accum_steps = accum
    try:
      p = plan_lib.plan_on_slice(config, mesh, topology)
    except ValueError:  # a batch the mesh or the microbatches do not divide
      continue
    if p["total_bytes_per_device"] <= 0.9 * p["hbm_bytes"]:
      steps = images / p["global_batch"]
      chips = tpu_compile.parse_slice(topology).chips
      return (mesh, remat, accum), p, steps * p["step_time_s"] * chips / 3600
  return None


def main():
  print(
      "| config | slice | layout | HBM per chip (plan) | step at peak | img/s per"
      " chip at peak | chip-hours at peak |"
  )
  print("|---|---|---|---|---|---|---|")
  for name, (get_config, images) in CONFIGS.items():
    for topology in SLICES:
      found = cell(get_config, topology, images)
      if found is None:
        print(f"| {name} | {topology} | does not fit | | | | |")
        continue
      (mesh, remat, accum), p, chip_hours = found
      layout = ", ".join(
          [mesh.replace(":-1", f":{p['devices']}")]
          + ([f"remat {remat}"] if remat != "none" else [])
          + ([f"accum {accum}"] if accum > 1 else [])
      )
      chips = tpu_compile.parse_slice(topology).chips
      print(
          f"| {name} | {topology} | {layout} | "
          f"{p['total_bytes_per_device'] / GIB:.1f} of {p['hbm_bytes'] / GIB:.0f}"
          f" GiB | {p['step_time_s'] * 1e3:.3g} ms | "
          f"{p['global_batch'] / p['step_time_s'] / chips:.0f} | "
          f"{chip_hours:,.0f} |",
          flush=True,
      )


if __name__ == "__main__":
  main()
