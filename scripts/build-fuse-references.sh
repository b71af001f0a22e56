#!/usr/bin/env bash
# libfuse's own example file systems, as references for the namespace benchmark
# (integration/bench_write.py --fuse-references): what a FUSE daemon written in C costs on the
# machine at hand, measured in the same run as the plain directory and the gateway.
#
# - passthrough_hp: libfuse's "high-performance" passthrough file system (C++), mirroring a
#   directory on the same disk, with FUSE passthrough for reads and writes;
# - memfs_ll: an in-memory file system (C++): the FUSE transport with nothing stored on disk.
#
# Built from the source of Debian 13's fuse3 package (the same one scripts/build-fuse.sh uses),
# statically linked, into $VENV/opt/fuse3-references/. Not needed to run or test ckptfs.
# Usage: scripts/build-fuse-references.sh [VENV]   (default .venv); prints the directory.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${1:-.venv}")
PY=$VENV/bin/python
OUT=$VENV/opt/fuse3-references
WORK=$VENV/opt/build-fuse-references   # scratch, removed after success
LOG=$VENV/build-fuse-references.log
PROGRAMS=(passthrough_hp memfs_ll)

[[ -x $PY ]] || { echo "build-fuse-references: no venv at $VENV (run scripts/setup.sh)" >&2; exit 1; }
have_all() { for p in "${PROGRAMS[@]}"; do [[ -x $OUT/$p ]] || return 1; done; }
if have_all; then echo "$OUT"; exit 0; fi

SECONDS=0
: >"$LOG"
fail() { echo "build-fuse-references: $* (log: $LOG)" >&2; tail -n 30 "$LOG" >&2; exit 1; }
run() { echo "+ [${SECONDS}s] $*" >>"$LOG"; "$@" >>"$LOG" 2>&1 || fail "failed: $*"; }
# shellcheck source=scripts/fuse-source.sh
source scripts/fuse-source.sh
command -v c++ >/dev/null || fail "no C++ compiler (apt-get install build-essential)"
mkdir -p "$WORK"
fuse_build_tools "$PY" "$WORK/tools"
fuse_fetch_source "$WORK/fuse3" "$WORK"
# Static: the programs carry their libfuse and need nothing installed beside them.
run env PATH="$WORK/tools/bin:$PATH" meson setup "$WORK/build" "$WORK/fuse3" --buildtype=release \
  -Ddefault_library=static -Dutils=false -Dexamples=true -Dtests=false -Duseroot=false
run env PATH="$WORK/tools/bin:$PATH" ninja -C "$WORK/build" "${PROGRAMS[@]/#/example/}"
mkdir -p "$OUT"
for p in "${PROGRAMS[@]}"; do run install -m 0755 "$WORK/build/example/$p" "$OUT/$p"; done
run rm -rf "$WORK"
echo "build-fuse-references: built ${PROGRAMS[*]} in ${SECONDS}s" >&2
echo "$OUT"
