#!/usr/bin/env bash
# Our ViT-B/16 and L/16 training step vs timm's (eager, torch.compile) on one NVIDIA GPU, plus
# the cuDNN numerics check and the A/B variants: one command, under 8 minutes on an H200.
#   bash benchmarks/gpu_bench.sh                  (from a checkout; no install needed)
#   bash benchmarks/gpu_bench.sh --smoke          (tiny variants on a CPU: checks the script)
#   bash benchmarks/gpu_bench.sh --only=main,timm --budget_s=300
# Needs jax with CUDA, flax, optax, numpy, absl; torch + timm for the peer (skipped without).
# Appends the summary to benchmarks/RESULTS.md; JSON lines + the table go to $OUT/ if OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ] && [ -z "${VIRTUAL_ENV:-}" ]; then . .venv/bin/activate; fi
exec python3 benchmarks/gpu_bench.py "$@"
