#!/usr/bin/env bash
# ViT-B/16 and L/16 bf16 training img/s and MFU on one NVIDIA GPU: one short run.
#   bash benchmarks/gpu_bench.sh [extra gpu_bench.py flags]      (e.g. --variants=B/16)
#   bash benchmarks/gpu_bench.sh --smoke                          (tiny CPU check)
# Needs jax with CUDA (pip install "jax[cuda12]==0.10.2") in the active python.
# Writes the JSON lines to stdout and to $OUT/gpu_bench.jsonl when OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ] && [ -z "${VIRTUAL_ENV:-}" ]; then . .venv/bin/activate; fi

# XLA GPU: overlap collectives/compute scheduling, let XLA use the memory.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
export TF_CPP_MIN_LOG_LEVEL=2

log="${OUT:-/tmp}/gpu_bench.jsonl"
python benchmarks/gpu_bench.py "$@" | tee "$log"
