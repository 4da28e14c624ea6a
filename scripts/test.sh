#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest tests "$@"
