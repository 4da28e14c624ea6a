"""Our ViT training step vs timm's on one NVIDIA GPU, with A/B variants: one command, < 8 min.

  bash benchmarks/gpu_bench.sh                 # on a GPU machine (jax[cuda]; torch+timm optional)
  bash benchmarks/gpu_bench.sh --smoke         # tiny variants on a CPU: checks the script itself
  python benchmarks/gpu_bench.py --render=FILE.jsonl   # append a saved run to RESULTS.md

Runs from a checkout without installing (the repo root goes on sys.path) and needs only
jax, flax, optax, numpy and absl (+ torch and timm for the peer). In order, each group in its
own process (so that JAX and torch never hold the GPU at the same time), within --budget_s:
  1. numerics: the padded+masked attention equals the unpadded one (XLA); cuDNN flash attention
     vs XLA attention at B/16 shapes, values and gradients, within bf16 tolerance. Chooses the
     cuDNN token padding (models/ops.CUDNN_SEQ_MULTIPLE 8, else 64) for the rest of the run.
  2. ours, B/16 and L/16, the defaults (attention auto = cuDNN on a GPU, no remat), bf16.
  3. timm B/16 and L/16, torch.compile then eager (bf16 autocast, fused AdamW, fused SDPA).
  4. A/B on B/16: remat on, attention custom / xla, bf16 residual stream, cuDNN padding 64,
     and an XLA GPU flag preset (its own process: XLA reads flags at start).
Same batch (256) and 224 px everywhere. A case that would not finish before its group's
deadline is skipped (and listed), so the run stops cleanly with what it has. Model MFU:
model FLOPs (big_vit_lite/runtime/flops.py, our step's jaxpr; timm at the same FLOPs per image) over
the datasheet peak (devices.py). Prints elapsed time per case, a summary table, appends it
to benchmarks/RESULTS.md, and writes JSON lines (and the table) to $OUT/ when OUT is set.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# no install needed: `import big_vit_lite` from the checkout
sys.path.insert(0, ROOT)

# XLA GPU flag presets for the A/B (XLA_FLAGS of a separate process).
FLAG_PRESETS = {
    "cublas_gemms": "--xla_gpu_enable_triton_gemm=false",
    "latency_hiding": "--xla_gpu_enable_latency_hiding_scheduler=true",
}
# Seconds a case takes, compile included (H200 estimates), for the deadline
# decisions.
ESTIMATE_S = {"B/16": 45, "L/16": 80, "timm eager": 25, "timm compile": 75}
SMOKE_VARIANTS = {"B/16": "mu/8", "L/16": "mu/16"}


def emit(d):
  print(json.dumps(d), flush=True)


def _one_line(e):
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


# ------------------------------------------------------------------------------
# JAX worker


def numerics(variant="B/16", res=224, batch=4):
  """Padded attention == unpadded (XLA); cuDNN vs XLA attention, op and 2-block model, at
  `variant`'s widths and `res` (B/16 at 224 px: 197 tokens, 12 heads of 64; --smoke: its tiny
  variant at the smoke's resolution)."""
  import jax
  import jax.numpy as jnp
  from big_vit_lite.models import vit
  from big_vit_lite.models import ops

  out = dict(kind="numerics")
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  arch = vit.decode_variant(variant)
  tokens = (res // arch["patch_size"]) ** 2 + 1
  heads = arch["num_heads"]
  shape = (batch, tokens, heads, arch["width"] // heads)
  q, k, v, g = (jax.random.normal(r, shape, jnp.float32) for r in keys)

  def vjp(fn, *args):
    y, back = jax.vjp(fn, *args)
    return (y, *back(g.astype(y.dtype)))

  def rel(a, b):
    a, b = (jnp.asarray(x, jnp.float32) for x in (a, b))
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))

  xla = jax.jit(
      lambda *a: vjp(
          lambda q, k, v: jax.nn.dot_product_attention(
              q, k, v, implementation="xla"
          ),
          *a,
      )
  )
  padded = jax.jit(
      lambda *a: vjp(
          lambda q, k, v: vit.padded_attention(q, k, v, implementation="xla"),
          *a,
      )
  )
  out["padded_xla_vs_xla_rel_err"] = max(
      rel(a, b) for a, b in zip(padded(q, k, v), xla(q, k, v))
  )
  if not vit.on_cuda():
    out["cudnn"] = f"skipped: no CUDA GPU (backend {jax.default_backend()})"
    # The model-level comparison all the same, of the two attentions a CPU has.
    out.update(
        compare_models(
            "custom", "xla", "float32", keys[0], batch, arch, min(res, 64)
        )
    )
    return out
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  ref = xla(qb, kb, vb)
  for multiple in dict.fromkeys((ops.CUDNN_SEQ_MULTIPLE, 64)):
    try:
      cudnn = jax.jit(
          lambda *a, m=multiple: vjp(
              lambda q, k, v: vit.padded_attention(
                  q, k, v, implementation="cudnn", multiple=m
              ),
              *a,
          )
      )
      out["cudnn_vs_xla_attention_rel_err"] = max(
          rel(a, b) for a, b in zip(cudnn(qb, kb, vb), ref)
      )
      out["seq_multiple"] = ops.CUDNN_SEQ_MULTIPLE = multiple
      break
    except Exception as e:  # pylint: disable=broad-except  # cuDNN refused this padding
      out[f"cudnn_error_multiple_{multiple}"] = _one_line(e)
  if "seq_multiple" not in out:
    return out
  out.update(
      compare_models("cudnn", "xla", "bfloat16", keys[0], batch, arch, res)
  )
  out["pass"] = (
      max(
          out["cudnn_vs_xla_attention_rel_err"],
          out["model_loss_rel_err"],
          out["model_grad_rel_err"],
      )
      < 3e-2
  )
  return out


def compare_models(kind, ref_kind, dtype_mm, key, batch, arch, res):
  """A 2-block model of `arch`'s widths, attention=kind vs ref_kind: loss and grads, same
  params."""
  import jax
  import jax.numpy as jnp
  from big_vit_lite.models import vit

  kw = dict(
      num_classes=10,
      variant=None,
      width=arch["width"],
      depth=2,
      mlp_dim=arch["mlp_dim"],
      num_heads=arch["num_heads"],
      patch_size=arch["patch_size"],
      dtype_mm=dtype_mm,
  )
  images = jax.random.normal(key, (batch, res, res, 3))
  params = vit.Model(**kw, attention=ref_kind).init(
      jax.random.PRNGKey(1), images
  )["params"]
  results = {}
  for attention in (kind, ref_kind):
    model = vit.Model(**kw, attention=attention)
    fn = lambda p, m=model: jnp.sum(
        m.apply({"params": p}, images, train=True)[1]["encoded"] ** 2
    )
    results[attention] = jax.jit(jax.value_and_grad(fn))(params)
  (loss, grads), (loss_ref, grads_ref) = results[kind], results[ref_kind]
  norm = lambda t: float(
      jnp.sqrt(
          sum(
              jnp.sum(jnp.square(x.astype(jnp.float32)))
              for x in jax.tree.leaves(t)
          )
      )
  )
  # All gradients as one vector: |a - b| / |b| (a leaf-wise max would weigh tiny
  # ones).
  diff = jax.tree.map(
      lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32),
      grads,
      grads_ref,
  )
  return dict(
      model_compared=f"{kind} vs {ref_kind}",
      model_loss_rel_err=abs(float(loss) - float(loss_ref))
      / abs(float(loss_ref)),
      model_grad_rel_err=norm(diff) / norm(grads_ref),
  )


def worker_ours(args):
  import jax
  from big_vit_lite import bench
  from big_vit_lite.runtime import devices
  from big_vit_lite.models import vit
  from big_vit_lite.models import ops

  dev = jax.devices()[0]
  peak = devices.datasheet_peak(dev, args.dtype)
  emit(
      dict(
          kind="device",
          device_kind=dev.device_kind,
          platform=dev.platform,
          jax_version=jax.__version__,
          xla_flags=os.environ.get("XLA_FLAGS", ""),
          datasheet_peak_tflops=peak / 1e12 if peak else None,
      )
  )
  if args.seq_multiple:  # what an earlier worker's numerics check found
    ops.CUDNN_SEQ_MULTIPLE = args.seq_multiple
  if args.no_cudnn:
    vit.on_cuda = lambda: False  # "auto" takes custom
  if args.numerics:
    t0 = time.time()
    try:
      out = numerics(args.numerics_variant, args.numerics_res)
    except Exception as e:  # pylint: disable=broad-except
      out = dict(kind="numerics", error=_one_line(e))
    if vit.on_cuda() and "seq_multiple" not in out:
      out["auto_attention"] = "custom: cuDNN refused every padding tried"
      vit.on_cuda = lambda: False
    out["elapsed_s"] = time.time() - t0
    emit(out)
  calib = bench.calibrate_matmul(args.calib_n, args.dtype, reps=5)
  default_multiple = ops.CUDNN_SEQ_MULTIPLE
  for case in json.loads(args.cases):
    base = dict(kind="ours", **case)
    if time.time() + case["estimate_s"] > args.deadline:
      emit(dict(base, skipped="deadline"))
      continue
    t0 = time.time()
    ops.CUDNN_SEQ_MULTIPLE = case.get("seq_multiple") or default_multiple
    try:
      model = bench.build_model(
          case["variant"],
          args.num_classes,
          args.dtype,
          "none",
          False,
          case["model_kw"],
      )
      out = bench.bench_model(
          model,
          batch=args.batch,
          res=args.res,
          num_classes=args.num_classes,
          mode=("train",),
          steps=args.steps,
          warmup=args.warmup,
          calib_gflops=calib,
          peak_flops=peak,
      )
      out.update(
          base,
          attention=model.resolved_attention(),
          seq_multiple=ops.CUDNN_SEQ_MULTIPLE,
          calib_gflops=calib,
          device_kind=dev.device_kind,
          **bench.peak_memory(),
      )
    except Exception as e:  # pylint: disable=broad-except  # OOM, a refused kernel, ...
      out = dict(base, error=_one_line(e))
      jax.clear_caches()
    out["elapsed_s"] = time.time() - t0
    emit(out)


# ------------------------------------------------------------------------------
# driver


def run_group(name, cmd, env, deadline, log):
  """Runs one worker until it exits or the deadline (+30 s grace) passes; its JSON lines."""
  print(
      f"== {name}: {' '.join(cmd[1:3])}... ({deadline - time.time():.0f} s left)",
      flush=True,
  )
  t0 = time.time()
  try:
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
  except OSError as e:
    return [dict(kind=name, error=_one_line(e))]
  lines, err = [], []

  def read_out():
    for line in proc.stdout:
      if line.startswith("{"):
        d = json.loads(line)
        lines.append(d)
        log(d)

  threads = [
      threading.Thread(target=read_out),
      threading.Thread(target=lambda: err.extend(proc.stderr)),
  ]
  for t in threads:
    t.start()
  try:
    proc.wait(timeout=max(1.0, deadline + 30 - time.time()))
  except subprocess.TimeoutExpired:
    proc.kill()
    lines.append(dict(kind=name, error="killed at the deadline"))
    log(lines[-1])
  for t in threads:
    t.join()
  # the worker's log, for a closer look at what went wrong
  if os.environ.get("OUT"):
    with open(
        os.path.join(os.environ["OUT"], f"gpu_bench_{name}.log"), "w"
    ) as f:
      f.writelines(err)
  if proc.returncode and not any(
      d.get("kind") in ("ours", "timm") for d in lines
  ):
    tail = [l.strip() for l in err if l.strip()][-1:] or ["?"]
    lines.append(
        dict(kind=name, error=f"exit {proc.returncode}: {tail[0][:300]}")
    )
    log(lines[-1])
  print(f"   {name}: {time.time() - t0:.0f} s", flush=True)
  return lines


def _log_line(d):
  what = d.get("name") or d.get("kind")
  if d.get("kind") == "timm":
    what = f"timm {d.get('variant')} {d.get('mode')}"
  if "error" in d:
    msg = f"ERROR {d['error']}"
  elif "skipped" in d:
    msg = f"skipped ({d['skipped']})"
  elif d.get("kind") == "numerics":
    msg = ", ".join(
        f"{k}={v:.2g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in d.items()
        if k != "kind"
    )
  elif "train_img_per_s" in d:
    mfu = d.get("train_mfu")
    msg = (
        f"{d['train_img_per_s']:.1f} img/s"
        + (f", model MFU {mfu:.1%}" if mfu else "")
        + f" [{d.get('elapsed_s', 0):.0f} s]"
    )
  else:
    msg = json.dumps(d)[:200]
  print(f"   {what}: {msg}", flush=True)


def summarize(rows):
  """Markdown table (one row per case) with ratios to timm and to our default step."""
  device = next((r for r in rows if r.get("kind") == "device"), {})
  peak = (device.get("datasheet_peak_tflops") or 0) * 1e12
  ours = [r for r in rows if r.get("kind") == "ours" and "train_img_per_s" in r]
  defaults = {r["variant"]: r for r in ours if r.get("default")}
  timm = {
      (r["variant"], r["mode"]): r
      for r in rows
      if r.get("kind") == "timm" and "train_img_per_s" in r
  }
  flops_per_img = {
      r["variant"]: r["train_step_flops"] / r["batch"] for r in ours
  }
  out = [
      "| case | train img/s | model MFU | vs timm compile | vs timm eager | vs our default |",
      "|---|---|---|---|---|---|",
  ]
  fmt = lambda x, spec: "" if x is None else format(x, spec)
  for r in rows:
    kind = r.get("kind")
    if kind not in ("ours", "timm"):
      continue
    name = r["name"] if kind == "ours" else f"timm {r['variant']} {r['mode']}"
    variant = r.get("variant")
    if "train_img_per_s" not in r:
      out.append(
          f"| {name} | {r.get('error') or 'skipped: ' + str(r.get('skipped'))} "
          "| | | | |"
      )
      continue
    img_s = r["train_img_per_s"]
    mfu = (
        r.get("train_mfu")
        if kind == "ours"
        else (
            img_s * flops_per_img[variant] / peak
            if peak and variant in flops_per_img
            else None
        )
    )
    ratio = lambda mode: (
        img_s / timm[variant, mode]["train_img_per_s"]
        if kind == "ours" and (variant, mode) in timm
        else None
    )
    default = defaults.get(variant)
    vs_default = (
        img_s / default["train_img_per_s"]
        if kind == "ours" and default
        else None
    )
    out.append(
        f"| {name} | {img_s:.1f} | {fmt(mfu, '.1%')} | {fmt(ratio('compile'), '.2f')} "
        f"| {fmt(ratio('eager'), '.2f')} | {fmt(vs_default, '.3f')} |"
    )
  # model FLOPs must not depend on remat, attention kind or flags
  for r in ours:
    default = defaults.get(r["variant"])
    if (
        default
        and not r.get("seq_multiple")
        and r["train_step_flops"] != default["train_step_flops"]
    ):
      out.append(
          f"\nnote: {r['name']}: model FLOPs {r['train_step_flops']:.4e} differ from the "
          f"default's {default['train_step_flops']:.4e}"
      )
  num = next((r for r in rows if r.get("kind") == "numerics"), None)
  if num:
    out += [
        "",
        "numerics: "
        + ", ".join(
            f"{k}={v:.2g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in num.items()
            if k not in ("kind", "elapsed_s")
        ),
    ]
  return "\n".join(out)


def append_results(md_path, rows, table):
  device = next((r for r in rows if r.get("kind") == "device"), {})
  timm = next(
      (r for r in rows if r.get("kind") == "timm" and r.get("torch_version")),
      {},
  )
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
  head = (
      f"### {date} UTC: {device.get('device_kind', '?')}, jax {device.get('jax_version', '?')}"
      + (
          f", torch {timm['torch_version']} / timm {timm['timm_version']}"
          if timm
          else ""
      )
  )
  text = (
      open(md_path).read()
      if os.path.exists(md_path)
      else "# Benchmark results\n"
  )
  if GPU_SECTION not in text:
    text = (
        text.rstrip("\n")
        + "\n\n"
        + GPU_SECTION
        + "\n\n"
        + GPU_SECTION_INTRO
        + "\n"
    )
  with open(md_path, "w") as f:
    f.write(text.rstrip("\n") + f"\n\n{head}\n\n{table}\n")


GPU_SECTION = "## GPU runs (benchmarks/gpu_bench.py)"
GPU_SECTION_INTRO = (
    "Appended by `bash benchmarks/gpu_bench.sh`: training step (fwd, softmax "
    "xent, bwd, AdamW), batch 256, 224 px, bf16 matmuls; timm with bf16 "
    "autocast and fused AdamW in the same run. Model MFU: the matmul FLOPs of "
    "our step's jaxpr (timm: the same per image) over the datasheet peak."
)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--worker", choices=["ours"], help=argparse.SUPPRESS)
  p.add_argument("--cases", help=argparse.SUPPRESS)
  p.add_argument("--numerics", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--numerics_variant", default="B/16", help=argparse.SUPPRESS)
  p.add_argument(
      "--numerics_res", type=int, default=224, help=argparse.SUPPRESS
  )
  p.add_argument(
      "--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS
  )
  p.add_argument("--seq_multiple", type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument("--no_cudnn", action="store_true", help=argparse.SUPPRESS)
  p.add_argument(
      "--budget_s",
      type=float,
      default=450,
      help="whole run, seconds (a worker past its deadline is killed 30 s later)",
  )
  p.add_argument(
      "--only",
      default="numerics,main,timm,ab,flags",
      help="groups to run, of numerics,main,timm,ab,flags",
  )
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--res", type=int, default=224)
  p.add_argument("--num_classes", type=int, default=1000)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--calib_n", type=int, default=8192)
  p.add_argument(
      "--flags",
      default="cublas_gemms",
      help=f"XLA flag preset: {list(FLAG_PRESETS)}",
  )
  p.add_argument(
      "--timm_python", default=sys.executable, help="python with torch + timm"
  )
  p.add_argument(
      "--results_md",
      default=None,
      help="markdown file the summary is appended to ('none': no file; default "
      "benchmarks/RESULTS.md, none with --smoke)",
  )
  p.add_argument(
      "--render", help="append the run saved in this JSONL file to --results_md"
  )
  p.add_argument(
      "--smoke",
      action="store_true",
      help="tiny variants on a CPU: checks the script",
  )
  args = p.parse_args()
  if args.worker:
    return worker_ours(args)
  # A --smoke run checks the script: its CPU figures stay out.
  if args.results_md is None:
    args.results_md = "none" if args.smoke else os.path.join(HERE, "RESULTS.md")
  if args.render:
    rows = [json.loads(l) for l in open(args.render) if l.strip()]
    append_results(args.results_md, rows, summarize(rows))
    return print(f"appended {args.render} to {args.results_md}")

  if args.smoke:
    args.batch, args.res, args.steps, args.warmup, args.calib_n = (
        4,
        32,
        1,
        1,
        256,
    )
  variant = lambda v: SMOKE_VARIANTS[v] if args.smoke else v
  estimate = lambda key: 10 if args.smoke else ESTIMATE_S[key]
  case = lambda name, v, model_kw=None, seq_multiple=None, default=False: dict(
      name=name.replace(v, variant(v)),
      variant=variant(v),
      model_kw=model_kw or {},
      seq_multiple=seq_multiple,
      estimate_s=estimate(v),
      default=default,
  )
  main_cases = [
      case("ours B/16", "B/16", default=True),
      case("ours L/16", "L/16", default=True),
  ]
  ab_cases = [
      case(
          "ours B/16 remat=nothing_saveable",
          "B/16",
          {"remat_policy": "nothing_saveable"},
      ),
      case("ours B/16 attention=custom", "B/16", {"attention": "custom"}),
      case("ours B/16 dtype_act=bfloat16", "B/16", {"dtype_act": "bfloat16"}),
      case("ours B/16 attention=xla", "B/16", {"attention": "xla"}),
      case("ours B/16 cuDNN padding 64", "B/16", seq_multiple=64),
  ]
  flags_cases = [case(f"ours B/16 XLA_FLAGS={args.flags}", "B/16")]
  groups = set(args.only.split(","))
  # Seconds per group (what one leaves goes to the next), in run order.
  share = dict(main=200, timm=195, ab=40, flags=15)

  env = dict(
      os.environ,
      PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
      TF_CPP_MIN_LOG_LEVEL="2",
  )
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  common = [
      f"--batch={args.batch}",
      f"--res={args.res}",
      f"--num_classes={args.num_classes}",
      f"--dtype={args.dtype}",
      f"--steps={args.steps}",
      f"--warmup={args.warmup}",
      f"--calib_n={args.calib_n}",
  ]
  t_end = time.time() + args.budget_s
  spent_until = time.time()
  rows = []
  out_dir = os.environ.get("OUT")
  jsonl = None
  if out_dir:
    # $OUT names where the results go: made if it is not there yet.
    os.makedirs(out_dir, exist_ok=True)
    jsonl = open(os.path.join(out_dir, "gpu_bench.jsonl"), "a")

  def log(d):
    _log_line(d)
    if jsonl:
      jsonl.write(json.dumps(d) + "\n")
      jsonl.flush()

  def ours(cases, numerics_too, extra_env=None, group="main"):
    nonlocal spent_until
    deadline = min(t_end, max(time.time(), spent_until) + share[group])
    spent_until = deadline
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker=ours",
        f"--cases={json.dumps(cases)}",
        f"--deadline={deadline}",
        *common,
    ]
    if numerics_too:
      cmd.append("--numerics")
      if args.smoke:
        # The check's code at the tiny variant's shapes (B/16's: ~2 s more CPU).
        cmd += [
            f"--numerics_variant={variant('B/16')}",
            f"--numerics_res={args.res}",
        ]
    num = next((r for r in rows if r.get("kind") == "numerics"), {})
    if num.get("seq_multiple"):
      cmd.append(f"--seq_multiple={num['seq_multiple']}")
    if num.get("auto_attention"):
      cmd.append("--no_cudnn")
    rows.extend(
        run_group(group, cmd, dict(env, **(extra_env or {})), deadline, log)
    )

  start = time.time()
  if groups & {"numerics", "main"}:
    ours(main_cases if "main" in groups else [], "numerics" in groups)
  if "timm" in groups:
    deadline = min(t_end, max(time.time(), spent_until) + share["timm"])
    spent_until = deadline
    probe = subprocess.run(
        [args.timm_python, "-c", "import torch, timm"],
        capture_output=True,
        text=True,
        env=dict(env, PYTHONPATH=os.path.join(HERE, "timm_standin")),
    )
    if probe.returncode:
      print(
          f"timm: skipped (torch/timm not importable by {args.timm_python})",
          flush=True,
      )
    else:
      from big_vit_lite.models import vit  # pylint: disable=g-import-not-at-top

      arch = {}
      for v in ("B/16", "L/16"):
        a = vit.decode_variant(variant(v))
        arch[variant(v)] = [
            a["width"],
            a["depth"],
            a["mlp_dim"],
            a["num_heads"],
            a["patch_size"],
        ]
      cmd = [
          args.timm_python,
          os.path.join(HERE, "timm_gpu_bench.py"),
          f"--arch={json.dumps(arch)}",
          f"--batch={args.batch}",
          f"--res={args.res}",
          f"--steps={args.steps}",
          f"--warmup={args.warmup}",
          f"--deadline={deadline}",
          "--estimates="
          + json.dumps(
              {m: estimate(f"timm {m}") for m in ("eager", "compile")}
          ),
      ]
      if args.smoke:
        cmd.append(f"--compile_variants={variant('B/16')}")
      # timm imports torchvision, which a ViT never uses: the stand-in
      # (timm_standin/) if absent.
      has_tv = (
          subprocess.run(
              [args.timm_python, "-c", "import torchvision"],
              capture_output=True,
          ).returncode
          == 0
      )
      timm_env = (
          dict(env)
          if has_tv
          else dict(env, PYTHONPATH=os.path.join(HERE, "timm_standin"))
      )
      rows.extend(run_group("timm", cmd, timm_env, deadline, log))
  if "ab" in groups:
    ours(ab_cases, False, group="ab")
  if "flags" in groups:
    ours(
        flags_cases,
        False,
        {
            "XLA_FLAGS": (
                (
                    env.get("XLA_FLAGS", "") + " " + FLAG_PRESETS[args.flags]
                ).strip()
            )
        },
        group="flags",
    )
  table = summarize(rows)
  print(f"\n{table}\n\ntotal {time.time() - start:.0f} s", flush=True)
  if out_dir:
    with open(os.path.join(out_dir, "gpu_bench.md"), "w") as f:
      f.write(table + "\n")
  if args.results_md.lower() != "none":
    append_results(args.results_md, rows, table)
    print(f"appended to {args.results_md}")


if __name__ == "__main__":
  main()
