"""The weight-update process group exactly as SGLang builds it.

SGLang (``utils/common.py`` ``init_custom_process_group``) rendezvouses over TCP, wraps the
store in ``PrefixStore(group_name)`` and creates a non-default group. Both sides must do the
same or the store keys differ and the rendezvous hangs, so the sim (engine side) and
``pdctl.weights`` (trainer side) both use this function. It never touches the default group,
so a trainer under torchrun keeps its own.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, cast

import psutil
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def init_custom_process_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_secs: float = 300.0,
) -> dist.ProcessGroup:
    """Join the flat group as ``rank``; blocks until all ``world_size`` ranks have joined.

    Rank 0 hosts the TCP store. Each side must call this concurrently with the others.
    """
    timeout = timedelta(seconds=timeout_secs)
    init_method = f"tcp://{_url_host(master_address)}:{master_port}"
    # Under torchrun, TORCHELASTIC_USE_AGENT_STORE=True makes a tcp:// rendezvous join the
    # agent's store instead of hosting its own: rank 0 would wait forever (AReaL sets it False).
    saved = os.environ.get(AGENT_STORE_ENV)
    os.environ[AGENT_STORE_ENV] = "False"
    try:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    finally:
        if saved is None:
            os.environ.pop(AGENT_STORE_ENV, None)
        else:
            os.environ[AGENT_STORE_ENV] = saved
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    with _gloo_interface_towards(master_address if backend == "gloo" else None):
        group, _ = _new_process_group_helper(
            # group_name: torch 2.13 types it as the NewType GroupName, older torch as str; both take a str
            world_size,
            rank,
            [],
            Backend(backend),
            prefixed,
            group_name=cast(Any, group_name),
            timeout=timeout,
        )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


@contextlib.contextmanager
def _gloo_interface_towards(master_address: str | None) -> Iterator[None]:
    """Gloo binds to the address its host name resolves to, which on many hosts (and in network
    namespaces) is 127.0.0.1: peers on other hosts are then told to connect to their own
    loopback. Unless GLOO_SOCKET_IFNAME is set, use the interface that routes to the master."""
    name = None if master_address is None or os.environ.get(GLOO_IFNAME_ENV) else interface_towards(master_address)
    if name is None:
        yield
        return
    os.environ[GLOO_IFNAME_ENV] = name
    try:
        yield
    finally:
        os.environ.pop(GLOO_IFNAME_ENV, None)


def interface_towards(address: str) -> str | None:
    """The local network interface whose address routes to ``address`` (None if none does)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:  # UDP connect sends nothing
            probe.connect((address.strip("[]"), 9))
            local = probe.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addrs):
            return name
    return None


def destroy_group(group: dist.ProcessGroup) -> None:
    """Tear down a group made by init_custom_process_group."""
    dist.destroy_process_group(group)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
