#!/usr/bin/env bash
# The README's two commands as a new user runs them: a fresh clone of this checkout's HEAD, a
# clean HOME, `scripts/demo.sh` then `scripts/test.sh`; fails if either fails or if their output
# shows a traceback. Writes both outputs under the work directory it prints.
#
#   scripts/check-fresh-clone.sh [WORKDIR]     # default: a new directory under /tmp
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d /tmp/pdctl-fresh-XXXXXX)}"
mkdir -p "$work/home"
git clone -q "$repo" "$work/clone"
cd "$work/clone"
echo "fresh clone of $(git rev-parse --short HEAD) in $work/clone, HOME=$work/home"
status=0
for cmd in scripts/demo.sh scripts/test.sh; do
    log="$work/$(basename "$cmd" .sh).log"
    started=$(date +%s)
    if HOME="$work/home" bash "$cmd" >"$log" 2>&1; then
        echo "$cmd: ok in $(( $(date +%s) - started ))s ($log)"
    else
        echo "$cmd: FAILED (exit $?; $log)"; status=1
    fi
    if grep -q "Traceback" "$log"; then
        echo "$cmd: its output shows a traceback ($log)"; status=1
    fi
done
exit $status
