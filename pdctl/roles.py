"""The vocabulary every layer shares: what a process is (topology, plan, cluster, router)."""

from __future__ import annotations

from pdctl.choices import Choice


class Role(Choice):
    """What a process is. ``prefill``/``decode`` are PD engines, ``regular`` a non-PD engine.

    A ``str`` enum: it compares equal to, and serializes as, its value (state files, the
    router's ``worker_type``)."""

    PREFILL = "prefill"
    DECODE = "decode"
    REGULAR = "regular"
    ROUTER = "router"
    TRAINER = "trainer"

    @property
    def is_engine(self) -> bool:
        """True for the engine roles: prefill, decode and regular."""
        return self in ENGINE_ROLES


ENGINE_ROLES = (Role.REGULAR, Role.PREFILL, Role.DECODE)
"""The roles of engines, and so of router workers."""


def engine_role(value: object) -> Role:
    """An engine role from untrusted text (a router's ``worker_type``); ValueError names the valid ones."""
    for role in ENGINE_ROLES:
        if value == role.value:
            return role
    raise ValueError(f"worker_type must be one of {', '.join(r.value for r in ENGINE_ROLES)}")


class RestartPolicy(Choice):
    """The topology's ``restart:`` on engine groups, the router and the trainer (systemd's words);
    the node's supervisor (pdctl.node.supervise) applies it."""

    ON_FAILURE = "on-failure"
    NEVER = "never"
