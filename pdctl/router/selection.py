"""Selection: which prefill and decode (or which regular engine) serve a request.

The workers in rotation (healthy, breaker closed, not quarantined or cordoned), narrowed to one
weight version when a continuation must stay on the version its tokens came from; a prefill and
its decode always share a weight version. A ``RouteError`` (503) names what is missing.
"""

from __future__ import annotations

import operator
from typing import Any

from pdctl.roles import Role
from pdctl.router import errors
from pdctl.router.config import RouterConfig
from pdctl.router.errors import RouteError
from pdctl.router.metrics import RouterMetrics
from pdctl.router.pair_room import PairRoom
from pdctl.router.policies import RequestContext, policy_class
from pdctl.router.workers import Worker, WorkerRegistry

PREFILL, DECODE = Role.PREFILL, Role.DECODE  # (an enum member read from its class costs ~0.1 us on 3.11)
_VERSION = operator.attrgetter("weight_version")


class Selector:
    """Picks the workers for a request: a prefill and a decode on one weight version for PD, or a regular worker, each
    by its role's policy among the workers in rotation."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics):
        self.registry = registry
        self.metrics = metrics
        self.prefill_policy = policy_class(config.prefill_policy or config.policy).from_config(config)
        self.decode_policy = policy_class(config.decode_policy or config.policy).from_config(config)
        self.regular_policy = policy_class(config.policy).from_config(config)
        self.pd_needs_text = self.prefill_policy.needs_text or self.decode_policy.needs_text
        self._pairing: tuple[list[Worker], list[Worker], _Pairing] | None = None
        """The pairing of the last routable lists seen (the registry makes new lists on a change)."""
        self.room: PairRoom | None = None
        """Late pairing's queue (pdctl.router.pair_room): a pair is chosen among engines with room."""

    def context(self, body: dict[str, Any], routing_key: str | None, *, pd: bool) -> RequestContext:
        """What the policies read of a request (its text only for those that hash or match it)."""
        needs_text = self.pd_needs_text if pd else self.regular_policy.needs_text
        if not needs_text and routing_key is None:
            return _NOTHING  # (frozen: one for every request that carries nothing a policy reads)
        return RequestContext(text=text_of(body) if needs_text else None, routing_key=routing_key)

    def pair(self, ctx: RequestContext, version: str | None = None) -> tuple[Worker, Worker]:
        """A prefill and a decode on the same weight version (``version`` when given)."""
        prefills = self.registry.routable(PREFILL)
        if version is not None:
            prefills = [p for p in prefills if p.weight_version == version]
        if not prefills:
            raise RouteError(503, errors.NO_PREFILL, "No prefill workers available" + self._why_none(Role.PREFILL))
        decodes = self.registry.routable(DECODE)
        if not decodes:
            raise RouteError(503, errors.NO_DECODE, "No decode workers available" + self._why_none(Role.DECODE))
        last = self._pairing
        if last is not None and last[0] is prefills and last[1] is decodes:
            pairing = last[2]
        else:
            pairing = _Pairing(prefills, decodes)
            if version is None:  # (a version's prefills are a new list each time: not kept)
                self._pairing = (prefills, decodes, pairing)
        versions, pairable = pairing.versions, pairing.prefills
        if not pairable:
            raise RouteError(
                503,
                errors.VERSION_MISMATCH,
                "no prefill and decode share a weight version "
                f"(prefill {sorted(map(str, {p.weight_version for p in prefills}))}, "
                f"decode {sorted(map(str, versions))})",
            )
        room = self.room
        if room is not None:
            pairable = room.with_room(PREFILL, pairable)
        prefill = _chosen(self.prefill_policy.select(pairable, ctx), PREFILL)
        same = decodes if len(versions) == 1 else pairing.decodes_on(prefill.weight_version)
        if room is not None:
            same = room.with_room(DECODE, same)
        decode = _chosen(self.decode_policy.select(same, ctx), DECODE)
        self.metrics.selected(prefill, decode)
        return prefill, decode

    def regular(self, ctx: RequestContext, version: str | None = None) -> Worker:
        """A regular engine (``version``'s when given)."""
        workers = self.registry.routable(Role.REGULAR)
        if version is not None:
            workers = [w for w in workers if w.weight_version == version]
        if not workers:
            raise RouteError(503, errors.NO_WORKERS, "No healthy workers available" + self._why_none(Role.REGULAR))
        return _chosen(self.regular_policy.select(workers, ctx), Role.REGULAR)

    def _why_none(self, role: Role) -> str:
        held = [w for w in self.registry.of_role(role) if w.quarantined]
        if held:
            return f" ({len(held)} out of rotation for their weights: {held[0].quarantined})"
        return " (none healthy)"


class _Pairing:
    """Which of ``prefills`` have a decode on their version, and each version's decodes."""

    __slots__ = ("_by_version", "decodes", "prefills", "versions")

    def __init__(self, prefills: list[Worker], decodes: list[Worker]):
        self.decodes = decodes
        self.versions = set(map(_VERSION, decodes))  # (C calls: no comprehension frame)
        if self.versions.issuperset(map(_VERSION, prefills)):
            self.prefills = prefills
        else:
            self.prefills = [p for p in prefills if p.weight_version in self.versions]
        self._by_version: dict[str | None, list[Worker]] = {}

    def decodes_on(self, version: str | None) -> list[Worker]:
        found = self._by_version.get(version)
        if found is None:
            found = self._by_version[version] = [d for d in self.decodes if d.weight_version == version]
        return found


_NOTHING = RequestContext()


def _chosen(worker: Worker | None, role: Role) -> Worker:
    if worker is None:  # a policy must choose among the workers it is given
        raise RouteError(503, errors.NONE_CHOSEN, f"the {role} policy chose no worker")
    return worker


def text_of(body: dict[str, Any]) -> str | None:
    """A request's prompt text, for policies that hash or match it."""
    for key in ("text", "prompt"):
        value = body.get(key)
        if isinstance(value, str):
            return value
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    return None
