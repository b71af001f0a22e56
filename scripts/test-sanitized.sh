#!/usr/bin/env bash
# The FUSE front end under AddressSanitizer + UndefinedBehaviorSanitizer, with CPython's debug
# memory hooks: the front end's own tests and a mounted slice (the POSIX tests, the passthrough
# and writeback data paths, /dev/fuse and, where the kernel offers it, io_uring, and the churn
# stress of one directory). Any sanitizer report fails the run, in any process (the gateways,
# the test file systems, pytest). Part of scripts/test.sh.
#
# Usage: scripts/test-sanitized.sh [PYTEST ARGS...]   (default: the slice below)
#        scripts/stress-native.sh runs the stress alone, larger.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
scripts/build-fuse.sh --sanitize .venv >&2
reports=$(mktemp -d /tmp/ckptfs-sanitizers.XXXXXX)
trap 'rm -rf "$reports"' EXIT

# A Python not built with ASan loads an instrumented extension only with the ASan runtime
# loaded first. The sanitized module comes first on the path; site-packages keeps the other.
LD_PRELOAD=$(cc -print-file-name=libasan.so)${LD_PRELOAD:+:$LD_PRELOAD}
PYTHONPATH=$ROOT/.venv/opt/ckptfs-asan${PYTHONPATH:+:$PYTHONPATH}
# CPython's debug hooks (as PYTHONMALLOC=debug: guard bytes, freed memory poisoned, the GIL
# checked), over the system malloc rather than pymalloc's arenas, so that ASan also sees every
# Python object's memory.
PYTHONMALLOC=malloc_debug
# detect_leaks=0: CPython frees neither its interned objects nor its modules' state at exit, on
# purpose; LeakSanitizer would report those in every Python process. Reports go to files
# (log_path), read below: a daemon's stderr is a log nobody else reads.
ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$reports/asan
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$reports/ubsan
export LD_PRELOAD PYTHONPATH PYTHONMALLOC ASAN_OPTIONS UBSAN_OPTIONS
PY=.venv/bin/python

fail_on_reports() {
  if compgen -G "$reports/*" >/dev/null; then
    echo "test-sanitized: sanitizer reports:" >&2
    for f in "$reports"/*; do echo "== $f" >&2; cat "$f" >&2; done
    return 1
  fi
}

# The sanitized module is the one imported, and a sanitizer report is caught: a heap overflow
# through libc's memmove (which ASan checks) in a throw-away process must leave a report.
"$PY" - "$ROOT/.venv/opt/ckptfs-asan/" <<'PY' || { echo "test-sanitized: the sanitized front end is not in use" >&2; exit 1; }
import sys, ckptfs_fuse
assert ckptfs_fuse.__file__.startswith(sys.argv[1]), ckptfs_fuse.__file__
assert any("libasan" in line for line in open("/proc/self/maps")), "libasan is not loaded"
PY
if ASAN_OPTIONS=$ASAN_OPTIONS:abort_on_error=0 "$PY" -c \
     'import ctypes; b = ctypes.create_string_buffer(4096); ctypes.memmove(b, b"x" * 8192, 8192)' 2>/dev/null \
   || ! compgen -G "$reports/asan*" >/dev/null; then
  echo "test-sanitized: a heap overflow went unreported: the sanitizer is not live" >&2
  exit 1
fi
rm -f "$reports"/*

SECONDS=0
# The front end's own tests; the POSIX tests on both data paths (/dev/fuse); the io_uring queues
# on both data paths (where the kernel offers them); a passthrough round trip to the bucket; the
# churn of one directory under drain and eviction. (A few minutes: a slice, not the suite.)
slice=(tests/test_native_frontend.py tests/test_passthrough_native.py tests/test_mount_posix.py
       tests/test_mount_io_uring.py::test_requests_come_through_the_io_uring_queues
       tests/test_mount_passthrough.py::test_writes_bypass_the_gateway_and_reach_cache_and_bucket
       tests/test_native_stress.py)
status=0
if (( $# )); then
  "$PY" -m pytest -q -p no:cacheprovider "$@" || status=$?
else  # (the throughput report measures dd, not the front end)
  "$PY" -m pytest -q -p no:cacheprovider -k "not throughput_report" "${slice[@]}" || status=$?
fi
fail_on_reports || status=1
echo "test-sanitized: $( ((status)) && echo FAILED || echo passed) in ${SECONDS}s" >&2
exit "$status"
