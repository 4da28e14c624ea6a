"""Where a training step's time goes: a jax.profiler trace summarised with plain Python.

  python benchmarks/gpu_profile.py --variant=B/16 --batch=256 --model_kw='{"attention": "xla"}'
  python benchmarks/gpu_profile.py --smoke        # tiny model on a CPU: checks the script

Times --steps steps of bench's training step (fwd, xent, bwd, AdamW) under
`jax.profiler.trace(..., create_perfetto_trace=True)`, then reads the Perfetto JSON trace and
prints the ops that took the most time in the timed steps (device kernels on a GPU: cuBLAS
gemms, cuDNN attention, XLA fusions), grouped by name and by kind, as one JSON line and a
table. No TensorBoard needed; the trace directory stays for a closer look (--trace_dir, or
$OUT/profile when OUT is set).
"""

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout, no install

_KINDS = (
    ("gemm", ("gemm", "cublas", "matmul", "dot")),
    ("attention", ("fmha", "cudnn", "flash")),
    ("fusion", ("fusion", "loop_", "input_", "triton")),
    ("copy", ("copy", "transpose")),
    ("collective", ("all-reduce", "all-gather", "reduce-scatter", "nccl")),
)


def kind_of(name):
  low = name.lower()
  return next((k for k, keys in _KINDS if any(s in low for s in keys)), "other")


def summarize(trace_path, top=25):
  """{name: total µs} of the complete events on device/op threads, and the same by kind."""
  with gzip.open(trace_path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  threads = {
      (e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
      for e in events
      if e.get("ph") == "M" and e.get("name") == "thread_name"
  }
  procs = {
      e.get("pid"): e.get("args", {}).get("name", "")
      for e in events
      if e.get("ph") == "M" and e.get("name") == "process_name"
  }
  gpu = any("/device:GPU" in p or "stream" in p.lower() for p in procs.values())
  by_name = collections.Counter()
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    proc = procs.get(e.get("pid"), "")
    # on a GPU: the kernels, not the host's launch calls
    if gpu and "/device:GPU" not in proc:
      continue
    if (
        not gpu
        and "python" in threads.get((e.get("pid"), e.get("tid")), "").lower()
    ):
      continue
    by_name[e["name"]] += float(e["dur"])
  total = sum(by_name.values()) or 1.0
  by_kind = collections.Counter()
  for name, us in by_name.items():
    by_kind[kind_of(name)] += us
  return dict(
      device_events="gpu" if gpu else "host",
      total_ms=total / 1e3,
      by_kind={k: round(v / total, 4) for k, v in by_kind.most_common()},
      top=[
          dict(
              name=n[:120],
              ms=round(us / 1e3, 3),
              share=round(us / total, 4),
              kind=kind_of(n),
          )
          for n, us in by_name.most_common(top)
      ],
  )


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variant", default="B/16")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--res", type=int, default=224)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument(
      "--model_kw", default="{}", help="JSON dict of extra vit.Model kwargs"
  )
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--trace_dir", default=None)
  p.add_argument("--smoke", action="store_true", help="tiny model on a CPU")
  args = p.parse_args()
  if args.smoke:
    args.variant, args.batch, args.res, args.steps, args.dtype = (
        "mu/8",
        4,
        32,
        2,
        "float32",
    )
  import jax  # pylint: disable=g-import-not-at-top
  from big_vit_lite import bench  # pylint: disable=g-import-not-at-top

  trace_dir = args.trace_dir or (
      os.path.join(os.environ["OUT"], "profile")
      if os.environ.get("OUT")
      else tempfile.mkdtemp(prefix="vit_profile_")
  )
  model = bench.build_model(
      args.variant, 1000, args.dtype, "none", False, json.loads(args.model_kw)
  )
  # Compiled and warmed up outside the trace: it holds only the timed steps.
  out = bench.bench_model(
      model,
      batch=args.batch,
      res=args.res,
      num_classes=1000,
      mode=("train",),
      steps=args.steps,
      warmup=1,
      trace_dir=trace_dir,
  )
  paths = sorted(
      glob.glob(
          os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
          recursive=True,
      )
  )
  if not paths:
    sys.exit(f"gpu_profile: no perfetto_trace.json.gz under {trace_dir}")
  summary = summarize(paths[-1], args.top)
  summary.update(
      variant=args.variant,
      batch=args.batch,
      model_kw=json.loads(args.model_kw),
      attention=model.resolved_attention(),
      train_img_per_s=out["train_img_per_s"],
      trace=paths[-1],
      device_kind=jax.devices()[0].device_kind,
  )
  for row in summary["top"]:
    print(
        f"{row['share']:7.1%} {row['ms']:10.2f} ms  {row['kind']:10s} {row['name']}"
    )
  print(
      "by kind: "
      + ", ".join(f"{k} {v:.1%}" for k, v in summary["by_kind"].items())
  )
  print(json.dumps(summary), flush=True)


if __name__ == "__main__":
  main()
