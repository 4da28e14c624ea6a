"""Our ViT vs timm's on this machine's CPU, back to back, and the README results table.

  python benchmarks/bench_vs_timm.py --variant=Ti/16,S/16 --batch=32 --res=224 --rounds=3

Each round runs `python -m big_vit_lite.bench` and then timm
(benchmarks/timm_vit_bench.py, in the torch venv given by --timm_python or
$TIMM_PYTHON, default /work/venv-timm/bin/python) on the same config, so both
see the same machine load; the per-round ratio ours/timm is what to trust on a
shared machine, and the medians over rounds are reported. Every measurement
is appended to benchmarks/results.jsonl (with --label and the exact command
line) and benchmarks/RESULTS.md is regenerated from that file: the latest
result of each (label, config) in one table, so a before/after comparison is
two labels, e.g. `--label=baseline --ours_args="--model_kw={...}"`.

Without a timm venv (--timm_python=none) only our side is measured.
Setting up the timm venv (never in the project's .venv):
  python3 -m venv /work/venv-timm
  /work/venv-timm/bin/pip install torch==2.13.0      # CPU wheel
  /work/venv-timm/bin/pip install timm --no-deps huggingface_hub safetensors pyyaml pillow
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_JSONL = os.path.join(HERE, "results.jsonl")
RESULTS_MD = os.path.join(HERE, "RESULTS.md")


def cpu_name():
  try:
    with open("/proc/cpuinfo") as f:
      info = f.read()
    model = next(
        (
            l.split(":", 1)[1].strip()
            for l in info.splitlines()
            if l.startswith("model name")
        ),
        platform.processor(),
    )
    isa = "AVX-512" if "avx512f" in info else ("AVX2" if "avx2" in info else "")
    return f"{model} ({isa}), {os.cpu_count()} cores"
  except OSError:
    return platform.processor() or platform.machine()


def _last_json(stdout, what):
  for line in reversed(stdout.strip().splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  raise RuntimeError(
      f"{what} printed no JSON result; its output ended with:\n{stdout[-2000:]}"
  )


def run_ours(variant, batch, res, steps, warmup, extra):
  cmd = [
      sys.executable,
      "-m",
      "big_vit_lite.bench",
      f"--variant={variant}",
      f"--batch={batch}",
      f"--res={res}",
      f"--steps={steps}",
      f"--warmup={warmup}",
      *extra,
  ]
  p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if p.returncode:
    raise RuntimeError(f"{shlex.join(cmd)} failed:\n{p.stderr[-3000:]}")
  return _last_json(p.stdout, "big_vit_lite.bench")


def run_timm(python, variant, batch, res, steps, warmup, threads, extra_env=()):
  env = dict(os.environ)
  env.update(kv.split("=", 1) for kv in extra_env)
  # timm imports torchvision at import time; a ViT never uses it (see
  # timm_standin/).
  env["PYTHONPATH"] = os.path.join(HERE, "timm_standin")
  cmd = [
      python,
      os.path.join(HERE, "timm_vit_bench.py"),
      f"--variant={variant}",
      f"--batch={batch}",
      f"--res={res}",
      f"--steps={steps}",
      f"--warmup={warmup}",
      f"--threads={threads}",
  ]
  p = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, env=env)
  if p.returncode:
    raise RuntimeError(f"{shlex.join(cmd)} failed:\n{p.stderr[-3000:]}")
  return _last_json(p.stdout, "timm_vit_bench.py")


def _med(xs):
  xs = [x for x in xs if x is not None]
  return statistics.median(xs) if xs else None


def summarize(rounds, flops_train, flops_infer):
  """Medians over rounds of our/timm img/s, MFUs and the per-round ratios."""
  s = {}
  for side in ("ours", "timm"):
    for mode in ("train", "infer"):
      vals = [r[side][f"{mode}_img_per_s"] for r in rounds if r.get(side)]
      if vals:
        s[f"{side}_{mode}_img_per_s"] = statistics.median(vals)
        s[f"{side}_{mode}_img_per_s_min"] = min(vals)
        s[f"{side}_{mode}_img_per_s_max"] = max(vals)
  s["ours_train_mfu"] = _med([r["ours"].get("train_mfu") for r in rounds])
  s["ours_infer_mfu"] = _med([r["ours"].get("infer_mfu") for r in rounds])
  s["ours_calib_gflops"] = _med([r["ours"]["calib_gflops"] for r in rounds])
  if all(r.get("timm") for r in rounds):
    # timm's MFU: the same step FLOPs (same model and step) at timm's speed,
    # against torch's matmul timed in timm's process.
    for mode, flops in (("train", flops_train), ("infer", flops_infer)):
      s[f"timm_{mode}_mfu"] = _med(
          [
              flops
              / r["timm"][f"{mode}_step_s"]
              / 1e9
              / r["timm"]["calib_gflops"]
              for r in rounds
          ]
      )
      ratios = [
          r["ours"][f"{mode}_img_per_s"] / r["timm"][f"{mode}_img_per_s"]
          for r in rounds
      ]
      s[f"{mode}_ratio"] = statistics.median(ratios)
      s[f"{mode}_ratio_min"] = min(ratios)
      s[f"{mode}_ratio_max"] = max(ratios)
      # CPU seconds per step (timm's / ours): what each framework costs the
      # machine, far less sensitive to the neighbours' load than wall time.
      cpu = [
          r["timm"][f"{mode}_cpu_s"] / r["ours"][f"{mode}_cpu_s"]
          for r in rounds
          if r["timm"].get(f"{mode}_cpu_s") and r["ours"].get(f"{mode}_cpu_s")
      ]
      if cpu:
        s[f"{mode}_cpu_ratio"] = statistics.median(cpu)
    s["timm_calib_gflops"] = _med([r["timm"]["calib_gflops"] for r in rounds])
  return s


def _fmt(x, spec=".2f"):
  return "-" if x is None else format(x, spec)


def render_markdown(records):
  """RESULTS.md from results.jsonl: the latest record per (label, config)."""
  latest = {}
  for r in records:
    key = (
        r["label"],
        r["variant"],
        r["batch"],
        r["res"],
        r["dtype"],
        r["machine"],
    )
    latest[key] = r
  rows = sorted(
      latest.values(),
      key=lambda r: (
          r["machine"],
          r["variant"],
          r["batch"],
          r["res"],
          r["date"],
      ),
  )
  out = [
      "# Benchmark results",
      "",
      "Regenerated by `benchmarks/bench_vs_timm.py` from `benchmarks/results.jsonl`; do not edit by",
      "hand. Training: forward + softmax xent + backward + AdamW, f32, random data (no input",
      "pipeline). Ours and timm (PyTorch CPU, 2 threads) run back to back in each round; the",
      "ratio is the median of the per-round ratios (min-max in brackets), img/s are medians over",
      "rounds. MFU: achieved FLOP/s (our step's FLOPs; the same count for timm) over a square",
      "matmul timed in the same process (`jnp.dot` for ours, `torch.mm` for timm). Step FLOPs:",
      "XLA's cost analysis (elementwise work included) in rows before 2026-12-05, model FLOPs",
      "(the matmuls of the step's jaxpr, big_vit_lite/runtime/flops.py: ~1% fewer on CPU) from then on.",
      "The machines are shared, so absolute img/s drift; the ratios are the figures to quote.",
      "CPU-time ratio: timm's process CPU seconds per training step over ours (median over",
      "rounds); it tracks each framework's own cost even when the neighbours' load swamps wall",
      "time, but counts spinning threads as work. Rows taken at different times saw different",
      "load (the `baseline` and `optimized` rows ran against timm's default OpenMP spin-waiting",
      "on a heavily shared CPU, which slows torch 3-4x): compare code versions with",
      "`benchmarks/ab_vit.py` (in-process A/B), not across rows.",
      "",
      "| label | machine | config | ours train img/s | timm train img/s | train ratio | "
      "train CPU-time ratio | ours infer img/s | timm infer img/s | infer ratio | ours train MFU | "
      "timm train MFU | rounds | date |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    s = r["summary"]
    cfg = f"{r['variant']} b{r['batch']} {r['res']}px {r['dtype']}"
    ratio = lambda m: (
        f"{_fmt(s.get(m + '_ratio'))} ({_fmt(s.get(m + '_ratio_min'))}-"
        f"{_fmt(s.get(m + '_ratio_max'))})"
        if s.get(m + "_ratio")
        else "-"
    )
    out.append(
        f"| {r['label']} | {r['machine']} | {cfg} | {_fmt(s.get('ours_train_img_per_s'))} | "
        f"{_fmt(s.get('timm_train_img_per_s'))} | {ratio('train')} | {_fmt(s.get('train_cpu_ratio'))} | "
        f"{_fmt(s.get('ours_infer_img_per_s'))} | {_fmt(s.get('timm_infer_img_per_s'))} | "
        f"{ratio('infer')} | {_fmt(s.get('ours_train_mfu'), '.0%')} | "
        f"{_fmt(s.get('timm_train_mfu'), '.0%')} | {r['rounds']} | {r['date'][:16]} |"
    )
  out += ["", "## Commands", ""]
  seen = set()
  for r in rows:
    line = f"- `{r['label']}`: `{r['command']}`"
    if line not in seen:
      seen.add(line)
      out.append(line)
  return "\n".join(out) + "\n"


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument(
      "--variant", default="Ti/16", help="comma-separated, e.g. Ti/16,S/16"
  )
  p.add_argument("--batch", default="32", help="comma-separated batch sizes")
  p.add_argument("--res", type=int, default=224)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument(
      "--threads", type=int, default=2, help="torch threads for timm"
  )
  p.add_argument(
      "--timm_python",
      default=os.environ.get("TIMM_PYTHON", "/work/venv-timm/bin/python"),
      help="python of a venv with torch + timm, or 'none' to skip timm",
  )
  p.add_argument(
      "--timm_env",
      action="append",
      default=[],
      help="KEY=VALUE for timm's process (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE: "
      "on a shared CPU, OpenMP's default spin-waiting makes torch 3-4x slower",
  )
  p.add_argument(
      "--ours_args",
      default="",
      help="extra flags for big_vit_lite.bench, e.g. '--calib_n=64 --model_kw=...'",
  )
  p.add_argument(
      "--label",
      default="default",
      help="names this configuration in RESULTS.md",
  )
  p.add_argument(
      "--no_write",
      action="store_true",
      help="print only; leave results files alone",
  )
  p.add_argument(
      "--render_only",
      action="store_true",
      help="measure nothing: regenerate RESULTS.md from results.jsonl",
  )
  args = p.parse_args()
  if args.render_only:
    write_markdown()
    return

  with_timm = args.timm_python.lower() != "none"
  if with_timm and not os.path.exists(args.timm_python):
    sys.exit(
        f"timm python {args.timm_python} not found: set up the timm venv (see this "
        "script's docstring), pass --timm_python=PATH, or --timm_python=none"
    )
  extra = shlex.split(args.ours_args)
  machine = cpu_name()
  command = shlex.join(["python", "benchmarks/bench_vs_timm.py", *sys.argv[1:]])
  for variant in args.variant.split(","):
    for batch in (int(b) for b in args.batch.split(",")):
      rounds = []
      for i in range(args.rounds):
        ours = run_ours(
            variant, batch, args.res, args.steps, args.warmup, extra
        )
        timm = (
            run_timm(
                args.timm_python,
                variant,
                batch,
                args.res,
                args.steps,
                args.warmup,
                args.threads,
                args.timm_env,
            )
            if with_timm
            else None
        )
        rounds.append(dict(ours=ours, timm=timm))
        msg = (
            f"[{variant} b{batch} round {i + 1}/{args.rounds}] ours train "
            f"{ours['train_img_per_s']:.2f} infer {ours['infer_img_per_s']:.2f} img/s "
            f"(MFU {ours['train_mfu']:.0%}, calib {ours['calib_gflops']:.0f} GFLOP/s)"
        )
        if timm:
          msg += (
              f" | timm train {timm['train_img_per_s']:.2f} infer "
              f"{timm['infer_img_per_s']:.2f} | ratio train "
              f"{ours['train_img_per_s'] / timm['train_img_per_s']:.2f} infer "
              f"{ours['infer_img_per_s'] / timm['infer_img_per_s']:.2f}"
          )
        print(msg, flush=True)
      summary = summarize(
          rounds,
          rounds[0]["ours"]["train_step_flops"],
          rounds[0]["ours"]["infer_step_flops"],
      )
      record = dict(
          label=args.label,
          variant=variant,
          batch=batch,
          res=args.res,
          dtype=rounds[0]["ours"]["dtype"],
          machine=machine,
          rounds=len(rounds),
          date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
          command=command,
          summary=summary,
          raw=rounds,
      )
      print(json.dumps(dict(record, raw=None)), flush=True)
      if not args.no_write:
        with open(RESULTS_JSONL, "a") as f:
          f.write(json.dumps(record) + "\n")
  if not args.no_write:
    write_markdown()


def write_markdown():
  with open(RESULTS_JSONL) as f:
    records = [json.loads(l) for l in f if l.strip()]
  # summaries from the raw rounds, so new summary fields show up
  for r in records:
    if r.get("raw"):
      r["summary"] = summarize(
          r["raw"],
          r["raw"][0]["ours"]["train_step_flops"],
          r["raw"][0]["ours"]["infer_step_flops"],
      )
  # The GPU section (appended by gpu_bench.py) is kept as it is.
  gpu = ""
  if os.path.exists(RESULTS_MD):
    text = open(RESULTS_MD).read()
    marker = "\n## GPU runs"
    gpu = text[text.index(marker) :] if marker in text else ""
  with open(RESULTS_MD, "w") as f:
    f.write(render_markdown(records) + gpu)
  print(f"wrote {RESULTS_MD}")


if __name__ == "__main__":
  main()
