#!/usr/bin/env bash
# Install-and-run check of the package as users get it: builds the wheel (python -m build),
# installs it with the NEWEST dependency versions setup.py's ranges allow (no lock file) into a
# fresh virtualenv on a second Python (3.12 where there is one; SMOKE_PYTHON=... picks another),
# and, from outside the checkout: imports it, finds the shipped `--config=demo`, trains
# demo:runlocal for real (6 steps, a checkpoint, the evals) and runs a one-step benchmark.
# Also checks that `big_vit_lite[cuda]` and `[tpu]` resolve (pip install --dry-run: nothing installed).
# Run after scripts/setup.sh (it builds with .venv's `build`). Ends with "N passed, N failed".
# Usage: bash scripts/wheel_smoke.sh [WORK_DIR]   (default: a new temporary directory)
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
REPO="$(pwd)"
WORK="${1:-$(mktemp -d "${TMPDIR:-/tmp}/bvl_smoke.XXXXXX")}"
mkdir -p "$WORK"
start=$SECONDS

PY2="${SMOKE_PYTHON:-}"
if [ -z "$PY2" ]; then
  for p in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      PY2="$p"; break
    fi
  done
fi
if [ -z "$PY2" ]; then
  echo "wheel_smoke: no Python 3.12 on this machine; using .venv's $(.venv/bin/python --version)"
  PY2="$(.venv/bin/python -c 'import sys; print(sys._base_executable)')"
fi
echo "wheel_smoke: $("$PY2" --version) in $WORK"

.venv/bin/python -m build --wheel --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 ||
  { tail -20 "$WORK/build.log"; exit 1; }
WHEEL="$(ls "$WORK"/dist/big_vit_lite-*.whl)"
rm -rf "$WORK/venv"
"$PY2" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q --upgrade pip
"$VPY" -m pip install -q "$WHEEL"
BVL_PYTHON="$VPY" bash scripts/fetch_offline_sources.sh >/dev/null  # animal-mnist into that venv

passed=0 failed=0
check() {  # check NAME COMMAND...: runs it in $WORK/run (outside the checkout), counts it
  local name="$1"
  shift
  if (cd "$WORK/run" && "$@") >"$WORK/$name.log" 2>&1; then
    passed=$((passed + 1)); echo "wheel_smoke: ok   $name"
  else
    failed=$((failed + 1)); echo "wheel_smoke: FAIL $name (last lines of $WORK/$name.log):"; tail -15 "$WORK/$name.log"
  fi
}
mkdir -p "$WORK/run"

check import "$VPY" -c '
import importlib.metadata as md, big_vit_lite, big_vit_lite.train, big_vit_lite.evaluate
assert "site-packages" in big_vit_lite.__file__, big_vit_lite.__file__
print(" ".join(f"{n}=={md.version(n)}" for n in ("jax", "flax", "optax", "orbax-checkpoint", "tensorflow-cpu", "tensorflow-datasets", "numpy")))'
check shipped_config "$VPY" -c '
from big_vit_lite.config import config_loading as c
p = c.resolve_config_path("demo:runlocal")
assert p.endswith("site-packages/big_vit_lite/configs/demo.py:runlocal"), p
print(p, c.shipped_config_names())'
check train_demo_runlocal bash -c "
for ds in fashion_mnist mnist10k animal_mnist; do '$VPY' -m big_vit_lite.data.prepare \$ds; done
'$VPY' -m big_vit_lite.train --config=demo:runlocal --workdir='$WORK/train' &&
grep -q '\"val/prec@1\"' '$WORK/train/metrics.jsonl' && test -d '$WORK/train/checkpoints/6'"
check bench "$VPY" -m big_vit_lite.bench --variant=Ti/16 --batch=2 --res=32 --steps=1 --warmup=0
check cuda_extra_resolves bash -c "set -o pipefail; '$VPY' -m pip install --dry-run 'big_vit_lite[cuda] @ file://$WHEEL' 2>&1 |
  grep '^Would install' | grep -o 'jax-cuda12-plugin-[^ ]*'"

check tpu_extra_resolves bash -c "set -o pipefail; '$VPY' -m pip install --dry-run 'big_vit_lite[tpu] @ file://$WHEEL' 2>&1 |
  grep '^Would install' | grep -o 'libtpu-[^ ]*'"

grep -h "==" "$WORK/import.log" | sed 's/^/wheel_smoke: newest allowed: /' || true
sed 's/^/wheel_smoke: [cuda] would install /' "$WORK/cuda_extra_resolves.log" || true
sed 's/^/wheel_smoke: [tpu] would install /' "$WORK/tpu_extra_resolves.log" || true
echo "wheel_smoke: $((SECONDS - start)) s"
echo "wheel_smoke: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
