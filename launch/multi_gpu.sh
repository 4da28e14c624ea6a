#!/usr/bin/env bash
# Multi-GPU / multi-host training without a scheduler: run this on every host.
#
#   # host 0 (its address must be reachable from the others):
#   launch/multi_gpu.sh --coordinator=10.0.0.1:8476 --num_hosts=2 --host_id=0 -- \
#       python -m big_vit_lite.train --config=configs/vit_b16.py --workdir=/shared/vit_b16
#   # host 1: the same with --host_id=1
#
# --procs=gpu (default): one process per GPU (JAX_LOCAL_DEVICE_IDS=i), the layout NVIDIA
#   recommends for JAX; --procs=host: one process per host driving all its GPUs.
# --gpus=N: GPUs per host (default: counted with nvidia-smi).
# The workdir must be on storage every host sees (NFS, a bucket): checkpoints are written by all
# processes together. Each host's processes are supervised as in launch/local.sh (own logs in
# $LOG_DIR, all of this host's processes stopped if one fails). A failure on one host reaches
# the others through the coordination service / NCCL errors or the hang guard.
# Single host, all GPUs: --num_hosts=1 --host_id=0 and any free port on 127.0.0.1.
# Every host needs jax's CUDA build: pip install -c requirements/lock.txt -e '.[cuda]' (CUDA 12
# wheels, NVIDIA driver >= 525; '.[cuda13]' for CUDA 13). `python -c 'import jax; print(jax.devices())'`
# should list the GPUs.
set -euo pipefail

usage() {
  echo "usage: $0 --coordinator=HOST:PORT --num_hosts=N --host_id=I [--procs=gpu|host] [--gpus=G] -- COMMAND... (--help: the details)" >&2
  exit 2
}

COORD="" NUM_HOSTS="" HOST_ID="" PROCS="gpu" GPUS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --coordinator=*) COORD="${1#*=}" ;;
    --num_hosts=*) NUM_HOSTS="${1#*=}" ;;
    --host_id=*) HOST_ID="${1#*=}" ;;
    --procs=*) PROCS="${1#*=}" ;;
    --gpus=*) GPUS="${1#*=}" ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) echo "multi_gpu.sh: unknown argument '$1'" >&2; usage ;;
  esac
  shift
done
[ $# -ge 1 ] || usage
case "$COORD" in *:[0-9]*) ;; *) echo "multi_gpu.sh: --coordinator must be HOST:PORT, got '$COORD'" >&2; exit 2 ;; esac
for v in "$NUM_HOSTS" "$HOST_ID"; do
  case "$v" in '' | *[!0-9]*) echo "multi_gpu.sh: --num_hosts and --host_id must be integers, got '$NUM_HOSTS' and '$HOST_ID'" >&2; exit 2 ;; esac
done
[ "$HOST_ID" -lt "$NUM_HOSTS" ] || { echo "multi_gpu.sh: need --host_id < --num_hosts" >&2; exit 2; }
if [ -z "$GPUS" ]; then
  command -v nvidia-smi >/dev/null || { echo "multi_gpu.sh: nvidia-smi not found; pass --gpus=N" >&2; exit 2; }
  GPUS="$(nvidia-smi -L | grep -c '^GPU ')"
fi
case "$GPUS" in '' | *[!0-9]* | 0) echo "multi_gpu.sh: no GPUs found (--gpus=$GPUS)" >&2; exit 2 ;; esac

case "$PROCS" in
  gpu) PER_HOST="$GPUS" ;;
  host) PER_HOST=1 ;;
  *) echo "multi_gpu.sh: --procs must be gpu or host, got '$PROCS'" >&2; exit 2 ;;
esac

export LOCAL_COORDINATOR="$COORD"
export LOCAL_NUM_PROCESSES=$((NUM_HOSTS * PER_HOST))
export LOCAL_PROCESS_ID_OFFSET=$((HOST_ID * PER_HOST))
export LOCAL_DEVICE_MODE=gpu
exec "$(dirname "$0")/local.sh" "$PER_HOST" -- "$@"
