"""``WeightSync``: trainer rank 0 pushes weights into every prefill and decode engine.

One flat broadcast group (sglang-protocol.md 4.2-4.3): the trainer is rank 0, engine i takes
ranks ``rank_offset_i .. rank_offset_i + gpus_i - 1`` with ``rank_offset_i = 1 + GPUs of the
engines before it``, prefill and decode alike, so engines of different TP share one group.
NCCL on CUDA, gloo on CPU: the same code with another ``backend``.

A push is one fleet-wide transaction, every phase timed in the returned ``PushReport``:

    probe     GET /server_info on every engine; rebuild the group if the engine set changed
    hold      the router stops admitting and drains in-flight requests (a lease it renews)
    pause     /pause_generation (retract by default: nothing is lost) and /flush_cache
    begin     /begin_weight_update (SGLang 0.5.21+)
    transfer  per bucket: one /update_weights_from_distributed to every engine at once, then the
              broadcast (one flattened uint8 tensor, or one per tensor in ``names`` order)
    end       /end_weight_update
    version   /update_weight_version: set only once every bucket is in, so an engine that stops
              half way never claims the new version
    verify    the engines' checksums of the pushed tensors against the trainer's
    continue  /continue_generation
    release   the router re-reads versions and resumes; engines that did not get the whole
              version stay out of its rotation until a later push reaches them

Failure: an engine that dies or refuses, or does not answer within ``timeout_secs``, ends the
transaction with ``WeightSyncError`` naming it and the phase. Before raising, when the tensors
can be read again (a list, a dict's items, anything that is not a one-shot iterator), the push
is redone on the surviving engines over a rebuilt group, so the fleet keeps serving a complete
version; the failed engine stays out of rotation until a later push (which rebuilds the group
to take it back in). A trainer killed mid-push stops renewing the router's lease: the router
then takes every engine of the push out of rotation, and the next trainer's ``connect`` clears
what the dead one left open on the engines (session, group).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pdctl.errors import WeightSyncError
from pdctl.refit import DEFAULT_HOLD_TIMEOUT_SECS, DEFAULT_LEASE_SECS, RefitMode
from pdctl.sglang import (
    DEFAULT_GROUP_NAME,
    Endpoint,
    destroy_weights_update_group_body,
    init_weights_update_group_body,
    supports_flattened_bucket,
    supports_weight_update_session,
    update_weight_version_body,
    update_weights_from_distributed_body,
)
from pdctl.sglang.group import init_custom_process_group
from pdctl.weights.buckets import Bucket, buckets, tensor_checksum
from pdctl.weights.client import CallFailure
from pdctl.weights.env import (
    API_KEY_ENV_ENV,
    DEFAULT_BUCKET_MB,
    READY_TIMEOUT_ENV,
    ROUTER_URL_ENV,
    WEIGHT_GROUP_ENV,
    WeightGroupEnv,
)
from pdctl.weights.fleet import EngineFault, EngineTarget, Fleet, Member, failures, refit_mode
from pdctl.weights.report import PushReport

log = logging.getLogger("pdctl.weights")
MIB = 1024 * 1024

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class InFlight:
    """One bucket's update calls, sent and broadcast, whose answers are still to be awaited."""

    futures: dict[str, Future]
    deadline: float


class WeightSync:
    """Connects trainer rank 0 to every engine and pushes weights; see the module docstring.

    Only trainer rank 0 talks to engines. On other ranks ``connect`` and ``close`` do nothing
    and ``push`` reads the tensors it is given and drops them (so collectives inside that
    iterable, such as ``full_tensors``' all-gathers of an FSDP2 model, run on every rank) and
    returns a report with ``pushed=False``. The rank is ``rank`` if given, else ``$RANK``
    (torchrun), else 0.

    Options: ``bucket_mb`` (bytes per update call), ``timeout_secs`` (each engine call and each
    collective), ``pause_mode`` (``retract`` | ``abort`` | ``in_place``), ``verify`` (``auto``:
    ``sample`` on pdctl's sim, off on SGLang whose ``/weights_checker`` differs; ``sample`` |
    ``full`` | ``off``), ``load_format`` (``auto``: over NCCL ``flattened_bucket`` where every
    engine's SGLang has it, else, and always over gloo, one broadcast per tensor; ``names`` |
    ``flattened_bucket``), ``recover`` (redo a failed push on the
    surviving engines), ``lease_secs`` (how long the router waits for a silent trainer).
    """

    def __init__(
        self,
        engines: Sequence[EngineTarget | Mapping[str, Any] | str],
        *,
        master_address: str,
        master_port: int,
        backend: str = "gloo",
        router_url: str | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        api_key: str | None = None,
        timeout_secs: float = 120.0,
        pause_mode: str = "retract",
        verify: str = "auto",
        load_format: str = "auto",
        recover: bool = True,
        lease_secs: float = DEFAULT_LEASE_SECS,
        hold_timeout_secs: float = DEFAULT_HOLD_TIMEOUT_SECS,
        rank: int | None = None,
        ready_timeout_secs: float = 0.0,
        refit: RefitMode | str = RefitMode.DRAIN,
        max_staleness: int | None = None,
    ):
        if verify not in ("auto", "sample", "full", "off"):
            raise WeightSyncError(f"verify must be auto, sample, full or off, not {verify!r}")
        if load_format not in ("auto", "flattened_bucket", "names"):
            raise WeightSyncError(f"load_format must be auto, flattened_bucket or names, not {load_format!r}")
        self.fleet = Fleet(
            engines,
            router_url=router_url,
            api_key=api_key,
            timeout_secs=timeout_secs,
            pause_mode=pause_mode,
            lease_secs=lease_secs,
            hold_timeout_secs=hold_timeout_secs,
            refit=refit,
            max_staleness=max_staleness,
        )
        self.engines = self.fleet.engines
        self.client = self.fleet.client
        self.master_address = master_address
        self.master_port = int(master_port)
        self.backend = backend
        self.group_name = group_name
        self.bucket_bytes = max(1, int(bucket_mb * MIB))
        self.timeout_secs = timeout_secs
        self.verify = verify
        self.load_format = load_format
        self.recover = recover
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.ready_timeout_secs = ready_timeout_secs
        self._group: dist.ProcessGroup | None = None
        self._members: tuple[Member, ...] = ()
        self._abandoned: list[Any] = []  # groups and works left pending by a failure; kept alive on purpose
        self._active_name = group_name
        self._signature_now: tuple = ()
        self._pending: list[Any] = []  # the last bucket's broadcasts, if a failure left them unfinished
        self._pushes = itertools.count(1)
        self._staging_buffer: torch.Tensor | None = None

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **options: Any) -> WeightSync:
        """Build from the environment ``pdctl up`` gives the trainer (``PDCTL_WEIGHT_GROUP`` etc.).

        ``options`` override any constructor argument (``bucket_mb``, ``verify``, ...).
        """
        env = os.environ if env is None else env
        raw = env.get(WEIGHT_GROUP_ENV)
        if not raw:
            raise WeightSyncError(
                f"${WEIGHT_GROUP_ENV} is not set: run the trainer with `pdctl up` on a topology with a `weights` "
                "section, or build WeightSync(engines, master_address=..., master_port=...) yourself"
            )
        try:
            group = WeightGroupEnv.from_json(raw)
        except ValueError as exc:
            raise WeightSyncError(f"${WEIGHT_GROUP_ENV} is not a pdctl weight group: {exc}") from exc
        kwargs: dict[str, Any] = {
            "engines": [{"id": e["id"], "url": e["url"], "gpus": e["gpus"]} for e in group.engines],
            "master_address": group.master_address,
            "master_port": group.master_port,
            "backend": group.backend,
            "group_name": group.group_name,
            "bucket_mb": group.bucket_mb,
            "refit": group.refit,
            "max_staleness": group.max_staleness,
        }
        kwargs["router_url"] = env.get(ROUTER_URL_ENV) or None
        try:
            kwargs["ready_timeout_secs"] = float(env.get(READY_TIMEOUT_ENV) or 0)
        except ValueError as exc:
            raise WeightSyncError(f"${READY_TIMEOUT_ENV} is not a number of seconds: {exc}") from exc
        key_var = env.get(API_KEY_ENV_ENV)
        kwargs["api_key"] = env.get(key_var) if key_var else None
        kwargs.update(options)
        return cls(**kwargs)

    @property
    def is_pusher(self) -> bool:
        return self.rank == 0

    @property
    def members(self) -> tuple[Member, ...]:
        """The engines in the current group (empty before ``connect``)."""
        return self._members

    def __enter__(self) -> WeightSync:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- group ---------------------------------------------------------------------------------------------
    def connect(self) -> WeightSync:
        """Build the flat group over every engine that answers (rank 0 only; others return at once).

        Clears what an earlier trainer may have left on the engines (an open update session, a
        group). With ``ready_timeout_secs`` it first waits up to that long until every engine
        is healthy and the router ready (a trainer started before the engines: colocate).
        Raises WeightSyncError (phase ``connect``) naming an engine that refuses to join.
        """
        if not self.is_pusher:
            return self
        if self.ready_timeout_secs > 0:
            self.fleet.wait_ready(self.ready_timeout_secs)
        report = PushReport(version="connect")
        live, infos = self.fleet.probe(report)
        self._build(live, infos)
        return self

    def close(self) -> None:
        """Destroy the group on the engines and here. Idempotent; rank 0 only does anything."""
        if self.is_pusher and self._members:
            self.fleet.fanout_quiet(
                self._members,
                Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP,
                destroy_weights_update_group_body(self._active_name),
            )
        self._drop_group()
        self.fleet.close()

    def _signature(self, live: list[EngineTarget], infos: dict[str, dict[str, Any]]) -> tuple:
        return tuple((e.url, infos[e.id].get("startup_time")) for e in live)

    def _build(self, live: list[EngineTarget], infos: dict[str, dict[str, Any]]) -> None:
        """(Re)build the group over ``live``: engines' init calls run while rank 0 rendezvouses."""
        self._drop_group()
        # This trainer's old group, or whatever an earlier trainer left open: a session (it died mid-push), its group.
        self.fleet.fanout_quiet(live, Endpoint.END_WEIGHT_UPDATE, {})
        for stale in {self.group_name, self._active_name}:
            body = destroy_weights_update_group_body(stale)
            self.fleet.fanout_quiet(live, Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP, body)
        members, offset = [], 1
        for engine in live:
            members.append(Member.of(engine, offset, infos[engine.id]))
            offset += engine.gpus
        world_size = offset
        port = self._rendezvous_port()
        # A group left with a pending collective keeps its name registered in torch: a new name.
        name = self.group_name if not self._abandoned else f"{self.group_name}-{len(self._abandoned)}"
        self._active_name = name
        futures = {
            m.id: self.client.submit(
                "POST",
                m.url + Endpoint.INIT_WEIGHTS_UPDATE_GROUP.value,
                init_weights_update_group_body(
                    master_address=self.master_address,
                    master_port=port,
                    rank_offset=m.rank_offset,
                    world_size=world_size,
                    group_name=name,
                    backend=self.backend,
                ),
            )
            for m in members
        }
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["group"] = init_custom_process_group(
                    backend=self.backend,
                    master_address=self.master_address,
                    master_port=port,
                    world_size=world_size,
                    rank=0,
                    group_name=name,
                    timeout_secs=self.timeout_secs,
                )
            except Exception as exc:  # reported below with the engines' answers
                box["error"] = exc

        # The engines' HTTP calls block inside the rendezvous until rank 0 joins: both sides at once.
        joiner = threading.Thread(target=join, name="pdctl-weights-rendezvous", daemon=True)
        joiner.start()
        deadline = time.monotonic() + self.timeout_secs + 5
        while True:
            if "error" in box:
                break
            failed = failures(futures)
            if failed:
                self._abandoned.append(joiner)  # its rendezvous times out on its own
                url = next(iter(failed))
                raise WeightSyncError(
                    f"engine {url} did not join the weight group: {failed[url]}", engine=url, phase="connect"
                )
            if not joiner.is_alive() and all(f.done() for f in futures.values()):
                break
            if time.monotonic() > deadline:
                waiting = [i for i, f in futures.items() if not f.done()]
                raise WeightSyncError(
                    f"the weight group did not form within {self.timeout_secs:.0f}s "
                    f"(waiting for {waiting or 'rank 0'})",
                    engine=waiting[0] if waiting else None,
                    phase="connect",
                )
            time.sleep(0.005)
        if "error" in box:  # the engines' calls now wait for a rank 0 that never comes: abandon them
            raise WeightSyncError(
                f"rank 0 could not join the weight group on port {port}: {box['error']}", phase="connect"
            ) from box["error"]
        self._group = box["group"]
        self._members = tuple(members)
        self._signature_now = self._signature(live, infos)
        log.info("weights: group %s of %d ranks over %d engines (port %d)", name, world_size, len(members), port)

    def _rendezvous_port(self) -> int:
        """The planned port while it is free; else a free one (an abandoned rendezvous may hold it)."""
        for port in (self.master_port, 0):
            with socket.socket(socket.AF_INET6 if ":" in self.master_address else socket.AF_INET) as s:
                try:
                    s.bind((self.master_address, port))
                except OSError:
                    continue
                return port or s.getsockname()[1]
        raise WeightSyncError(f"no free port on {self.master_address} for the weight group", phase="connect")

    def _drop_group(self) -> None:
        if self._group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group)
        self._group = None
        self._members = ()

    def _abandon_group(self) -> None:
        """After a failed collective: destroy the group, unless an op is still pending on it (a
        live rank that never received): then keep it alive until that op times out on its own."""
        if any(not w.is_completed() for w in self._pending):
            if self._group is not None:
                self._abandoned.append((self._group, self._pending))
            self._group = None
            self._staging_buffer = None  # the pending op may still read it: the next push takes a new one
        self._pending = []
        self._drop_group()

    # -- push ---------------------------------------------------------------------------------------------
    def push(
        self,
        named_tensors: NamedTensors | Callable[[], NamedTensors],
        version: str | None = None,
        *,
        refit: RefitMode | str | None = None,
    ) -> PushReport:
        """Push ``(name, tensor)`` pairs into every engine as version ``version`` (default ``push-N``).

        ``refit`` (default: the one given at construction, the topology's ``weights.refit``):
        ``drain`` waits for in-flight requests first; ``interrupt`` stops them at a token
        boundary and the router continues them on the new weights (pdctl.refit).

        ``named_tensors`` may be a callable returning the pairs (then a failed push can be redone
        on the surviving engines). Returns the report; raises WeightSyncError naming the engine
        and phase when any engine did not get the whole version (``error.report`` says which did).
        """
        number = next(self._pushes)
        version = version or f"push-{number}"
        if not self.is_pusher:
            for _ in _tensor_source(named_tensors)[0]():
                pass
            return PushReport(version=version, pushed=False)
        source, reusable = _tensor_source(named_tensors)
        mode = self.fleet.refit if refit is None else refit_mode(refit)
        report = PushReport(version=version, refit=mode.value)
        with report.phase("probe"):
            live, infos = self.fleet.probe(report)
            if self._group is None or self._signature(live, infos) != self._signature_now:
                if self._group is not None:
                    log.warning("weights: the engine set changed; rebuilding the group")
                try:
                    self._build(live, infos)
                except WeightSyncError as exc:
                    exc.report = report
                    raise
        members = self._members
        with self.fleet.held(report, self._group_info(), refit=mode):
            try:
                self._transaction(members, source, version, report)
            except EngineFault as fault:
                self._recover(fault, members, source if reusable else None, version, report)
        self.fleet.raise_if_failed(report, f"weight push {version}")
        log.info(
            "weights %s: pushed %.1f MB in %d buckets to %d engines in %.3fs (transfer %.3fs)",
            version,
            report.bytes / 1e6,
            report.buckets,
            len(report.engines),
            report.seconds,
            report.phases.get("transfer", 0.0),
        )
        return report

    def _recover(
        self,
        fault: EngineFault,
        members: tuple[Member, ...],
        source: Callable[[], NamedTensors] | None,
        version: str,
        report: PushReport,
    ) -> None:
        """After ``fault``: record the culprits, then get the survivors to a complete version if possible."""
        for engine, reason in fault.culprits.items():
            report.failed[engine] = f"{fault.phase}: {reason}"
            log.error("weights %s: engine %s failed in %s: %s", version, engine, fault.phase, reason)
        survivors = [m for m in members if m.id not in fault.culprits]
        if fault.phase in ("verify", "continue"):  # every bucket is in: the survivors hold the version
            self.fleet.fanout_quiet(survivors, Endpoint.CONTINUE_GENERATION, {})
            report.engines = [m.id for m in survivors]
            return
        if fault.phase == "transfer":
            self._abandon_group()  # a collective failed: the group is unusable on every rank
        self.fleet.fanout_quiet(survivors, Endpoint.END_WEIGHT_UPDATE, {})
        if self.recover and survivors and source is not None:
            try:
                report.retried = True
                live, infos = self.fleet.probe(report)
                alive = [e for e in live if e.id in {m.id for m in survivors}]
                if alive:
                    self._build(alive, infos)
                    self._transaction(self._members, source, version, report)
                    return
            except EngineFault as again:
                for engine, reason in again.culprits.items():
                    report.failed.setdefault(engine, f"retry {again.phase}: {reason}")
                self._abandon_group()
            except WeightSyncError as again:
                report.failed.setdefault(again.engine or "rank 0", f"retry {again.phase}: {again}")
                self._abandon_group()
        for m in survivors:  # their weights may be partial: out of rotation until a later push
            report.failed.setdefault(
                m.id, f"{fault.phase}: left with partial weights when {', '.join(fault.culprits)} failed"
            )
        self.fleet.fanout_quiet(survivors, Endpoint.CONTINUE_GENERATION, {})

    def _transaction(
        self, members: tuple[Member, ...], source: Callable[[], NamedTensors], version: str, report: PushReport
    ) -> None:
        """pause -> begin -> buckets -> end -> version -> verify -> continue; raises EngineFault."""
        with report.phase("pause"):
            body = self.fleet.pause_body(RefitMode(report.refit))
            self.fleet.fanout(members, "pause", Endpoint.PAUSE_GENERATION, body)
            refused = self.fleet.fanout_quiet(members, Endpoint.FLUSH_CACHE, {})
            for engine_id in refused:  # only requests sent around the router keep a cache busy
                log.warning(
                    "weights %s: %s kept its cache (requests queued); stale prefixes may be reused", version, engine_id
                )
        sessions = [m for m in members if supports_weight_update_session(m.sglang_version)]
        with report.phase("begin"):
            if sessions:
                self.fleet.fanout(tuple(sessions), "begin", Endpoint.BEGIN_WEIGHT_UPDATE, {"selector": "all"})
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
        with report.phase("transfer"):
            answering: InFlight | None = None
            for bucket in buckets(source(), self.bucket_bytes):
                # Flatten this bucket while the engines still load the previous one: the staging
                # buffer is free once that bucket's broadcast has completed.
                tensors = [bucket.flat(self._staging(bucket))] if flattened else list(bucket.tensors)
                if answering is not None:
                    self._await_answers(answering)
                answering = self._send_bucket(members, bucket, tensors, flattened, report)
                if verify != "off":
                    started = time.perf_counter()
                    sums.update(
                        (n, tensor_checksum(n, t, verify)) for n, t in zip(bucket.names, bucket.tensors, strict=True)
                    )
                    checksum_secs += time.perf_counter() - started
            if answering is not None:
                self._await_answers(answering)
        report.phases["transfer"] -= checksum_secs  # the trainer's checksums count as verify time
        report.phases["verify"] = report.phases.get("verify", 0.0) + checksum_secs
        with report.phase("end"):
            if sessions:
                self.fleet.fanout(tuple(sessions), "end", Endpoint.END_WEIGHT_UPDATE, {})
        with report.phase("version"):
            self.fleet.fanout(members, "version", Endpoint.UPDATE_WEIGHT_VERSION, update_weight_version_body(version))
        with report.phase("verify"):
            if verify != "off":
                self._verify(members, sums, verify)
        with report.phase("continue"):
            self.fleet.fanout(members, "continue", Endpoint.CONTINUE_GENERATION, {})
        report.engines = [m.id for m in members]

    def _send_bucket(
        self,
        members: tuple[Member, ...],
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
            group_name=self._active_name,
            weight_version=None,
            flush_cache=False,
            load_format="flattened_bucket" if flattened else None,
        )
        # Connect to every engine before the broadcast starts: gloo relays a broadcast through
        # other ranks, so one dead engine would leave the live ones waiting inside it.
        urls = {m.id: m.url + Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED.value for m in members}
        conns = {i: self.client.pool.submit(self.client.connect, url) for i, url in urls.items()}
        answers = {i: f.result() for i, f in conns.items()}
        opened = {i: c for i, c in answers.items() if not isinstance(c, CallFailure)}
        refused = {i: c.message for i, c in answers.items() if isinstance(c, CallFailure)}
        if refused:
            for conn in opened.values():
                conn.close()
            raise EngineFault("transfer", refused)
        sent = InFlight(
            futures={i: self.client.pool.submit(self.client.send, opened[i], urls[i], body) for i in urls},
            deadline=time.monotonic() + self.timeout_secs,
        )
        assert self._group is not None
        works = [dist.broadcast(t, src=0, group=self._group, async_op=True) for t in tensors]
        self._await_broadcast(works, sent)
        report.bytes += bucket.nbytes
        report.tensors += len(bucket.names)
        report.buckets += 1
        report.collectives += len(works)
        report.http_calls += len(sent.futures)
        return sent

    def _staging(self, bucket: Bucket) -> torch.Tensor:
        """The buffer buckets are flattened into, on their device, kept between buckets and
        pushes (grown as needed)."""
        device = bucket.tensors[0].device
        buf = self._staging_buffer
        if buf is None or buf.numel() < bucket.nbytes or buf.device != device:
            self._staging_buffer = None  # free the old one before allocating the new one
            self._staging_buffer = buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        return buf

    def _await_broadcast(self, works: list[Any], sent: InFlight) -> None:
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
                self._pending = works
                raise EngineFault("transfer", self._culprits(sent.futures, sent.deadline))
            wake.wait(min(until - now, 1.0))
        error: Exception | None = None
        for work in works:
            try:
                work.wait()
            except Exception as exc:  # a peer died: the engines' answers say which
                error = exc
        if error is not None:
            raise EngineFault("transfer", self._culprits(sent.futures, sent.deadline, error))

    def _await_answers(self, sent: InFlight) -> None:
        """Wait for every engine's answer to a bucket whose broadcast has completed."""
        failed = failures(sent.futures, wait_until=sent.deadline)
        if failed or not all(f.done() for f in sent.futures.values()):  # a failure, or silence past the deadline
            raise EngineFault("transfer", self._culprits(sent.futures, sent.deadline))

    def _culprits(self, futures: dict[str, Future], deadline: float, error: Exception | None = None) -> dict[str, str]:
        """Who is at fault: engines that gave no answer (dead, hung) before engines that answered
        with an error (the others fail with 'connection closed by peer' when one dies)."""
        grace = min(deadline, time.monotonic() + 5.0)
        failed = failures(futures, wait_until=grace)
        silent = {i: f"no answer within {self.timeout_secs:.0f}s" for i, f in futures.items() if not f.done()}
        transport = {i: f.message for i, f in failed.items() if f.transport}
        if transport or silent:
            return {**transport, **silent}
        if failed:
            return {i: f.message for i, f in failed.items()}
        return {"rank 0": f"broadcast failed: {error}"}

    def _verify(self, members: tuple[Member, ...], sums: dict[str, str], mode: str) -> None:
        body = {"action": "checksum", "names": list(sums), "mode": mode}
        results = self.fleet.fanout(members, "verify", Endpoint.WEIGHTS_CHECKER, body)
        wrong: dict[str, str] = {}
        for m in members:
            theirs = results[m.id].get("checksums", {}) if isinstance(results[m.id], dict) else {}
            bad = [n for n, s in sums.items() if theirs.get(n) != s]
            if bad:
                wrong[m.id] = f"checksum differs for {len(bad)} tensor(s), first {bad[0]}"
        if wrong:
            raise EngineFault("verify", wrong)

    def _group_info(self) -> dict[str, Any]:
        """The group as the router keeps it for ``pdctl weights status``."""
        return {
            "name": self._active_name,
            "backend": self.backend,
            "world_size": 1 + sum(m.target.gpus for m in self._members),
            "ranks": {m.url: [m.rank_offset, m.rank_offset + m.target.gpus - 1] for m in self._members},
        }

    def load_from_disk(
        self, model_path: str, version: str | None = None, *, refit: RefitMode | str | None = None
    ) -> PushReport:
        """``/update_weights_from_disk`` on every engine under the push's transaction rules (see
        ``Fleet.load_from_disk``); needs no group. Rank 0 only (others return ``pushed=False``)."""
        version = version or f"disk-{next(self._pushes)}"
        if not self.is_pusher:
            return PushReport(version=version, pushed=False)
        return self.fleet.load_from_disk(model_path, version, refit)


def _tensor_source(named_tensors: NamedTensors | Callable[[], NamedTensors]) -> tuple[Callable[[], NamedTensors], bool]:
    """A function returning the pairs, and whether it can be called again (an iterator cannot)."""
    if callable(named_tensors) and not isinstance(named_tensors, Iterable):
        return named_tensors, True
    if isinstance(named_tensors, Iterator):
        box = [named_tensors]

        def once() -> NamedTensors:
            if not box:
                raise WeightSyncError("the tensors were an iterator and were already read; pass a list or a callable")
            return box.pop()

        return once, False
    if isinstance(named_tensors, Mapping):
        return (lambda: named_tensors.items()), True
    return (lambda: named_tensors), True
