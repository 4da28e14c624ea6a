"""The TPU cost model's step time for a deep model, from two shallow unrolled compiles.

  python benchmarks/tpu_step_time.py --variant=L/16 --topology=v5p-256 --mesh=fsdp:-1 \
      --out=benchmarks/tpu_step_time.jsonl

Why: under nn.scan the compiler's cost analysis holds the layer loop's body once, so plan
scales its `optimal_seconds` by a FLOPs ratio, which also multiplies the work outside the
loop (the optimizer update, the head); an unrolled L/16 for 128 chips takes over 25
minutes to compile on a 2-core host. The blocks of a ViT are identical, so the cost model's
time is affine in the depth: t(depth) = t(1) + (depth - 1) * (t(2) - t(1)). This compiles
the trainer's step (plan --topology=SLICE --compile --time_by_depth: the scanned step for
memory and model FLOPs, then unrolled at depth 1 and 2) and extrapolates the time to the
variant's depth; `--check` also compiles the full depth unrolled to compare (small models
only). One JSON line per run.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top
import plan_vs_tpu
from big_vit_lite.planner import plan as plan_lib
from big_vit_lite.runtime.devices import GIB


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  plan_vs_tpu.add_arguments(parser)
  parser.add_argument(
      "--check",
      action="store_true",
      help="also compile the full depth unrolled and report the extrapolation's error",
  )
  args = parser.parse_args()
  start = time.time()
  # The scanned step (memory, model FLOPs) plus the two shallow unrolled ones.
  config = plan_vs_tpu.make_config(args)
  p = plan_lib.plan_on_slice(
      config,
      args.mesh,
      args.topology,
      compile_step=True,
      time_by_depth=True,
  )
  row = dict(
      variant=args.variant,
      topology=args.topology,
      chips=p["tpu_chips"],
      mesh=p["mesh"],
      batch=args.batch,
      remat=args.remat,
      attention=args.attention,
      dropout=float(config.model.dropout),
      model=args.model,
      depth=p["arch"]["depth"],
      peak_gib=p["tpu_peak_bytes"] / GIB,
      step_s_at_depth_1_and_2=p.get("tpu_est_by_depth"),
      est_step_s=p["tpu_est_step_s"],
      est_img_per_s_per_chip=p["tpu_est_img_per_s_per_chip"],
      est_mfu=p["tpu_est_mfu"],
      model_flops=p["tpu_model_flops"],
  )
  if args.check:
    config.model.scan = False
    full = plan_lib.plan_on_slice(
        config,
        args.mesh,
        args.topology,
        compile_step=True,
    )
    row["full_unrolled_step_s"] = full["tpu_est_step_s"]
    row["extrapolation_error"] = (
        p["tpu_est_step_s"] / full["tpu_est_step_s"] - 1
    )
  row["compile_s"] = round(time.time() - start)
  plan_vs_tpu.append_line(row, args.out)


if __name__ == "__main__":
  main()
