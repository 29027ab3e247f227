"""The router's request path compiled to C with mypyc, where it was built: the same source, run as C.

Under load the interpreter is about 60% of the router's CPU per request; the kernel's sockets,
httptools and uvloop are most of the rest (benchmarks/results/router_profile_native_plain_*.md).
mypyc, mypy's compiler, turns these typed modules into C extensions: each attribute read, call
and branch stops being a bytecode the interpreter dispatches (the router's CPU per request:
0.89x, benchmarks/results/router_overhead.md). The source stays the one truth; the build is a
cache of it.

- ``python -m pdctl.router.build`` builds ``MODULES`` (scripts/setup.sh runs it) into
  ``<sys.prefix>/pdctl-compiled/<interpreter>-<key>``, where ``key`` hashes every pdctl source
  file (the compiled code trusts the types of what it imports, so any change there counts too).
- Importing ``pdctl.router`` puts that build ahead of the sources in the package's ``__path__``
  only when its key matches the sources as they are now: an edited file is never shadowed by a
  stale build. Without a matching build (none made, no C compiler, a file changed since) the
  router runs the sources, interpreted: the same behaviour, at the interpreter's speed.
- ``PDCTL_ROUTER_INTERPRETED=1`` (any value) runs the sources even where a build matches.
- A build is loaded only from directories of this user or root that no one else may write.

One source, two ways to run it, with the same behaviour but for what compiled code does not
allow: setting attributes a class does not declare, subclassing a compiled class in Python (but
``UpstreamPool``), and patching a compiled module's classes or functions, which its own compiled
callers do not look up (tests/router/test_refit_rules.py sets state on instances instead). A
``functools.cached_property`` computes each time (``Worker.bootstrap_host`` is a field instead).

``mode()`` says which runs (``pdctl router`` logs it when it starts).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

MODULES = (
    "app",
    "body_rules",
    "cancels",
    "dispatch",
    "gate",
    "http1",
    "legs",
    "metrics",
    "relay",
    "reply",
    "resume",
    "retry",
    "selection",
    "server",
    "shaping",
    "streaming",
    "upstream",
    "workers",
)
"""The modules of the request path that are compiled (pdctl.router.<name>)."""

INTERPRETED_ENV = "PDCTL_ROUTER_INTERPRETED"
PACKAGE = Path(__file__).resolve().parent.parent  # pdctl/
BUILDS = Path(sys.prefix) / "pdctl-compiled"


def source_key(package: Path | None = None) -> str:
    """A hash of every source file of the pdctl ``package`` (this one unless given), their paths
    included (about 6 ms)."""
    package = package or PACKAGE
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def build_dir(key: str) -> Path:
    return BUILDS / f"{sys.implementation.cache_tag}-{key}"


def prefer_build(package_path: list[str]) -> None:
    """Put the build that matches the sources ahead of them in ``pdctl.router``'s ``package_path``
    (its ``__path__``); nothing when none matches or ``PDCTL_ROUTER_INTERPRETED`` is set."""
    if os.environ.get(INTERPRETED_ENV) or not BUILDS.is_dir():
        return
    built = build_dir(source_key())
    if not (built / "pdctl" / "router").is_dir() or not trusted(built):
        return
    package_path.insert(0, str(built / "pdctl" / "router"))
    sys.path.append(str(built))  # the compiled modules' shared library is a top-level module


def trusted(built: Path) -> bool:
    """Whether ``built`` and the directories above it up to ``sys.prefix`` belong to this user or
    root and no one else may write them (code is loaded from there, as from site-packages)."""
    me = os.getuid()
    for place in (built, built / "pdctl", built / "pdctl" / "router", BUILDS):
        info = place.stat()
        if info.st_uid not in (me, 0) or info.st_mode & 0o022:
            return False
    return True


def mode() -> str:
    """ "compiled" when the request path runs from a build, else "interpreted"."""
    import pdctl.router.server

    return "compiled" if not pdctl.router.server.__file__.endswith(".py") else "interpreted"
