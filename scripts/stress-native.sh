#!/usr/bin/env bash
# The churn of one directory (tests/test_native_stress.py: many processes creating, renaming,
# unlinking, reading, writing, truncating, mapping and setting xattrs while the drain uploads and
# the space manager evicts) under the sanitizers, larger than in the default run; it ends with a
# clean `ckptfs fsck` and no sanitizer report, on both data paths.
# Usage: scripts/stress-native.sh [SECONDS [PROCESSES]]   (default 120 s, 16 processes)
set -euo pipefail
cd "$(dirname "$0")/.."
export CKPTFS_STRESS_SECONDS=${1:-120} CKPTFS_STRESS_PROCS=${2:-16}
exec scripts/test-sanitized.sh tests/test_native_stress.py -s
