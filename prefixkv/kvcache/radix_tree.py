"""A radix tree over token ids whose nodes own KV pages (SGLang's RadixAttention index).

Each node holds a run of tokens and the ids of the pages holding their KV; a child is keyed by its first token
(its first page's token tuple when page_size > 1), so siblings never share a first page and a lookup is one dict
probe per node. Everything is page aligned: a node's run is a whole number of pages, so a page is never shared
between two nodes and a match covers whole pages only. Tokens a request computes after its own unshared leaf
extend that leaf in place, so a request decoding 1,000 tokens adds one node, not one per page.

Lifetime: a request that uses a prefix holds a lock reference on every node from its deepest node up to the
namespace root. Unlocked nodes are evictable, leaves only, in the order of the eviction policy (eviction.py;
least recently used by default) kept in a lazy heap; evicting a parent's last child makes the parent an evictable
leaf. Pages in the retention table (retention.py) are evicted only when no unretained page can be. Counters of
evictable and protected tokens are kept up to date on every lock change, so a free-page count never scans the
tree.

The tree knows nothing about requests or the free list: eviction hands freed page ids back to the caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator, Sequence

from prefixkv.kvcache.eviction import EvictionHeap, make_eviction_policy
from prefixkv.kvcache.retention import RetentionTable

Namespace = Hashable  # (lora_id, cache_salt): separate roots, so tenants never match each other


class RadixNode:
    __slots__ = (
        "tokens",
        "pages",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "hits",
        "namespace",
        "release_age",
        "heap_seq",
        "shrunk_at",
    )

    def __init__(self, tokens: list, pages: list[int], parent: RadixNode | None, namespace: Namespace) -> None:
        self.tokens = tokens  # the token run this edge adds (len == len(pages) * page_size)
        self.pages = pages  # page ids holding the KV of `tokens`, in order
        self.children: dict[Hashable, RadixNode] = {}
        self.parent = parent  # None for a root, and for a node after eviction
        self.lock_ref = 0  # running requests whose path passes through here
        self.last_access = 0  # logical clock of the last lock/unlock through here (LRU)
        self.hits = 0  # admissions whose cache hit passed through here
        self.namespace = namespace
        self.release_age = 0.0  # the eviction policy's age at last_access (what its priority starts from)
        self.heap_seq = 0  # the node's current entry in the eviction heap (older entries are stale)
        self.shrunk_at = 0  # the tree's evict_version when this node last lost tokens (trimmed or removed)

    def __repr__(self) -> str:
        head = self.tokens[:4]
        return f"RadixNode({len(self.tokens)} tok {head}{'...' if len(self.tokens) > 4 else ''}, lock={self.lock_ref})"


def common_prefix_len(run: Sequence, seq: Sequence, start: int, end: int) -> int:
    """Length of the common prefix of run and seq[start:end]; slice compares in chunks keep it in C mostly."""
    limit = min(len(run), end - start)
    if run[:limit] == seq[start : start + limit]:  # the common case: one comparison in C
        return limit
    n, step = 0, 64
    while n < limit:
        m = min(step, limit - n)
        if run[n : n + m] == seq[start + n : start + n + m]:
            n += m
            continue
        for k in range(n, n + m):
            if run[k] != seq[start + k]:
                return k
    return limit


class RadixTree:
    def __init__(self, page_size: int = 1, eviction: str = "lru", retention: RetentionTable | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.roots: dict[Namespace, RadixNode] = {}
        self.evictable_tokens = 0  # tokens in unlocked nodes (all of them evictable, leaves first)
        self.protected_tokens = 0  # tokens in locked nodes
        self.num_nodes = 0  # excluding roots
        self.version = 0  # bumped whenever a match result can change (insert, grow, evict); lookups memoise on it
        self.evict_version = 0  # bumped when cached tokens go: only then can a match shrink (see shrunk_at)
        self._clock = itertools.count(1)
        self.eviction = make_eviction_policy(eviction)
        self._evictable: EvictionHeap[RadixNode] = EvictionHeap()  # unlocked leaves; stale entries skipped
        self.retention = retention  # the cache's (it records what requests retain); read when evicting

    # -- keys and roots ------------------------------------------------------------------------------------
    def key(self, tokens: Sequence, i: int) -> Hashable:
        return tokens[i] if self.page_size == 1 else tuple(tokens[i : i + self.page_size])

    def root(self, namespace: Namespace, create: bool = False) -> RadixNode | None:
        node = self.roots.get(namespace)
        if node is None and create:
            node = self.roots[namespace] = RadixNode([], [], None, namespace)
        return node

    def drop_root_if_unused(self, root: RadixNode | None) -> None:
        if (
            root is not None
            and root.parent is None
            and not root.children
            and root.lock_ref == 0
            and self.roots.get(root.namespace) is root
        ):
            del self.roots[root.namespace]

    # -- matching ------------------------------------------------------------------------------------------
    def match(self, namespace: Namespace, tokens: Sequence, limit: int) -> tuple[list[RadixNode], int]:
        """Nodes on the longest cached prefix of tokens[:limit] and its length in tokens (whole pages).

        The last node may be matched only partly. Read-only: nothing is split or touched.
        """
        node = self.roots.get(namespace)
        if node is None:
            return [], 0
        path, matched, _, _ = self.walk(node, tokens, 0, limit)
        return path, matched

    def walk(
        self, node: RadixNode, tokens: Sequence, i: int, limit: int
    ) -> tuple[list[RadixNode], int, RadixNode, int]:
        """Continue a match from `node`, which ends at token i. Returns the nodes entered, the match length, and
        the deepest node matched in full with the token where it ends. Without evictions that node stays in
        the tree (splits keep the lower part's identity and end), so a later match can resume there: only
        insertions below it, or its own growth in place (its run gets longer), can make the match longer."""
        limit -= limit % self.page_size
        path: list[RadixNode] = []
        full, full_end = node, i
        while i < limit:
            child = node.children.get(self.key(tokens, i))
            if child is None:
                break
            n = common_prefix_len(child.tokens, tokens, i, limit)
            n -= n % self.page_size
            path.append(child)
            i += n
            if n < len(child.tokens):
                break
            node = full = child
            full_end = i
        return path, i, full, full_end

    def match_node(self, namespace: Namespace, tokens: Sequence, length: int) -> RadixNode:
        """The node ending exactly at `length` matched tokens (splitting one if needed). Creates the root."""
        root = self.root(namespace, create=True)
        assert root is not None
        path, matched = self.match(namespace, tokens, length)
        if matched < length:
            raise ValueError(f"only {matched} of {length} tokens are cached")
        if not path:
            return root
        last = path[-1]
        covered = sum(len(n.tokens) for n in path)
        if covered > length:  # the match ends inside `last`
            last = self._split(last, len(last.tokens) - (covered - length))
        return last

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut node after n tokens; the new upper node takes the first part. KV stays where it is: only the
        token run and page-id list are divided. The lower part keeps its identity, so requests that point at
        it (their deepest node) stay correct."""
        assert 0 < n < len(node.tokens) and n % self.page_size == 0
        parent = node.parent
        assert parent is not None, "a root is never split"
        upper = RadixNode(node.tokens[:n], node.pages[: n // self.page_size], parent, node.namespace)
        upper.lock_ref, upper.last_access, upper.hits = node.lock_ref, node.last_access, node.hits
        upper.release_age = node.release_age
        node.tokens = node.tokens[n:]
        node.pages = node.pages[n // self.page_size :]
        parent.children[self.key(upper.tokens, 0)] = upper
        upper.children[self.key(node.tokens, 0)] = node
        node.parent = upper
        self.num_nodes += 1
        return upper

    # -- insertion -----------------------------------------------------------------------------------------
    def insert(
        self, node: RadixNode, tokens: Sequence, start: int, end: int, pages: list[int]
    ) -> tuple[RadixNode, list[int]]:
        """Add tokens[start:end] (KV in `pages`) below `node`, which ends at token `start` and is locked by the
        caller. Returns the new deepest node, now locked in place of `node` (the lock moves down; `node` itself
        when it grew in place), and the tree's page ids for the range: where the tokens were already cached
        these are the tree's pages, and the caller's pages for them are duplicates it must free."""
        ps = self.page_size
        assert start % ps == 0 and end % ps == 0 and len(pages) * ps == end - start
        top, out, i = node, [], start
        if start < end and self._grows_in_place(node):
            self._grow(node, tokens[start:end], pages)
            return node, list(pages)
        while i < end:
            child = node.children.get(self.key(tokens, i))
            if child is None:
                new = RadixNode(list(tokens[i:end]), list(pages[(i - start) // ps :]), node, node.namespace)
                new.last_access = next(self._clock)
                node.children[self.key(new.tokens, 0)] = new
                self.num_nodes += 1
                self.evictable_tokens += len(new.tokens)
                self.version += 1
                out.extend(new.pages)
                node = new
                break
            n = common_prefix_len(child.tokens, tokens, i, end)
            n -= n % ps
            if n < len(child.tokens):
                child = self._split(child, n)
            out.extend(child.pages)
            i += n
            node = child
        # move the caller's lock down: lock the new part of the path, from the new node up to `top` (exclusive)
        up: RadixNode | None = node
        while up is not None and up is not top:
            self._inc(up)
            up = up.parent
        return node, out

    @staticmethod
    def _grows_in_place(node: RadixNode) -> bool:
        """Whether tokens computed after `node` (the caller's deepest node, locked by it) may extend it instead of
        hanging below it as a child. Only a leaf (no other branch to keep apart), held by the caller alone
        (another holder's path would end inside the longer node), that no admission has hit yet (a node's `hits`
        count for every one of its tokens, and the new tokens have none). So a decoding request keeps one node
        instead of adding one per page; a later turn that hits it starts a node of its own, as SGLang's does."""
        return node.parent is not None and not node.children and node.lock_ref == 1 and node.hits == 0

    def _grow(self, node: RadixNode, tokens: Sequence, pages: list[int]) -> None:
        """Append tokens and their pages to a node (see _grows_in_place). It stays locked, so its new tokens are
        protected and no LRU heap entry changes. A longer node can lengthen a memoised match that ended at its
        old end: `version` tells lookups that the tree changed, and their memo notices the node's new last page."""
        node.tokens.extend(tokens)
        node.pages.extend(pages)
        node.last_access = next(self._clock)
        self.protected_tokens += len(tokens)
        self.version += 1

    # -- locks and recency ---------------------------------------------------------------------------------
    def _inc(self, node: RadixNode) -> None:
        if node.lock_ref == 0:
            self.evictable_tokens -= len(node.tokens)
            self.protected_tokens += len(node.tokens)
        node.lock_ref += 1

    def lock(self, node: RadixNode | None) -> None:
        """Protect node and its ancestors (the root included: it keeps the namespace alive)."""
        while node is not None:
            self._inc(node)
            node = node.parent

    def unlock(self, node: RadixNode | None) -> None:
        while node is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.tokens)
                self.protected_tokens -= len(node.tokens)
                self._push_if_evictable(node)
            node = node.parent

    def touch(self, node: RadixNode | None) -> None:
        """Mark the path as just used. Only locked paths are touched, so no heap entry needs fixing here;
        the new stamp enters the heap when the lock is released. A release touches first, so a node's last
        touch before it becomes evictable is its release (a failed admission locks and unlocks, untouched)."""
        stamp, age = next(self._clock), self.eviction.age
        while node is not None:
            node.last_access = stamp
            node.release_age = age
            node = node.parent

    def record_hit(self, node: RadixNode | None) -> None:
        while node is not None and node.parent is not None:
            node.hits += 1
            node = node.parent

    # -- eviction ------------------------------------------------------------------------------------------
    def _push_if_evictable(self, node: RadixNode) -> None:
        if node.parent is not None and node.lock_ref == 0 and not node.children:
            self._evictable.push(node, self._priority(node), node.last_access)

    def _priority(self, node: RadixNode) -> float:
        """The policy's rank of the node's last page (the one a trim takes first; the pages above it rank no
        higher: as often hit, released together, no deeper)."""
        ps = self.page_size
        depth = self.depth(node) - ps if self.eviction.uses_depth else 0
        return self.eviction.priority(node.release_age, node.last_access, node.hits, depth, ps)

    @staticmethod
    def _is_evictable_leaf(node: RadixNode) -> bool:
        return node.parent is not None and node.lock_ref == 0 and not node.children

    def evict(self, num_pages: int) -> list[int]:
        """Free up to num_pages pages from unlocked leaves, lowest eviction priority first; returns their ids.

        A leaf bigger than what is still needed is trimmed from its tail (SGLang drops whole leaves; keeping
        the head keeps the part more likely to be shared, and frees exactly what was asked)."""
        if self.retention:  # some pages are retained: spare them while anything else can go
            return self._evict_sparing_retained(num_pages, self.retention)
        ps, freed = self.page_size, list[int]()
        while len(freed) < num_pages:
            entry = self._evictable.pop(self._is_evictable_leaf)
            if entry is None:
                break
            priority, node = entry
            self.eviction.evicted(priority)
            need = num_pages - len(freed)
            self._shrink(node)
            if len(node.pages) > need:
                freed.extend(node.pages[-need:])
                del node.pages[-need:]
                del node.tokens[-need * ps :]
                self.evictable_tokens -= need * ps
                self._push_if_evictable(node)
                break
            freed.extend(node.pages)
            self.evictable_tokens -= len(node.tokens)
            self._remove(node)
        self._maybe_compact_heap()
        return freed

    def _evict_sparing_retained(self, num_pages: int, retention: RetentionTable) -> list[int]:
        """evict() when pages are retained: a leaf's unretained tail pages go in the policy's order; a leaf
        whose last page is retained is set aside, and only when no other leaf is left does the one whose last
        page is weakest (retention.rank) lose pages. Set-aside leaves go back to the heap at the end."""
        retention.expire()
        freed: list[int] = []
        aside: list[RadixNode] = []
        while len(freed) < num_pages:
            entry = self._evictable.pop(self._is_evictable_leaf)
            if entry is not None:
                priority, node = entry
                unretained = 0
                while unretained < len(node.pages) and node.pages[-1 - unretained] not in retention:
                    unretained += 1
                if not unretained:
                    aside.append(node)
                    continue
                self.eviction.evicted(priority)
                self._take_tail(node, min(unretained, num_pages - len(freed)), freed)
                continue
            aside = [n for n in aside if self._is_evictable_leaf(n)]
            if not aside:
                break
            node = min(aside, key=lambda n: retention.rank(n.pages[-1]))
            aside.remove(node)
            retained = 0
            while retained < len(node.pages) and node.pages[-1 - retained] in retention:
                retained += 1
            taken = min(retained, num_pages - len(freed))
            for page in node.pages[-taken:]:
                retention.discard(page)
            self._take_tail(node, taken, freed)
        for node in aside:
            self._push_if_evictable(node)
        self._maybe_compact_heap()
        return freed

    def _take_tail(self, node: RadixNode, n: int, freed: list[int]) -> None:
        """Evict the last n pages of an evictable leaf into `freed`; a leaf left with pages is pushed back."""
        self._shrink(node)
        freed.extend(node.pages[-n:])
        if n < len(node.pages):
            del node.pages[-n:]
            del node.tokens[-n * self.page_size :]
            self.evictable_tokens -= n * self.page_size
            self._push_if_evictable(node)
            return
        self.evictable_tokens -= len(node.tokens)
        self._remove(node)

    def evict_namespace(self, namespace: Namespace) -> list[int]:
        """Free every unlocked node under one root (leaves first, so a parent goes once its children have);
        returns their page ids. Locked paths stay."""
        root = self.roots.get(namespace)
        if root is None:
            return []
        below: list[RadixNode] = []
        stack = [root]
        while stack:
            node = stack.pop()
            below.extend(node.children.values())
            stack.extend(node.children.values())
        freed: list[int] = []
        for node in reversed(below):  # every child after its parent in `below`, so before it here
            if node.lock_ref == 0 and not node.children:
                freed.extend(node.pages)
                self.evictable_tokens -= len(node.tokens)
                self._shrink(node)
                self._remove(node)
        self._maybe_compact_heap()
        return freed

    def _shrink(self, node: RadixNode) -> None:
        """Record that `node` is about to lose tokens. Only leaves lose tokens, so a match whose deepest node
        and partly matched child have not shrunk since it was made still holds: every node above them is
        intact (lookups check this instead of redoing every match after any eviction)."""
        self.version += 1
        self.evict_version += 1
        node.shrunk_at = self.evict_version

    def _remove(self, node: RadixNode) -> None:
        parent = node.parent
        assert parent is not None, "only a node in the tree is removed"
        del parent.children[self.key(node.tokens, 0)]
        node.parent = None
        self.num_nodes -= 1
        if parent.parent is None:
            self.drop_root_if_unused(parent)
        else:
            self._push_if_evictable(parent)

    def _maybe_compact_heap(self) -> None:
        self._evictable.compact(self._is_evictable_leaf, 4 * self.num_nodes + 64)

    def evictable_leaf_priorities(self) -> dict[int, float]:
        """id(node) -> priority of the current heap entries (for invariant checks)."""
        return {id(node): priority for priority, node in self._evictable.current(self._is_evictable_leaf)}

    # -- walking -------------------------------------------------------------------------------------------
    def nodes(self) -> Iterator[RadixNode]:
        """Every non-root node, parents before children."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                yield child
                stack.append(child)

    def path_pages(self, node: RadixNode | None) -> list[int]:
        chunks = []
        while node is not None:
            chunks.append(node.pages)
            node = node.parent
        return [p for chunk in reversed(chunks) for p in chunk]

    def depth(self, node: RadixNode | None) -> int:
        """Tokens from the root to the end of node."""
        total = 0
        while node is not None:
            total += len(node.tokens)
            node = node.parent
        return total
