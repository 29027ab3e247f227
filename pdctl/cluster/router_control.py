"""The router's operator endpoints as the control plane calls them (cordon, register, remove,
refresh, read a worker), with the cluster's keys; and where the router's client key comes from."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

from pdctl.cluster.keys import ClusterKeys, load_keys
from pdctl.cluster.state import ClusterState, StateStore
from pdctl.errors import LifecycleError
from pdctl.roles import Role
from pdctl.weights.client import CallFailure, JsonClient

CORDON_PATH = "/pdctl/cordon"
DRAIN_TIMEOUT_SECS = 600.0


def secret_env(name: str | None) -> dict[str, str]:
    """The router's API key (in variable ``name``), read from the control machine's environment;
    never logged or saved. The router and the trainer get it (``PDCTL_API_KEY_ENV`` names it for
    ``WeightSync.from_env``)."""
    if not name:
        return {}
    value = os.environ.get(name)
    if not value:
        raise LifecycleError(f"router.api_key_env is {name} but ${name} is unset or empty on this machine")
    return {name: value}


def router_client_key(state: ClusterState) -> str | None:
    """The router's client key (from the variable ``router.api_key_env`` names), or None."""
    return next(iter(secret_env(state.plan.api_key_env).values()), None)


class RouterControl:
    """The router's operator endpoints (``of``: a cluster's router, with the cluster's keys)."""

    def __init__(self, url: str, key: str | None, keys: ClusterKeys | None = None):
        """The router at ``url``, called with ``key``; ``keys``: the cluster's, whose engine key an
        engine registered live is given (None: a router of one's own, no keys to hand on)."""
        self.keys = keys
        self.client = JsonClient(api_key=key, timeout_secs=DRAIN_TIMEOUT_SECS + 30)
        self.url = url
        self.handed_off: dict[str, int] = {}
        """Per worker URL, the requests this command's cordons with ``handoff`` took back from it."""

    @classmethod
    def of(cls, state: ClusterState, store: StateStore | None = None) -> RouterControl:
        """The cluster's router, with its control-plane key (or, for a cluster brought up before
        pdctl made keys, the router's client key)."""
        keys = load_keys(store or StateStore(), state.name)
        return cls(state.router_url or "", keys.control if keys else router_client_key(state), keys)

    def cordon(
        self, worker_url: str, on: bool, *, wait: bool = True, reason: str = "pdctl restart", handoff: bool = False
    ) -> dict[str, Any]:
        """Cordon the worker (``on``) or lift its cordon, and return the router's answer; raises
        ``LifecycleError`` when the router does not do it. A cordon answers once the worker's
        requests have finished (``wait``; up to ``DRAIN_TIMEOUT_SECS``), or at once; ``handoff``:
        the PD requests queued at a prefill are sent to other pairs instead (a role switch's
        drain; pdctl.router.legs ``Legs.hand_off``)."""
        timeout = DRAIN_TIMEOUT_SECS if wait else 0
        body: dict[str, Any] = {"url": worker_url, "cordon": on, "reason": reason, "timeout_secs": timeout}
        if handoff:
            body["handoff"] = True
        answer = self.client.post(self.url + CORDON_PATH, body)
        if isinstance(answer, CallFailure) or not isinstance(answer, dict):
            raise LifecycleError(
                f"the router at {self.url} did not {'cordon' if on else 'uncordon'} {worker_url}: {answer}"
            )
        handed = answer.get("handed_off")
        if handoff and isinstance(handed, int) and handed > 0:
            self.handed_off[worker_url] = self.handed_off.get(worker_url, 0) + handed
        return answer

    def uncordon_listed(self, worker_url: str) -> None:
        """Lift the worker's cordon; a worker the router does not list (404) is fine. Raises
        ``LifecycleError`` on any other failure (no answer, refused): only the router saying the
        worker is gone makes a cordon nothing to lift."""
        body = {"url": worker_url, "cordon": False}
        answer = self.client.post(self.url + CORDON_PATH, body)
        if isinstance(answer, CallFailure) and answer.status != 404:
            raise LifecycleError(f"the router at {self.url} did not uncordon {worker_url}: {answer}")

    def add(self, worker_url: str, role: Role, bootstrap_port: int | None) -> None:
        """Register the engine with the router in ``role`` (with the engine key, when the cluster has
        keys); raises ``LifecycleError`` when the router does not take it."""
        body: dict[str, Any] = {"url": worker_url, "worker_type": role.value, "bootstrap_port": bootstrap_port}
        if self.keys is not None:  # what the router sends the new engine (a worker added live gets no key unasked)
            body["api_key"] = self.keys.engine
        answer = self.client.post(self.url + "/workers", body)
        if isinstance(answer, CallFailure):
            raise LifecycleError(f"the router at {self.url} did not register {worker_url}: {answer}")

    def remove(self, worker_url: str) -> None:
        """Unregister the worker; one the router does not know is fine. Raises ``LifecycleError`` when
        the router does not remove it."""
        answer = self.client.call("DELETE", self.url + "/workers/" + quote(worker_url, safe=""))
        if isinstance(answer, CallFailure) and answer.status != 404:
            raise LifecycleError(f"the router at {self.url} did not remove {worker_url}: {answer}")

    def refresh(self, worker_url: str | None = None) -> None:
        """A health round now (``/pdctl/refresh``), of every worker or of ``worker_url`` only: a
        worker just registered is checked at once rather than at the router's next check. Best
        effort: the loop checks it anyway."""
        self.client.post(self.url + "/pdctl/refresh", {"url": worker_url} if worker_url else {})

    def worker(self, worker_url: str) -> dict[str, Any] | None:
        """The router's record of the worker, or ``None`` when it does not list it or could not be
        asked."""
        answer = self.client.get(self.url + "/workers")
        if isinstance(answer, CallFailure) or not isinstance(answer, dict):
            return None
        return next((w for w in answer.get("workers", []) if w.get("url") == worker_url), None)
