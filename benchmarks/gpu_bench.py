"""ViT-B/16 and L/16 training throughput and MFU on one NVIDIA GPU (bf16 matmuls).

  bash benchmarks/gpu_bench.sh            # on a machine with a GPU and jax[cuda]
  python benchmarks/gpu_bench.py --smoke  # tiny CPU run: checks the script itself

For each variant: the largest batch from --batches that compiles and runs
(an out-of-memory batch is skipped, so the list goes from large to small),
its training img/s, and MFU against a bf16 matmul timed in this script
(`calib_gflops`, --calib_n square, f32 accumulation) as well as against the
datasheet peak. One JSON line per variant; the last line is a summary.
"""
import argparse
import json
import sys

import jax

from big_vit_lite import bench
from big_vit_lite import devices


def _oom(e):
  text = str(e).lower()
  return "resource_exhausted" in text or "out of memory" in text or "oom" in text


def run_variant(variant, batches, res, dtype, steps, warmup, calib, peak, model_kw):
  errors = []
  for batch in batches:
    model = bench.build_model(variant, 1000, dtype, "none", False, model_kw)
    try:
      out = bench.bench_model(model, batch=batch, res=res, num_classes=1000,
                              mode=("train",), steps=steps, warmup=warmup,
                              calib_gflops=calib, peak_flops=peak)
    except Exception as e:  # pylint: disable=broad-except
      if not _oom(e):
        raise
      errors.append(f"batch {batch}: out of memory")
      jax.clear_caches()
      continue
    out.update(variant=variant, dtype=dtype, skipped=errors, model_kw=model_kw)
    out.update(bench.peak_memory())
    return out
  raise RuntimeError(f"{variant}: no batch in {batches} fits: {errors}")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variants", default="B/16,L/16")
  p.add_argument("--batches", default="1024,768,512,384,256,128",
                 help="tried from left to right; the first that fits is measured")
  p.add_argument("--res", type=int, default=224)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--calib_n", type=int, default=8192)
  p.add_argument("--model_kw", default="{}", help="JSON dict of extra vit.Model kwargs")
  p.add_argument("--smoke", action="store_true",
                 help="tiny model/batch/matmul: checks the script on a CPU")
  args = p.parse_args()

  variants, batches = args.variants.split(","), [int(b) for b in args.batches.split(",")]
  res, steps, warmup, calib_n = args.res, args.steps, args.warmup, args.calib_n
  if args.smoke:
    variants, batches, res, steps, warmup, calib_n = ["mu/8"], [4, 2], 32, 2, 1, 256
  model_kw = json.loads(args.model_kw)

  dev = jax.devices()[0]
  print(f"# device: {dev.device_kind} x{jax.device_count()}, jax {jax.__version__}",
        file=sys.stderr)
  calib = bench.calibrate_matmul(calib_n, args.dtype, reps=10)
  peak = devices.datasheet_peak(dev, args.dtype)
  results = []
  for variant in variants:
    r = run_variant(variant, batches, res, args.dtype, steps, warmup, calib, peak, model_kw)
    r.update(device_kind=dev.device_kind, calib_gflops=calib, calib_n=calib_n,
             datasheet_peak_tflops=peak / 1e12 if peak else None)
    print(json.dumps(r), flush=True)
    results.append(r)
  summary = {r["variant"]: dict(batch=r["batch"], img_per_s=round(r["train_img_per_s"], 1),
                                mfu=round(r["train_mfu"], 3),
                                mfu_peak=round(r["train_mfu_peak"], 3)
                                if r.get("train_mfu_peak") else None) for r in results}
  print(json.dumps(dict(summary=summary, calib_gflops=calib, device_kind=dev.device_kind)))


if __name__ == "__main__":
  main()
