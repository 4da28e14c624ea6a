"""timm's VisionTransformer on PyTorch CPU: the peer that bench_vs_timm.py compares to.

Runs inside a separate venv holding torch + timm (never the project's .venv):

  PYTHONPATH=benchmarks/timm_standin /work/venv-timm/bin/python \
      benchmarks/timm_vit_bench.py --variant=Ti/16 --batch=32 --res=224

Prints one JSON line with the same keys as `python -m big_vit_lite.bench`
where they mean the same thing (train/infer img/s, step time median/min/max,
calib_gflops from a torch matmul timed in this process). The training step is
the same work as ours: forward, softmax cross-entropy on one-hot labels,
backward, AdamW update, f32.
"""

import argparse
import json
import statistics
import time

import torch
import timm

# Same names as big_vit_lite.models.vit variants -> timm model names.
_TIMM_NAMES = {
    "Ti": "vit_tiny_patch{p}_{r}",
    "S": "vit_small_patch{p}_{r}",
    "B": "vit_base_patch{p}_{r}",
    "L": "vit_large_patch{p}_{r}",
}


def timm_name(variant, res):
  width, patch = variant.split("/")
  if width not in _TIMM_NAMES:
    raise ValueError(
        f"variant {variant!r}: timm comparison knows {sorted(_TIMM_NAMES)} widths"
    )
  return _TIMM_NAMES[width].format(p=patch, r=res)


def _times(fn, warmup, steps, cpu_times=None):
  for _ in range(warmup):
    fn()
  out = []
  for _ in range(steps):
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    out.append(time.perf_counter() - t0)
    if cpu_times is not None:
      cpu_times.append(time.process_time() - c0)
  return out


def calib_gflops(n=2048, reps=5):
  a = torch.randn(n, n)
  b = torch.randn(n, n)
  ts = _times(lambda: torch.mm(a, b), 1, reps)
  return 2 * n**3 / statistics.median(ts) / 1e9


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--variant", default="Ti/16")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--res", type=int, default=224)
  p.add_argument("--num_classes", type=int, default=1000)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--mode", default="train,infer")
  args = p.parse_args()

  torch.set_num_threads(args.threads)
  torch.manual_seed(0)
  name = timm_name(args.variant, args.res)
  # img_size passed explicitly so that non-default resolutions work.
  model = timm.create_model(
      name, num_classes=args.num_classes, img_size=args.res
  )
  x = torch.randn(args.batch, 3, args.res, args.res)
  y = torch.randint(0, args.num_classes, (args.batch,))
  res = dict(
      impl="timm",
      timm_model=name,
      timm_version=timm.__version__,
      torch_version=torch.__version__,
      threads=args.threads,
      variant=args.variant,
      batch=args.batch,
      res=args.res,
      dtype="float32",
  )
  res["calib_gflops"] = calib_gflops()
  modes = args.mode.split(",")

  if "train" in modes:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
      opt.zero_grad(set_to_none=True)
      loss = loss_fn(model(x), y)
      loss.backward()
      opt.step()

    cpu = []
    ts = _times(step, args.warmup, args.steps, cpu)
    med = statistics.median(ts)
    res.update(
        train_cpu_s=statistics.median(cpu),
        train_step_s=med,
        train_step_s_min=min(ts),
        train_step_s_max=max(ts),
        train_img_per_s=args.batch / med,
    )

  if "infer" in modes:
    model.eval()

    def infer():
      with torch.inference_mode():
        model(x)

    cpu = []
    ts = _times(infer, args.warmup, args.steps, cpu)
    med = statistics.median(ts)
    res.update(
        infer_cpu_s=statistics.median(cpu),
        infer_step_s=med,
        infer_step_s_min=min(ts),
        infer_step_s_max=max(ts),
        infer_img_per_s=args.batch / med,
    )

  res["calib_gflops_after"] = calib_gflops()
  print(json.dumps(res), flush=True)


if __name__ == "__main__":
  main()
