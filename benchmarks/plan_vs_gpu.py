"""plan's analytic memory per GPU against XLA's GPU compiler's, one run per line.

  PYTHONPATH=.venv/gpu-compiler python benchmarks/plan_vs_gpu.py --variant=B/16 \
      --depth=1 --remat=nothing_saveable --out=benchmarks/plan_vs_gpu.jsonl

Compiles the trainer's step for a shipped config (--config, default configs/vit_l16.py; any
variant; its batch and mesh as it ships, unless flags say otherwise) with XLA's GPU compiler
(`plan --gpu=HOST --compile`, no GPU needed) and prints one JSON line: plan's figures
(total, activations, state) and the compiler's (arguments, temporaries, peak), plan's
error and the compile's CPU seconds. --depth=N overrides the model's depth: the
difference between depths 2 and 1 is one block's bytes (benchmarks/NOTES.md, section
"Plan vs the GPU compiler, fitted").
"""

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from big_vit_lite.config import config_loading  # pylint: disable=g-import-not-at-top
from big_vit_lite.planner import gpu  # pylint: disable=g-import-not-at-top
from big_vit_lite.planner import plan as plan_lib  # pylint: disable=g-import-not-at-top
from big_vit_lite.runtime.devices import GIB  # pylint: disable=g-import-not-at-top


def cpu_seconds() -> float:
  """User + system CPU seconds of this process so far (all its threads)."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/vit_l16.py")
  parser.add_argument("--variant", default=None, help="default: the config's")
  parser.add_argument("--gpu", default="h100x8")
  parser.add_argument("--hosts", type=int, default=1)
  parser.add_argument(
      "--accum", type=int, default=None, help="grad_accum_steps"
  )
  parser.add_argument("--mesh", default=None, help="default: the config's")
  parser.add_argument("--remat", default="none")
  parser.add_argument(
      "--batch", type=int, default=None, help="default: the config's"
  )
  parser.add_argument("--depth", type=int, default=None)
  parser.add_argument(
      "--scan",
      action="store_true",
      help="the blocks under nn.scan (config.model.scan=True)",
  )
  parser.add_argument("--attention", default="auto")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  gpu.prepare_environment()
  get_config = config_loading.config_module(args.config).get_config
  config = get_config()
  if args.variant:
    config = get_config(f"variant={args.variant}")
  if args.batch:
    config.input.batch_size = args.batch
  if args.accum:
    config.grad_accum_steps = args.accum
  with config.unlocked():
    config.model.remat_policy = args.remat
    config.model.attention = args.attention
    if args.depth:
      config.model.depth = args.depth
    if args.scan:
      config.model.scan = True
  mesh = args.mesh or config.mesh
  cpu0, wall0 = cpu_seconds(), time.time()
  p = plan_lib.plan_on_gpus(
      config, mesh, args.gpu, args.hosts, compile_step=True
  )
  row = dict(
      config=args.config,
      variant=p["variant"],
      depth=p["arch"]["depth"],
      remat=args.remat,
      scan=bool(config.model.get("scan")),
      gpu=args.gpu,
      hosts=args.hosts,
      grad_accum_steps=p["grad_accum_steps"],
      plan_attention=p["attention"],
      mesh=p["mesh"],
      local_batch=p["local_batch"],
      attention=p["gpu_attention"],
      compile_cpu_s=round(cpu_seconds() - cpu0, 1),
      compile_wall_s=round(time.time() - wall0, 1),
      plan_gib=p["total_bytes_per_device"] / GIB,
      plan_act_gib=p["act_bytes_per_device"] / GIB,
      **{k: p[k] for k in p if k.startswith("gpu_") and k.endswith("_bytes")},
  )
  row["plan_error"] = p["total_bytes_per_device"] / p["gpu_peak_bytes"] - 1
  line = json.dumps(row)
  print(line)
  if args.out:
    with open(args.out, "a") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  main()
