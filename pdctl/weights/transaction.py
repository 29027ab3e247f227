"""A push's buckets over a built group and, for engines with no router, the whole transaction,
every phase timed in the ``PushReport``. With a router, the router runs the transaction
(pdctl.weights.routed): here only the buckets, each one call to the router (``run_routed``).
With none (``run``):

    pause     /pause_generation (drain: ``pause_mode``, retract by default, nothing is lost;
              interrupt: abort, the router continues what it stops) and /flush_cache
    begin     /begin_weight_update (SGLang 0.5.21+)
    transfer  per bucket: one /update_weights_from_distributed to every engine at once, then the
              broadcast (one flattened uint8 tensor, or one per tensor in ``names`` order)
    end       /end_weight_update
    version   /update_weight_version: set only once every bucket is in, so an engine that stops
              half way never claims the new version
    verify    the engines' checksums of the pushed tensors against the trainer's
    continue  /continue_generation

Any engine that fails, refuses or does not answer within ``timeout_secs`` ends it with an
``EngineFault`` naming the engines and the phase; what to do then is ``WeightSync``'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pdctl.refit import RefitMode
from pdctl.sglang import (
    Endpoint,
    supports_flattened_bucket,
    supports_weight_update_session,
    update_weight_version_body,
    update_weights_from_distributed_body,
)
from pdctl.weights.buckets import Bucket, buckets, tensor_checksum
from pdctl.weights.client import CallFailure
from pdctl.weights.fleet import Fleet, Member, failures
from pdctl.weights.group import BroadcastGroup
from pdctl.weights.modes import LoadFormat, VerifyMode
from pdctl.weights.phase import EngineFault, Phase
from pdctl.weights.report import PushReport
from pdctl.weights.routed import RouterPush

log = logging.getLogger("pdctl.weights")

NamedTensors = Iterable[tuple[str, torch.Tensor]]
ROUTER_GRACE_SECS = 10.0
"""How much longer than the engines' limit a bucket's answer from the router is awaited: the
router gives up on a silent engine at the same limit and then answers which engine it was."""


@dataclass(frozen=True)
class BucketCalls:
    """Where each bucket's update call goes: id -> URL, each engine's (no router), or the
    router's one, which it forwards to every engine; ``blame`` names the engines at fault from
    the router's failed answer."""

    urls: dict[str, str]
    blame: Callable[[CallFailure], dict[str, str]] | None = None
    grace: float = 0.0
    """Seconds past the engines' own limit to wait for an answer (the router's, which names them)."""


@dataclass(frozen=True)
class InFlight:
    """One bucket's update calls, sent and broadcast, whose answers are still to be awaited."""

    futures: dict[str, Future]
    deadline: float


class Transaction:
    """How pushes run over ``group``: bucket size, load format, verification, timeouts."""

    def __init__(
        self,
        fleet: Fleet,
        group: BroadcastGroup,
        *,
        bucket_bytes: int,
        verify: VerifyMode,
        load_format: LoadFormat,
        timeout_secs: float,
    ):
        self.fleet = fleet
        self.group = group
        self.backend = group.backend
        self.bucket_bytes = bucket_bytes
        self.verify = verify
        self.load_format = load_format
        self.timeout_secs = timeout_secs

    def run(
        self, members: tuple[Member, ...], source: Callable[[], NamedTensors], version: str, report: PushReport
    ) -> None:
        """pause -> begin -> buckets -> end -> version -> verify -> continue over ``members`` (the
        group's), calling each engine from here (a fleet with no router); fills ``report``;
        raises EngineFault naming the engines that failed and the phase."""
        with report.phase(Phase.PAUSE):
            body = self.fleet.pause_body(RefitMode(report.refit))
            self.fleet.fanout(members, Phase.PAUSE, Endpoint.PAUSE_GENERATION, body)
            refused = self.fleet.fanout_quiet(members, Endpoint.FLUSH_CACHE, {})
            for engine_id in refused:  # only requests sent around the router keep a cache busy
                log.warning(
                    "weights %s: %s kept its cache (requests queued); stale prefixes may be reused", version, engine_id
                )
        sessions = [m for m in members if supports_weight_update_session(m.sglang_version)]
        with report.phase(Phase.BEGIN):
            if sessions:
                self.fleet.fanout(tuple(sessions), Phase.BEGIN, Endpoint.BEGIN_WEIGHT_UPDATE, {"selector": "all"})
        endpoint = Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED.value
        sums = self.transfer(members, source, report, BucketCalls({m.id: m.url + endpoint for m in members}))
        with report.phase(Phase.END):
            if sessions:
                self.fleet.fanout(tuple(sessions), Phase.END, Endpoint.END_WEIGHT_UPDATE, {})
        with report.phase(Phase.VERSION):
            self.fleet.fanout(
                members, Phase.VERSION, Endpoint.UPDATE_WEIGHT_VERSION, update_weight_version_body(version)
            )
        with report.phase(Phase.VERIFY):
            if sums:
                self._verify(members, sums, report.verify)
        with report.phase(Phase.CONTINUE):
            self.fleet.fanout(members, Phase.CONTINUE, Endpoint.CONTINUE_GENERATION, {})
        report.engines = [m.id for m in members]

    def run_routed(
        self, members: tuple[Member, ...], source: Callable[[], NamedTensors], report: PushReport, push: RouterPush
    ) -> None:
        """The buckets of a push the router runs (pdctl.weights.routed; it has held and paused the
        fleet), each one update call to the router, which forwards it to every member; then its
        commit (end, verify against the checksums taken here, version, continue, release).
        Raises EngineFault naming the engines that failed a bucket (the push stays open)."""
        url = push.router + Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED.value
        sums = self.transfer(members, source, report, BucketCalls({"router": url}, push.blame, ROUTER_GRACE_SECS))
        push.commit(sums, self.verify)

    def transfer(
        self, members: tuple[Member, ...], source: Callable[[], NamedTensors], report: PushReport, calls: BucketCalls
    ) -> dict[str, str]:
        """Every bucket of ``source``: its update calls (``calls``) and its broadcast over the
        group of ``members``; returns the checksums of what was sent (none when verify is off)."""
        # auto: one broadcast per tensor over gloo, where a flatten would be one more full copy on the
        # cores that carry the broadcast and the per-call cost is small (benchmarks/weight_push.py);
        # flattened buckets over NCCL, where per-call latency dominates and copies run at HBM speed.
        flattened = self.load_format == "flattened_bucket" or (
            self.load_format == "auto"
            and self.backend == "nccl"
            and all(supports_flattened_bucket(m.sglang_version) for m in members)
        )
        verify = self.verify if self.verify != "auto" else ("sample" if all(m.is_sim for m in members) else "off")
        report.load_format = "flattened_bucket" if flattened else "names"
        report.verify = verify
        sums: dict[str, str] = {}
        report.bytes = report.tensors = report.buckets = 0
        checksum_secs = 0.0
        with report.phase(Phase.TRANSFER):
            answering: InFlight | None = None
            for bucket in buckets(source(), self.bucket_bytes):
                # Flatten this bucket while the engines still load the previous one: the staging
                # buffer is free once that bucket's broadcast has completed.
                tensors = (
                    [bucket.flat(self.group.staging(bucket.nbytes, bucket.tensors[0].device))]
                    if flattened
                    else list(bucket.tensors)
                )
                if answering is not None:
                    self._await_answers(answering, calls)
                answering = self._send_bucket(calls, bucket, tensors, flattened, report)
                if verify != "off":
                    started = time.perf_counter()
                    sums.update(
                        (n, tensor_checksum(n, t, verify)) for n, t in zip(bucket.names, bucket.tensors, strict=True)
                    )
                    checksum_secs += time.perf_counter() - started
            if answering is not None:
                self._await_answers(answering, calls)
        report.phases[Phase.TRANSFER.value] -= checksum_secs  # the trainer's checksums count as verify time
        report.phases[Phase.VERIFY.value] = report.phases.get(Phase.VERIFY.value, 0.0) + checksum_secs
        return sums

    def _send_bucket(
        self,
        calls: BucketCalls,
        bucket: Bucket,
        tensors: list[torch.Tensor],
        flattened: bool,
        report: PushReport,
    ) -> InFlight:
        """Start every engine's update call and broadcast ``tensors``; returns once the broadcasts
        have completed (``tensors`` may be reused), with the engines' answers still to come."""
        body = update_weights_from_distributed_body(
            names=bucket.names,
            dtypes=bucket.dtypes,
            shapes=bucket.shapes,
            group_name=self.group.name,
            weight_version=None,
            flush_cache=False,
            load_format="flattened_bucket" if flattened else None,
        )
        # Connect to every engine before the broadcast starts: gloo relays a broadcast through
        # other ranks, so one dead engine would leave the live ones waiting inside it.
        urls = calls.urls
        conns = {i: self.fleet.client.pool.submit(self.fleet.client.connect, url) for i, url in urls.items()}
        answers = {i: f.result() for i, f in conns.items()}
        opened = {i: c for i, c in answers.items() if not isinstance(c, CallFailure)}
        refused = {i: c for i, c in answers.items() if isinstance(c, CallFailure)}
        if refused:
            for conn in opened.values():
                conn.close()
            raise EngineFault(Phase.TRANSFER, {i: str(c) for i, c in refused.items()})
        sent = InFlight(
            futures={i: self.fleet.client.pool.submit(self.fleet.client.send, opened[i], urls[i], body) for i in urls},
            deadline=time.monotonic() + self.timeout_secs + calls.grace,
        )
        assert self.group.process_group is not None
        works = [dist.broadcast(t, src=0, group=self.group.process_group, async_op=True) for t in tensors]
        self._await_broadcast(works, sent, calls)
        report.bytes += bucket.nbytes
        report.tensors += len(bucket.names)
        report.buckets += 1
        report.collectives += len(works)
        report.http_calls += len(sent.futures)
        return sent

    def _await_broadcast(self, works: list[Any], sent: InFlight, calls: BucketCalls) -> None:
        """Wait for the broadcasts. An engine that fails before they complete would leave them
        pending (a live rank that never receives): stop waiting after a short grace and abandon
        the group.

        Woken by the broadcasts' completion or by an engine's answer (one that comes before the
        broadcast ends is a failure), not by polling: a 1 ms poll took CPU from the gloo threads
        that carry the broadcast on the same cores."""
        wake = threading.Event()
        torch.futures.collect_all([w.get_future() for w in works]).add_done_callback(lambda _: wake.set())
        for future in sent.futures.values():
            future.add_done_callback(lambda _: wake.set())
        failed_since: float | None = None
        while True:
            wake.clear()  # before the checks, so that no wake-up between them is lost
            if all(w.is_completed() for w in works):
                break
            now = time.monotonic()
            if failed_since is None and failures(sent.futures):
                failed_since = now
            until = sent.deadline if failed_since is None else min(sent.deadline, failed_since + 1.0)
            if now >= until:
                self.group.pending = works
                raise EngineFault(Phase.TRANSFER, self._culprits(sent.futures, sent.deadline, calls))
            wake.wait(min(until - now, 1.0))
        error: Exception | None = None
        for work in works:
            try:
                work.wait()
            except Exception as exc:  # a peer died: the engines' answers say which
                error = exc
        if error is not None:
            raise EngineFault(Phase.TRANSFER, self._culprits(sent.futures, sent.deadline, calls, error))

    def _await_answers(self, sent: InFlight, calls: BucketCalls) -> None:
        """Wait for every engine's answer to a bucket whose broadcast has completed."""
        failed = failures(sent.futures, wait_until=sent.deadline)
        if failed or not all(f.done() for f in sent.futures.values()):  # a failure, or silence past the deadline
            raise EngineFault(Phase.TRANSFER, self._culprits(sent.futures, sent.deadline, calls))

    def _culprits(
        self, futures: dict[str, Future], deadline: float, calls: BucketCalls, error: Exception | None = None
    ) -> dict[str, str]:
        """Who is at fault: engines that gave no answer (dead, hung) before engines that answered
        with an error (the others fail with 'connection closed by peer' when one dies). Through
        the router, its answer names them (``Fleet.blame``)."""
        grace = min(deadline, time.monotonic() + 5.0)
        failed = failures(futures, wait_until=grace)
        silent = {i: f"no answer within {self.timeout_secs:.0f}s" for i, f in futures.items() if not f.done()}
        if calls.blame is not None and failed and not silent:
            return {i: why for f in failed.values() for i, why in calls.blame(f).items()}
        transport = {i: f.message for i, f in failed.items() if f.transport}
        if transport or silent:
            return {**transport, **silent}
        if failed:
            return {i: f.message for i, f in failed.items()}
        return {"rank 0": f"broadcast failed: {error}"}

    def _verify(self, members: tuple[Member, ...], sums: dict[str, str], mode: str) -> None:
        body = {"action": "checksum", "names": list(sums), "mode": mode}
        results = self.fleet.fanout(members, Phase.VERIFY, Endpoint.WEIGHTS_CHECKER, body)
        wrong: dict[str, str] = {}
        for m in members:
            theirs = results[m.id].get("checksums", {}) if isinstance(results[m.id], dict) else {}
            bad = [n for n, s in sums.items() if theirs.get(n) != s]
            if bad:
                wrong[m.id] = f"checksum differs for {len(bad)} tensor(s), first {bad[0]}"
        if wrong:
            raise EngineFault(Phase.VERIFY, wrong)
