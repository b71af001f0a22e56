#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian 12 machine: system packages, a venv, ckptfs.
# Usage: scripts/setup.sh [--with-ceph]   (--with-ceph: also radosgw for the integration suite)
set -euo pipefail
cd "$(dirname "$0")/.."

need_pkgs=(fuse3 libfuse3-dev pkg-config attr python3-venv curl)
if [[ "${1:-}" == "--with-ceph" ]]; then
  need_pkgs+=(ceph-mon ceph-osd ceph-mgr radosgw ceph-common)
fi
missing=()
for p in "${need_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} )); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  echo "setup: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
stamp=.venv/.ckptfs-installed
if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e '.[test]'
  touch "$stamp"
fi
