"""Checks that two training runs computed the same bits: for a refactor that must not change
training (issue 25), run the same config before and after and compare the two workdirs.

Compares every metrics.jsonl line without its timing fields (losses, learning rate, grad norm and
eval metrics at full float precision) and, for every checkpoint step both runs saved, the
checksums of all saved leaves (params, optimizer state, EMA: each step's checksums/metadata).

Usage: python scripts/same_bits.py WORKDIR_A WORKDIR_B   (exit 0: identical, 1: different)
"""

import json
import os
import sys

TIMING = (
    "step_time",
    "img/sec",
    "img/sec/device",
    "eta_hours",
    "core_hours",
    "uptime_hours",
    "mfu",
    "mfu_xla",
)
# Keys newer runs add (compared when both runs have them): a run from before
# them still compares.
ADDED = ("training_loss_avg",)


def _comparable(x, y):
  """Rows x and y without the keys in ADDED that only one of them has."""
  one_sided = [k for k in ADDED if (k in x) != (k in y)]
  return (
      {k: v for k, v in x.items() if k not in one_sided},
      {k: v for k, v in y.items() if k not in one_sided},
  )


def metrics_rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def checksums(workdir):
  """{step: {leaf path: [dtype, checksum]}} of the workdir's checkpoints."""
  root = os.path.join(workdir, "checkpoints")
  out = {}
  for step in sorted(os.listdir(root) if os.path.isdir(root) else []):
    path = os.path.join(root, step, "checksums", "metadata")
    if step.isdigit() and os.path.exists(path):
      with open(path) as f:
        out[int(step)] = json.load(f)
  return out


def differences(a, b):
  """Lines saying where runs `a` and `b` differ ([] when they computed the same bits)."""
  out = []
  rows_a, rows_b = metrics_rows(a), metrics_rows(b)
  if len(rows_a) != len(rows_b):
    out.append(f"metrics.jsonl: {len(rows_a)} vs {len(rows_b)} lines")
  pairs = [_comparable(x, y) for x, y in zip(rows_a, rows_b)]
  out += [
      f"metrics.jsonl line {i + 1}: {x} vs {y}"
      for i, (x, y) in enumerate(pairs)
      if x != y
  ][:5]
  sums_a, sums_b = checksums(a), checksums(b)
  for step in sorted(set(sums_a) & set(sums_b)):
    leaves = [
        k
        for k in sorted(set(sums_a[step]) | set(sums_b[step]))
        if sums_a[step].get(k) != sums_b[step].get(k)
    ]
    if leaves:
      out.append(
          f"checkpoint {step}: {len(leaves)} leaves differ, e.g. {leaves[0]}"
      )
  if not set(sums_a) & set(sums_b):
    out.append("no checkpoint step saved by both runs")
  return out


def main(argv):
  if len(argv) != 2 or argv[0] in ("-h", "--help"):
    print(__doc__)
    return 0 if argv and argv[0] in ("-h", "--help") else 2
  diff = differences(*argv)
  print(
      "\n".join(diff)
      if diff
      else f"same bits: {len(metrics_rows(argv[0]))} metrics lines, checkpoints "
      f"{sorted(checksums(argv[0]))} with {len(next(iter(checksums(argv[0]).values())))} leaves"
  )
  return 1 if diff else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
