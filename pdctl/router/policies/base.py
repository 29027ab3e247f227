"""Policy: pick one worker from a list of candidates (already healthy, same role, same version)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pdctl.router.config import RouterConfig
    from pdctl.router.workers import Worker


@dataclass(frozen=True)
class RequestContext:
    """What a policy may look at: the request's text (cache_aware, prefix_hash) and the
    client's routing key (``X-SMG-Routing-Key``: manual, consistent_hashing), if any."""

    text: str | None = None
    routing_key: str | None = None


class Policy(ABC):
    """How the router picks one worker among candidates of one role. ``name`` is the policy's setting (``--policy``);
    ``needs_text`` says whether ``select`` reads the request's text, which the router then extracts."""

    name: ClassVar[str]
    needs_text: ClassVar[bool] = False

    @abstractmethod
    def select(self, workers: list[Worker], ctx: RequestContext) -> Worker | None:
        """One of ``workers`` (non-empty), or None when none is acceptable."""

    @classmethod
    def from_config(cls, config: RouterConfig) -> Policy:
        """The policy as the router's settings configure it (most have no settings)."""
        return cls()
