#!/usr/bin/env bash
# The README's test command: set up, lint, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check pdctl tests tools benchmarks examples
.venv/bin/mypy
workers=${PDCTL_TEST_WORKERS:-4}
mode=$(.venv/bin/python -c 'from pdctl.router.compiled import mode; print(mode())')
echo "test: the router's request path runs $mode"
.venv/bin/python -m pytest -q -n "$workers" "$@"
# The suite ran the compiled request path (pdctl.router.compiled) where setup built it: the
# router's tests run once more on its sources, interpreted, so that both ways stay right.
if [ $# -eq 0 ] && [ "$mode" = compiled ]; then
  PDCTL_ROUTER_INTERPRETED=1 .venv/bin/python -m pytest -q -n "$workers" tests/router
fi
