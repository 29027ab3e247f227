"""``python -m pdctl.node.supervise FILE [--restart on-failure|never] -- ARGV...``: run ARGV, restart it
when it fails, and keep its story in FILE.

The node agent starts every process of a cluster through this wrapper, as the leader of the
process's own session, so healing happens on the node itself and goes on while no pdctl command
runs anywhere. The child stays in the wrapper's process group: ``down`` signals the whole group
(wrapper and child), and the wrapper passes SIGTERM/SIGINT on to the child as well.

Rules (systemd's ``Restart=on-failure``, with its clean signals):
- a child that exits 0, or is ended by SIGTERM, SIGINT, SIGHUP or SIGPIPE, has stopped cleanly:
  not restarted (``kill PID`` of an engine is a stop, ``kill -9`` or an OOM kill is a failure);
- once the wrapper itself got SIGTERM or SIGINT (``down``), nothing is restarted again;
- a failed child is restarted after a backoff (BACKOFF_SECS doubling up to BACKOFF_MAX_SECS),
  at most MAX_RESTARTS times within WINDOW_SECS; the next failure leaves it down (``gave_up``);
- the child does not outlive the wrapper (Linux: the kernel SIGKILLs it when the wrapper dies, a
  ``kill -9`` or an OOM kill of the wrapper): an orphan would go on serving while ``status`` says
  it is down and nothing would heal it;
- with ``--liveness URL SECS`` (Kubernetes' liveness probe): once the child has answered ``URL``
  (any status: an engine's open ``/ready``), a child that answers nothing there for SECS (a hung
  process: ``kill -STOP``, a wedged GPU) is SIGKILLed with its descendants, and its restart policy
  applies (``last_exit`` says why).

FILE.argv, when present (a JSON list, written by pdctl.node.agent's ``retarget``), is the command from
the next restart on: an engine that switched its PD role comes back in its new role.

With ``--peers PLAN`` (an engine's pdctl.node.peer_weights ``PeerPlan``, JSON) the wrapper relays the
engine's seed side of SGLang's engine-to-engine transfer, and starts the engine, each time, from a
peer that holds weights past the boot version when there is one (FILE's ``peer`` says how it went);
after a start from a peer that failed, the next start loads from disk.

FILE (0600, replaced atomically) says: ``state`` (running, backoff, exited, gave_up), the child's
``pid`` and ``create_time`` (pdctl.node.proc.start_time), ``restarts``, ``last_exit`` (``code``: the
exit status, negative for a signal; ``at``: epoch seconds) and, once the wrapper is done,
``exit_code`` (the trainer's status, as ``up`` and ``status`` read it).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from pdctl.choices import Choice
from pdctl.jsonhttp import exchange
from pdctl.node.peer_weights import Armed, PeerPlan, PeerSource, SeedRelay, engine_key
from pdctl.node.proc import expand, start_time
from pdctl.node.seed_states import PEER_MOVES, Machine, PeerState, Refusal
from pdctl.roles import RestartPolicy

MAX_RESTARTS = 5
WINDOW_SECS = 600.0
BACKOFF_SECS = 0.1
BACKOFF_MAX_SECS = 10.0
CLEAN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE})
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def failed(code: int) -> bool:
    """Whether an exit status (negative: killed by that signal) is a failure to restart from."""
    if code == 0:
        return False
    return code > 0 or signal.Signals(-code) not in CLEAN_SIGNALS


class SupervisedState(Choice):
    """Where a supervised process stands (FILE's ``state``; ``pdctl status`` reads it)."""

    RUNNING = "running"
    BACKOFF = "backoff"
    """It failed; restarted after a backoff."""
    EXITED = "exited"
    GAVE_UP = "gave_up"
    """It failed too often: left down (``reason`` says why)."""


@dataclass(frozen=True)
class PeerStory:
    """How the last start took its weights from a peer: FILE's ``peer``. ``seed``, ``version`` and
    ``secs`` (how long the transfer and its check took) once a transfer ended (done or failed)."""

    state: PeerState
    detail: str
    seed: str | None = None
    version: str | None = None
    secs: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """FILE's ``peer``: ``state`` and ``detail``, then ``seed``, ``version`` and ``secs`` when a
        transfer ended."""
        out: dict[str, Any] = {"state": self.state.value, "detail": self.detail}
        if self.seed is not None:
            out.update(seed=self.seed, version=self.version, secs=self.secs)
        return out


@dataclass
class Story:
    """What FILE says about the supervised process. The main loop writes its fields; a start's
    receive from a peer, on its own thread, moves ``peer`` (``set_peer``) and writes FILE too,
    both under ``lock``."""

    path: str
    restart: RestartPolicy
    state: SupervisedState = SupervisedState.RUNNING
    pid: int | None = None
    create_time: float | None = None
    restarts: int = 0
    last_exit: dict[str, Any] | None = None
    reason: str | None = None
    exit_code: int | None = None
    peer: PeerStory | None = None
    """The last start's weights from a peer (None before the first start, and without ``--peers``);
    moved only by ``set_peer``."""
    recent: deque[float] = field(default_factory=deque)
    """When the restarts within the window happened (monotonic)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    _peer_state: Machine[PeerState] = field(
        default_factory=lambda: Machine("weights from a peer", PEER_MOVES, PeerState.NONE), init=False, repr=False
    )

    def set_peer(self, peer: PeerStory) -> Refusal | None:
        """Make ``peer`` the story's when ``PEER_MOVES`` holds the move to its state (None); otherwise
        keep the story as it is and return the ``Refusal``. Safe to call from any thread; FILE is
        written by the next ``write``."""
        with self.lock:
            refused = self._peer_state.move(peer.state)
            if refused is None:
                self.peer = peer
            return refused

    def write(self) -> None:
        """Replace FILE with the story as it stands now (0600, atomically); safe to call from any
        thread."""
        with self.lock:
            self._write()

    def _write(self) -> None:
        body = {
            "state": self.state.value,
            "restart": self.restart,
            "pid": self.pid,
            "create_time": self.create_time,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "reason": self.reason,
            "peer": self.peer.to_dict() if self.peer is not None else None,
        }
        if self.exit_code is not None:
            body["exit_code"] = self.exit_code
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(body, out)
        os.replace(tmp, self.path)


@dataclass(frozen=True)
class Liveness:
    """The ``--liveness`` probe: the URL a started child must keep answering, and how long it may go
    without an answer before it is killed as hung."""

    url: str
    timeout_secs: float

    @property
    def period_secs(self) -> float:
        """How often the URL is probed, and each probe's timeout: a fifth of the timeout, at most one
        second."""
        return min(1.0, self.timeout_secs / 5)

    def answers(self) -> bool:
        """Whether ``url`` answers at all (any HTTP status: 503 while starting is an answer) within a
        period."""
        try:
            exchange("GET", self.url, timeout_secs=self.period_secs)
        except (OSError, ValueError):
            return False
        return True


class RestartNotes:
    """What the supervisor's threads (a start's receive from a peer, the liveness watch) tell its main
    loop about the child they killed and its next start, under one lock; the main loop takes each
    note once.

        notes.killed("weights from decode-1 failed: ...")  # a watching thread, before it kills
        notes.take_killed_for()                            # the main loop, once the child exited
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._killed_for: str | None = None
        self._from_disk_next = False

    def killed(self, why: str) -> None:
        """The child is being killed, and why (its ``last_exit.why``)."""
        with self._lock:
            self._killed_for = why

    def take_killed_for(self) -> str | None:
        """Why the child was killed, if a thread killed it; cleared."""
        with self._lock:
            why, self._killed_for = self._killed_for, None
            return why

    def load_from_disk_next(self) -> None:
        """The next start loads from disk (a start from a peer failed)."""
        with self._lock:
            self._from_disk_next = True

    def take_from_disk_next(self) -> bool:
        """Whether the next start loads from disk; cleared."""
        with self._lock:
            from_disk, self._from_disk_next = self._from_disk_next, False
            return from_disk


class Supervisor:
    """Runs one command under its restart policy and keeps its story in FILE (module docstring); with a
    ``PeerPlan`` it also relays the engine's seed side and starts it from a peer when it can."""

    def __init__(
        self, story: Story, command: list[str], liveness: Liveness | None = None, peers: PeerPlan | None = None
    ):
        self.story = story
        self.command = command
        self.liveness = liveness
        self.child: subprocess.Popen | None = None
        self.stopping = False
        """A stop signal came (set only on the main thread, where signal handlers run)."""
        self.notes = RestartNotes()
        key = engine_key(command) if peers is not None else None
        self.peer_source = PeerSource(peers, key) if peers is not None else None
        self.relay = SeedRelay(peers.me, key) if peers is not None else None

    def run(self) -> int:
        """Run the command until it stops cleanly, it may not be restarted, the wrapper is told to
        stop, or it fails too often; write the final story and return the wrapper's exit status (the
        child's status, 128 + N for signal N)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._stop)
        if self.relay is not None:
            try:
                self.relay.start()
            except OSError as exc:  # the engine still runs; it cannot seed others
                _say(f"cannot relay its seed side on port {self.relay.me.relay_port}: {exc}")
        while True:
            code = self._run_once()
            story = self.story
            story.last_exit = {"code": code, "at": time.time()}
            why = self.notes.take_killed_for()
            if why is not None:
                story.last_exit["why"] = why
            if self.stopping or story.restart == RestartPolicy.NEVER or not failed(code):
                return self._done(SupervisedState.EXITED, code)
            now = time.monotonic()
            while story.recent and now - story.recent[0] > WINDOW_SECS:
                story.recent.popleft()
            if len(story.recent) >= MAX_RESTARTS:
                story.reason = (
                    f"failed {len(story.recent) + 1} times within {WINDOW_SECS / 60:g} minutes "
                    f"(last exit {_describe(code)}); left down"
                )
                _say(f"{story.reason}")
                return self._done(SupervisedState.GAVE_UP, code)
            delay = min(BACKOFF_SECS * 2 ** len(story.recent), BACKOFF_MAX_SECS)
            story.state, story.pid, story.create_time = SupervisedState.BACKOFF, None, None
            story.write()
            _say(f"exited ({_describe(code)}); restart {story.restarts + 1} in {delay:g}s")
            if self._wait_stop(delay):
                return self._done(SupervisedState.EXITED, code)
            story.recent.append(time.monotonic())
            story.restarts += 1

    def _run_once(self) -> int:
        story = self.story
        if self.stopping:
            return -signal.SIGTERM
        self.command = restart_command(self.story.path, self.command)
        command, armed = self.command, None
        if self.relay is not None:  # a new process holds no group an earlier one left open
            self.relay.engine_started()
        if self.peer_source is not None:
            if self.notes.take_from_disk_next():
                self._set_peer(PeerStory(PeerState.NONE, "loads from disk: the last start from a peer failed"))
            else:
                result = self.peer_source.arm(lambda: self.stopping)
                armed = result.armed
                self._set_peer(PeerStory(PeerState.RECEIVING if armed else PeerState.NONE, result.detail))
                if armed is not None:
                    command = self.peer_source.command(self.command, armed)
                    _say(f"starting from a peer: {result.detail}")
        try:
            self.child = subprocess.Popen(command, preexec_fn=_die_with(os.getpid()))
        except OSError as exc:  # as a shell does: 127 for a program that cannot be run
            _say(f"cannot run {self.command[0]}: {exc.strerror or exc}")
            if armed is not None and self.peer_source is not None:  # no engine to receive: the seed is free
                self.peer_source.disarm(armed)
                self._set_peer(PeerStory(PeerState.FAILED, f"cannot run {self.command[0]}", armed.seed.engine_id,
                                         armed.version, 0.0))  # fmt: skip
            return 127
        if self.stopping:  # a stop signal came while it started: its handler may have missed it
            self.child.terminate()
        story.state, story.pid = SupervisedState.RUNNING, self.child.pid
        try:
            story.create_time = start_time(psutil.Process(self.child.pid))
        except psutil.Error:
            story.create_time = None
        story.write()
        if self.liveness is not None:
            threading.Thread(target=self._watch, args=(self.child, self.liveness), daemon=True).start()
        receiving = None
        if armed is not None:
            receiving = threading.Thread(target=self._receive, args=(self.child, armed), daemon=True)
            receiving.start()
        code = self.child.wait()
        if receiving is not None and not self.stopping:  # its outcome decides how the next start loads
            receiving.join()
        elif armed is not None and self.peer_source is not None:  # stopped: the seed is free now, not at
            self.peer_source.disarm(armed)  # its arm's lapse (the receiving thread may not get to it)
        return code

    def _receive(self, child: subprocess.Popen, armed: Armed) -> None:
        """The start from a peer, beside the engine: the transfer's outcome, then the checksums
        and the version stamp. A transfer that failed ends the engine, to load from disk next."""
        assert self.peer_source is not None
        source = self.peer_source
        started = time.monotonic()

        def alive() -> bool:
            return child.poll() is None and not self.stopping

        sent, detail = False, "not started"
        unchecked = False
        try:
            step = source.wait_sent(armed, alive)
            sent, detail = step.ok, step.detail
            if sent:
                step = source.verify_and_stamp(armed, alive)
                sent, detail = step.ok, step.detail
                # Its weights came but nothing could vouch for them (the seed died before its checksum,
                # no other engine holds that version): an engine left at the receiving label would stay
                # out for good; it starts again, from a peer (one may hold the version by then).
                unchecked = not sent and detail.startswith("could not compare checksums") and alive()
                if unchecked:
                    self._kill(child, f"weights from {armed.seed.engine_id} unchecked: {detail}",
                               "to start from a peer again")  # fmt: skip
            elif alive():
                self.notes.load_from_disk_next()
                self._kill(child, f"weights from {armed.seed.engine_id} failed: {detail}", "to load from disk")
        except Exception as exc:  # a bug must not leave the story saying "receiving" for ever
            sent, detail = False, f"{type(exc).__name__}: {exc}"
        finally:
            source.disarm(armed)
        if not sent and not self.stopping and not unchecked:  # its next start does not try a peer again
            self.notes.load_from_disk_next()
        state = PeerState.DONE if sent else PeerState.FAILED
        secs = round(time.monotonic() - started, 3)
        self._set_peer(PeerStory(state, detail, armed.seed.engine_id, armed.version, secs))
        _say(f"weights from a peer: {state}: {detail}")
        self.story.write()

    def _set_peer(self, peer: PeerStory) -> None:
        """Move the story's peer (``Story.set_peer``); a move ``PEER_MOVES`` refuses is a bug of the
        supervisor: said in the log, and the story keeps its peer."""
        refused = self.story.set_peer(peer)
        if refused is not None:
            _say(f"bug: {refused} ({peer.detail})")

    def _kill(self, child: subprocess.Popen, why: str, then: str) -> None:
        """Kill ``child`` and its descendants from a watching thread, ``why`` noted for its
        ``last_exit`` first (the main loop reads it once the child exited)."""
        self.notes.killed(why)
        _say(f"{why}: killing it{', ' + then if then else ''}")
        _kill_tree(child.pid)

    def _watch(self, child: subprocess.Popen, liveness: Liveness) -> None:
        """Kill ``child`` once it has answered and then stays silent for the timeout."""
        last: float | None = None
        while child.poll() is None and not self.stopping:
            started = time.monotonic()
            if liveness.answers():
                last = time.monotonic()
            elif last is not None and time.monotonic() - last >= liveness.timeout_secs:
                why = f"answered nothing on {liveness.url} for {time.monotonic() - last:.0f}s (liveness)"
                self._kill(child, why, "")
                return
            time.sleep(max(0.0, liveness.period_secs - (time.monotonic() - started)))

    def _stop(self, signum: int, _frame: Any) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def _wait_stop(self, delay: float) -> bool:
        """Wait ``delay`` seconds for a stop signal; True if one came (or had come)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            if self.stopping:
                return True
            got = signal.sigtimedwait(STOP_SIGNALS, delay)
            self.stopping = self.stopping or got is not None
            return self.stopping
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _done(self, state: SupervisedState, code: int) -> int:
        self.story.state, self.story.exit_code = state, code
        self.story.pid = self.story.create_time = None
        self.story.write()
        return code if code >= 0 else 128 - code


PR_SET_PDEATHSIG = 1


def command_file(story_path: str) -> str:
    """Where a command to run from the next (re)start on is kept: beside the story (pdctl.node.agent
    writes it when an engine switched its PD role, so that a restart comes back in its new role)."""
    return story_path + ".argv"


def peers_file(story_path: str) -> str:
    """Where an engine's peer plan is kept for its supervisor (``--peers``), beside the story."""
    return story_path + ".peers"


def restart_command(story_path: str, command: list[str]) -> list[str]:
    """The command in ``command_file(story_path)`` when there is a valid one, else ``command``."""
    try:
        with open(command_file(story_path)) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return command
    if isinstance(kept, list) and kept and all(isinstance(a, str) for a in kept):
        return kept
    _say(f"ignored {command_file(story_path)}: not a list of strings")
    return command


def _die_with(parent: int) -> Callable[[], None] | None:
    """For the child, between fork and exec: be SIGKILLed when ``parent`` dies (and exit at once
    if it is dead already). None where the kernel has no such thing (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # (it died before the line above: no signal would come)
            os._exit(1)

    return arm


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (a stopped process dies of SIGKILL too)."""
    try:
        parent = psutil.Process(pid)
        for proc in [*parent.children(recursive=True), parent]:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    except psutil.Error:
        pass


def _describe(code: int) -> str:
    return f"code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"


def _say(message: str) -> None:
    """A line in the process's log (the wrapper's stderr is the log), marked as pdctl's."""
    print(f"=== pdctl {time.strftime('%Y-%m-%d %H:%M:%S')} supervise: {message} ===", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    """Run the wrapper's command line (``FILE [--restart ...] [--liveness URL SECS] [--peers PLAN] --
    ARGV...``, the module's docstring); its exit status: 2 for a command line it cannot read, else
    ``Supervisor.run``'s."""
    restart = "never"
    liveness = None
    peers = None
    usage = (
        "usage: python -m pdctl.node.supervise FILE [--restart on-failure|never] [--liveness URL SECS] [--peers PLAN] "
        "-- ARGV..."
    )
    if len(argv) >= 2 and argv[1] == "--restart":
        restart, argv = argv[2], [argv[0], *argv[3:]]
    if len(argv) >= 4 and argv[1] == "--liveness":
        try:
            liveness = Liveness(argv[2], float(argv[3]))
        except ValueError:
            print(usage, file=sys.stderr)
            return 2
        argv = [argv[0], *argv[4:]]
    if len(argv) >= 3 and argv[1] == "--peers":
        try:
            with open(argv[2]) as f:
                peers = PeerPlan.from_dict(json.load(f))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"--peers {argv[2]}: {exc}", file=sys.stderr)
            return 2
        argv = [argv[0], *argv[3:]]
    if len(argv) < 3 or argv[1] != "--" or restart not in {p.value for p in RestartPolicy}:
        print(usage, file=sys.stderr)
        return 2
    return Supervisor(Story(expand(argv[0]), RestartPolicy(restart)), argv[2:], liveness, peers).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
