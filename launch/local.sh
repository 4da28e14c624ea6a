#!/usr/bin/env bash
# Runs NPROC cooperating JAX processes on this machine, for testing multi-host
# code without hosts:
#
#   launch/local.sh NPROC -- python -m big_vit_lite.train --config=... --workdir=...
#
# Every process gets the same command and, in its environment:
#   JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT (a free loopback port), JAX_NUM_PROCESSES=NPROC,
#   JAX_PROCESS_ID=i, JAX_PLATFORMS=cpu (unless set), and
#   XLA_FLAGS+=--xla_force_host_platform_device_count=$DEVICES_PER_PROCESS (default 1).
# big_vit_lite.runtime.distributed.initialize() turns those into jax.distributed.initialize(); CPU
# collectives go over gloo.
#
# Environment knobs:
#   DEVICES_PER_PROCESS  CPU devices per process (default 1).
#   LOG_DIR              where proc<i>.log go (default: a new directory under /tmp, printed).
#   LOCAL_PREFIX_OUTPUT  1 (default): also echo every process's output here, prefixed "[p<i>] ".
#   KILL_GRACE_S         seconds between SIGTERM and SIGKILL when stopping survivors (default 10).
# Used by launch/multi_gpu.sh to run this host's share of a multi-host job (not needed locally):
#   LOCAL_COORDINATOR        HOST:PORT of process 0 (default: 127.0.0.1 and a free port).
#   LOCAL_NUM_PROCESSES      processes in the whole job (default NPROC).
#   LOCAL_PROCESS_ID_OFFSET  global id of this host's first process (default 0).
#   LOCAL_DEVICE_MODE        cpu (default: simulated CPU devices, as above) or gpu (no CPU
#                            flags; with NPROC > 1 process i sees GPU i via JAX_LOCAL_DEVICE_IDS).
#
# If any process exits non-zero the others are stopped (SIGTERM, then SIGKILL) and this script
# exits with that process's status. SIGINT/SIGTERM to this script are forwarded to all processes
# (SIGTERM is how a preemption looks to the trainer). Exit status 0 only if all exited 0.
set -uo pipefail

usage() {
  echo "usage: DEVICES_PER_PROCESS=D $0 NPROC -- COMMAND [ARGS...] (--help: the details)" >&2
  exit 2
}

is_uint() { case "$1" in '' | *[!0-9]*) return 1 ;; *) return 0 ;; esac; }

case "${1:-}" in  # --help: the comment above, on stdout.
  -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
[ $# -ge 3 ] || usage
NPROC="$1"
shift
[ "$1" = "--" ] || usage
shift
if ! is_uint "$NPROC" || [ "$NPROC" -lt 1 ]; then
  echo "local.sh: NPROC must be a positive integer, got '$NPROC'" >&2
  exit 2
fi
DEVICES_PER_PROCESS="${DEVICES_PER_PROCESS:-1}"
if ! is_uint "$DEVICES_PER_PROCESS" || [ "$DEVICES_PER_PROCESS" -lt 1 ]; then
  echo "local.sh: DEVICES_PER_PROCESS must be a positive integer, got '$DEVICES_PER_PROCESS'" >&2
  exit 2
fi
TOTAL="${LOCAL_NUM_PROCESSES:-$NPROC}"
OFFSET="${LOCAL_PROCESS_ID_OFFSET:-0}"
MODE="${LOCAL_DEVICE_MODE:-cpu}"
if ! is_uint "$TOTAL" || ! is_uint "$OFFSET" || [ $((OFFSET + NPROC)) -gt "$TOTAL" ]; then
  echo "local.sh: need LOCAL_PROCESS_ID_OFFSET ($OFFSET) + NPROC ($NPROC) <= LOCAL_NUM_PROCESSES ($TOTAL)" >&2
  exit 2
fi
case "$MODE" in cpu | gpu) ;; *) echo "local.sh: LOCAL_DEVICE_MODE must be cpu or gpu, got '$MODE'" >&2; exit 2 ;; esac
KILL_GRACE_S="${KILL_GRACE_S:-10}"
PREFIX_OUTPUT="${LOCAL_PREFIX_OUTPUT:-1}"
LOG_DIR="${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/bvl_local.XXXXXX")}"
mkdir -p "$LOG_DIR"

if [ -n "${LOCAL_COORDINATOR:-}" ]; then
  COORD="$LOCAL_COORDINATOR"
else
  # A free port: bind port 0 and read what the kernel picked. A tiny race (someone else takes
  # it before process 0 binds) is possible but harmless: process 0 then fails, we exit non-zero.
  PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" || {
    echo "local.sh: could not find a free port (is python3 on PATH?)" >&2
    exit 2
  }
  COORD="127.0.0.1:$PORT"
fi

if [ "$MODE" = cpu ]; then
  echo "local.sh: $NPROC processes x $DEVICES_PER_PROCESS CPU devices, coordinator $COORD, logs in $LOG_DIR" >&2
else
  echo "local.sh: processes $OFFSET..$((OFFSET + NPROC - 1)) of $TOTAL (GPU), coordinator $COORD, logs in $LOG_DIR" >&2
fi

pids=()
tailers=()
for ((i = 0; i < NPROC; i++)); do
  gid=$((OFFSET + i))
  log="$LOG_DIR/proc$gid.log"
  : >"$log"
  if [ "$MODE" = cpu ]; then
    JAX_COORDINATOR_ADDRESS="$COORD" JAX_NUM_PROCESSES="$TOTAL" JAX_PROCESS_ID="$gid" \
      JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$DEVICES_PER_PROCESS" \
      "$@" >"$log" 2>&1 </dev/null &
  elif [ "$NPROC" -gt 1 ]; then
    JAX_COORDINATOR_ADDRESS="$COORD" JAX_NUM_PROCESSES="$TOTAL" JAX_PROCESS_ID="$gid" \
      JAX_LOCAL_DEVICE_IDS="$i" "$@" >"$log" 2>&1 </dev/null &
  else
    JAX_COORDINATOR_ADDRESS="$COORD" JAX_NUM_PROCESSES="$TOTAL" JAX_PROCESS_ID="$gid" \
      "$@" >"$log" 2>&1 </dev/null &
  fi
  pids[i]=$!
  if [ "$PREFIX_OUTPUT" = "1" ]; then
    # tail stops by itself once the process it follows (--pid) has gone.
    tail -n +1 -F --pid="${pids[i]}" "$log" 2>/dev/null | sed -u "s/^/[p$gid] /" &
    tailers+=($!)
  fi
done

stop_all() {  # stop_all SIGNAL: signal every process still running, escalate to SIGKILL after grace
  local sig="$1" pid deadline alive
  for pid in "${pids[@]}"; do kill -s "$sig" "$pid" 2>/dev/null; done
  # A SIGSTOPped process only acts on SIGTERM once continued.
  for pid in "${pids[@]}"; do kill -s CONT "$pid" 2>/dev/null; done
  deadline=$((SECONDS + KILL_GRACE_S))
  while [ $SECONDS -lt $deadline ]; do
    alive=0
    for pid in "${pids[@]}"; do
      if kill -0 "$pid" 2>/dev/null && [ "$(ps -o stat= -p "$pid" 2>/dev/null | cut -c1)" != "Z" ]; then alive=1; fi
    done
    [ $alive = 1 ] || return 0
    sleep 0.2
  done
  for pid in "${pids[@]}"; do kill -s KILL "$pid" 2>/dev/null; done
}

forwarded=""
# shellcheck disable=SC2317  # invoked through trap
on_signal() {  # forward SIGINT/SIGTERM (e.g. a preemption notice) to every process
  forwarded="$1"
  echo "local.sh: got SIG$1, forwarding to all processes" >&2
  for pid in "${pids[@]}"; do kill -s "$1" "$pid" 2>/dev/null; done
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

status=0
running=("${pids[@]}")
while [ "${#running[@]}" -gt 0 ]; do
  finished=""
  wait -n -p finished "${running[@]}" 2>/dev/null
  rc=$?
  if [ -z "${finished:-}" ]; then
    # Either a trapped signal interrupted wait, or bash already reaped a child (its job is gone
    # from the job table, but `wait PID` still has its status).
    for pid in "${running[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        finished=$pid
        wait "$pid"
        rc=$?
        break
      fi
    done
    [ -n "${finished:-}" ] || continue
  fi
  still=()
  for pid in "${running[@]}"; do [ "$pid" = "$finished" ] || still+=("$pid"); done
  running=("${still[@]}")
  for ((i = 0; i < NPROC; i++)); do [ "${pids[i]}" = "$finished" ] && break; done
  if [ "$rc" -ne 0 ]; then
    echo "local.sh: process $((OFFSET + i)) (pid $finished) exited with status $rc; see $LOG_DIR/proc$((OFFSET + i)).log" >&2
    if [ "$status" -eq 0 ]; then
      status=$rc
      if [ "${#running[@]}" -gt 0 ]; then
        echo "local.sh: stopping the other processes" >&2
        stop_all TERM
      fi
    fi
  fi
done

for t in "${tailers[@]}"; do wait "$t" 2>/dev/null; done
if [ -n "$forwarded" ] && [ "$status" -eq 0 ]; then
  echo "local.sh: all processes exited 0 after SIG$forwarded" >&2
fi
exit "$status"
