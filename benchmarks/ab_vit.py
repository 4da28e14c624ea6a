"""Interleaved A/B timing of the current vit.py against another version of it, in one process.

  python benchmarks/ab_vit.py --old=HEAD~1 --variant=Ti/16 --mode=train --rounds=8
  python benchmarks/ab_vit.py --old=current --old_kw='{"gelu": "tanh"}'   # a model option
  python benchmarks/ab_vit.py --old=current --grad_accum=2   # 2 microbatches vs 1 batch
  python benchmarks/ab_vit.py --old=current \
      --compiler_options='{"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}'

Both training (or inference) steps are compiled first, then timed in turns,
one step each per round, so machine load hits both alike. Prints one JSON
line per version: medians, and the per-round speedup of the current version
over --old in wall time and in process CPU time. On a shared CPU, trust the
CPU-time ratio (its spread is a few %) over wall time (spread of 2x).
One bias it cannot remove: two programs whose temporaries are large and of
different sizes slow each other down in turns (the freed block goes back to
the kernel every step). ViT-S/16, batch 32, --old_grad_accum=2 vs 1 read
0.54x here but 1.0x in separate `big_vit_lite.bench` processes (8.1-9.8 vs
8.8-9.0 img/s); ViT-Ti/16 --grad_accum=4 read 1.12x here, 1.0x there. Check a
gain from changing the program's memory footprint with separate processes.
Like the job entry points it runs with glibc's huge-page tunable
(big_vit_lite/runtime/hostmem.py); BIG_VIT_LITE_HUGE_PAGES=0 turns that off.
"""

# First, before jax loads: once more with huge pages.
if __name__ == "__main__":
  from big_vit_lite.runtime import hostmem  # pylint: disable=g-import-not-at-top

  hostmem.use_huge_pages(__file__)

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

from big_vit_lite.trainer import grad_accum
from big_vit_lite.trainer import losses
from big_vit_lite.runtime import sharding
from big_vit_lite.models import vit as vit_current


def load_module(path):
  spec = importlib.util.spec_from_file_location("vit_old", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_revision(rev):
  """vit.py of git revision `rev`, with that revision's models/ops.py where it has one (vit.py
  imports its attention/LayerNorm/GELU from there: loading the old vit.py alone would time the
  current ops)."""

  def show(path):
    out = subprocess.run(
        ["git", "show", f"{rev}:{path}"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    return out.stdout if out.returncode == 0 else None

  vit_src = show("big_vit_lite/models/vit.py")
  if vit_src is None:
    raise SystemExit(
        f"--old={rev}: no big_vit_lite/models/vit.py at that git revision"
    )
  tmp = tempfile.mkdtemp(prefix="ab_vit_old_")
  ops_src = show("big_vit_lite/models/ops.py")
  if ops_src is not None:
    with open(os.path.join(tmp, "ops_old.py"), "w") as f:
      f.write(ops_src)
    vit_src = vit_src.replace(
        "from big_vit_lite.models.ops import", "from ops_old import"
    )
    sys.path.insert(0, tmp)
  with open(os.path.join(tmp, "vit_old.py"), "w") as f:
    f.write(vit_src)
  return load_module(os.path.join(tmp, "vit_old.py"))


def make_step(
    vit_module,
    variant,
    mode,
    batch,
    res,
    num_classes,
    model_kw,
    compiler_options=None,
    accum_steps=1,
):
  model = vit_module.Model(
      num_classes=num_classes, **{"variant": variant, **model_kw}
  )
  rng = jax.random.PRNGKey(0)
  x = jax.random.normal(rng, (batch, res, res, 3))
  labels = jax.nn.one_hot(jnp.arange(batch) % num_classes, num_classes)
  params = sharding.unbox(jax.jit(model.init)(rng, x)["params"])
  if mode == "infer":
    f = (
        jax.jit(lambda p, x: model.apply({"params": p}, x)[0])
        .lower(params, x)
        .compile(compiler_options)
    )
    return lambda: f(params, x).block_until_ready()
  tx = optax.adamw(1e-3, weight_decay=1e-4)

  def step(state, x, labels):
    p, opt_state = state
    loss_fn = lambda p, b, rng: losses.softmax_xent(
        model.apply({"params": p}, b[0], train=True, rngs={"dropout": rng})[0],
        b[1],
    )
    loss, grads = grad_accum.value_and_grad(
        loss_fn, p, (x, labels), rng, accum_steps
    )
    updates, opt_state = tx.update(grads, opt_state, p)
    return (optax.apply_updates(p, updates), opt_state), loss

  state = [(params, tx.init(params))]
  f = (
      jax.jit(step, donate_argnums=0)
      .lower(state[0], x, labels)
      .compile(compiler_options)
  )

  def run():
    state[0], loss = f(state[0], x, labels)
    loss.block_until_ready()

  return run


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument(
      "--old",
      required=True,
      help="a git revision (its vit.py and models/ops.py), the path of a vit.py, "
      "or 'current' to compare model kwargs only",
  )
  p.add_argument("--variant", default="Ti/16")
  p.add_argument("--mode", default="train", choices=["train", "infer"])
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--res", type=int, default=224)
  p.add_argument("--rounds", type=int, default=8)
  p.add_argument(
      "--model_kw",
      default='{"remat_policy": null}',
      help="JSON kwargs for both Models (default: no remat)",
  )
  p.add_argument(
      "--old_kw",
      default="{}",
      help='JSON kwargs for the old Model only, on top of --model_kw, e.g. \'{"gelu": "tanh"}\'',
  )
  p.add_argument(
      "--compiler_options",
      default="{}",
      help="JSON XLA compiler options for the current version only, e.g. "
      '\'{"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}\'',
  )
  p.add_argument(
      "--old_compiler_options",
      default="{}",
      help="JSON XLA compiler options for the old version only",
  )
  p.add_argument(
      "--grad_accum",
      type=int,
      default=1,
      help="microbatches per training step, current version (config.grad_accum_steps)",
  )
  p.add_argument(
      "--old_grad_accum", type=int, default=1, help="the same, old version"
  )
  args = p.parse_args()
  kw = json.loads(args.model_kw)
  options = [
      json.loads(args.old_compiler_options),
      json.loads(args.compiler_options),
  ]
  if args.old == "current":
    old = vit_current
  elif os.path.isfile(args.old):
    # A vit.py that needs nothing of models/ops.py's past.
    old = load_module(args.old)
  else:
    old = load_revision(args.old)
  versions = [("old", old), ("current", vit_current)]
  kws = [{**kw, **json.loads(args.old_kw)}, kw]
  runs = []
  accums = [args.old_grad_accum, args.grad_accum]
  for (_, module), model_kw, opts, accum in zip(versions, kws, options, accums):
    run = make_step(
        module,
        args.variant,
        args.mode,
        args.batch,
        args.res,
        1000,
        model_kw,
        opts or None,
        accum,
    )
    run()  # warm-up
    runs.append(run)
  wall, cpu = [[] for _ in runs], [[] for _ in runs]
  for _ in range(args.rounds):
    for j, run in enumerate(runs):
      c0, t0 = time.process_time(), time.perf_counter()
      run()
      wall[j].append(time.perf_counter() - t0)
      cpu[j].append(time.process_time() - c0)
  for j, (name, _) in enumerate(versions):
    sw = [wall[0][i] / wall[j][i] for i in range(args.rounds)]
    sc = [cpu[0][i] / cpu[j][i] for i in range(args.rounds)]
    print(
        json.dumps(
            dict(
                version=name,
                variant=args.variant,
                mode=args.mode,
                batch=args.batch,
                wall_s=statistics.median(wall[j]),
                cpu_s=statistics.median(cpu[j]),
                speedup_wall=statistics.median(sw),
                speedup_wall_range=[min(sw), max(sw)],
                speedup_cpu=statistics.median(sc),
                speedup_cpu_range=[min(sc), max(sc)],
            )
        ),
        flush=True,
    )


if __name__ == "__main__":
  main()
