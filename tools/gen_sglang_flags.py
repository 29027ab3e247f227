"""Regenerate pdctl/sglang/server_flags.json from SGLang's real ServerArgs parser.

Run inside an environment with `pip install --no-deps sglang==X` (sglang-protocol.md 1.1):

    python tools/gen_sglang_flags.py > pdctl/sglang/server_flags.json

The committed JSON lets `pdctl validate` and the sim check flag names, arity and
choices without SGLang installed.
"""

from __future__ import annotations

import argparse
import json
import sys
import types


def main() -> None:
    sys.modules.setdefault("triton", types.ModuleType("triton"))  # sglang imports it; a stub suffices
    from importlib.metadata import version

    import sglang  # noqa: F401
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        takes_value = action.nargs != 0
        canonical = "--" + action.dest.replace("_", "-")
        if canonical not in action.option_strings:
            canonical = action.option_strings[0]
        aliases = sorted(o for o in action.option_strings if o != canonical)
        flags.append(
            {
                "names": [canonical, *aliases],
                "dest": action.dest,
                "takes_value": takes_value,
                "nargs": action.nargs if isinstance(action.nargs, (str, int)) else None,
                "choices": [str(c) for c in action.choices] if action.choices else None,
                "type": getattr(action.type, "__name__", None) if action.type else None,
                "required": bool(action.required),
                "default": _json_default(action.default),
            }
        )
    flags.sort(key=lambda f: f["names"][0])
    json.dump({"sglang_version": version("sglang"), "flags": flags}, sys.stdout, indent=1)
    sys.stdout.write("\n")


def _json_default(value: object) -> object:
    """The flag's default as JSON (None where SGLang's is no JSON value: what /server_info shows then
    is not a constant pdctl can carry)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    return None


if __name__ == "__main__":
    main()
