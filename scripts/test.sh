#!/usr/bin/env bash
# Set up (if needed) and run the default test suite: fast tests, mounted tests, the integration
# suite against a radosgw the harness starts on 127.0.0.1, and then the FUSE front end under the
# sanitizers (scripts/test-sanitized.sh). With arguments, only pytest runs, with them.
# Slow suites (soak, big benchmarks) are separate: see README.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
if (( $# )); then
  exec .venv/bin/python -m pytest tests integration -q -p no:cacheprovider "$@"
fi
status=0
.venv/bin/python -m pytest tests integration -q -p no:cacheprovider --durations=25 || status=$?
scripts/test-sanitized.sh || status=$?
exit "$status"
