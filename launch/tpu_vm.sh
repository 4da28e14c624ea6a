#!/usr/bin/env bash
# Cloud TPU VM slices (any size): create, install this project on every worker, run a command on
# all workers at once, follow/collect logs, stop, delete.
#
#   export TPU_NAME=bvl-v4-256 ZONE=us-central2-b ACCELERATOR_TYPE=v4-256
#   export TFDS_DATA_DIR=gs://MY_BUCKET/tensorflow_datasets      # data read by every worker
#   launch/tpu_vm.sh create          # picks the runtime image for the accelerator type
#   launch/tpu_vm.sh install         # Python >= 3.11 + venv, this tree with the [tpu] extra
#   launch/tpu_vm.sh run -- python -m big_vit_lite.train --config=configs/vit_l16.py \
#       --workdir=gs://MY_BUCKET/runs/vit_l16
#   launch/tpu_vm.sh logs            # follow worker 0's log (DETACH=1 runs)
#   launch/tpu_vm.sh collect logs/   # every worker's log into logs/<worker-host>.log
#   launch/tpu_vm.sh stop            # SIGTERM: the trainer saves a checkpoint and exits
#   launch/tpu_vm.sh delete
#
# Subcommands: create | install | run -- CMD... | logs [WORKER] | collect DIR | stop |
#              ssh -- CMD... (on all workers) | delete
# Environment:
#   TPU_NAME, ZONE        required.
#   PROJECT               gcloud project (default: gcloud's configured one).
#   ACCELERATOR_TYPE      slice type for create, e.g. v4-8, v4-256, v5litepod-16, v5p-128 (default v4-8).
#   RUNTIME_VERSION       TPU VM image (--version). Default: the one Google lists for the
#                         accelerator type: v6e-* v2-alpha-tpuv6e, v5p-* v2-alpha-tpuv5,
#                         v5litepod-* v2-alpha-tpuv5-lite, v4 and older tpu-ubuntu2204-base.
#                         These images are Ubuntu 22.04 (Python 3.10); `install` adds Ubuntu's
#                         python3.11 and python3.11-venv, since jax 0.10 needs Python >= 3.11.
#   SPOT=1                create a Spot (preemptible) slice.
#   TFDS_DATA_DIR         exported on the workers for `run` (a gs:// bucket all workers read).
#   LOCK=0                `install` takes the newest versions setup.py allows instead of the
#                         tested ones in requirements/lock.txt (default LOCK=1).
#   DETACH=1              `run` starts the job in the background on every worker and returns
#                         (an ssh disconnect then cannot kill it); follow it with `logs`.
#   REMOTE_DIR, VENV      where the project and its virtualenv live on the workers
#                         (default ~/big_vit_lite and ~/bvl_venv).
# The workdir must be a bucket path (gs://...): every worker writes its shards of each checkpoint.
# `run` sets BVL_DISTRIBUTED=auto, so big_vit_lite.runtime.distributed.initialize() lets jax find the
# slice's workers through the TPU metadata server. A restart after a preemption or crash is the
# same `run` command: training resumes from the newest complete checkpoint in the workdir.
set -euo pipefail

GCLOUD="${GCLOUD:-gcloud}"
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v4-8}"
LOCK="${LOCK:-1}"
case "$LOCK" in 0 | 1) ;; *) echo "tpu_vm.sh: LOCK must be 0 or 1, got '$LOCK'" >&2; exit 2 ;; esac
REMOTE_DIR="${REMOTE_DIR:-~/big_vit_lite}"
VENV="${VENV:-~/bvl_venv}"
# shellcheck disable=SC2088  # "~" is expanded on the worker, not here.
REMOTE_LOG="~/bvl_logs/run.log"
REPO_ROOT="$(cd "$(dirname "$0")/.." && pwd)"

die() { echo "tpu_vm.sh: $*" >&2; exit 2; }

help_text() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

usage() {
  help_text >&2
  exit 2
}

need_env() {
  [ -n "${TPU_NAME:-}" ] || die "set TPU_NAME (the TPU VM's name)"
  [ -n "${ZONE:-}" ] || die "set ZONE (e.g. us-central2-b for v4)"
}

common_flags() {  # flags every gcloud tpu-vm call gets
  printf '%s\n' "--zone=$ZONE"
  if [ -n "${PROJECT:-}" ]; then printf '%s\n' "--project=$PROJECT"; fi
}

tpu() {  # tpu SUBCOMMAND ARGS...: gcloud compute tpus tpu-vm SUBCOMMAND ARGS... --zone ...
  local sub="$1"
  shift
  local flags
  mapfile -t flags < <(common_flags)
  "$GCLOUD" compute tpus tpu-vm "$sub" "$@" "${flags[@]}"
}

on_all_workers() {  # on_all_workers REMOTE_COMMAND: one ssh to every worker of the slice at once
  tpu ssh "$TPU_NAME" --worker=all --command="$1"
}

quote_cmd() {  # the arguments as one shell-quoted command line
  local out="" a
  for a in "$@"; do out+="$(printf '%q' "$a") "; done
  printf '%s' "${out% }"
}

default_runtime() {  # the TPU software version Google lists for an accelerator type
  case "$1" in
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-*) echo v2-alpha-tpuv5-lite ;;
    v2-* | v3-* | v4-*) echo tpu-ubuntu2204-base ;;
    *) die "unknown ACCELERATOR_TYPE '$1' (e.g. v4-8, v5litepod-16, v5p-128, v6e-8); or set RUNTIME_VERSION" ;;
  esac
}

cmd_create() {
  local extra=() version="${RUNTIME_VERSION:-}"
  [ -n "$version" ] || version="$(default_runtime "$ACCELERATOR_TYPE")"
  if [ "${SPOT:-0}" = 1 ]; then extra+=(--spot); fi
  tpu create "$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" --version="$version" "${extra[@]}"
}

cmd_install() {
  # The working tree as it is (tracked + untracked files git does not ignore), not just HEAD.
  local tarball
  tarball="$(mktemp "${TMPDIR:-/tmp}/big_vit_lite.XXXXXX.tar.gz")"
  (cd "$REPO_ROOT" && git ls-files -z --cached --others --exclude-standard | tar czf "$tarball" --null -T -)
  tpu scp "$tarball" "$TPU_NAME:~/big_vit_lite.tar.gz" --worker=all
  rm -f "$tarball"
  on_all_workers "set -e; rm -rf $REMOTE_DIR && mkdir -p $REMOTE_DIR ~/bvl_logs \
&& tar xzf ~/big_vit_lite.tar.gz -C $REMOTE_DIR \
&& LOCK=$LOCK bash $REMOTE_DIR/launch/tpu_worker_setup.sh $REMOTE_DIR $VENV"
}

cmd_run() {
  [ $# -ge 1 ] || die "run needs a command: run -- python -m big_vit_lite.train ..."
  local cmd env_exports=""
  cmd="$(quote_cmd "$@")"
  if [ -n "${TFDS_DATA_DIR:-}" ]; then
    env_exports="export TFDS_DATA_DIR=$(printf '%q' "$TFDS_DATA_DIR"); "
  fi
  local body="cd $REMOTE_DIR && . $VENV/bin/activate && mkdir -p ~/bvl_logs && ${env_exports}export BVL_DISTRIBUTED=auto; "
  if [ "${DETACH:-0}" = 1 ]; then
    # setsid + nohup: the job survives the ssh session; its log is on each worker.
    on_all_workers "$body setsid nohup bash -c $(printf '%q' "$cmd") > $REMOTE_LOG 2>&1 < /dev/null & echo started on \$(hostname)"
  else
    # Foreground: every worker's output streams here, prefixed with its host name; also kept in
    # the worker's log. pipefail: the ssh exits non-zero if the command failed on a worker.
    on_all_workers "$body set -o pipefail; $cmd 2>&1 | tee $REMOTE_LOG | sed -u \"s/^/[\$(hostname)] /\""
  fi
}

cmd_logs() {
  local worker="${1:-0}"
  tpu ssh "$TPU_NAME" --worker="$worker" --command="tail -n +1 -F $REMOTE_LOG"
}

cmd_collect() {
  local dir="${1:-}"
  [ -n "$dir" ] || die "collect needs a local directory: collect logs/"
  mkdir -p "$dir"
  # One ssh to all workers; each prints its log with a "<host>\t" prefix, split here by host.
  on_all_workers "sed \"s/^/\$(hostname)\t/\" $REMOTE_LOG" | awk -F '\t' -v dir="$dir" '
    { host = $1; sub(/^[^\t]*\t/, ""); print > (dir "/" host ".log") }'
  echo "tpu_vm.sh: logs in $dir/" >&2
}

cmd_stop() {
  # SIGTERM, as a preemption would: the trainer checkpoints at the next step and exits 0.
  on_all_workers "pkill -TERM -f '[b]ig_vit_lite.train' || true"
}

cmd_delete() {
  tpu delete "$TPU_NAME" --quiet
}

[ $# -ge 1 ] || usage
sub="$1"
shift
case "$sub" in
  -h | --help | help) help_text; exit 0 ;;
esac
need_env
case "$sub" in
  create) cmd_create ;;
  install) cmd_install ;;
  run | ssh)
    [ "${1:-}" = "--" ] && shift
    if [ "$sub" = run ]; then cmd_run "$@"; else on_all_workers "$(quote_cmd "$@")"; fi ;;
  logs) cmd_logs "$@" ;;
  collect) cmd_collect "$@" ;;
  stop) cmd_stop ;;
  delete) cmd_delete ;;
  *) die "unknown subcommand '$sub' (create, install, run, logs, collect, stop, ssh, delete)" ;;
esac
