#!/usr/bin/env bash
# Set up (if needed) and run the default test suite: fast tests, mounted tests,
# and the integration suite against a radosgw the harness starts on 127.0.0.1.
# Slow suites (soak, big benchmarks) are separate: see README.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
exec .venv/bin/python -m pytest tests integration -q -p no:cacheprovider "$@"
