"""The costed sim's prefix cache (pdctl.sim.prefix_cache) and KV pool (pdctl.sim.costed):
SGLang's radix cache rules, checked by example and against a model (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.gpu_profiles import PROFILES
from pdctl.sim.costed import CostedPool
from pdctl.sim.prefix_cache import PrefixCache


def test_a_shared_prefix_is_found_and_split_where_it_ends() -> None:
    cache = PrefixCache()
    assert cache.insert([1, 2, 3, 4, 5]) == 5
    assert cache.match([1, 2, 3, 9])[0] == 3
    assert cache.insert([1, 2, 3, 9, 9]) == 2  # only the new tail is held again
    assert cache.tokens == 7
    assert cache.match([1, 2, 3, 4, 5, 6])[0] == 5
    assert cache.match([7])[0] == 0


def test_eviction_drops_the_least_recently_used_and_never_a_locked_path() -> None:
    cache = PrefixCache()
    cache.insert([1] * 10)
    cache.insert([2] * 10)
    cache.insert([3] * 10)
    cache.match([1] * 10)  # used again: the oldest now is [2]
    _, node = cache.match([3] * 10)
    cache.lock(node)
    assert cache.evict(5) == 10  # a whole leaf: [2] * 10
    assert cache.match([2] * 10)[0] == 0 and cache.match([1] * 10)[0] == 10
    assert cache.evict(100) == 10  # [1]; [3] is locked
    assert cache.tokens == 10 and cache.locked_tokens == 10 and cache.evictable_tokens == 0
    cache.unlock(node)
    assert cache.evict(100) == 10 and cache.tokens == 0


def test_eviction_climbs_to_a_parent_left_without_children() -> None:
    cache = PrefixCache()
    cache.insert([1, 2, 3, 4])
    cache.insert([1, 2, 5, 6])  # splits: [1, 2] -> [3, 4] | [5, 6]
    assert cache.evict(6) == 6 and cache.tokens == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["insert", "evict", "lock", "unlock"]), st.lists(st.integers(0, 3), max_size=8)),
        max_size=40,
    )
)
def test_the_cache_agrees_with_a_set_of_held_prefixes(ops: list[tuple[str, list[int]]]) -> None:
    """Against a model: the tokens held are the distinct prefixes of what was inserted and not
    evicted; a match finds the longest held prefix; a locked path survives any eviction."""
    cache = PrefixCache()
    held: set[tuple[int, ...]] = set()  # every held prefix (a token of the tree is one prefix)
    locks: list[tuple[tuple[int, ...], object]] = []
    for op, ids in ops:
        if op == "insert" and ids:
            cache.insert(ids)
            held.update(tuple(ids[: i + 1]) for i in range(len(ids)))
        elif op == "lock" and ids:
            n, node = cache.match(ids)
            if n:
                cache.lock(node)
                locks.append((tuple(ids[:n]), node))
        elif op == "unlock" and locks:
            cache.unlock(locks.pop()[1])
        elif op == "evict":
            cache.evict(len(ids) + 1)
            held = _held_prefixes(cache)
        assert cache.tokens == len(held)
        for path, _ in locks:
            assert all(path[: i + 1] in held for i in range(len(path)))
        if ids:
            longest = max((i + 1 for i in range(len(ids)) if tuple(ids[: i + 1]) in held), default=0)
            assert cache.match(ids)[0] == longest


def _held_prefixes(cache: PrefixCache) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    stack = [(cache._root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            full = path + child.key
            out.update(full[: len(path) + i + 1] for i in range(len(child.key)))
            stack.append((child, full))
    return out


def test_the_pool_queues_a_request_it_cannot_hold_and_takes_it_once_another_ends() -> None:
    profile = PROFILES["llama3-8b-h100"]
    pool = CostedPool(profile, context=10_000, cache=True)
    pool.total = 1000
    first = pool.admit(list(range(100)), 500, prefill=True, use_cache=True)
    assert first is not None and pool.used == 600
    assert pool.admit(list(range(200, 300)), 500, prefill=True, use_cache=True) is None  # 1200 > 1000
    pool.release(first, list(range(100)) + [7] * 499)
    assert pool.used == 599 and pool.cache is not None and pool.cache.tokens == 599  # cached, evictable
    again = pool.admit(list(range(100)), 10, prefill=True, use_cache=True)
    assert again is not None and again.cached == 99 and again.new_tokens == 1  # the last token is recomputed
    pool.release(again, None)
    second = pool.admit(list(range(200, 300)), 500, prefill=True, use_cache=True)
    assert second is not None and pool.used <= pool.total  # the cache gave way (least recently used first)
    assert pool.cache.tokens == 100  # its private tail went first; the prefix it shares with `again` stays
