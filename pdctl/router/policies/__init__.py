"""Routing policies behind one interface, looked up by name (``policy_class``, ``make_policy``)."""

from __future__ import annotations

from typing import Any

from pdctl.router.policies.base import Policy, RequestContext
from pdctl.router.policies.cache_aware import CacheAwarePolicy
from pdctl.router.policies.keyed import ConsistentHashingPolicy, ManualPolicy, PrefixHashPolicy
from pdctl.router.policies.simple import PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy

REGISTRY: dict[str, type[Policy]] = {
    p.name: p
    for p in (
        RandomPolicy,
        RoundRobinPolicy,
        PowerOfTwoPolicy,
        CacheAwarePolicy,
        ManualPolicy,
        ConsistentHashingPolicy,
        PrefixHashPolicy,
    )
}


def policy_class(name: str) -> type[Policy]:
    """The policy called ``name``; raises ValueError listing the valid names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(REGISTRY))}") from None


def make_policy(name: str, **options: Any) -> Policy:
    """A new policy with these constructor options (TypeError for one it does not take)."""
    return policy_class(name)(**options)


__all__ = [
    "REGISTRY",
    "CacheAwarePolicy",
    "ConsistentHashingPolicy",
    "ManualPolicy",
    "Policy",
    "PowerOfTwoPolicy",
    "PrefixHashPolicy",
    "RandomPolicy",
    "RequestContext",
    "RoundRobinPolicy",
    "make_policy",
    "policy_class",
]
