"""Weights from a peer engine: a (re)started engine takes the fleet's weights from a serving engine
of the same TP layout over SGLang's engine-to-engine transfer (sglang-protocol.md 7.3), instead of
waiting out of rotation for the trainer's next push. Runs in the engines' supervisors
(pdctl.node.supervise), on the nodes, so it heals while no pdctl command runs.

SGLang's receiver (``--load-format remote_instance``) drives the transfer itself: at load, its TP
rank 0 POSTs ``/init_weights_send_group_for_remote_instance`` and then
``/send_weights_to_remote_instance`` to the seed's address, with no key. pdctl's engines all have
a key (SGLang answers those routes 401 without it), so each engine's supervisor runs a **seed
relay** on a planned port of the engine's host: it passes the receiver's two calls on to its
engine with the engine key, only while a transfer is **armed** (by the receiver's supervisor, with
the engine key) and only for the seed's own planned group ports. The seed's scheduler stalls from
the receiver's init to the end of the broadcast (SGLang runs both handlers in it); the relay
makes that window the transfer itself, not the receiver's whole start. The relay's states, and the
only moves it makes between them, are pdctl.node.seed_states's ``RelayState`` and ``RELAY_MOVES``.

The receiver's side (``PeerSource``), before each start of its engine:
1. ask every planned peer its weight version; peers past the boot weights (not ``boot_version``,
   not mid-transfer) are candidates, the most common version first; none: a plain start;
2. arm one candidate's relay (one transfer per seed at a time);
3. start the engine with the receiver's flags and ``--weight-version`` = ``PENDING``, which no
   fleet holds, so the router's version rule keeps it out of rotation;
4. once the relay says the send ended and the engine answers: compare ``/weights_checker``
   checksums (``per_engine_checksum``) of receiver and seed, and the seed's version before and
   after; equal: ``/update_weight_version`` stamps the seed's version, and the router puts the
   engine in rotation when that is the fleet's. Otherwise it stays out with the reason in the
   supervisor's story (``peer``), and the next push (or restart) recovers it.
"""

from __future__ import annotations

import hmac
import json
import logging
import socketserver
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml

from pdctl.jsonhttp import StatusError, call_json
from pdctl.node.seed_states import RELAY_MOVES, Machine, RelayState
from pdctl.refit import in_flux
from pdctl.sglang import Endpoint, update_weight_version_body

log = logging.getLogger("pdctl.node.peer_weights")

PENDING = "pdctl:receiving-from-peer"
"""The version a receiver starts with: the fleet never holds it, so the router keeps it out."""
INIT_ROUTE = Endpoint.INIT_WEIGHTS_SEND_GROUP_FOR_REMOTE_INSTANCE
SEND_ROUTE = Endpoint.SEND_WEIGHTS_TO_REMOTE_INSTANCE
ARM_ROUTE = "/pdctl/seed/arm"
WAIT_ROUTE = "/pdctl/seed/wait"
DISARM_ROUTE = "/pdctl/seed/disarm"
ARM_IDLE_SECS = 30.0
"""An arm lapses when its receiver's supervisor has not asked for the outcome this long (it died:
the seed must not stay reserved for it). The supervisor asks every second while it waits."""
PROBE_SECS = 5.0
RELAY_READ_SECS = 30.0
RECEIVER_FLAGS = (
    "--load-format",
    "--remote-instance-weight-loader-seed-instance-ip",
    "--remote-instance-weight-loader-seed-instance-service-port",
    "--remote-instance-weight-loader-send-weights-group-ports",
    "--weight-version",
)


@dataclass(frozen=True)
class SeedSide:
    """One engine as a seed: where it serves, its relay, and one group port per TP rank."""

    engine_id: str
    url: str
    host: str
    relay_port: int
    ports: tuple[int, ...]

    @property
    def relay_url(self) -> str:
        """The base URL of the engine's seed relay (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.relay_port}"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SeedSide:
        """The seed side that ``to_dict`` wrote; raises ``KeyError`` or ``ValueError`` on a malformed
        one."""
        return cls(str(raw["engine_id"]), str(raw["url"]), str(raw["host"]), int(raw["relay_port"]),
                   tuple(int(p) for p in raw["ports"]))  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of the seed side, as ``from_dict`` reads it."""
        return {"engine_id": self.engine_id, "url": self.url, "host": self.host, "relay_port": self.relay_port,
                "ports": list(self.ports)}  # fmt: skip


@dataclass(frozen=True)
class PeerPlan:
    """An engine's part in peer weights: its own seed side and its peers' (same TP layout)."""

    me: SeedSide
    peers: tuple[SeedSide, ...]
    boot_version: str = "default"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PeerPlan:
        """The plan that ``to_dict`` wrote (a ``--peers`` file); ``boot_version`` defaults to
        ``default``."""
        return cls(SeedSide.from_dict(raw["me"]), tuple(SeedSide.from_dict(p) for p in raw["peers"]),
                   str(raw.get("boot_version", "default")))  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of the plan, as ``from_dict`` reads it."""
        return {"me": self.me.to_dict(), "peers": [p.to_dict() for p in self.peers], "boot_version": self.boot_version}


def engine_key(argv: list[str]) -> str | None:
    """The engine key of an engine command: ``api-key`` of its ``--config`` file (pdctl.node.agent
    writes it 0600), or an ``--api-key=K`` word."""
    for i, word in enumerate(argv):
        if word.startswith("--api-key="):
            return word.split("=", 1)[1]
        if word == "--api-key" and i + 1 < len(argv):
            return argv[i + 1]
        if word == "--config" and i + 1 < len(argv):
            try:
                with open(argv[i + 1]) as f:
                    config = yaml.safe_load(f)
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(config, dict) and config.get("api-key"):
                return str(config["api-key"])
    return None


# -- the seed's side ------------------------------------------------------------------------------
NO_ARM = "no transfer is armed on this seed"
ONE_GROUP = "one pair group per transfer: world_size 2, the seed at rank 0, nccl"
ONE_SEND = "one send per transfer, of the group its init made"
ARMED_STATES = frozenset({RelayState.ARMED, RelayState.JOINING, RelayState.JOINED, RelayState.SENDING})
"""The relay is armed for a receiver: its transfer has not ended."""
IN_FLIGHT = frozenset({RelayState.JOINING, RelayState.SENDING, RelayState.DRAINING})
"""The engine is answering a receiver's init or send: no new arm, and a send waits."""


@dataclass(frozen=True)
class RelayAnswer:
    """A relay request's answer: the HTTP status and the JSON body."""

    status: int
    body: dict[str, Any]


@dataclass(frozen=True)
class SeedOutcome:
    """How a receiver's transfer ended, kept for that receiver's supervisor to ask (``wait``)."""

    receiver: str
    success: bool
    message: str


@dataclass
class _Transfer:
    """The relay's one transfer, from its arm until the engine's last answer to it."""

    receiver: str
    armed_until: float
    """When the arm lapses unless the receiver's supervisor asks for the outcome again (monotonic)."""
    group: str | None = None
    """The group its one init made (set once: a second init, or a send of another group, is refused)."""


class SeedRelay:
    """The relay of one engine (see the module's docstring); ``start`` serves it on a thread.

    Its state is a ``RelayState`` (pdctl.node.seed_states draws the moves), moved only through its
    table and only under ``_lock``, a Condition that a receiver's long poll (``wait``) and a send
    that came before its init's answer wait on. With the state go the transfer (``_Transfer``,
    from its arm until the engine's last answer), the last transfer's outcome, and why the engine
    cannot seed (``LEFT_OPEN``, or ``DRAINING`` towards it)."""

    def __init__(self, me: SeedSide, key: str | None):
        self.me = me
        self.key = key
        self._lock = threading.Condition()
        self._state = Machine("seed relay", RELAY_MOVES, RelayState.IDLE)
        self._transfer: _Transfer | None = None
        """Set in every state but IDLE and LEFT_OPEN."""
        self._outcome: SeedOutcome | None = None
        """The last transfer's end, for its receiver (cleared by the next arm)."""
        self._left_open: str | None = None
        """Why this engine cannot seed until it restarts: an arm ended after its init made a group
        and before a send used it. SGLang keeps such a group, and its port, for the process's
        life, so every later init to it would fail (and its receiver start for nothing)."""
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        """Serve the relay on the engine's host and relay port, on a daemon thread; raises ``OSError``
        when the port cannot be bound."""
        relay = self

        class Handler(BaseHTTPRequestHandler):
            """The relay's HTTP side: POST bodies of JSON objects, passed to ``SeedRelay.handle``."""

            timeout = RELAY_READ_SECS  # a client that sends its request slowly does not hold a thread

            def do_POST(self) -> None:
                """Answer one POST with ``SeedRelay.handle``'s status and JSON; a body that is not a
                JSON object, or is over 64 KiB, is refused with 400 or 413."""
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if length < 0:
                    self._answer(400, {"error": "a body needs a valid Content-Length"})
                    return
                if length > 64 * 1024:
                    self._answer(413, {"error": "body too large"})
                    return
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    body = None
                if not isinstance(body, dict):
                    self._answer(400, {"error": "the body must be a JSON object"})
                    return
                answer = relay.handle(self.path, body, self.headers.get("Authorization"))
                self._answer(answer.status, answer.body)

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client went away: nothing to tell it
                    pass

            def log_message(self, fmt: str, *args: Any) -> None:
                """Log nothing per request (http.server writes each one to stderr)."""
                pass

        self._server = _QuietServer((self.me.host, self.me.relay_port), Handler)
        threading.Thread(target=self._server.serve_forever, name="pdctl-seed-relay", daemon=True).start()

    def stop(self) -> None:
        """Stop serving and close the relay's socket; nothing to do when it was never started."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def state(self) -> RelayState:
        """Where the relay stands now (a snapshot: another thread may move it next)."""
        with self._lock:
            return self._state.state

    def _authorized(self, header: str | None) -> bool:
        if not self.key:  # an engine with no key: nobody may arm it (the triggers would be anyone's)
            return False
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self.key.encode())

    def handle(self, path: str, body: dict[str, Any], auth: str | None) -> RelayAnswer:
        """One relay request's answer. Arm, wait and disarm need the engine key (401 otherwise); a
        receiver's init and send are passed on to the engine only when they fit the current arm
        (403 otherwise, 502 when the engine did not succeed); any other path is 404."""
        if path in (ARM_ROUTE, WAIT_ROUTE, DISARM_ROUTE):
            if not self._authorized(auth):
                return RelayAnswer(401, {"error": "Unauthorized"})
            if path == ARM_ROUTE:
                return self._arm(str(body.get("receiver", "")))
            if path == WAIT_ROUTE:
                try:
                    wait = min(max(float(body.get("timeout_secs", 5.0)), 0.0), ARM_IDLE_SECS / 2)
                except (TypeError, ValueError):
                    return RelayAnswer(400, {"error": "timeout_secs must be a number"})
                return RelayAnswer(200, self._wait(str(body.get("receiver", "")), wait))
            return self._disarm(str(body.get("receiver", "")))
        if path in (INIT_ROUTE, SEND_ROUTE):
            return self._forward(path, body)
        return RelayAnswer(404, {"error": f"unknown path {path}"})

    def engine_started(self) -> None:
        """A new engine process: it holds no group of an earlier one, and may seed again."""
        with self._lock:
            self._left_open = None
            if self._state.state is RelayState.LEFT_OPEN:
                self._move(RelayState.IDLE)

    # Everything below runs with the lock held, or takes it.
    def _move(self, to: RelayState) -> None:
        """Move the state (caller holds the lock); the transfer ends with IDLE and LEFT_OPEN. A move
        the table refuses is a bug of the relay: logged, and the state stays."""
        refused = self._state.move(to)
        if refused is not None:
            log.error("bug: %s", refused)
            return
        if to in (RelayState.IDLE, RelayState.LEFT_OPEN):
            self._transfer = None

    def _armed_for(self) -> str | None:
        """The receiver the relay is armed for, if any (caller holds the lock)."""
        if self._state.state in ARMED_STATES and self._transfer is not None:
            return self._transfer.receiver
        return None

    def _lapsed(self) -> bool:
        """The arm's receiver stopped asking for its outcome (caller holds the lock)."""
        return self._transfer is not None and time.monotonic() >= self._transfer.armed_until

    def _end_arm(self) -> None:
        """The arm ends (caller holds the lock); an init it passed that no send used leaves its group open."""
        state, transfer = self._state.state, self._transfer
        if state in (RelayState.JOINING, RelayState.JOINED) and transfer is not None:
            self._left_open = (
                f"its engine holds the group {transfer.group!r} that {transfer.receiver} made and never used"
            )
            log.warning("%s: it seeds again once its engine restarts", self._left_open)
        if state is RelayState.ARMED:
            self._move(RelayState.IDLE)
        elif state is RelayState.JOINED:
            self._move(RelayState.LEFT_OPEN)
        elif state in (RelayState.JOINING, RelayState.SENDING):  # its engine still answers
            self._move(RelayState.DRAINING)

    def _arm(self, receiver: str) -> RelayAnswer:
        with self._lock:
            state, transfer = self._state.state, self._transfer
            if transfer is not None and (state in IN_FLIGHT or not self._lapsed()):
                return RelayAnswer(409, {"error": f"seeding {transfer.receiver} already"})
            if transfer is not None:  # an arm that lapsed
                self._end_arm()
            if self._state.state is RelayState.LEFT_OPEN:
                return RelayAnswer(409, {"error": f"cannot seed: {self._left_open} (until it restarts)"})
            self._move(RelayState.ARMED)
            self._transfer = _Transfer(receiver, time.monotonic() + ARM_IDLE_SECS)
            self._outcome = None
        log.info("armed to seed %s", receiver)
        return RelayAnswer(200, {"armed": receiver})

    def _disarm(self, receiver: str) -> RelayAnswer:
        with self._lock:
            if self._armed_for() == receiver:
                self._end_arm()
                self._lock.notify_all()
        return RelayAnswer(200, {"disarmed": receiver})

    def _wait(self, receiver: str, timeout_secs: float) -> dict[str, Any]:
        """Long poll of ``receiver``'s supervisor: its transfer's outcome once there is one
        (``done`` false at the timeout, to be asked again); each call keeps its arm alive."""
        with self._lock:
            if self._armed_for() == receiver and self._outcome is None and self._transfer is not None:
                self._transfer.armed_until = time.monotonic() + ARM_IDLE_SECS
            self._lock.wait_for(lambda: self._outcome is not None or self._armed_for() != receiver, timeout_secs)
            outcome = self._outcome
            if outcome is not None and outcome.receiver == receiver:
                return {"done": True, "success": outcome.success, "message": outcome.message}
            if self._armed_for() != receiver:
                return {"done": True, "success": False, "message": "this seed is not armed for it (its arm lapsed)"}
            return {"done": False}

    def _finish(self, receiver: str, success: bool, message: str) -> None:
        """``receiver``'s transfer ended (caller holds the lock): its outcome kept for it, the arm
        ended, and those who wait told."""
        self._outcome = SeedOutcome(receiver, success, message)
        if self._armed_for() == receiver:
            self._end_arm()
        self._lock.notify_all()

    def _refusal(self, path: str, body: dict[str, Any]) -> str | None:
        """Why a receiver's trigger does not fit the seed and its arm (caller holds the lock), or
        None: the seed's own host and ports (a port count that is not its tp would end an SGLang
        seed), a pair group of SGLang's receiver (world 2, the seed at rank 0, nccl,
        ``send_weights_*``), and a send of the group its init made. One init and then one send
        per arm is the table's to hold."""
        transfer = self._transfer
        if self._state.state not in (RelayState.ARMED, RelayState.JOINED) or transfer is None or self._lapsed():
            return NO_ARM
        ports = ",".join(str(p) for p in self.me.ports)
        if str(body.get("ports")) != ports or str(body.get("master_address")) != self.me.host:
            return f"this seed sends from {self.me.host} on ports {ports}"
        name = body.get("group_name")
        if not (isinstance(name, str) and name.startswith("send_weights_") and len(name) < 256):
            return "a receiver's group is send_weights_<its address>"
        if path == INIT_ROUTE:
            pair = body.get("group_rank") == 0 and body.get("world_size") == 2
            return None if pair and body.get("backend", "nccl") == "nccl" else ONE_GROUP
        return None if transfer.group == name else ONE_SEND

    def _forward(self, path: str, body: dict[str, Any]) -> RelayAnswer:
        """A receiver's trigger, passed on to the engine with its key when it fits the arm
        (``_refusal``) and the table allows the move it makes (ARMED to JOINING for an init,
        JOINED to SENDING for a send). Checked and moved under one lock, so two triggers cannot
        both pass. A refused send ends its transfer (its receiver then loads from disk)."""
        init = path == INIT_ROUTE
        with self._lock:
            if not init:  # SGLang's receiver sends as soon as it joined: its init may still be
                # on its way back from the engine (whose scheduler takes the two in order)
                self._lock.wait_for(lambda: self._state.state not in IN_FLIGHT, ARM_IDLE_SECS)
            problem = self._refusal(path, body)
            if problem is None and self._state.move(RelayState.JOINING if init else RelayState.SENDING) is not None:
                problem = ONE_GROUP if init else ONE_SEND
            if problem is not None:
                log.warning("refused %s: %s", path, problem)
                armed_for = self._armed_for()
                if armed_for is not None and not init and self._state.state not in IN_FLIGHT:
                    self._finish(armed_for, False, f"send refused: {problem}")
                return RelayAnswer(403, {"success": False, "message": problem})
            transfer = self._transfer
            assert transfer is not None  # (for the type checker: _refusal passed an armed transfer)
            receiver = transfer.receiver
            if init:
                transfer.group = str(body["group_name"])
        try:
            answer = call_json(self.me.url + path, body, key=self.key, timeout_secs=None)
        except StatusError as exc:
            answer = {"success": False, "message": f"the seed answered {exc.status}: {exc.text}"}
        except (OSError, ValueError) as exc:
            answer = {"success": False, "message": f"the seed did not answer: {exc}"}
        ok = isinstance(answer, dict) and bool(answer.get("success"))
        message = str(answer.get("message", "")) if isinstance(answer, dict) else repr(answer)
        self._answered(receiver, init, ok, message if ok or not init else f"init: {message}")
        return RelayAnswer(200 if ok else 502, answer if isinstance(answer, dict) else {"success": False})

    def _answered(self, receiver: str, init: bool, ok: bool, message: str) -> None:
        """The engine answered ``receiver``'s init or send: the move that answer makes, and the
        transfer's outcome when it ended (a send, or an init that failed)."""
        with self._lock:
            if self._state.state is RelayState.DRAINING:  # its arm ended meanwhile
                self._move(RelayState.LEFT_OPEN if self._left_open is not None else RelayState.IDLE)
            elif init and ok:
                self._move(RelayState.JOINED)  # the receiver's send may already wait for this (above)
            else:
                self._move(RelayState.IDLE)  # a send answered, or an init that made no group
            if not init or not ok:
                self._outcome = SeedOutcome(receiver, ok, message)
            self._lock.notify_all()


class _QuietServer(ThreadingHTTPServer):
    """One log line, not a traceback, for a connection that broke (a client gone, a slow one timed out)."""

    daemon_threads = True

    def server_bind(self) -> None:
        """Bind without http.server's reverse DNS lookup of the address (``socket.getfqdn``): on a
        node whose resolver does not answer it blocks for the resolver's timeout, 12 s here in a
        network namespace, and every engine start and restart waited for it (issue 59.2's
        benchmark found it). ``server_name`` is only used for CGI's environment."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Log, at info, that a connection broke (http.server prints a traceback to stderr)."""
        log.info("seed relay: a connection from %s broke", client_address)


# -- the receiver's side --------------------------------------------------------------------------
@dataclass(frozen=True)
class Armed:
    """A seed armed for this engine's next start, and the weight version it reported when chosen."""

    seed: SeedSide
    version: str


@dataclass(frozen=True)
class ArmResult:
    """``PeerSource.arm``'s answer: the seed armed for this engine (``armed``), or None and
    ``detail`` says why not; ``busy`` when a peer refused only because it seeds another engine now."""

    armed: Armed | None
    detail: str
    busy: bool = False


@dataclass(frozen=True)
class StepResult:
    """How a step of a start from a peer went (``PeerSource.wait_sent``, ``verify_and_stamp``): ``ok``,
    and ``detail`` for the supervisor's story."""

    ok: bool
    detail: str


class PeerSource:
    """What one engine's supervisor does to start it from a peer (see the module's docstring)."""

    def __init__(self, plan: PeerPlan, key: str | None):
        self.plan = plan
        self.key = key

    def arm(self, stopping: Callable[[], bool] = lambda: False) -> ArmResult:
        """A seed armed for this engine and the version it holds, or None and why not. While every
        peer that holds the fleet's weights is busy seeding another engine (two engines restarted
        at once), it asks again once one may be free (a seed is busy for its transfer, or until
        its arm lapses), and a peer that healed meanwhile is a seed too; ``stopping()`` ends the wait."""
        delay = 0.1
        while True:
            result = self._arm()
            if result.armed is not None or not result.busy or stopping():
                return result
            log.info("every seed is busy (%s): asking again", result.detail)
            time.sleep(delay)  # a poll with backoff: the relays tell no one when they are free
            delay = min(delay * 2, 2.0)

    def _arm(self) -> ArmResult:
        """One round of ``arm``."""

        def version_of(peer: SeedSide) -> str | None:
            try:
                info = call_json(peer.url + Endpoint.MODEL_INFO, key=self.key, timeout_secs=PROBE_SECS)
            except (OSError, ValueError):
                return None
            version = info.get("weight_version") if isinstance(info, dict) else None
            # a pdctl: label (an update moving its weights or left half done, a transfer of its own) is
            # no version anyone can take from it
            if not isinstance(version, str) or version == self.plan.boot_version or in_flux(version):
                return None
            return version

        # all peers at once: one host that drops packets costs its probe's timeout once, not per peer after it
        with ThreadPoolExecutor(max(1, min(8, len(self.plan.peers)))) as pool:
            held_by = list(pool.map(version_of, self.plan.peers))
        versions = {peer: v for peer, v in zip(self.plan.peers, held_by, strict=True) if v is not None}
        if not versions:
            none = f"no peer of this TP layout holds weights past the boot version {self.plan.boot_version!r}"
            return ArmResult(None, none)
        ranked = [v for v, _ in Counter(versions.values()).most_common()]
        refusals = []
        busy = False
        for version in ranked:
            for peer, held in versions.items():
                if held != version:
                    continue
                try:
                    call_json(peer.relay_url + ARM_ROUTE, {"receiver": self.plan.me.engine_id}, key=self.key,
                              timeout_secs=PROBE_SECS)  # fmt: skip
                except StatusError as exc:  # busy seeding another engine, or cannot seed
                    why = exc.error()
                    busy = busy or why.startswith("seeding ")
                    refusals.append(f"{peer.engine_id}: {why}")
                    continue
                except (OSError, ValueError) as exc:  # its supervisor is gone
                    refusals.append(f"{peer.engine_id}: {exc}")
                    continue
                return ArmResult(Armed(peer, version), f"from {peer.engine_id} at {version!r}")
        refused = "every peer that holds the fleet's weights is busy or unreachable (" + "; ".join(refusals) + ")"
        return ArmResult(None, refused, busy)

    def command(self, argv: list[str], armed: Armed) -> list[str]:
        """``argv`` as a receiver from ``armed.seed`` (SGLang's flags; later words win)."""
        seed = armed.seed
        return [
            *_without(argv, RECEIVER_FLAGS),
            "--load-format", "remote_instance",
            "--remote-instance-weight-loader-seed-instance-ip", seed.host,
            "--remote-instance-weight-loader-seed-instance-service-port", str(seed.relay_port),
            "--remote-instance-weight-loader-send-weights-group-ports", json.dumps(list(seed.ports)),
            "--weight-version", PENDING,
        ]  # fmt: skip

    def wait_sent(self, armed: Armed, alive: Callable[[], bool]) -> StepResult:
        """Wait for the armed transfer's outcome while ``alive()`` (the engine process runs): the
        relay's outcome, or why none came."""
        lost_since: float | None = None
        while alive():
            try:
                body = {"receiver": self.plan.me.engine_id, "timeout_secs": 1.0}
                answer = call_json(armed.seed.relay_url + WAIT_ROUTE, body, key=self.key, timeout_secs=30.0)
                lost_since = None
            except (OSError, ValueError) as exc:  # one lost answer is not a lost relay: its arm outlives it
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since >= ARM_IDLE_SECS:
                    return StepResult(False, f"the seed's relay went away: {exc}")
                time.sleep(1.0)
                continue
            if isinstance(answer, dict) and answer.get("done"):
                return StepResult(bool(answer.get("success")), str(answer.get("message", "")))
        return StepResult(False, "the engine exited before its weights arrived")

    def verify_and_stamp(self, armed: Armed, alive: Callable[[], bool]) -> StepResult:
        """Once the engine answers (while ``alive()``): its checksum against the seed's (or, the seed
        gone, another peer's at the same version), then the seed's version stamped on it; ``ok``
        only when both were done."""
        me = self.plan.me
        while alive():
            try:
                call_json(me.url + Endpoint.MODEL_INFO, key=self.key, timeout_secs=PROBE_SECS)
                break
            except (OSError, ValueError):
                time.sleep(0.05)  # a poll of one local call: the engine is in its last second of start
        else:
            return StepResult(False, "the engine exited before it answered")

        def checksum(url: str) -> Any:
            return call_json(url + Endpoint.WEIGHTS_CHECKER, {"action": "checksum"}, key=self.key, timeout_secs=600.0)

        def reference(peer: SeedSide) -> tuple[Any, str]:
            """A peer's checksum and the version it holds after hashing (a push meanwhile moves it)."""
            theirs = checksum(peer.url)
            info = call_json(peer.url + Endpoint.MODEL_INFO, key=self.key, timeout_secs=PROBE_SECS)
            return theirs, str(info.get("weight_version"))

        # The seed first, then any peer of this TP layout at the same version (the seed may have died
        # since it sent: another engine at that version holds the same weights). Both hashes at once:
        # each engine hashes its own weights (a full pass over them).
        others = [p for p in self.plan.peers if p != armed.seed]
        with ThreadPoolExecutor(2) as pool:
            mine_call, first = pool.submit(checksum, me.url), pool.submit(reference, armed.seed)
            try:
                mine = mine_call.result()
            except (OSError, ValueError) as exc:
                return StepResult(False, f"could not read its own checksum: {exc}")
            compared, problems = None, []
            for peer, answer in [(armed.seed, first), *((p, None) for p in others)]:
                try:
                    theirs, held = (answer or pool.submit(reference, peer)).result()
                except (OSError, ValueError, AttributeError) as exc:
                    problems.append(f"{peer.engine_id}: {exc}")
                    continue
                if held != armed.version:
                    problems.append(f"{peer.engine_id} holds {held!r} now")
                    continue
                compared = (peer, theirs)
                break
        if compared is None:
            return StepResult(
                False, f"could not compare checksums with any engine at {armed.version!r}: {'; '.join(problems)}"
            )
        peer, theirs = compared
        mine_sum = mine.get("per_engine_checksum") if isinstance(mine, dict) else None
        theirs_sum = theirs.get("per_engine_checksum") if isinstance(theirs, dict) else None
        if mine_sum is None or mine_sum != theirs_sum:
            return StepResult(False, f"its checksum differs from {peer.engine_id}'s")
        try:
            call_json(me.url + Endpoint.UPDATE_WEIGHT_VERSION, update_weight_version_body(armed.version), key=self.key,
                      timeout_secs=PROBE_SECS)  # fmt: skip
        except (OSError, ValueError) as exc:
            return StepResult(False, f"could not stamp {armed.version!r}: {exc}")
        checked = "" if peer == armed.seed else f", checked against {peer.engine_id}"
        return StepResult(True, f"took {armed.version!r} from {armed.seed.engine_id} (checksums equal{checked})")

    def disarm(self, armed: Armed) -> None:
        """Release the seed's arm for this engine; when the relay cannot be reached, the arm lapses on
        its own."""
        try:
            call_json(armed.seed.relay_url + DISARM_ROUTE, {"receiver": self.plan.me.engine_id}, key=self.key,
                      timeout_secs=PROBE_SECS)  # fmt: skip
        except (OSError, ValueError):
            pass  # its lease ends it


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in flags:
            skip = True
            continue
        if any(word.startswith(f + "=") for f in flags):
            continue
        out.append(word)
    return out
