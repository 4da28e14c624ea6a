"""timm's ViT training step on one GPU (bf16 autocast, fused AdamW): gpu_bench.py's peer.

  python benchmarks/timm_gpu_bench.py --arch='{"B/16": [768, 12, 3072, 12, 16]}' --batch=256

Builds timm's VisionTransformer with the same widths as our variant (class token, qkv bias,
LayerNorm eps 1e-6, fused SDPA attention), so tiny smoke variants work too. For each mode
(torch.compile of the model, eager) and variant prints one JSON line: train_img_per_s (median of
--steps after --warmup), step time min/max and compile seconds. The step: forward under
bf16 autocast, cross-entropy, backward, AdamW (fused on CUDA), params f32. On a machine
without CUDA it runs on the CPU (a smoke check of this script, not a benchmark).
"""

import argparse
import json
import statistics
import sys
import time

import torch
import timm
from timm.models import vision_transformer


def build(width, depth, mlp_dim, heads, patch, res, num_classes):
  return vision_transformer.VisionTransformer(
      img_size=res,
      patch_size=patch,
      embed_dim=width,
      depth=depth,
      num_heads=heads,
      mlp_ratio=mlp_dim / width,
      num_classes=num_classes,
      class_token=True,
      global_pool="token",
  )


def bench_case(name, dims, mode, args, device):
  torch.manual_seed(0)
  model = build(*dims, args.res, args.num_classes).to(device).train()
  opt = torch.optim.AdamW(
      model.parameters(),
      lr=1e-3,
      weight_decay=1e-4,
      fused=device.type == "cuda",
  )
  fwd = torch.compile(model) if mode == "compile" else model
  x = torch.randn(args.batch, 3, args.res, args.res, device=device)
  y = torch.randint(0, args.num_classes, (args.batch,), device=device)
  loss_fn = torch.nn.CrossEntropyLoss()

  def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
      loss = loss_fn(fwd(x), y)
    loss.backward()
    opt.step()

  sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
  t0 = time.perf_counter()
  step()  # compiles under torch.compile
  sync()
  compile_s = time.perf_counter() - t0
  for _ in range(args.warmup):
    step()
  sync()
  times = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    step()
    sync()
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  out = dict(
      kind="timm",
      mode=mode,
      variant=name,
      batch=args.batch,
      res=args.res,
      train_img_per_s=args.batch / med,
      train_step_s=med,
      train_step_s_min=min(times),
      train_step_s_max=max(times),
      compile_s=compile_s,
      device=str(device),
      device_name=torch.cuda.get_device_name()
      if device.type == "cuda"
      else "cpu",
      torch_version=torch.__version__,
      timm_version=timm.__version__,
  )
  if device.type == "cuda":
    out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument(
      "--arch",
      required=True,
      help="JSON {name: [width, depth, mlp_dim, heads, patch]}, in run order",
  )
  p.add_argument(
      "--modes",
      default="compile,eager",
      help="in run order: every variant of the first mode, then of the next",
  )
  p.add_argument(
      "--compile_variants",
      default=None,
      help="comma-separated: the variants timed under torch.compile (default: all;"
      " gpu_bench.py --smoke: the first, as inductor's CPU compile dominates its cost)",
  )
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--res", type=int, default=224)
  p.add_argument("--num_classes", type=int, default=1000)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument(
      "--deadline",
      type=float,
      default=None,
      help="time.time() by which every case started must have finished",
  )
  p.add_argument(
      "--estimates",
      default='{"eager": 25, "compile": 90}',
      help="JSON: seconds a 12-block case of each mode takes, for --deadline",
  )
  args = p.parse_args()
  device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  if device.type == "cpu":
    torch.set_num_threads(2)  # the CPU smoke check, on a shared 2-core machine
  estimates = json.loads(args.estimates)
  compiled = None
  if args.compile_variants:
    compiled = args.compile_variants.split(",")
  for mode in args.modes.split(","):
    for name, dims in json.loads(args.arch).items():
      if mode == "compile" and compiled is not None and name not in compiled:
        print(
            json.dumps(
                dict(
                    kind="timm",
                    mode=mode,
                    variant=name,
                    skipped="not in --compile_variants",
                )
            ),
            flush=True,
        )
        continue
      # deeper: longer
      estimate = estimates.get(mode, 0) * max(1.0, dims[1] / 12) ** 0.5
      if args.deadline and time.time() + estimate > args.deadline:
        print(
            json.dumps(
                dict(kind="timm", mode=mode, variant=name, skipped="deadline")
            ),
            flush=True,
        )
        continue
      t0 = time.time()
      try:
        out = bench_case(name, dims, mode, args, device)
      except Exception as e:  # pylint: disable=broad-except  # e.g. OOM, a compile failure
        out = dict(
            kind="timm",
            mode=mode,
            variant=name,
            error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
        )
      out["elapsed_s"] = time.time() - t0
      print(json.dumps(out), flush=True)
      if device.type == "cuda":
        torch.cuda.empty_cache()
  sys.stdout.flush()


if __name__ == "__main__":
  main()
