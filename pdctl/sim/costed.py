"""The costed sim's scheduler parts (``--sim-profile``): a KV pool counted in tokens with a
prefix cache, the time each round of the scheduler waits, and a forward pass that costs
nothing to compute.

Admission follows SGLang's scheduler in what a planner can see: a request starts only when the
pool holds its uncached prompt and its whole output (``max_new_tokens``, clipped to the
context): SGLang starts on an estimate and retracts when it guessed wrong, the sim reserves the
worst case and never retracts; the difference is how full the pool runs, not whether requests
queue when it is full. Cached tokens (pdctl.sim.prefix_cache) need no prefill and are reported
as ``cached_tokens``; a finished request's tokens are cached, and the least recently used are
evicted when a new request needs room.

The forward pass is a stand-in (``StandInForward``): each next token is a fixed function of the
last one, never a special token, so output lengths are exactly ``max_new_tokens`` (set
``ignore_eos`` or not: a profile engine never stops early). Timing and queueing are the point of
a profile; numerics are the plain sim's (without ``--sim-profile``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pdctl.gpu_profiles import SimProfile
from pdctl.sim.model import BYTE_VOCAB, DTYPE, KVPool, SimModelConfig
from pdctl.sim.prefix_cache import PrefixCache, _Node


class NoKV(KVPool):
    """The KV pool of a profile engine: nothing is stored (the stand-in forward reads none)."""

    def __init__(self) -> None:  # (no tensors: a profile engine's pool may hold 1,024 requests)
        self.slots = 0
        self.k = self.v = torch.zeros(0, dtype=DTYPE)

    def write(self, slot: int, kv: torch.Tensor) -> None:
        """Store nothing (a profile engine keeps no KV tensors)."""
        pass

    def move(self, src: int, dst: int, length: int) -> None:
        """Move nothing (a profile engine keeps no KV tensors)."""
        pass


class StandInForward:
    """TinyLM's ``prefill``/``decode_step`` at no cost: logits from a fixed table by last token."""

    def __init__(self, config: SimModelConfig, context: int):
        self.config = _Context(config, context)
        generator = torch.Generator().manual_seed(config.seed)
        table = torch.randn((config.vocab_size, config.vocab_size), generator=generator, dtype=DTYPE)
        table[:, BYTE_VOCAB:] = -1e9  # never a special token: outputs run to max_new_tokens
        self._table = table
        self._empty_kv = torch.zeros((config.layers, 2, config.heads, 0, config.head_dim), dtype=DTYPE)

    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits for every prompt position, read from the fixed table, and an empty KV (zero positions)."""
        return self._table[torch.tensor(ids, dtype=torch.long)], self._empty_kv

    def decode_step(self, ids: torch.Tensor, positions: torch.Tensor, pool: object) -> torch.Tensor:
        """Logits for the next token of each request in ``ids``, read from the fixed table; ``positions`` and ``pool``
        are ignored."""
        return self._table[ids]


@dataclass(frozen=True)
class _Context:
    """The model config a stand-in forward reports: the tiny model's, with the profile's context."""

    model: SimModelConfig
    context: int

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size


@dataclass
class Held:
    """What one admitted request holds of the pool."""

    node: _Node | None
    """Its cached prefix's last node (locked), or None (a PD decode: no prefix cache)."""
    private: int
    """Tokens reserved for it beyond the cache: its uncached prompt and its whole output."""
    new_tokens: int
    """Prompt tokens its prefill computes (0: a PD decode, whose KV came from its prefill)."""
    cached: int


class CostedPool:
    """KV tokens of one profile engine: the prefix cache plus every running request's reserve.
    Owned by the scheduler thread (``admit``, ``release``); ``used`` and ``total`` may be read
    from any thread (ints: a torn read is one round stale)."""

    def __init__(self, profile: SimProfile, context: int, cache: bool):
        self.profile = profile
        self.total = profile.kv_pool_tokens
        self.context = context
        self.cache = PrefixCache() if cache else None
        self.reserved = 0
        self.cached_hits = 0
        self.prompt_tokens = 0

    @property
    def used(self) -> int:
        """KV tokens in use: every running request's reserve plus the tokens the prefix cache holds."""
        return self.reserved + (self.cache.tokens if self.cache else 0)

    def admit(self, ids: list[int], max_new: int, *, prefill: bool, use_cache: bool) -> Held | None:
        """Room for a request of prompt ``ids`` (and ``max_new`` more tokens), or None when the
        pool cannot hold it even after evicting every unlocked cached token. ``prefill``: its
        prompt is computed here (not a PD decode's); ``use_cache``: it may match and lock the
        prefix cache."""
        node, cached = None, 0
        if use_cache and self.cache is not None:
            cached, node = self.cache.match(ids)
            cached = min(cached, len(ids) - 1)  # SGLang recomputes at least the last token
        output = max(0, min(max_new, self.context - len(ids)))
        private = len(ids) - cached + output
        short = self.used + private - self.total
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
            short = self.used + private - self.total
        if short > 0 and self.reserved > 0:
            return None  # waits for running requests to finish
        # (a request larger than an empty pool runs alone: SGLang would refuse it at once, the
        # sim lets it run rather than wait for ever)
        if node is not None:
            assert self.cache is not None
            self.cache.lock(node)
        self.reserved += private
        if prefill:
            self.cached_hits += cached
            self.prompt_tokens += len(ids)
        return Held(node, private, len(ids) - cached if prefill else 0, cached)

    def release(self, held: Held, tokens: list[int] | None) -> None:
        """A request ended (or was retracted): its reserve is freed, its path unlocked and
        ``tokens`` (its prompt and output, when it is to be cached) cached."""
        self.reserved -= held.private
        if self.cache is None:
            return
        if held.node is not None:
            self.cache.unlock(held.node)
        if tokens:
            self.cache.insert(tokens)
            over = self.used - self.total
            if over > 0:
                self.cache.evict(over)

    @property
    def hit_rate(self) -> float:
        """The share of prefilled prompt tokens found in the prefix cache since start; 0.0 before any prefill."""
        return self.cached_hits / self.prompt_tokens if self.prompt_tokens else 0.0


def wait_until(deadline: float) -> None:
    """The modelled time of a forward, spent waiting (what the GPU would be doing)."""
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)
