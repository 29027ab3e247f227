"""A fork server for the tests' sim engines, started by tests/helpers.SimProcess.

Why: a sim engine's start is about 1.3 CPU-seconds, 0.9 of them torch's import, and the suite
starts some 230 of them through tests/helpers.SimProcess; on a 2-core machine that import was a
fifth of the suite's CPU. This server imports the sim's modules once and forks one child per
engine, which then runs ``python -m pdctl.sim ARGS`` as a fresh process would: its own session,
its output in its log file, the environment, working directory and ``sys.path`` asked for, and
the Python and NumPy random state drawn again. Engines that pdctl itself plans (``pdctl up``) are
never started here: they go through the node agent and ``exec`` as on a user's node.

The protocol, one connection per engine: the client sends one JSON line ``{"args": [...],
"env": {...}, "cwd": "...", "log": "..."}``; the server answers ``{"pid": N}`` and, when the
child has exited and been reaped, ``{"returncode": R}`` (R as ``subprocess.Popen`` gives it:
-N for a signal), then closes. The server exits when its standard input closes (the test
process that started it has gone); children it leaves run on in their own sessions and are
stopped by their tests, as exec'd engines are.
"""

from __future__ import annotations

import json
import os
import random
import runpy
import selectors
import signal
import socket
import sys
import traceback

# The modules a sim engine imports, once, before any fork. (None of them starts a thread that a
# child would miss: torch's pools start at its first operation, in the child.)
import torch.distributed  # noqa: F401

import pdctl.sim.__main__
import pdctl.sim.multinode
import pdctl.sim.remote_instance
import pdctl.sim.server
import pdctl.sim.weights
import pdctl.sim.weights_http


def _run_child(request: dict, keep_closed: list[int]) -> None:
    """In the forked child: become ``python -m pdctl.sim ARGS`` and never return."""
    code = 1
    try:
        for fd in keep_closed:
            os.close(fd)
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *extra, *[p for p in sys.path[1:] if p not in extra]]
        random.seed()
        import numpy

        numpy.random.seed()
        sys.argv = [pdctl.sim.__main__.__file__, *request["args"]]
        runpy.run_module("pdctl.sim", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(path: str, ready_fd: int) -> None:
    """Listen on the Unix socket ``path``, write ``1`` to ``ready_fd`` once it listens, and fork
    an engine per connection until standard input closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")
    try:
        _forks(listener, sel)
    finally:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


def _forks(listener: socket.socket, sel: selectors.BaseSelector) -> None:
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, its client's connection)
    while True:
        for key, _ in sel.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # the test process is gone
            elif key.data == "accept":
                conn, _ = listener.accept()
                line = conn.makefile("rb").readline()
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                held = [listener.fileno(), conn.fileno(), *children, *(c.fileno() for _, c in children.values())]
                pid = os.fork()
                if pid == 0:
                    _run_child(request, held)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                sel.register(pidfd, selectors.EVENT_READ, "child")
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            else:
                pidfd = key.fd
                pid, conn = children.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass  # its client went away first
                conn.close()
