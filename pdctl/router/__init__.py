"""The embedded PD router (``pdctl router``; started by ``pdctl up``)."""

from pdctl.router.app import RouterServer
from pdctl.router.config import RouterConfig, WorkerSpec
from pdctl.router.policies import REGISTRY, make_policy
from pdctl.router.workers import Worker, WorkerRegistry

__all__ = [
    "REGISTRY",
    "RouterConfig",
    "RouterServer",
    "Worker",
    "WorkerRegistry",
    "WorkerSpec",
    "make_policy",
]
