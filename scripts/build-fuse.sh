#!/usr/bin/env bash
# Native set-up: libfuse >= 3.17 and the gateway's FUSE front end (ckptfs_fuse) in the venv.
#
# - If the system libfuse (pkg-config fuse3) is >= 3.17, the front end is built against it.
# - Otherwise (Debian 12 ships 3.14) the source of Debian 13's fuse3 package is fetched with
#   apt-get source through a private sources list (the system's apt configuration is only
#   read, never written), and the library alone is built with meson + ninja from PyPI and
#   installed as a shared library into $VENV/opt/fuse3.
# - native/*.c are compiled into the venv's site-packages as the extension module ckptfs_fuse,
#   with an rpath to that libfuse.
# - With --sanitize, the front end is built instead with AddressSanitizer and
#   UndefinedBehaviorSanitizer into $VENV/opt/ckptfs-asan (not site-packages: only what puts it
#   first on PYTHONPATH, with libasan preloaded, uses it; scripts/test-sanitized.sh).
# A stamp keyed on the source, this script and the versions skips everything next time.
# Prints one line saying what it did. Usage: scripts/build-fuse.sh [--sanitize] [VENV]
# (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SANITIZE=0
if [[ ${1:-} == --sanitize ]]; then SANITIZE=1; shift; fi
VENV=$(realpath -m "${1:-.venv}")
PY=$VENV/bin/python
SRCS=("$ROOT"/native/*.c)
FUSE_MIN=3.17
PREFIX=$VENV/opt/fuse3
WORK=$VENV/opt/build-fuse      # scratch (removed after success): sources, build trees, meson+ninja
LOG=$VENV/build-fuse.log

[[ -x $PY ]] || { echo "build-fuse: no venv at $VENV (run scripts/setup.sh)" >&2; exit 1; }
SECONDS=0
key=$( { cat "${SRCS[@]}" "$ROOT"/native/*.h "$0" scripts/fuse-source.sh; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
kind=native what=ckptfs_fuse
if (( SANITIZE )); then
  ASAN_DIR=$VENV/opt/ckptfs-asan
  LIBASAN=$(cc -print-file-name=libasan.so)
  [[ $LIBASAN == /* ]] || { echo "build-fuse: no libasan.so for cc (apt-get install build-essential)" >&2; exit 1; }
  kind=asan what="ckptfs_fuse with ASan+UBSan in ${ASAN_DIR#"$ROOT"/}"
fi
stamp=$VENV/.ckptfs-$kind-$key

# The venv's Python with the module just built (a Python not built with ASan loads the
# sanitized one only with libasan preloaded).
front_py() {
  if (( SANITIZE )); then
    LD_PRELOAD=$LIBASAN ASAN_OPTIONS=detect_leaks=0 PYTHONPATH=$ASAN_DIR "$PY" "$@"
  else
    "$PY" "$@"
  fi
}
front_end_ok() {
  front_py -c 'import os, sys, ckptfs_fuse; sys.exit(os.path.dirname(ckptfs_fuse.__file__) != sys.argv[1])' \
    "$( ((SANITIZE)) && echo "$ASAN_DIR" || "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')" \
    2>/dev/null
}
if [[ -f $stamp ]] && front_end_ok; then
  echo "build-fuse: up to date ($what, $(cat "$stamp"))"
  exit 0
fi

: >"$LOG"
fail() { echo "build-fuse: $* (log: $LOG)" >&2; tail -n 30 "$LOG" >&2; exit 1; }
run() { echo "+ [${SECONDS}s] $*" >>"$LOG"; "$@" >>"$LOG" 2>&1 || fail "failed: $*"; }
# shellcheck source=scripts/fuse-source.sh
source scripts/fuse-source.sh
mkdir -p "$WORK"

# -- libfuse ---------------------------------------------------------------------------------
if pkg-config --atleast-version="$FUSE_MIN" fuse3 2>/dev/null; then
  fuse_pc_path=""
  fuse_ldflags=""
  fuse_desc="system libfuse $(pkg-config --modversion fuse3)"
else
  if [[ ! -f $PREFIX/.built ]] || ! PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig \
       pkg-config --atleast-version="$FUSE_MIN" fuse3 2>/dev/null; then
    BT=$WORK/tools
    fuse_build_tools "$PY" "$BT"
    fuse_fetch_source "$WORK/fuse3" "$WORK"
    run rm -rf "$WORK/fuse3-build" "$PREFIX"
    # Only the library: no helpers (fusermount3 stays the system's setuid one), no udev rules,
    # no init script, no examples, no tests.
    run env PATH="$BT/bin:$PATH" meson setup "$WORK/fuse3-build" "$WORK/fuse3" \
      --prefix="$PREFIX" --libdir=lib --buildtype=release -Ddefault_library=shared \
      -Dutils=false -Dexamples=false -Dtests=false -Duseroot=false
    run env PATH="$BT/bin:$PATH" ninja -C "$WORK/fuse3-build"
    run env PATH="$BT/bin:$PATH" meson install -C "$WORK/fuse3-build" --no-rebuild
    PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig pkg-config --modversion fuse3 >"$PREFIX/.built"
  fi
  fuse_pc_path=$PREFIX/lib/pkgconfig
  fuse_ldflags="-Wl,-rpath,$PREFIX/lib"
  fuse_desc="libfuse $(cat "$PREFIX/.built") in ${PREFIX#"$ROOT"/}"
fi

# -- the front end ----------------------------------------------------------------------------
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[[ -f $include/Python.h ]] || fail "no Python.h in $include (apt-get install python3-dev)"
fuse_cflags=$(PKG_CONFIG_PATH="$fuse_pc_path${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}" pkg-config --cflags fuse3)
fuse_libs=$(PKG_CONFIG_PATH="$fuse_pc_path${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}" pkg-config --libs fuse3)
cflags=(-O2 -g)
if (( SANITIZE )); then   # any report ends the process (-fno-sanitize-recover): nothing is missed
  site=$ASAN_DIR
  mkdir -p "$site"
  cflags=(-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all)
fi
# Built as a temporary file and renamed: a running gateway keeps the module it mapped.
# shellcheck disable=SC2086  # the pkg-config flags are word lists
run cc "${cflags[@]}" -Wall -Wextra -Wno-unused-parameter -fPIC -shared -I"$include" $fuse_cflags \
  "${SRCS[@]}" -o "$site/ckptfs_fuse$suffix.tmp" $fuse_libs $fuse_ldflags -lpthread
run mv -f "$site/ckptfs_fuse$suffix.tmp" "$site/ckptfs_fuse$suffix"
front_end_ok || fail "the built ckptfs_fuse does not import"
if [[ -n $fuse_pc_path ]]; then   # the extension must load our libfuse (rpath), not the system's
  front_py - "$PREFIX/lib/" >>"$LOG" 2>&1 <<'PY' || fail "ckptfs_fuse does not load $PREFIX/lib/libfuse3"
import sys, ckptfs_fuse
libs = {l.split()[-1] for l in open("/proc/self/maps") if "libfuse3.so" in l}
print("ckptfs_fuse loads", libs, "libfuse", ckptfs_fuse.LIBFUSE_VERSION)
sys.exit(0 if libs and all(lib.startswith(sys.argv[1]) for lib in libs) else 1)
PY
fi
run rm -rf "$WORK"              # sources, build trees and build tools (~80 MB) are not kept

rm -f "$VENV"/.ckptfs-$kind-*
echo "$fuse_desc" >"$stamp"
echo "build-fuse: built $what against $fuse_desc in ${SECONDS}s"
