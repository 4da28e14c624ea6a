"""plan's analytic memory per device against the TPU compiler's, one run per line.

  python benchmarks/plan_vs_tpu.py --variant=L/16 --topology=v5p-256 --mesh=data:-1 \
      --remat=nothing_saveable --out=benchmarks/plan_vs_tpu.jsonl

Compiles the trainer's step for configs/vit_l16.py (any variant, batch 4096 unless
--batch) under nn.scan with the TPU compiler (plan --topology=SLICE --compile) and appends
one JSON line: plan's figures (total, activations, state) and the compiler's (arguments,
temporaries, peak), and plan's error. benchmarks/NOTES.md, section "Plan vs the TPU
compiler", tables these lines.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import vit_l16  # pylint: disable=g-import-not-at-top
from big_vit_lite.planner import plan as plan_lib
from big_vit_lite.runtime.devices import GIB


def add_arguments(parser):
  """The run's flags, shared with benchmarks/tpu_step_time.py."""
  parser.add_argument("--variant", default="L/16")
  parser.add_argument("--topology", default="v5p-256")
  parser.add_argument("--mesh", default="data:-1")
  parser.add_argument("--remat", default="none")
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--scan", type=int, default=1)
  parser.add_argument("--dropout", type=float, default=None)
  parser.add_argument("--attention", default="auto")
  parser.add_argument(
      "--model",
      default="",
      help="block options as config.model keys, e.g. mlp=swiglu,qk_norm=1",
  )
  parser.add_argument("--out", default=None)


def make_config(args):
  """configs/vit_l16.py with the run's flags applied."""
  config = vit_l16.get_config(f"variant={args.variant}")
  config.input.batch_size = args.batch
  config.model.scan = bool(args.scan)
  config.model.remat_policy = args.remat
  config.model.attention = args.attention
  for item in filter(None, args.model.split(",")):
    key, value = item.split("=")
    current = config.model[key]
    config.model[key] = (
        type(current)(int(value))
        if isinstance(current, bool)
        else type(current)(value)
    )
  if args.dropout is not None:
    config.model.dropout = args.dropout
  return config


def append_line(row, path):
  line = json.dumps(row)
  print(line)
  if path:
    with open(path, "a") as f:
      f.write(line + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_arguments(parser)
  args = parser.parse_args()
  config = make_config(args)
  start = time.time()
  p = plan_lib.plan_on_slice(
      config,
      args.mesh,
      args.topology,
      compile_step=True,
  )
  row = dict(
      variant=args.variant,
      topology=args.topology,
      mesh=p["mesh"],
      batch=args.batch,
      scan=bool(args.scan),
      remat=args.remat,
      dropout=float(config.model.dropout),
      attention=args.attention,
      model=args.model,
      compile_s=round(time.time() - start),
      plan_total_gib=p["total_bytes_per_device"] / GIB,
      plan_act_gib=p["act_bytes_per_device"] / GIB,
      **{k: v for k, v in p.items() if k.startswith("tpu_")},
  )
  if "tpu_peak_bytes" in p:
    row["tpu_peak_gib"] = p["tpu_peak_bytes"] / GIB
    row["plan_error"] = p["total_bytes_per_device"] / p["tpu_peak_bytes"] - 1
  append_line(row, args.out)


if __name__ == "__main__":
  main()
