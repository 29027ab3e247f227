"""``WeightSync``: trainer rank 0 pushes weights into every prefill and decode engine.

Three parts: the flat broadcast group (``pdctl.weights.group``), the buckets over it
(``pdctl.weights.transaction``) and, around them here, what a push is as a whole:

    probe     GET /server_info on every engine; rebuild the group if the engine set changed
    ...       the transaction: with a router, the router's own fleet transaction
              (pdctl.weights.routed: open, buckets through the router, commit), the one that RL
              frameworks' updates and ``pdctl weights load`` run through too; without one,
              pause, begin, buckets, end, version, verify, continue from here

With a router: the push holds new requests (drain: once those in flight are done; interrupt: the
router aborts them and continues them after the update), with a lease the trainer renews; at its
end, engines that did not get the whole version stay out of rotation until a later push reaches
them, engines it never changed serve on.

Failure: an engine that dies or refuses, or does not answer within ``timeout_secs``, fails the
push with ``WeightSyncError`` naming it and the phase. Before raising, when the tensors can be
read again (a list, a dict's items, anything that is not a one-shot iterator), the push is redone
on the surviving engines over a rebuilt group, within the same hold, so the fleet keeps serving a
complete version; the failed engine stays out of rotation until a later push (which rebuilds the
group to take it back in). An exception or a Ctrl-C in the trainer aborts the push at once. A
trainer killed mid-push stops renewing the lease: the router then ends the push as failed, and
the next trainer's ``connect`` clears what the dead one left open on the engines (session, group).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from pdctl.choices import parse_choice
from pdctl.errors import WeightSyncError
from pdctl.refit import DEFAULT_HOLD_TIMEOUT_SECS, DEFAULT_LEASE_SECS, RefitMode
from pdctl.sglang import DEFAULT_GROUP_NAME, Endpoint
from pdctl.weights.env import (
    API_KEY_ENV_ENV,
    CONTROL_KEY_ENV,
    DEFAULT_BUCKET_MB,
    ENGINE_KEY_ENV,
    READY_TIMEOUT_ENV,
    ROUTER_URL_ENV,
    WEIGHT_GROUP_ENV,
    WeightGroupEnv,
)
from pdctl.weights.fleet import EngineTarget, Fleet, Member, refit_mode
from pdctl.weights.group import BroadcastGroup
from pdctl.weights.modes import LoadFormat, VerifyMode
from pdctl.weights.phase import EngineFault, Failure, Phase
from pdctl.weights.report import PushReport
from pdctl.weights.routed import RouterPush
from pdctl.weights.transaction import NamedTensors, Transaction

log = logging.getLogger("pdctl.weights")
MIB = 1024 * 1024


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
        engine_key: str | None = None,
        timeout_secs: float = 120.0,
        pause_mode: str = "retract",
        verify: VerifyMode | str = VerifyMode.AUTO,
        load_format: LoadFormat | str = LoadFormat.AUTO,
        recover: bool = True,
        lease_secs: float = DEFAULT_LEASE_SECS,
        hold_timeout_secs: float = DEFAULT_HOLD_TIMEOUT_SECS,
        rank: int | None = None,
        ready_timeout_secs: float = 0.0,
        refit: RefitMode | str = RefitMode.DRAIN,
        max_staleness: int | None = None,
        follow_router: bool = False,
    ):
        try:
            verify = parse_choice(VerifyMode, verify, "verify")
            load_format = parse_choice(LoadFormat, load_format, "load_format")
        except ValueError as exc:
            raise WeightSyncError(str(exc)) from None
        self.fleet = Fleet(
            engines,
            router_url=router_url,
            api_key=api_key,
            engine_key=engine_key,
            timeout_secs=timeout_secs,
            pause_mode=pause_mode,
            lease_secs=lease_secs,
            hold_timeout_secs=hold_timeout_secs,
            refit=refit,
            max_staleness=max_staleness,
            follow_router=follow_router,
        )
        self.group = BroadcastGroup(
            self.fleet,
            master_address=master_address,
            master_port=int(master_port),
            backend=backend,
            group_name=group_name,
            timeout_secs=timeout_secs,
        )
        self.transaction = Transaction(
            self.fleet,
            self.group,
            bucket_bytes=max(1, int(bucket_mb * MIB)),
            verify=verify,
            load_format=load_format,
            timeout_secs=timeout_secs,
        )
        self.recover = recover
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.ready_timeout_secs = ready_timeout_secs
        self._pushes = itertools.count(1)

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
        kwargs["follow_router"] = True  # `pdctl apply` changes the engine set; the next push follows
        try:
            kwargs["ready_timeout_secs"] = float(env.get(READY_TIMEOUT_ENV) or 0)
        except ValueError as exc:
            raise WeightSyncError(f"${READY_TIMEOUT_ENV} is not a number of seconds: {exc}") from exc
        key_var = env.get(API_KEY_ENV_ENV)  # the router's client key (clusters up before control keys)
        kwargs["api_key"] = env.get(CONTROL_KEY_ENV) or (env.get(key_var) if key_var else None)
        kwargs["engine_key"] = env.get(ENGINE_KEY_ENV) or None
        kwargs.update(options)
        return cls(**kwargs)

    @property
    def is_pusher(self) -> bool:
        """True on trainer rank 0, the only rank that talks to the engines."""
        return self.rank == 0

    @property
    def members(self) -> tuple[Member, ...]:
        """The engines in the current group (empty before ``connect``)."""
        return self.group.members

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
        live, infos = self.fleet.probe(PushReport(version="connect"))
        self.group.build(live, infos)
        return self

    def close(self) -> None:
        """Destroy the group on the engines and here. Idempotent; rank 0 only does anything."""
        if self.is_pusher:
            self.group.destroy_on_engines()
        self.group.drop()
        self.fleet.close()

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
        with report.phase(Phase.PROBE):
            live, infos = self.fleet.probe(report)
            if not self.group.is_current(live, infos):
                if self.group.process_group is not None:
                    log.warning("weights: the engine set changed; rebuilding the group")
                try:
                    self.group.build(live, infos)
                except WeightSyncError as exc:
                    exc.report = report
                    raise
        members = self.group.members
        if self.fleet.router_url:
            self._push_through_router(members, source if reusable else None, source, report, mode)
        else:
            try:
                self.transaction.run(members, source, version, report)
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
            report.phases.get(Phase.TRANSFER.value, 0.0),
        )
        return report

    def _push_through_router(
        self,
        members: tuple[Member, ...],
        again: Callable[[], NamedTensors] | None,
        source: Callable[[], NamedTensors],
        report: PushReport,
        refit: RefitMode,
    ) -> None:
        """The push as the router's fleet transaction (pdctl.weights.routed). ``again``: the
        tensors once more, for a redo on the engines that survive a failure (None: an iterator)."""
        push = RouterPush(self.fleet, report, refit)
        push.open()
        try:
            try:
                self.transaction.run_routed(members, source, report, push)
            except EngineFault as fault:
                self._redo(fault, members, again, report, push)
        except BaseException as exc:  # an error or a Ctrl-C here: the router ends it as failed
            push.abort(f"the trainer's push stopped: {type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            push.close()

    def _redo(
        self,
        fault: EngineFault,
        members: tuple[Member, ...],
        source: Callable[[], NamedTensors] | None,
        report: PushReport,
        push: RouterPush,
    ) -> None:
        """After ``fault`` in a push the router runs: record the culprits, then, within the same
        hold, redo the push on the survivors over a group built again, or abort it."""
        _record_culprits(fault, report)
        self.group.abandon()  # a bucket failed: the group is unusable on every rank
        culprits = ", ".join(fault.culprits)
        survivors = {m.id for m in members if m.id not in fault.culprits}
        if not (self.recover and survivors and source is not None and "router" not in fault.culprits):
            push.abort(f"{culprits} failed in {fault.phase}")
            return
        report.retried = True
        try:
            live, infos = self.fleet.probe(report)
            alive = [e for e in live if e.id in survivors]
            if not alive:
                push.abort(f"{culprits} failed in {fault.phase}; no other engine answers")
                return
            push.redo([e.url for e in alive])
            self.group.build(alive, infos)
            self.transaction.run_routed(self.group.members, source, report, push)
        except (EngineFault, WeightSyncError) as failed:
            _record_retry_failure(failed, report)
            self.group.abandon()
            push.abort(f"{culprits} failed in {fault.phase}, then in the redo: {failed}")

    def _recover(
        self,
        fault: EngineFault,
        members: tuple[Member, ...],
        source: Callable[[], NamedTensors] | None,
        version: str,
        report: PushReport,
    ) -> None:
        """After ``fault`` in a push with no router: record the culprits, then get the survivors
        to a complete version if possible."""
        _record_culprits(fault, report)
        survivors = [m for m in members if m.id not in fault.culprits]
        if fault.phase in (Phase.VERIFY, Phase.CONTINUE):  # every bucket is in: the survivors hold the version
            self.fleet.fanout_quiet(survivors, Endpoint.CONTINUE_GENERATION, {})
            report.engines = [m.id for m in survivors]
            return
        if fault.phase is Phase.TRANSFER:
            self.group.abandon()  # a collective failed: the group is unusable on every rank
        self.fleet.fanout_quiet(survivors, Endpoint.END_WEIGHT_UPDATE, {})
        if self.recover and survivors and source is not None:
            try:
                report.retried = True
                live, infos = self.fleet.probe(report)
                alive = [e for e in live if e.id in {m.id for m in survivors}]
                if alive:
                    self.group.build(alive, infos)
                    self.transaction.run(self.group.members, source, version, report)
                    return
            except (EngineFault, WeightSyncError) as again:
                _record_retry_failure(again, report)
                self.group.abandon()
        for m in survivors:  # their weights may be partial: out of rotation until a later push
            report.failed.setdefault(
                m.id, Failure(m.id, fault.phase, f"left with partial weights when {', '.join(fault.culprits)} failed")
            )
        self.fleet.fanout_quiet(survivors, Endpoint.CONTINUE_GENERATION, {})

    def load_from_disk(
        self, model_path: str, version: str | None = None, *, refit: RefitMode | str | None = None
    ) -> PushReport:
        """``/update_weights_from_disk`` on every engine under the push's transaction rules (see
        ``Fleet.load_from_disk``); needs no group. Rank 0 only (others return ``pushed=False``)."""
        version = version or f"disk-{next(self._pushes)}"
        if not self.is_pusher:
            return PushReport(version=version, pushed=False)
        return self.fleet.load_from_disk(model_path, version, refit)


def _record_culprits(fault: EngineFault, report: PushReport) -> None:
    """The engines ``fault`` names go into ``report.failed`` (and the log), whatever they had before."""
    for engine, failure in fault.failures().items():
        report.failed[engine] = failure
        log.error("weights %s: engine %s failed in %s: %s", report.version, engine, failure.phase, failure.reason)


def _record_retry_failure(failed: EngineFault | WeightSyncError, report: PushReport) -> None:
    """What failed the redo on the survivors goes into ``report.failed``, unless an engine already
    failed before it (its first reason stands)."""
    if isinstance(failed, EngineFault):
        for engine, failure in failed.failures(retry=True).items():
            report.failed.setdefault(engine, failure)
        return
    engine = failed.engine or "rank 0"
    report.failed.setdefault(engine, Failure(engine, Phase(failed.phase or Phase.CONNECT), str(failed), True))


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
