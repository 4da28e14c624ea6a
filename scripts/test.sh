#!/usr/bin/env bash
# Sets up (scripts/setup.sh), installs the system tools some tests use (shellcheck lints the
# launch scripts; headless Chromium renders the HTML report; openssl makes the fake bucket's CA) and
# runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
# Two xdist workers, one test file each at a time (module fixtures built once;
# tests/conftest.py deals the longest file to both and starts the longest first);
# `-n 0` runs in this process, `-n 4` on a bigger machine.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/apt_install.sh shellcheck chromium openssl
. .venv/bin/activate
exec python -m pytest tests -n 2 --dist loadfile "$@"
