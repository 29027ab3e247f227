"""An RL framework's trainer rank 0 as it drives SGLang engines over HTTP (prior-art.md section 9),
byte for byte, pointed at pdctl's router: the calls AReaL 1.0.4 sends (``areal/engine/sglang_remote.py``
and ``areal/engine/fsdp_engine.py``), skyrl-train 0.3.1's one-parameter form, and a gloo broadcast
from rank 0 of the group the engines join. A stand-in for the frameworks' own code where they cannot
run here (tests/frameworks runs AReaL's own client)."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import urllib.error
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pdctl.sglang.group import destroy_group, init_custom_process_group
from tests.helpers import free_port, post, sse


@dataclass
class Trainer:
    """Rank 0 of a weight group of ``world_size`` that the router's fleet joins at ``rank_offset``."""

    router: str
    world_size: int
    group_name: str = "update_weight_group"
    rank_offset: int = 1
    port: int = field(default_factory=free_port)
    group: Any = None
    pool: cf.ThreadPoolExecutor = field(default_factory=lambda: cf.ThreadPoolExecutor(4))

    def init(self, timeout_secs: float = 60) -> tuple[int, Any]:
        """AReaL's init: the HTTP call and its own rendezvous at once (the call blocks until both)."""
        body = {
            "master_address": "127.0.0.1",
            "master_port": str(self.port),  # AReaL sends it as a string
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "backend": "gloo",
            "group_name": self.group_name,
        }
        answer = self.pool.submit(post, self.router + "/init_weights_update_group", body, timeout=timeout_secs + 30)
        self.group = init_custom_process_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=self.port,
            world_size=self.world_size,
            rank=0,
            group_name=self.group_name,
            timeout_secs=timeout_secs,
        )
        return answer.result()

    def bucket(self, named: list[tuple[str, torch.Tensor]], *, single: bool = False, **extra: Any) -> tuple[int, Any]:
        """One bucket: the update call sent, then the broadcast in ``names`` order, then its answer
        (AReaL's ``_update_bucket_weights_from_distributed``). ``single``: skyrl-train's
        ``{name, dtype, shape}`` (one tensor, no group name)."""
        if single:
            ((name, tensor),) = named
            body: dict[str, Any] = {
                "name": name,
                "dtype": str(tensor.dtype).split("torch.")[1],
                "shape": list(tensor.shape),
            }
        else:
            body = {
                "names": [n for n, _ in named],
                "dtypes": [str(t.dtype).split("torch.")[1] for _, t in named],
                "shapes": [list(t.shape) for _, t in named],
                "group_name": self.group_name,
                "abort_all_requests": True,
                **extra,
            }
        answer = self.pool.submit(post, self.router + "/update_weights_from_distributed", body, timeout=120)
        works = [dist.broadcast(t.detach(), src=0, group=self.group, async_op=True) for _, t in named]
        for w in works:
            w.wait()
        return answer.result()

    def push(self, tensors: Iterable[tuple[str, torch.Tensor]], per_bucket: int = 3, **extra: Any) -> list:
        named = list(tensors)
        return [self.bucket(named[i : i + per_bucket], **extra) for i in range(0, len(named), per_bucket)]

    def close(self) -> None:
        if self.group is not None:
            destroy_group(self.group)
            self.group = None
        self.pool.shutdown(wait=False, cancel_futures=True)


class Load:
    """Closed-loop clients through the router until ``stop``: every answer's status, finish reason
    and weight version, and the failures (a status other than 200, a broken stream)."""

    def __init__(self, url: str, clients: int = 4, max_new_tokens: int = 24):
        self.url = url
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.failures: list[Any] = []
        self.finishes: Counter = Counter()
        self.versions: Counter = Counter()
        self.answers = 0
        self.body = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=120)

    def _client(self, i: int) -> None:
        while not self.stop_event.is_set():
            body = {"text": f"load {i}", **self.body}
            try:
                if i % 2:
                    events = sse(self.url + "/generate", {**body, "stream": True}, timeout=120)
                    chunks = [e for e in events if e != "[DONE]"]
                    if events[-1] != "[DONE]" or any("error" in c for c in chunks):
                        self._failed(events[-2:])
                        continue
                    result = chunks[-1]
                else:
                    status, result = post(self.url + "/generate", body, timeout=120)
                    if status != 200:
                        self._failed((status, result))
                        continue
            except urllib.error.HTTPError as exc:  # the router's refusal: keep its reason
                self._failed((exc.code, exc.read().decode(errors="replace")))
                continue
            except Exception as exc:  # a broken stream or connection is a failure too
                self._failed(repr(exc))
                continue
            meta = result["meta_info"]
            with self.lock:
                self.answers += 1
                self.finishes[meta["finish_reason"]["type"]] += 1
                self.versions[meta["weight_version"]] += 1

    def _failed(self, what: Any) -> None:
        with self.lock:
            self.failures.append(what)
