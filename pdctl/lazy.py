"""Names a package exports without importing what they need until first use (torch for the sim
and the trainer, paramiko for SSH, click for the CLI), so that importing the package costs
nothing of theirs: one way to write the module ``__getattr__`` (PEP 562) every such package uses."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: each name in ``homes`` is read from its home
    module (imported on first use); any other name raises AttributeError as Python's own does.
    The package also imports the names under ``TYPE_CHECKING``, for type checkers and readers."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    return __getattr__
