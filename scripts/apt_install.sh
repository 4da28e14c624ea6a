#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages named on the command line that are not installed yet
# (apt-get, as root or through sudo). Says in one line what is missing where it cannot.
# Usage: bash scripts/apt_install.sh PACKAGE...
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt_install.sh: this machine has no apt-get; install ${missing[*]} (or their equivalents) and rerun" >&2
  exit 1
fi
SUDO=()
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "apt_install.sh: need root or sudo to apt-get install ${missing[*]}" >&2; exit 1; }
  SUDO=(sudo)
fi
echo "apt-get install ${missing[*]}"
"${SUDO[@]}" apt-get update -qq
if ! "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; then
  echo "apt_install.sh: apt-get could not install ${missing[*]}; install them by hand and rerun" >&2
  exit 1
fi
