"""Build the router's compiled request path (pdctl.router.compiled): ``python -m pdctl.router.build``.

Needs mypy (its compiler, mypyc) and a C compiler. Prints where the build is, or why there is none
(the router then runs its sources, interpreted); exits 1 when it could not build.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pdctl.router.compiled import BUILDS, MODULES, PACKAGE, build_dir, source_key


def build() -> tuple[Path, bool]:
    """Compile ``MODULES`` for this interpreter and these sources, unless built already: the
    build's directory, and whether it was compiled now. Needs mypy (mypyc) and a C compiler;
    raises CalledProcessError with the compiler's output otherwise. Older builds are removed."""
    key = source_key()
    target = build_dir(key)
    if (target / "pdctl" / "router").is_dir():
        return target, False
    BUILDS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=BUILDS) as tmp:
        work = Path(tmp)
        # A copy of the sources: mypyc names modules by their paths under the working directory,
        # and the checkout's own files (pyproject.toml, build/) stay out of it.
        shutil.copytree(PACKAGE, work / "src" / "pdctl", ignore=shutil.ignore_patterns("__pycache__"))
        paths = [f"pdctl/router/{name}.py" for name in MODULES]
        script = (
            "import sys\nfrom setuptools import setup\nfrom mypyc.build import mypycify\n"
            "setup(name='pdctl-router-compiled', ext_modules=mypycify(sys.argv[1:], opt_level='3', "
            "target_dir='../c'), script_args=['build_ext', '--build-lib', '../out', '--build-temp', '../tmp'])\n"
        )
        subprocess.run(
            [sys.executable, "-c", script, *paths], cwd=work / "src", check=True, capture_output=True, text=True
        )
        try:
            (work / "out").rename(target)
        except OSError:
            if not (target / "pdctl" / "router").is_dir():
                raise
            # another build of the same sources (a second setup beside this one) finished first
    for old in BUILDS.iterdir():
        if old != target and not old.name.startswith("build-"):
            shutil.rmtree(old, ignore_errors=True)
    return target, True


def main() -> int:
    """Silent when a build of these sources exists already."""
    try:
        built, now = build()
    except subprocess.CalledProcessError as exc:
        print(f"pdctl: the router's request path was not compiled (exit {exc.returncode}):\n{exc.stderr[-3000:]}")
        return 1
    except OSError as exc:
        print(f"pdctl: the router's request path was not compiled: {exc}")
        return 1
    if now:
        print(f"pdctl: the router's request path is compiled: {built}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
