#!/usr/bin/env bash
# The README's test command: set up, lint, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check pdctl tests tools benchmarks examples
.venv/bin/mypy
workers=${PDCTL_TEST_WORKERS:-4}
.venv/bin/python -m pytest -q -n "$workers" "$@"
