"""SGLang server flags: the committed flag table, the flags pdctl owns, extra-args rendering.

``server_flags.json`` is generated from SGLang 0.5.23's real ``ServerArgs`` parser by
``tools/gen_sglang_flags.py``; it lets validation and the sim know every flag's name,
aliases, arity and choices without SGLang installed.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from pdctl.gpu_profiles import PROFILES


@dataclass(frozen=True)
class FlagInfo:
    """One SGLang server flag. ``name`` is the canonical long form (``--tp-size``)."""

    name: str
    aliases: tuple[str, ...]
    dest: str
    takes_value: bool
    nargs: str | int | None
    choices: tuple[str, ...] | None
    type_name: str | None
    required: bool
    default: Any = None
    """SGLang's default (None where it has none, or none that JSON can carry): what its
    ``/server_info`` reports for a flag not given (tools/gen_sglang_flags.py)."""


@dataclass(frozen=True)
class ServerFlagTable:
    """All flags of one SGLang version, looked up by any of their spellings."""

    version: str
    flags: tuple[FlagInfo, ...]
    by_spelling: Mapping[str, FlagInfo] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        index = {spelling: f for f in self.flags for spelling in (f.name, *f.aliases)}
        object.__setattr__(self, "by_spelling", index)

    def lookup(self, name: str) -> FlagInfo | None:
        """The flag spelled ``name`` (``--x`` or bare ``x``), or None."""
        return self.by_spelling.get(name if name.startswith("-") else f"--{name}")

    def suggest(self, name: str) -> str | None:
        """The closest real flag name, for "did you mean" hints."""
        spelled = name if name.startswith("-") else f"--{name}"
        match = difflib.get_close_matches(spelled, list(self.by_spelling), n=1, cutoff=0.75)
        return match[0] if match else None


@cache
def server_flags() -> ServerFlagTable:
    """The committed SGLang flag table (SGLang 0.5.23)."""
    raw = json.loads(resources.files("pdctl.sglang").joinpath("server_flags.json").read_text())
    flags = tuple(
        FlagInfo(
            name=f["names"][0],
            aliases=tuple(f["names"][1:]),
            dest=f["dest"],
            takes_value=f["takes_value"],
            nargs=f["nargs"],
            choices=tuple(f["choices"]) if f["choices"] else None,
            type_name=f["type"],
            required=f["required"],
            default=f.get("default"),
        )
        for f in raw["flags"]
    )
    return ServerFlagTable(version=raw["sglang_version"], flags=flags)


# Flags pdctl sets itself, with where the user sets the same thing in the topology.
OWNED_FLAGS: Mapping[str, str] = {
    "--model-path": "model.path",
    "--served-model-name": "model.served_name",
    "--tokenizer-path": "model.tokenizer",
    "--dtype": "model.dtype",
    "--host": "nodes[].host",
    "--port": "ports.base (pdctl allocates ports)",
    "--tp-size": "<group>.tp",
    "--dp-size": "<group>.dp",
    "--pp-size": "<group>.pp",
    "--attn-dp-size": "<group>.attn_dp",
    "--enable-dp-attention": "<group>.attn_dp",
    "--base-gpu-id": "pdctl's GPU placement (<group>.nodes to pin)",
    "--gpu-id-step": "pdctl's GPU placement",
    "--nccl-port": "ports.base (pdctl allocates ports)",
    "--nnodes": "pdctl's placement (engines larger than a node span whole nodes)",
    "--node-rank": "pdctl's placement",
    "--dist-init-addr": "ports.base (pdctl allocates ports)",
    "--disaggregation-mode": "the group's role (prefill / decode / regular)",
    "--disaggregation-bootstrap-port": "ports.base (pdctl allocates ports)",
    "--disaggregation-transfer-backend": "<group>.transfer_backend",
    "--disaggregation-ib-device": "<group>.ib_device",
    "--config": "the flags themselves in <group>.args (pdctl passes each engine its key in a --config file)",
    "--api-key": "router.api_key_env for clients (each cluster's engines get a key `pdctl up` makes)",
    "--admin-api-key": "router.api_key_env for clients (each cluster's engines get a key `pdctl up` makes)",
}

# Flags SGLang removed; 0.5.23's parser rejects them.
REMOVED_FLAGS: Mapping[str, str] = {
    "--disaggregation-decode-tp": "removed after SGLang 0.5.5; give decode its own tp instead",
    "--disaggregation-decode-dp": "removed after SGLang 0.5.5; give decode its own dp instead",
    "--disaggregation-prefill-pp": "removed after SGLang 0.5.5; give prefill its own pp instead",
}

# Sim-only flags (the latency model); accepted in args only when engine is sim.
SIM_ONLY_PREFIX = "--sim-"


def _flag_name(key: str) -> str:
    return key if key.startswith("--") else f"--{key}"


def render_extra_args(args: Mapping[str, Any]) -> list[str]:
    """Turn a group's ``args`` mapping into argv.

    ``{"chunked-prefill-size": 8192, "enable-metrics": True, "x": False, "l": [1, 2]}`` gives
    ``--chunked-prefill-size 8192 --enable-metrics --l 1 2``: True is a bare flag, False and
    None are omitted, lists become several values. Keys keep the caller's order.
    """
    argv: list[str] = []
    for key, value in args.items():
        name = _flag_name(key)
        if value is None or value is False:
            continue
        if value is True:
            argv.append(name)
        elif isinstance(value, list | tuple):
            argv.append(name)
            argv.extend(_scalar(v) for v in value)
        elif isinstance(value, dict):
            argv.extend([name, json.dumps(value, separators=(",", ":"), sort_keys=True)])
        else:
            argv.extend([name, _scalar(value)])
    return argv


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def check_extra_args(args: Mapping[str, Any], *, allow_sim_flags: bool) -> list[tuple[str, str, str]]:
    """Check a group's extra args against the flag table.

    Returns ``(key, message, hint)`` for each problem: an unknown or removed flag, an
    abbreviation or alias instead of the full name, a flag pdctl owns, a value for a bare
    flag, a missing value, or a value outside the flag's choices.
    """
    table = server_flags()
    problems: list[tuple[str, str, str]] = []
    for key, value in args.items():
        name = _flag_name(key)
        if allow_sim_flags and name.startswith(SIM_ONLY_PREFIX):
            if name == "--sim-profile" and str(value) not in PROFILES:  # (a missing one would fail only at up)
                problems.append((key, f"unknown sim profile {value!r}", "choose from " + ", ".join(sorted(PROFILES))))
            continue
        if name in REMOVED_FLAGS:
            problems.append((key, f"{name} is not an SGLang {table.version} flag", REMOVED_FLAGS[name]))
            continue
        flag = table.lookup(name)
        if flag is None:
            suggestion = table.suggest(name)
            hint = f"did you mean {suggestion}?" if suggestion else "see `python -m sglang.launch_server --help`"
            problems.append((key, f"unknown SGLang {table.version} flag {name}", hint))
            continue
        if flag.name in OWNED_FLAGS:
            problems.append((key, f"{flag.name} is set by pdctl", f"set {OWNED_FLAGS[flag.name]} instead"))
            continue
        if name != flag.name:
            problems.append((key, f"{name} is an alias", f"write the full flag name {flag.name}"))
            continue
        problems.extend(_check_value(key, flag, value))
    return problems


def _check_value(key: str, flag: FlagInfo, value: Any) -> list[tuple[str, str, str]]:
    if not flag.takes_value:
        if not isinstance(value, bool):
            return [(key, f"{flag.name} is a bare flag and takes no value", "write true or false")]
        return []
    if value is True:
        return [(key, f"{flag.name} needs a value", f"write {key}: <value>")]
    if value is None or value is False:
        return []
    values = value if isinstance(value, list | tuple) else [value]
    if isinstance(value, list | tuple) and flag.nargs in (None, "?"):
        return [(key, f"{flag.name} takes one value, not a list", "")]
    if flag.choices:
        bad = [v for v in values if _scalar(v) not in flag.choices]
        if bad:
            return [(key, f"{flag.name}: invalid choice {_scalar(bad[0])!r}", "choose from " + ", ".join(flag.choices))]
    if flag.type_name in ("int", "float"):
        conv = int if flag.type_name == "int" else float
        for v in values:
            try:
                conv(v)
            except (TypeError, ValueError):
                return [(key, f"{flag.name} takes an {flag.type_name}, got {v!r}", "")]
    return []
