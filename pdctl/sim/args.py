"""The sim's command line: SGLang 0.5.23's full server flag set, plus ``--sim-*`` knobs.

Built from the committed flag table, so every flag ``sglang.launch_server`` accepts is
accepted here with the same arity and choices, and an unknown flag exits 2 as SGLang's
argparse does. Flags that only mean something on a GPU are accepted and listed in the log.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml

from pdctl.sglang import server_flags
from pdctl.sim.config import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_TOKENS, DEFAULT_MAX_SEQUENCES_PER_REQUEST


def human_readable_int(value: str) -> int:
    """SGLang's ``human_readable_int`` (``--context-length 32k``): an integer, or a number with an
    SI suffix (k M G T) or an IEC one (Ki Mi Gi Ti, integers only); suffixes are case-sensitive."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value.strip())
    try:
        if match is None:
            return int(value)
        number, suffix = match.groups()
        if suffix.endswith("i"):
            return int(number) * 2 ** (10 * ("KMGT".index(suffix[0]) + 1))
        return int(Decimal(number) * 10 ** (3 * ("kMGT".index(suffix) + 1)))
    except (ValueError, InvalidOperation):
        raise argparse.ArgumentTypeError(
            f"Invalid integer value: '{value}'. Use a plain integer, SI suffixes (1k, 1M), or IEC suffixes "
            "(1Ki, 1Mi). Suffixes are case-sensitive."
        ) from None


def json_list_type(value: str) -> Any:
    """SGLang's ``json_list_type`` (utils/common.py): any JSON (a list, e.g. ``'[30100,30101]'``,
    by intent; SGLang does not check), its message on text that is not JSON."""
    try:
        return json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"Invalid JSON list: {value}. Please provide a valid JSON list.") from None


_TYPES = {"int": int, "float": float, "human_readable_int": human_readable_int, "json_list_type": json_list_type}
# Flags the sim acts on; everything else set on the command line is logged as ignored.
USED = {
    "model_path",
    "served_model_name",
    "tokenizer_path",
    "host",
    "port",
    "tp_size",
    "dp_size",
    "pp_size",
    "attn_dp_size",
    "base_gpu_id",
    "nccl_port",
    "dist_init_addr",
    "dist_timeout",
    "nnodes",
    "node_rank",
    "disaggregation_mode",
    "disaggregation_bootstrap_port",
    "disaggregation_transfer_backend",
    "enable_pd_role_switch",
    "load_format",
    "remote_instance_weight_loader_backend",
    "remote_instance_weight_loader_seed_instance_ip",
    "remote_instance_weight_loader_seed_instance_service_port",
    "remote_instance_weight_loader_send_weights_group_ports",
    "random_seed",
    "weight_version",
    "enable_metrics",
    "api_key",
    "config",  # merged into the command line before parsing, as SGLang does
    "log_level",
    "skip_server_warmup",
    "context_length",
    "max_running_requests",
    "max_queued_requests",
    "stream_interval",
    "dtype",
    "mem_fraction_static",
    "forward_hooks",
    "enable_return_hidden_states",
    "disable_radix_cache",  # a profile engine runs no prefix cache; the plain sim has none to disable
    "max_total_tokens",  # a profile engine's KV pool in tokens
    "chunked_prefill_size",  # a profile engine's prefill batch bound
    "disable_prefill_cuda_graph",  # holds trivially: the sim captures no CUDA graphs
}


@dataclass(frozen=True)
class SimOptions:
    """The sim-only latency model and limits (documented as simulation, not measurement)."""

    prefill_ms_per_token: float
    decode_ms_per_step: float
    threads: int
    weight_digest: str
    max_n: int = DEFAULT_MAX_N
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    weight_group_timeout_secs: float = 300.0
    disk_load_ms: float = 0.0
    profile: str | None = None
    null: bool = False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pdctl.sim",
        usage="python -m pdctl.sim --model-path PATH [SGLang server flags] [--sim-* flags]  (-h lists them all)",
        description="pdctl's CPU stand-in for an SGLang server: SGLang's flags and HTTP API, a tiny real model.",
    )
    for flag in server_flags().flags:
        names = [flag.name, *flag.aliases]
        kwargs: dict = {"dest": flag.dest, "default": None}
        if not flag.takes_value:
            negated = [n for n in names if n.startswith("--no-")]
            if negated and len(names) == 2:
                parser.add_argument(
                    *[n for n in names if n not in negated], action=argparse.BooleanOptionalAction, **kwargs
                )
                continue
            parser.add_argument(*names, action="store_true", **kwargs)
            continue
        if flag.nargs is not None:
            kwargs["nargs"] = flag.nargs
        if flag.choices:
            kwargs["choices"] = list(flag.choices)
        if flag.type_name in _TYPES:
            kwargs["type"] = _TYPES[flag.type_name]
        kwargs["required"] = flag.required
        parser.add_argument(*names, **kwargs)
    sim = parser.add_argument_group("sim only (latency model; simulation, not measurement)")
    sim.add_argument("--sim-prefill-ms-per-token", type=float, default=0.0, help="Added per prompt token.")
    sim.add_argument("--sim-decode-ms-per-step", type=float, default=0.0, help="Added per batched decode step.")
    sim.add_argument(
        "--sim-disk-load-ms", type=float, default=0.0, help="Added to each load from disk (a GPU engine's takes secs)."
    )
    sim.add_argument(
        "--sim-profile",
        help="Cost what a GPU costs: prefill, decode steps, a KV pool of tokens with a prefix cache, KV transfer "
        "and graph capture as the named profile's model on its GPUs (--list-profiles; docs/sim-profiles.md). "
        "Outputs then run to max_new_tokens from a stand-in forward pass.",
    )
    sim.add_argument(
        "--sim-graph-capture-secs",
        type=float,
        help="A profile engine's decode CUDA graph capture on its first flip to decode, in seconds "
        "(default: the profile's; docs/sim-profiles.md).",
    )
    sim.add_argument("--list-profiles", action="store_true", help="List the profiles and exit.")
    sim.add_argument(
        "--sim-null",
        action="store_true",
        help="No model and no torch: answer every call at once with SGLang-shaped bodies (pdctl.sim.null), "
        "the key checked as SGLang checks it. For lifecycle tests and benchmarks of many engines on one "
        "machine: starts in a fraction of a second; weight updates, role switches and sampling are not served.",
    )
    sim.add_argument("--sim-threads", type=int, default=1, help="torch CPU threads (default 1).")
    sim.add_argument(
        "--sim-port-file", help="Once serving, write the bound ports here as JSON (for --port 0; pdctl's own flag)."
    )
    sim.add_argument(
        "--sim-weight-digest",
        choices=["full", "sample"],
        default="full",
        help="How the engine's TP ranks compare each weight update they received (SGLang does not): "
        "full reads every byte; sample reads names, sizes, each tensor's ends and 64 words (default full).",
    )
    sim.add_argument(
        "--sim-weight-group-timeout-secs",
        type=float,
        default=300.0,
        help="How long a rank of a weight group waits in a collective (a broadcast whose trainer died) before it "
        "fails; SGLang's groups use torch's default, 30 minutes (default 300).",
    )
    limits = parser.add_argument_group("sim only (request bounds; SGLang has none; beyond: 400 naming the flag)")
    limits.add_argument(
        "--sim-max-n", type=int, default=DEFAULT_MAX_N, help=f"Largest n of one request (default {DEFAULT_MAX_N})."
    )
    limits.add_argument(
        "--sim-max-sequences-per-request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help=f"Largest prompts x n of one request (default {DEFAULT_MAX_SEQUENCES_PER_REQUEST}).",
    )
    limits.add_argument(
        "--sim-max-request-tokens",
        type=int,
        default=DEFAULT_MAX_REQUEST_TOKENS,
        help=f"Most prompt tokens over all sequences of one request (default {DEFAULT_MAX_REQUEST_TOKENS}).",
    )
    return parser


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """Flags given on the command line that the sim accepts but does not act on."""
    out = []
    for flag in server_flags().flags:
        value = getattr(args, flag.dest, None)
        if flag.dest not in USED and value not in (None, False):
            out.append(flag.name)
    return out


def sim_options(args: argparse.Namespace) -> SimOptions:
    return SimOptions(
        args.sim_prefill_ms_per_token,
        args.sim_decode_ms_per_step,
        args.sim_threads,
        args.sim_weight_digest,
        args.sim_max_n,
        args.sim_max_sequences_per_request,
        args.sim_max_request_tokens,
        args.sim_weight_group_timeout_secs,
        args.sim_disk_load_ms,
        args.sim_profile,
        args.sim_null,
    )


def _keys(action: argparse.Action) -> set[str]:
    """The config-file keys that name ``action``: its dest and each long spelling."""
    return {action.dest} | {o[2:].replace("-", "_") for o in action.option_strings if o.startswith("--")}


def merge_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with the flags of its ``--config FILE.yaml`` put in front, as SGLang 0.5.23's
    ``prepare_server_args`` does (``ConfigArgumentMerger``): the file's flags come first, so the
    command line wins; a key ``k`` becomes ``--k`` as written (so ``context_length`` is an
    unknown flag, in SGLang 0.5.23 too); ``true`` sets a bare flag (``false`` leaves it out), a
    list gives a flag its values, a mapping goes as JSON.
    ``pdctl up`` hands an engine its key this way, in a file only its owner reads, so that the
    key is not in the process's command line for every user of the node to see. Raises
    ValueError where SGLang does (two ``--config``, no file, not .yaml, not a mapping, a key of a
    flag that takes no single value and is not store_true)."""
    where = [i for i, arg in enumerate(argv) if arg == "--config"]
    if not where:
        return argv
    if len(where) > 1:
        raise ValueError("Multiple config files specified! Only one allowed.")
    at = where[0]
    if at == len(argv) - 1:
        raise ValueError("No config file specified after --config flag!")
    path = Path(argv[at + 1])
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ValueError(f"Config file must be YAML format, got: {path.suffix}")
    if not path.exists():
        raise ValueError(f"Config file not found: {path}")
    with path.open() as stream:  # (a stream: a YAML error then quotes no line of the file, which holds a key)
        data = yaml.safe_load(stream) or {}
    if not isinstance(data, dict):
        raise ValueError("Config file must contain a dictionary at root level")
    bare = {key for action in parser._actions if isinstance(action, argparse._StoreTrueAction) for key in _keys(action)}
    # SGLang takes store_true flags and flags of one value from a file; a key of another kind
    # (--x/--no-x flags, say) is refused, unless a supported flag reads the same key.
    supported = [
        a
        for a in parser._actions
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreAction)) or a.nargs is None
    ]
    supported_keys = {key for action in supported for key in _keys(action)}
    refused = {
        key: action
        for action in parser._actions
        if action.option_strings
        and action not in supported
        and not {"--config", "--help", "-h"} & set(action.option_strings)
        for key in _keys(action)
        if key not in supported_keys
    }
    front: list[str] = []
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        if norm in refused:
            raise ValueError(f"Unsupported config option '{norm}' with action '{type(refused[norm]).__name__}'")
        if isinstance(value, bool):
            if str(key).replace("-", "_") not in bare:
                front += [f"--{key}", str(value).lower()]
            elif value:
                front.append(f"--{key}")
        elif isinstance(value, list):
            if value:
                front += [f"--{key}", *map(str, value)]
        elif isinstance(value, dict):
            front += [f"--{key}", json.dumps(value)]
        else:
            front += [f"--{key}", str(value)]
    return front + argv[:at] + argv[at + 2 :]
