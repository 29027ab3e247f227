#!/usr/bin/env bash
# The README's main job: the embedded default topology (the CPU sim engine on localhost,
# one prefill + one decode behind pdctl's PD router): up, requests through the router,
# status, down. Installs what it needs into .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PDCTL=.venv/bin/pdctl
export PDCTL_HOME="${PDCTL_HOME:-$PWD/.pdctl}"

cleanup() { "$PDCTL" down local >/dev/null 2>&1 || true; }
trap cleanup EXIT

"$PDCTL" plan
"$PDCTL" up
URL=$(.venv/bin/python -c "import json,os; print(json.load(open(os.environ['PDCTL_HOME']+'/local/state.json'))['router_url'])")
echo "== requests through the router at $URL"
.venv/bin/python - "$URL" <<'PY'
import json, sys, urllib.request
url = sys.argv[1]
def post(path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())
for prompt in ("The capital of France is", "def fibonacci(n):", "pdctl says"):
    out = post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    print(f"  /generate {prompt!r} -> {out['text']!r} ({out['meta_info']['completion_tokens']} tokens)")
chat = post("/v1/chat/completions", {"model": "sim-tiny", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 12, "temperature": 0})
print(f"  /v1/chat/completions -> {chat['choices'][0]['message']['content']!r}")
PY
"$PDCTL" status
echo "== one frame of pdctl top (live without --once; q quits)"
"$PDCTL" top --once
"$PDCTL" down
trap - EXIT
echo "demo finished: the sim fleet came up, served requests through the PD router, and went down."
