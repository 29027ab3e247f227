"""``python -m pdctl.exitcode FILE -- ARGV...``: run ARGV and write its exit status to FILE.

A process started by the node agent is reparented when the agent exits, so nobody is left to
read its exit status; ``up`` and ``status`` need the trainer's. This wrapper stays in the
process group (``down`` signals the whole group, the child included), passes SIGTERM/SIGINT
on to the child, and writes ``{"exit_code": N}`` (negative: killed by signal -N) atomically.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m pdctl.exitcode FILE -- ARGV...", file=sys.stderr)
        return 2
    path, command = argv[0], argv[2:]
    try:
        child = subprocess.Popen(command)
    except OSError as exc:  # as a shell does: 127 for a program that cannot be run
        print(f"pdctl.exitcode: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        code = 127
    else:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
        code = child.wait()
    tmp = f"{path}.tmp"
    with open(tmp, "w") as out:
        json.dump({"exit_code": code}, out)
    os.replace(tmp, path)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
