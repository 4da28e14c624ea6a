#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds the offline datasets and runs the main
# job: the demo ViT pretrained on Fashion-MNIST (configs/demo.py).
# Usage: bash scripts/demo.sh [WORKDIR] [extra train flags, e.g. --config.total_steps=100]
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
WORKDIR="${1:-workdirs/demo}"
shift || true
for ds in fashion_mnist mnist10k animal_mnist; do
  python -m big_vit_lite.data.prepare "$ds"
done
exec python -m big_vit_lite.train --config=configs/demo.py --workdir="$WORKDIR" "$@"
