"""Routing policies behind one interface; ``make_policy(name)`` looks them up by name."""

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


def make_policy(name: str, **options: Any) -> Policy:
    """A new policy instance; raises ValueError listing the valid names."""
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(REGISTRY))}") from None
    accepted = cls.__init__.__code__.co_varnames[1 : cls.__init__.__code__.co_argcount]
    return cls(**{k: v for k, v in options.items() if k in accepted})


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
]
