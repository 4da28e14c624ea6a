#!/usr/bin/env bash
# Runs on each TPU VM worker (launch/tpu_vm.sh install calls it there): a Python that jax 0.10
# supports (>= 3.11; the TPU images are Ubuntu 22.04 with 3.10, so Ubuntu's python3.11 is
# apt-installed), its venv module, a virtualenv, and this project with the [tpu] extra
# (jax + libtpu), at the versions of requirements/lock.txt unless LOCK=0.
#   bash launch/tpu_worker_setup.sh PROJECT_DIR VENV_DIR
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 PROJECT_DIR VENV_DIR" >&2; exit 2; }
PROJECT="$1" VENV="$2"
die() { echo "tpu_worker_setup.sh on $(hostname): $*" >&2; exit 1; }
supported() { "$1" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 14))' 2>/dev/null; }
apt_get() { sudo env DEBIAN_FRONTEND=noninteractive apt-get "$@"; }

PY=""
for p in python3 python3.13 python3.12 python3.11; do
  if command -v "$p" >/dev/null 2>&1 && supported "$p"; then PY="$p"; break; fi
done
if [ -z "$PY" ]; then
  { apt_get update -qq && apt_get install -y -qq python3.11 python3.11-venv; } >/dev/null ||
    die "python3 is $(python3 --version 2>&1) and apt-get could not install python3.11 python3.11-venv"
  PY=python3.11
fi
if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then  # Ubuntu splits ensurepip into pythonX.Y-venv
  pkg="$("$PY" -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])')"
  { apt_get update -qq && apt_get install -y -qq "$pkg"; } >/dev/null || die "apt-get could not install $pkg"
fi
if [ ! -x "$VENV/bin/pip" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091  # the venv made just above
. "$VENV/bin/activate"
constraints=()
if [ "${LOCK:-1}" = 1 ]; then constraints=(-c "$PROJECT/requirements/lock.txt"); fi
pip install -q -U pip
pip install -q "${constraints[@]}" -e "${PROJECT}[tpu]"
python -c 'import jax; print(jax.process_index(), jax.device_count(), jax.devices()[0].device_kind)'
