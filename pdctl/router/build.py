"""Build the router's compiled request path (pdctl.router.compiled): ``python -m pdctl.router.build``.

Needs mypy (its compiler, mypyc), setuptools and a C compiler. Prints where it built, nothing when
a build of these sources exists already, or why it could not build (the router then runs its
sources, interpreted: exit 1). Builds of other sources are removed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from pdctl.router.compiled import BUILDS, MODULES, PACKAGE, build_dir, source_key


def build() -> tuple[Path, bool]:
    """Compile ``MODULES`` for this interpreter and these sources, unless built already: the
    build's directory, and whether it was compiled now. Needs mypy (mypyc) and a C compiler;
    raises CalledProcessError with the compiler's output otherwise. Older builds are removed."""
    target = build_dir(source_key())
    if (target / "pdctl" / "router").is_dir():
        return target, False
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler ({compiler}) on PATH")
    BUILDS.mkdir(mode=0o755, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=BUILDS) as tmp:
        work = Path(tmp)
        # A copy of the sources: mypyc names modules by their paths under the working directory,
        # and the checkout's own files (pyproject.toml, build/) stay out of it. The key is the
        # copy's: a file saved meanwhile makes a build under its own key, never under the old one.
        shutil.copytree(PACKAGE, work / "src" / "pdctl", ignore=shutil.ignore_patterns("__pycache__"))
        key = source_key(work / "src" / "pdctl")
        target = build_dir(key)
        paths = [f"pdctl/router/{name}.py" for name in MODULES]
        # group_name: the shared library's module name is the build's own, so that no other
        # module on sys.path (an older build, a stray mypyc output) can stand in for it.
        script = (
            "import sys\nfrom setuptools import setup\nfrom mypyc.build import mypycify\n"
            "setup(name='pdctl-router-compiled', ext_modules=mypycify(sys.argv[2:], opt_level='3', "
            "target_dir='../c', group_name=sys.argv[1]), "
            "script_args=['build_ext', '--build-lib', '../out', '--build-temp', '../tmp'])\n"
        )
        argv = [sys.executable, "-c", script, f"pdctl_router_{key}", *paths]
        subprocess.run(argv, cwd=work / "src", check=True, capture_output=True, text=True)
        (work / "out").chmod(0o755)
        try:
            (work / "out").rename(target)
        except OSError:
            if not (target / "pdctl" / "router").is_dir():
                raise
            # another build of the same sources (a second setup beside this one) finished first
    for old in BUILDS.iterdir():
        if old == target or old.name.startswith("build-"):  # (another build's work in progress)
            continue
        if not old.name.startswith("old-"):
            old = old.rename(old.with_name(f"old-{old.name}"))  # at once: never found half removed
        shutil.rmtree(old, ignore_errors=True)
    return target, True


def main() -> int:
    """Silent when a build of these sources exists already."""
    try:
        built, now = build()
    except subprocess.CalledProcessError as exc:
        output = (exc.stdout or "") + (exc.stderr or "")  # (mypyc reports type errors on stdout)
        print(f"pdctl: the router's request path was not compiled (exit {exc.returncode}):\n{output[-3000:]}")
        return 1
    except OSError as exc:
        print(f"pdctl: the router's request path was not compiled: {exc}")
        return 1
    if now:
        print(f"pdctl: the router's request path is compiled: {built}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
