#!/usr/bin/env bash
# Create .venv and install pdctl with what its tests and demo need. Idempotent.
#   scripts/setup.sh            pdctl + test extras + SGLang's CPU parser (sglang-protocol.md 1.1)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
  command -v ip >/dev/null || need+=(iproute2)
  if [ ${#need[@]} -gt 0 ]; then
    # Only the multi-host tests need these; without them they are skipped with the reason.
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) ||
      echo "setup: could not install ${need[*]}; the multi-host tests will be skipped" >&2
  fi
  if ! command -v promtool >/dev/null; then  # the observability tests' real Prometheus (not started here)
    (apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) ||
      echo "setup: could not install prometheus; the Prometheus test will be skipped" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"
# A second run costs a second: nothing is installed again unless pyproject.toml changed (the stamp
# holds its hash) or SGLang is not the pinned version.
stamp=.venv/.pdctl-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  $PIP install --upgrade pip >/dev/null 2>&1 || true
  # torch first, its CPU build: from PyTorch's CPU index where that index answers (PyPI's torch is the
  # CUDA build on an ordinary Linux machine: several GB of nvidia-* wheels for a demo that runs on CPU),
  # else the pinned PyPI wheel (where a local wheel house or mirror serves the CPU one).
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    cpu_index=https://download.pytorch.org/whl/cpu
    if .venv/bin/python -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" 2>/dev/null &&
      $PIP install --index-url "$cpu_index" torch==2.13.0 2>/dev/null; then
      echo "setup: torch 2.13.0 (CPU build) from $cpu_index"
    else
      $PIP install torch==2.13.0
      echo "setup: torch 2.13.0 from the package index (PyTorch's CPU index did not answer)"
    fi
  fi
  # Quiet when it works (setuptools' license-table deprecation notes are noise here); all of it when not.
  if ! out=$($PIP install -e ".[test]" 2>&1); then echo "$out" >&2; exit 1; fi
fi
# SGLang's real argument parser on CPU: its import-time deps, then sglang without its GPU pins. Checked by
# version, not by import: `import sglang` needs triton, which no CPU machine has.
if [ "$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null)" != 0.5.23 ]; then
  $PIP install numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
    ipython aiohttp
  $PIP install --no-deps sglang==0.5.23
fi
echo "$want" > "$stamp"
# AReaL 1.0.4's own client in a venv of its own (torch from .venv), for the test that drives a fleet
# with it (tests/frameworks); never one of pdctl's dependencies.
bash scripts/areal-venv.sh
echo "setup: .venv ready"
