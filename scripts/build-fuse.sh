#!/usr/bin/env bash
# Native set-up for FUSE passthrough: libfuse >= 3.17 and a patched pyfuse3 in the venv.
#
# - If the system libfuse (pkg-config fuse3) is >= 3.17, pyfuse3 is built against it.
# - Otherwise (Debian 12 ships 3.14) the source of Debian 13's fuse3 package is fetched with
#   apt-get source through a private sources list (the system's apt configuration is only
#   read, never written), and the library alone is built with meson + ninja from PyPI and
#   installed as a shared library into $VENV/opt/fuse3.
# - The pyfuse3 sdist from PyPI gets native/pyfuse3-passthrough.patch and is built into the
#   venv with an rpath to that libfuse.
# A stamp keyed on the patch, this script and the versions skips everything next time.
# Prints one line saying what it did. Usage: scripts/build-fuse.sh [VENV]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$(realpath -m "${1:-.venv}")
PY=$VENV/bin/python
PATCH=$ROOT/native/pyfuse3-passthrough.patch
PYFUSE3_VERSION=3.5.0
FUSE_MIN=3.17
FUSE_SUITE=trixie              # Debian release whose fuse3 source package has libfuse >= 3.17
PREFIX=$VENV/opt/fuse3
WORK=$VENV/opt/build-fuse      # scratch (removed after success): sources, build trees, meson+ninja
LOG=$VENV/build-fuse.log

[[ -x $PY ]] || { echo "build-fuse: no venv at $VENV (run scripts/setup.sh)" >&2; exit 1; }
SECONDS=0
key=$( { cat "$PATCH" "$0"; echo "$PYFUSE3_VERSION $FUSE_SUITE"; } | sha256sum | cut -c1-16)
stamp=$VENV/.ckptfs-native-$key

patched_pyfuse3_ok() {
  "$PY" -c 'import pyfuse3, sys; sys.exit(0 if getattr(pyfuse3, "HAVE_PASSTHROUGH", False) else 1)' 2>/dev/null
}
if [[ -f $stamp ]] && patched_pyfuse3_ok; then
  echo "build-fuse: up to date (patched pyfuse3 $PYFUSE3_VERSION, $(cat "$stamp"))"
  exit 0
fi

: >"$LOG"
fail() { echo "build-fuse: $* (log: $LOG)" >&2; tail -n 30 "$LOG" >&2; exit 1; }
run() { echo "+ [${SECONDS}s] $*" >>"$LOG"; "$@" >>"$LOG" 2>&1 || fail "failed: $*"; }
mkdir -p "$WORK"

# -- libfuse ---------------------------------------------------------------------------------
if pkg-config --atleast-version="$FUSE_MIN" fuse3 2>/dev/null; then
  fuse_pc_path=""
  fuse_ldflags=""
  fuse_desc="system libfuse $(pkg-config --modversion fuse3)"
else
  if [[ ! -f $PREFIX/.built ]] || ! PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig \
       pkg-config --atleast-version="$FUSE_MIN" fuse3 2>/dev/null; then
    # Build tools from PyPI in their own small venv (not in the project's venv).
    BT=$WORK/tools
    [[ -x $BT/bin/meson && -x $BT/bin/ninja ]] || {
      run "$PY" -m venv --clear --without-pip "$BT"
      run "$PY" -m pip --python "$BT/bin/python" install -q meson ninja
    }
    # Private apt state: our own sources.list, lists and cache dirs. The system's apt.conf.d
    # (proxy settings, etc.) still applies; the mirror is the one the system uses for Debian.
    mirror=${DEBIAN_MIRROR:-$( { cat /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null || true; } \
               | grep -oE '^(URIs:|deb(-src)?( \[[^]]*\])?) +https?://[^ ]+/debian/?( |$)' \
               | grep -oE 'https?://[^ ]+' | head -n1 || true)}
    mirror=${mirror:-http://deb.debian.org/debian}
    A=$WORK/apt; rm -rf "$A"; mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/src"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${mirror%/} $FUSE_SUITE main" \
      >"$A/sources.list"
    aopt=(-o "Dir::Etc::sourcelist=$A/sources.list" -o Dir::Etc::sourceparts=- \
          -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache" -o APT::Sandbox::User=root \
          -o Debug::NoLocking=1 -q)
    run apt-get "${aopt[@]}" update
    echo "+ [${SECONDS}s] apt-get source --download-only fuse3" >>"$LOG"
    (cd "$A/src" && apt-get "${aopt[@]}" source --download-only fuse3) >>"$LOG" 2>&1 \
      || fail "apt-get source fuse3 ($FUSE_SUITE) failed"
    dsc=$(ls "$A"/src/fuse3_*.dsc | head -n1)
    run rm -rf "$WORK/fuse3"
    run dpkg-source -x "$dsc" "$WORK/fuse3"     # also applies Debian's patches
    run rm -rf "$A"
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

# -- pyfuse3 ---------------------------------------------------------------------------------
P=$WORK/pyfuse3
run rm -rf "$P"; mkdir -p "$P"
# --no-binary for pyfuse3 only: ":all:" would also build its build dependencies (Cython) from
# source to prepare the metadata, which takes minutes.
run "$PY" -m pip download -q --no-binary pyfuse3 --no-deps -d "$P" "pyfuse3==$PYFUSE3_VERSION"
run tar xzf "$P/pyfuse3-$PYFUSE3_VERSION.tar.gz" -C "$P"
src=$P/pyfuse3-$PYFUSE3_VERSION
(cd "$src" && patch -p1 --forward <"$PATCH") >>"$LOG" 2>&1 || fail "the patch does not apply"
rm -f "$src/src/pyfuse3/__init__.c"       # make Cython regenerate it from the patched .pyx
# The local version label shows in `pip show pyfuse3`; it still satisfies pyfuse3>=3.3, so the
# project's own `pip install -e .` leaves this build in place.
run env PKG_CONFIG_PATH="$fuse_pc_path${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}" \
  LDFLAGS="$fuse_ldflags${LDFLAGS:+ $LDFLAGS}" \
  SETUPTOOLS_SCM_PRETEND_VERSION_FOR_PYFUSE3="$PYFUSE3_VERSION+passthrough" \
  "$PY" -m pip install -q --no-cache-dir --force-reinstall --no-deps "$src"
# pyfuse3's one dependency, if the venv lacks it.
"$PY" -c 'import trio' 2>/dev/null || run "$PY" -m pip install -q 'trio>=0.15'
patched_pyfuse3_ok || fail "the installed pyfuse3 lacks HAVE_PASSTHROUGH"
if [[ -n $fuse_pc_path ]]; then   # the extension must load our libfuse (rpath), not the system's
  "$PY" - "$PREFIX/lib/" >>"$LOG" 2>&1 <<'PY' || fail "pyfuse3 does not load $PREFIX/lib/libfuse3"
import sys, pyfuse3
libs = {l.split()[-1] for l in open("/proc/self/maps") if "libfuse3.so" in l}
print("pyfuse3 loads", libs)
sys.exit(0 if libs and all(lib.startswith(sys.argv[1]) for lib in libs) else 1)
PY
fi
run rm -rf "$WORK"              # sources, build trees and build tools (~80 MB) are not kept

rm -f "$VENV"/.ckptfs-native-*
echo "$fuse_desc" >"$stamp"
echo "build-fuse: built patched pyfuse3 $PYFUSE3_VERSION against $fuse_desc in ${SECONDS}s"
