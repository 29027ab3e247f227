"""A radix tree of token ids over a fixed pool of KV tokens: SGLang's prefix cache, as the
costed sim (``--sim-profile``) models it.

Every KV token an engine holds is in exactly one place: a node of the tree (shared by every
request whose tokens begin with the node's path) or a running request's private tail. A
request that starts ``match``es its prompt (the tokens found need no prefill: SGLang's
``cached_tokens``) and ``lock``s that path so that it cannot be evicted while the request
runs; when it ends, its tokens are ``insert``ed (SGLang caches a finished request's prompt and
output) and the path is unlocked. When the pool runs short, ``evict`` drops the least recently
used unlocked leaves first, as SGLang's ``RadixCache.evict`` does.

Edges hold runs of tokens (a radix tree, not a trie), so a 4,000-token prompt is one node
until another request shares part of it and splits the edge.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    locks: int = 0
    used: int = 0
    """A logical clock: when a request last matched or inserted through this node."""


class PrefixCache:
    """Cached KV tokens by prefix. Not thread-safe: the scheduler thread owns it."""

    def __init__(self) -> None:
        self._root = _Node((), None)
        self._clock = itertools.count(1)
        self.tokens = 0
        """KV tokens held by the tree (locked or not)."""
        self.locked_tokens = 0
        """Of those, tokens on a path some running request holds (not evictable)."""

    @property
    def evictable_tokens(self) -> int:
        """Cached tokens no running request holds: what ``evict`` can free."""
        return self.tokens - self.locked_tokens

    def match(self, ids: list[int] | tuple[int, ...]) -> tuple[int, _Node]:
        """The longest cached prefix of ``ids``: its length and its last node (split so that the
        node ends exactly there). Marks the path as just used."""
        node, at, now = self._root, 0, next(self._clock)
        node.used = now
        while at < len(ids):
            child = node.children.get(ids[at])
            if child is None:
                break
            same = _common(child.key, ids, at)
            if same < len(child.key):
                child = self._split(child, same)
            child.used = now
            node, at = child, at + same
        return at, node

    def lock(self, node: _Node) -> None:
        """Keep ``node``'s path from eviction (a running request reads it)."""
        while node is not self._root:
            if node.locks == 0:
                self.locked_tokens += len(node.key)
            node.locks += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: _Node) -> None:
        """Undo one ``lock`` of ``node``'s path; once no request holds a node it may be evicted."""
        while node is not self._root:
            node.locks -= 1
            if node.locks == 0:
                self.locked_tokens -= len(node.key)
            assert node.parent is not None
            node = node.parent

    def insert(self, ids: list[int] | tuple[int, ...]) -> int:
        """Cache ``ids`` (a finished request's tokens); the number of tokens newly held."""
        matched, node = self.match(ids)
        if matched == len(ids):
            return 0
        leaf = _Node(tuple(ids[matched:]), node, used=next(self._clock))
        node.children[leaf.key[0]] = leaf
        self.tokens += len(leaf.key)
        return len(leaf.key)

    def evict(self, wanted: int) -> int:
        """Free at least ``wanted`` tokens if that many are unlocked, least recently used leaves
        first; the number freed."""
        if wanted <= 0:
            return 0
        heap = [(n.used, id(n), n) for n in self._leaves() if n.locks == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < wanted:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            if parent is not self._root and not parent.children and parent.locks == 0:
                heapq.heappush(heap, (parent.used, id(parent), parent))
        self.tokens -= freed
        return freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self._root:
                out.append(node)
        return out

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` tokens; the new upper node (same locks and use)."""
        assert child.parent is not None
        upper = _Node(child.key[:at], child.parent, locks=child.locks, used=child.used)
        child.parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper


def _common(key: tuple[int, ...], ids: list[int] | tuple[int, ...], at: int) -> int:
    """How many of ``key``'s tokens equal ``ids`` from ``at`` on."""
    n = min(len(key), len(ids) - at)
    i = 0
    while i < n and key[i] == ids[at + i]:
        i += 1
    return i
