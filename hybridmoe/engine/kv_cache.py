"""Paged KV cache bookkeeping: a page allocator with reference counts and a prefix cache.

Pure Python: page ids only. The tensors live in the model runner. Page 0 is reserved as a scratch
page (padding entries of a CUDA-graph batch write there) and is never handed out.

The prefix cache is a tree of full pages: a node is one page holding S tokens, keyed by those
tokens under its parent, so a lookup is exact (no hashing of prefixes). A request holds a
reference on every page it uses; a cached page with no holder stays in the tree until the
allocator needs it, and is then evicted leaf first, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    page: int
    key: tuple[int, ...]
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_access: int = 0


class KVCacheManager:
    """Allocates pages of `page_size` tokens and shares full prompt pages between requests."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._ref = [0] * num_pages
        self._node_of: dict[int, _Node] = {}  # cached page -> its tree node
        self._root = _Node(page=-1, key=(), parent=None)
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, _Node]] = []  # (last_access, tiebreak, leaf) candidates
        self._tiebreak = itertools.count()
        self._num_idle_cached = 0  # cached pages with no holder (all evictable eventually)

    # ---- queries ----
    @property
    def capacity_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    def num_available(self) -> int:
        """Pages that can be handed out now (free plus evictable cached pages)."""
        return len(self._free) + self._num_idle_cached

    def num_used(self) -> int:
        """Pages held by at least one request."""
        return self.num_pages - 1 - self.num_available()

    def num_cached(self) -> int:
        return len(self._node_of)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- operations ----
    def match_prefix(self, token_ids: list[int], namespace: str | None = None) -> list[int]:
        """Pages of the longest cached prefix of token_ids, leaving at least one token to compute.

        Each returned page is referenced for the caller, who must `release` it later. `namespace`
        (a LoRA adapter's load key): prefixes cached under another namespace are never matched.
        """
        if not self.enable_prefix_cache:
            return []
        s = self.page_size
        max_pages = (len(token_ids) - 1) // s
        node, pages, now = self._root, [], next(self._clock)
        for i in range(max_pages):
            child = node.children.get(_key(token_ids, i, s, namespace))
            if child is None:
                break
            self._incref(child.page)
            child.last_access = now
            pages.append(child.page)
            node = child
        return pages

    def cached_prefix_len(self, token_ids: list[int], namespace: str | None = None) -> int:
        """Tokens of token_ids that match_prefix would reuse now (no reference taken, no LRU update)."""
        if not self.enable_prefix_cache:
            return 0
        s, node, n = self.page_size, self._root, 0
        for i in range((len(token_ids) - 1) // s):
            node = node.children.get(_key(token_ids, i, s, namespace))
            if node is None:
                break
            n += s
        return n
    def share(self, pages: list[int]) -> list[int]:
        """Another reference on each of pages (held pages: a prefilled prompt forked into n sequences)."""
        for p in pages:
            if self._ref[p] <= 0:
                raise RuntimeError(f"page {p} is shared but held by no one")
            self._incref(p)
        return list(pages)

    def allocate(self, n: int) -> list[int] | None:
        """n pages referenced for the caller, evicting idle cached pages if needed; None if short."""
        if n <= 0:
            return []
        if n > self.num_available():
            return None
        while len(self._free) < n:
            self._evict_one()
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def release(self, pages: list[int], token_ids: list[int], namespace: str | None = None) -> None:
        """Drop the caller's references; full pages of token_ids (the tokens whose KV is in
        `pages`, in order) are kept in the prefix cache for later requests."""
        s = self.page_size
        num_full = min(len(pages), len(token_ids) // s) if self.enable_prefix_cache else 0
        node, now = self._root, next(self._clock)
        diverged = False  # the walk follows cached nodes of other pages (the same tokens computed twice)
        for i, page in enumerate(pages):
            if node is not None and i < num_full:
                key = _key(token_ids, i, s, namespace)
                child = node.children.get(key)
                if child is not None:
                    diverged = diverged or child.page != page  # a duplicate page is just freed below
                elif diverged and self._ref[page] > 1:
                    # Under another copy's nodes, a page someone still holds (a fork's shared prompt page) is not
                    # cached: its holders hold none of the nodes above it, which could then go idle with a held
                    # child, counted evictable (num_available) yet never a leaf ("nothing to evict" in allocate).
                    # The holders' pages are a prefix (parallel.fork), so nothing after it is cached either.
                    pass
                elif page not in self._node_of:
                    child = _Node(page=page, key=key, parent=node, last_access=now)
                    node.children[key] = child
                    self._node_of[page] = child
                node = child
                if node is not None:
                    node.last_access = now
            self._decref(page)

    # ---- internals ----
    def _incref(self, page: int) -> None:
        if self._ref[page] == 0 and page in self._node_of:
            self._num_idle_cached -= 1
        self._ref[page] += 1

    def _decref(self, page: int) -> None:
        if self._ref[page] <= 0:
            raise RuntimeError(f"page {page} released more often than it was taken")
        self._ref[page] -= 1
        if self._ref[page] == 0:
            node = self._node_of.get(page)
            if node is None:
                self._free.append(page)
            else:
                self._num_idle_cached += 1
                if not node.children:
                    self._push_leaf(node)

    def _push_leaf(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))

    def _evict_one(self) -> None:
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            live = self._node_of.get(node.page) is node
            if not live or node.children or self._ref[node.page] != 0:
                continue  # stale entry
            if stamp != node.last_access:
                self._push_leaf(node)  # touched since it was pushed: requeue with its new time
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            del self._node_of[node.page]
            self._num_idle_cached -= 1
            self._free.append(node.page)
            if parent is not self._root and not parent.children and self._ref[parent.page] == 0:
                self._push_leaf(parent)
            return
        self._rebuild_heap()
        if not self._heap:
            raise RuntimeError("prefix cache accounting error: nothing to evict")
        self._evict_one()

    def _rebuild_heap(self) -> None:
        self._heap = []
        for node in self._node_of.values():
            if not node.children and self._ref[node.page] == 0:
                self._push_leaf(node)

    def reset_prefix_cache(self) -> bool:
        """Forget every idle cached page (flush_cache). False if some page is still in use."""
        if any(self._ref[p] > 0 for p in self._node_of):
            return False
        for page in self._node_of:
            self._free.append(page)
        self._node_of.clear()
        self._root.children.clear()
        self._heap.clear()
        self._num_idle_cached = 0
        return True


def _key(token_ids: list[int], i: int, s: int, namespace: str | None) -> tuple:
    """The tree key of page i: its tokens; the first page's carries the namespace (a LoRA adapter), so
    the trees of two namespaces share no node."""
    key = tuple(token_ids[i * s:(i + 1) * s])
    return (("ns", namespace), *key) if namespace is not None and i == 0 else key
