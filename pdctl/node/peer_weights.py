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
makes that window the transfer itself, not the receiver's whole start.

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
import http.client
import json
import logging
import socketserver
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import yaml

from pdctl.refit import in_flux

log = logging.getLogger("pdctl.node.peer_weights")

PENDING = "pdctl:receiving-from-peer"
"""The version a receiver starts with: the fleet never holds it, so the router keeps it out."""
INIT_ROUTE = "/init_weights_send_group_for_remote_instance"
SEND_ROUTE = "/send_weights_to_remote_instance"
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


def _call(url: str, key: str | None, body: dict[str, Any] | None = None, timeout: float | None = PROBE_SECS) -> Any:
    """POST ``body`` (GET when None) with the key; the JSON answer. Raises OSError (HTTPError
    included) or ValueError."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")
    except http.client.HTTPException as exc:  # a broken answer (BadStatusLine, IncompleteRead): no answer
        raise OSError(f"{url}: {type(exc).__name__}: {exc}") from exc


# -- the seed's side ------------------------------------------------------------------------------
class SeedRelay:
    """The relay of one engine (see the module's docstring); ``start`` serves it on a thread."""

    def __init__(self, me: SeedSide, key: str | None):
        self.me = me
        self.key = key
        self._lock = threading.Condition()
        self._armed_until = 0.0
        self._armed_for: str | None = None
        self._group: str | None = None
        """The group of the arm's one init (set once: a second init, or a send of another group, is refused)."""
        self._sent = False
        """The arm's one send was passed on (a second would end an SGLang seed: its group is gone)."""
        self._in_flight: str | None = None
        """The receiver whose init or send the engine is answering now: no new arm meanwhile, and
        the outcome is this receiver's whatever happened to its arm."""
        self._outcome: dict[str, Any] | None = None
        self._outcome_for: str | None = None
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
                status, answer = relay.handle(self.path, body, self.headers.get("Authorization"))
                self._answer(status, answer)

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

    def _authorized(self, header: str | None) -> bool:
        if not self.key:  # an engine with no key: nobody may arm it (the triggers would be anyone's)
            return False
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self.key.encode())

    def handle(self, path: str, body: dict[str, Any], auth: str | None) -> tuple[int, dict[str, Any]]:
        """One relay request's status and JSON answer. Arm, wait and disarm need the engine key (401
        otherwise); a receiver's init and send are passed on to the engine only when they fit the
        current arm (403 otherwise, 502 when the engine did not succeed); any other path is 404."""
        if path in (ARM_ROUTE, WAIT_ROUTE, DISARM_ROUTE):
            if not self._authorized(auth):
                return 401, {"error": "Unauthorized"}
            if path == ARM_ROUTE:
                return self._arm(str(body.get("receiver", "")))
            if path == WAIT_ROUTE:
                try:
                    wait = min(max(float(body.get("timeout_secs", 5.0)), 0.0), ARM_IDLE_SECS / 2)
                except (TypeError, ValueError):
                    return 400, {"error": "timeout_secs must be a number"}
                return 200, self._wait(str(body.get("receiver", "")), wait)
            return self._disarm(str(body.get("receiver", "")))
        if path in (INIT_ROUTE, SEND_ROUTE):
            return self._forward(path, body)
        return 404, {"error": f"unknown path {path}"}

    def engine_started(self) -> None:
        """A new engine process: it holds no group of an earlier one, and may seed again."""
        with self._lock:
            self._left_open = None

    def _end_arm(self) -> None:
        """The arm ends (caller holds the lock); an init it passed that no send used leaves its group open."""
        if self._group is not None and not self._sent:
            self._left_open = f"its engine holds the group {self._group!r} that {self._armed_for} made and never used"
            log.warning("%s: it seeds again once its engine restarts", self._left_open)
        self._armed_for, self._group = None, None

    def _arm(self, receiver: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            if self._in_flight is not None or (self._armed_for is not None and time.monotonic() < self._armed_until):
                return 409, {"error": f"seeding {self._in_flight or self._armed_for} already"}
            if self._armed_for is not None:  # lapsed
                self._end_arm()
            if self._left_open is not None:
                return 409, {"error": f"cannot seed: {self._left_open} (until it restarts)"}
            self._armed_for, self._armed_until = receiver, time.monotonic() + ARM_IDLE_SECS
            self._group, self._sent, self._outcome = None, False, None
        log.info("armed to seed %s", receiver)
        return 200, {"armed": receiver}

    def _disarm(self, receiver: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            if self._armed_for == receiver:
                self._end_arm()
                self._lock.notify_all()
        return 200, {"disarmed": receiver}

    def _wait(self, receiver: str, timeout_secs: float) -> dict[str, Any]:
        """Long poll of ``receiver``'s supervisor: its transfer's outcome once there is one
        (``done`` false at the timeout, to be asked again); each call keeps its arm alive."""
        with self._lock:
            if self._armed_for == receiver and self._outcome is None:
                self._armed_until = time.monotonic() + ARM_IDLE_SECS
            self._lock.wait_for(lambda: self._outcome is not None or self._armed_for != receiver, timeout_secs)
            if self._outcome is not None and self._outcome_for == receiver:
                return {"done": True, **self._outcome}
            if self._armed_for != receiver:
                return {"done": True, "success": False, "message": "this seed is not armed for it (its arm lapsed)"}
            return {"done": False}

    def _finish(self, receiver: str | None, success: bool, message: str) -> None:
        """``receiver``'s transfer ended: its outcome kept for it, the seed free for another."""
        with self._lock:
            self._outcome, self._outcome_for = {"success": success, "message": message}, receiver
            if self._armed_for == receiver:
                self._end_arm()
            self._in_flight = None
            self._lock.notify_all()

    def _forward(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A receiver's trigger, passed on to the engine with its key when it fits the arm: the
        seed's own host and ports (a port count that is not its tp would end an SGLang seed), a
        pair group of SGLang's receiver (world 2, the seed at rank 0, nccl, ``send_weights_*``),
        one init and then one send of that group per arm (a send with no group ends an SGLang
        seed). Checked and recorded under one lock, so two triggers cannot both pass."""
        ports = ",".join(str(p) for p in self.me.ports)
        name = body.get("group_name")
        with self._lock:
            if path == SEND_ROUTE:  # SGLang's receiver sends as soon as it joined: its init may still be
                # on its way back from the engine (whose scheduler takes the two in order)
                self._lock.wait_for(lambda: self._in_flight is None, ARM_IDLE_SECS)
            receiver = self._armed_for
            problem = None
            if receiver is None or time.monotonic() >= self._armed_until or self._in_flight is not None:
                problem = "no transfer is armed on this seed"
            elif str(body.get("ports")) != ports or str(body.get("master_address")) != self.me.host:
                problem = f"this seed sends from {self.me.host} on ports {ports}"
            elif not (isinstance(name, str) and name.startswith("send_weights_") and len(name) < 256):
                problem = "a receiver's group is send_weights_<its address>"
            elif path == INIT_ROUTE and (
                self._group is not None
                or body.get("group_rank") != 0
                or body.get("world_size") != 2
                or body.get("backend", "nccl") != "nccl"
            ):
                problem = "one pair group per transfer: world_size 2, the seed at rank 0, nccl"
            elif path == SEND_ROUTE and (self._group != name or self._sent):
                problem = "one send per transfer, of the group its init made"
            if problem is None:
                self._in_flight = receiver
                if path == INIT_ROUTE:
                    self._group = name
                else:
                    self._sent = True
        if problem is not None:
            log.warning("refused %s: %s", path, problem)
            if receiver is not None and path == SEND_ROUTE and self._in_flight is None:
                self._finish(receiver, False, f"send refused: {problem}")
            return 403, {"success": False, "message": problem}
        try:
            answer = _call(self.me.url + path, self.key, body, timeout=None)
        except urllib.error.HTTPError as exc:
            answer = {"success": False, "message": f"the seed answered {exc.code}: {_body_of(exc)}"}
        except (OSError, ValueError) as exc:
            answer = {"success": False, "message": f"the seed did not answer: {exc}"}
        ok = isinstance(answer, dict) and bool(answer.get("success"))
        message = str(answer.get("message", "")) if isinstance(answer, dict) else repr(answer)
        if path == INIT_ROUTE and not ok:
            with self._lock:  # the engine made no group to leave open (its init failed)
                self._group = None
        if path == SEND_ROUTE or not ok:
            self._finish(receiver, ok, message if ok or path == SEND_ROUTE else f"init: {message}")
        else:
            with self._lock:  # the receiver's send may already wait for this answer (above)
                self._in_flight = None
                self._lock.notify_all()
        return (200 if ok else 502), (answer if isinstance(answer, dict) else {"success": False})


def _error_of(exc: urllib.error.HTTPError) -> str:
    """The relay's ``error`` in a refusal, else its status and body."""
    body = _body_of(exc)
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    return error if isinstance(error, str) else f"{exc.code} {body}"


def _body_of(exc: urllib.error.HTTPError) -> str:
    try:
        return exc.read(2000).decode(errors="replace")
    except OSError:
        return ""


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
        log.info("seed relay: a connection from %s broke", client_address)


# -- the receiver's side --------------------------------------------------------------------------
@dataclass(frozen=True)
class Armed:
    """A seed armed for this engine's next start, and the weight version it reported when chosen."""

    seed: SeedSide
    version: str


class PeerSource:
    """What one engine's supervisor does to start it from a peer (see the module's docstring)."""

    def __init__(self, plan: PeerPlan, key: str | None):
        self.plan = plan
        self.key = key

    def arm(self, stopping: Any = lambda: False) -> tuple[Armed | None, str]:
        """A seed armed for this engine and the version it holds, or None and why not. While every
        peer that holds the fleet's weights is busy seeding another engine (two engines restarted
        at once), it asks again once one may be free (a seed is busy for its transfer, or until
        its arm lapses), and a peer that healed meanwhile is a seed too; ``stopping()`` ends the wait."""
        delay = 0.1
        while True:
            armed, detail, busy = self._arm()
            if armed is not None or not busy or stopping():
                return armed, detail
            log.info("every seed is busy (%s): asking again", detail)
            time.sleep(delay)  # a poll with backoff: the relays tell no one when they are free
            delay = min(delay * 2, 2.0)

    def _arm(self) -> tuple[Armed | None, str, bool]:
        """One round of ``arm``: and whether a peer refused only because it seeds another engine now."""

        def version_of(peer: SeedSide) -> str | None:
            try:
                info = _call(peer.url + "/model_info", self.key)
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
            return None, none, False
        ranked = [v for v, _ in Counter(versions.values()).most_common()]
        refusals = []
        busy = False
        for version in ranked:
            for peer, held in versions.items():
                if held != version:
                    continue
                try:
                    _call(peer.relay_url + ARM_ROUTE, self.key, {"receiver": self.plan.me.engine_id})
                except urllib.error.HTTPError as exc:  # busy seeding another engine, or cannot seed
                    why = _error_of(exc)
                    busy = busy or why.startswith("seeding ")
                    refusals.append(f"{peer.engine_id}: {why}")
                    continue
                except (OSError, ValueError) as exc:  # its supervisor is gone
                    refusals.append(f"{peer.engine_id}: {exc}")
                    continue
                return Armed(peer, version), f"from {peer.engine_id} at {version!r}", False
        refused = "every peer that holds the fleet's weights is busy or unreachable (" + "; ".join(refusals) + ")"
        return None, refused, busy

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

    def wait_sent(self, armed: Armed, alive: Any) -> tuple[bool, str]:
        """Wait for the armed transfer's outcome while ``alive()`` (the engine process runs)."""
        lost_since: float | None = None
        while alive():
            try:
                body = {"receiver": self.plan.me.engine_id, "timeout_secs": 1.0}
                answer = _call(armed.seed.relay_url + WAIT_ROUTE, self.key, body, timeout=30.0)
                lost_since = None
            except (OSError, ValueError) as exc:  # one lost answer is not a lost relay: its arm outlives it
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since >= ARM_IDLE_SECS:
                    return False, f"the seed's relay went away: {exc}"
                time.sleep(1.0)
                continue
            if isinstance(answer, dict) and answer.get("done"):
                return bool(answer.get("success")), str(answer.get("message", ""))
        return False, "the engine exited before its weights arrived"

    def verify_and_stamp(self, armed: Armed, alive: Any) -> tuple[bool, str]:
        """Once the engine answers: its checksum against the seed's, then the seed's version."""
        me = self.plan.me
        while alive():
            try:
                _call(me.url + "/model_info", self.key)
                break
            except (OSError, ValueError):
                time.sleep(0.05)  # a poll of one local call: the engine is in its last second of start
        else:
            return False, "the engine exited before it answered"

        def checksum(url: str) -> Any:
            return _call(url + "/weights_checker", self.key, {"action": "checksum"}, timeout=600.0)

        def reference(peer: SeedSide) -> tuple[Any, str]:
            """A peer's checksum and the version it holds after hashing (a push meanwhile moves it)."""
            theirs = checksum(peer.url)
            return theirs, str(_call(peer.url + "/model_info", self.key).get("weight_version"))

        # The seed first, then any peer of this TP layout at the same version (the seed may have died
        # since it sent: another engine at that version holds the same weights). Both hashes at once:
        # each engine hashes its own weights (a full pass over them).
        others = [p for p in self.plan.peers if p != armed.seed]
        with ThreadPoolExecutor(2) as pool:
            mine_call, first = pool.submit(checksum, me.url), pool.submit(reference, armed.seed)
            try:
                mine = mine_call.result()
            except (OSError, ValueError) as exc:
                return False, f"could not read its own checksum: {exc}"
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
            return False, f"could not compare checksums with any engine at {armed.version!r}: {'; '.join(problems)}"
        peer, theirs = compared
        mine_sum = mine.get("per_engine_checksum") if isinstance(mine, dict) else None
        theirs_sum = theirs.get("per_engine_checksum") if isinstance(theirs, dict) else None
        if mine_sum is None or mine_sum != theirs_sum:
            return False, f"its checksum differs from {peer.engine_id}'s"
        try:
            _call(me.url + "/update_weight_version", self.key,
                  {"new_version": armed.version, "abort_all_requests": False})  # fmt: skip
        except (OSError, ValueError) as exc:
            return False, f"could not stamp {armed.version!r}: {exc}"
        checked = "" if peer == armed.seed else f", checked against {peer.engine_id}"
        return True, f"took {armed.version!r} from {armed.seed.engine_id} (checksums equal{checked})"

    def disarm(self, armed: Armed) -> None:
        """Release the seed's arm for this engine; when the relay cannot be reached, the arm lapses on
        its own."""
        try:
            _call(armed.seed.relay_url + DISARM_ROUTE, self.key, {"receiver": self.plan.me.engine_id})
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
