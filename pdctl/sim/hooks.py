"""``--forward-hooks``: PyTorch forward hooks on the sim's model, as SGLang 0.5.23 registers
them (``model_executor/hook_manager.py``).

The flag's value is a JSON list of ``{name, target_modules, hook_factory, config}``: for each,
``hook_factory`` (``"pkg.mod:func"``, or ``"pkg.mod.func"``) is imported and called with
``config`` (``{}`` when absent), and the hook it returns is registered with
``register_forward_hook`` on every module whose ``named_modules()`` name matches one of the
``target_modules`` fnmatch patterns, once, when the model is loaded. A spec without target
modules or factory, a factory that returns None, or patterns that match nothing are skipped
with a warning, as in SGLang; a factory that cannot be imported fails the start.

The sim's model names its modules as HF checkpoints do (``model.embed_tokens``,
``model.layers.N.{input_layernorm,self_attn.q_proj,...,mlp.down_proj}``, ``model.norm``,
``lm_head``); ``model.norm``'s output is the final hidden states, ``[T, hidden]`` in a prefill
(one request) and ``[B, hidden]`` in a decode step (B running requests).
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from pdctl.errors import SimError

log = logging.getLogger("pdctl.sim")


def parse_hook_specs(text: str | list | None) -> tuple[dict[str, Any], ...]:
    """The flag's JSON list (parsed already by SGLang's ``json_list_type``, or its text);
    ValueError saying what is wrong."""
    if not text:
        return ()
    try:
        specs = json.loads(text) if isinstance(text, str) else text
    except ValueError as exc:
        raise ValueError(f"--forward-hooks is not JSON: {exc}") from None
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise ValueError("--forward-hooks must be a JSON list of objects")
    return tuple(specs)


def resolve_callable(path: str) -> Callable[..., Any]:
    """``pkg.mod:func`` or ``pkg.mod.func``, imported."""
    if ":" in path:
        module_name, attr = path.split(":", 1)
    else:
        module_name, _, attr = path.rpartition(".")
        if not module_name:
            raise SimError(f"hook factory {path!r}: expected 'module.submodule:factory' or 'module.submodule.factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SimError(f"hook factory {path!r}: cannot import {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SimError(f"hook factory {path!r}: module {module_name!r} has no attribute {attr!r}") from None


def register_forward_hooks(model: nn.Module, specs: tuple[dict[str, Any], ...]) -> list[tuple[str, str]]:
    """Register each spec's hook on its matching modules; (spec name, module name) per hook."""
    modules = dict(model.named_modules())
    registered: list[tuple[str, str]] = []
    for spec in specs:
        name = str(spec.get("name", ""))
        patterns = spec.get("target_modules") or []
        factory_path = spec.get("hook_factory")
        if not patterns:
            log.warning("hook spec %r has no 'target_modules', skipping", name)
            continue
        if not factory_path:
            log.warning("hook spec %r has no 'hook_factory', skipping", name)
            continue
        hook = resolve_callable(str(factory_path))(spec.get("config") or {})
        if hook is None:
            log.warning("hook factory %r of spec %r returned None, not registering any hook", factory_path, name)
            continue
        matched = [m for m in modules if any(fnmatch.fnmatch(m, str(p)) for p in patterns)]
        if not matched:
            log.warning("no modules matched hook spec %r (patterns %s)", name, patterns)
            continue
        for module_name in matched:
            modules[module_name].register_forward_hook(hook)
            log.info("registered forward hook %r on %s", name, module_name)
            registered.append((name, module_name))
    return registered
