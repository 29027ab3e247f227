"""A client request as the router serves it: what was asked, how it is routed, and where its
attempts stand. Made by the dispatcher, read by the attempt loop, the relay and the
continuation (nothing here imports them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdctl.router.policies import RequestContext
from pdctl.router.resume import Job
from pdctl.router.shaping import Headers


@dataclass(eq=False, slots=True)
class ClientRequest:
    """One client request as the dispatcher serves it."""

    path: str
    body: dict[str, Any]
    ctx: RequestContext
    headers: Headers
    pd: bool
    batch: int | None = None
    stream: bool = False
    with_logprobs: bool = False
    sent: int = 0
    """The refit gate's epoch when the latest attempt was sent."""
    waits_until: float | None = None
    """Its deadline for a worker to come into rotation, once it found a role with none."""
    _job: Job | bool | None = field(default=False, repr=False)  # False: not read yet

    @property
    def job(self) -> Job | None:
        """The request as a /generate job that can be continued (read only when needed)."""
        if self._job is False:
            self._job = Job.of(self.path, self.body)
        return self._job  # type: ignore[return-value]
