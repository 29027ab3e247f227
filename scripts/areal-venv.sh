#!/usr/bin/env bash
# Create .venv-areal: the RL frameworks' own client code importable on CPU, for the tests that drive pdctl's
# engines with it: AReaL 1.0.4 (RemoteSGLangEngine, its WeightUpdateMeta, name_resolve) and skyrl-train 0.3.1
# (RemoteInferenceEngine, InferenceEngineClient, its broadcast weight sync). Idempotent.
#   scripts/areal-venv.sh        needs .venv (scripts/setup.sh); prints the interpreter's path once it made it
#
# AReaL is installed with --no-deps (its metadata pulls in CUDA torch, sglang, wandb, litellm, ...), then
# only what the import of areal.engine.sglang_remote, areal.api.{cli_args,io_struct},
# areal.engine.core.distributed and areal.utils.name_resolve needs. torch is not downloaded again: a .pth
# file puts .venv's site-packages on sys.path AFTER .venv-areal's own, so .venv-areal's packages win and
# torch, numpy, aiohttp, pydantic, ... come from .venv. .venv's pip installs into it (`pip --python`), so
# pip sees .venv's packages as installed and resolves against them. AReaL pins torch<2.11; .venv's
# torch 2.13 imports and runs what these modules use.
set -euo pipefail
self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$self")/.."
root=$(pwd)
VENV=.venv-areal

[ -x .venv/bin/python ] || { echo "areal-venv: .venv is missing: run scripts/setup.sh first" >&2; exit 1; }
base_sp=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# A second run costs about a second: nothing is installed again unless this script, the repo's path or
# .venv's set of installed distributions (e.g. another torch) changed: the stamp holds their hash.
stamp=$VENV/.pdctl-areal-venv
want=$( { cat "$self" tests/frameworks/skyrl_compat.py; echo "$root"; ls "$base_sp" | grep -E '\.(dist|egg)-info$' || true; } | sha256sum | cut -d' ' -f1)
if [ -x $VENV/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0 # made already: quiet (scripts/setup.sh says one line when it has nothing to do)
fi

rm -f "$stamp"
# Built from .venv's interpreter: venv makes it from the same base Python. No pip of its own (.venv's
# pip installs into it), so it has no setuptools 65 of its own either to shadow .venv's.
[ -x $VENV/bin/python ] || .venv/bin/python -m venv --without-pip $VENV
echo '*' >$VENV/.gitignore # not in the repo's .gitignore; Python 3.13's venv writes the same file
sp=$($VENV/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# addsitedir, not a bare path: .venv's own .pth files run too (pdctl's editable install is importable).
echo "import site; site.addsitedir('$base_sp')" >"$sp/zz-pdctl-venv.pth"

PIP=(.venv/bin/python -m pip --python $VENV/bin/python --disable-pip-version-check -q)
# Quiet when it works; all of pip's output when not.
pip_install() { local out; if ! out=$("${PIP[@]}" install "$@" 2>&1); then echo "$out" >&2; exit 1; fi; }
pip_install --no-deps areal==1.0.4
# skyrl-train 0.3.1 declares Python >= 3.12 and pulls in vllm, flash-attn, ...: its remote-engine client and
# broadcast weight sync use none of that (what they import is installed here for AReaL, plus loguru).
pip_install --no-deps --ignore-requires-python skyrl-train==0.3.1
pip_install loguru
# What those imports need (AReaL's own pins where a version matters); pip takes the rest from .venv.
pip_install \
  'transformers>=5.0.0,<=5.3.0' 'hydra-core==1.4.0.dev1' 'omegaconf==2.4.0.dev2' 'aiohttp>=3.13.3,<4' \
  'httpx>=0.28.1' 'tenacity>=8.2.0' 'uvloop>=0.21.0' 'pillow>=12.1.1' \
  torchdata ray numba aiofiles requests lark einops colorlog flask openai orjson psutil pybase64 pydantic \
  pyyaml packaging numpy

# Nothing installed here may bring a torch of its own (torchdata only needs some torch >= 2): the one
# .venv-areal imports must be .venv's.
if ls "$sp" | grep -qE '^((torch|triton)-[0-9].*\.dist-info|nvidia_.*)$'; then
  echo "areal-venv: a torch/nvidia/triton distribution got into $VENV; remove it ($sp)" >&2
  exit 1
fi
# The imports the tests make, and torch from .venv (AReaL logs a line at import: shown only on failure).
if ! out=$($VENV/bin/python - "$base_sp" 2>&1 <<'EOF'
import sys
import torch
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig  # noqa: F401
from areal.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta  # noqa: F401
from areal.engine.core.distributed import init_custom_process_group  # noqa: F401
from areal.engine.sglang_remote import RemoteSGLangEngine  # noqa: F401
from areal.utils import name_resolve  # noqa: F401

sys.path.insert(0, "tests/frameworks")
import skyrl_compat  # noqa: F401,E402  (ray's moved class, before skyrl_train imports it)
from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient  # noqa: F401,E402
from skyrl_train.inference_engines.remote_inference_engine import create_remote_inference_engines  # noqa: F401,E402
from skyrl_train.weight_sync import BroadcastTransferStrategy  # noqa: F401,E402

assert torch.__file__.startswith(sys.argv[1]), f"torch from {torch.__file__}, not .venv"
EOF
); then
  echo "$out" >&2
  exit 1
fi
echo "$want" >"$stamp"
versions=$($VENV/bin/python -c 'import importlib.metadata as m; print("AReaL", m.version("areal") + ", skyrl-train", m.version("skyrl-train"))')
echo "areal-venv: $root/$VENV/bin/python ($versions, torch from .venv)"
