"""Prefix caching with a radix tree (SGLang's RadixAttention) behind the KVCacheManager interface.

Pages: one pool of page ids. Each page is in exactly one place: the free list, a tree node (cached, shareable),
or a request's private tail (allocated, not yet committed: the prefill chunk being computed, the partial last
page, room reserved for decoding). `num_free_pages()` counts free plus evictable tree pages, since an
allocation evicts unlocked least-recently-used leaves on demand.

A request's page table is the page list of its tree path (the committed prefix, locked) followed by its private
pages. `commit` inserts newly computed full pages right away, so a running request's prompt is shareable as
soon as it is prefilled. If another request inserted the same tokens first, the duplicate private pages go
back to the free list and the page table points at the tree's pages (same tokens after the same prefix means
the same KV).

KV events (events.py): a page's hash is the hash cache's key for the same page of the same prompt (hashing.py's
chain, computed from the request at commit), kept per page id while the page is in the tree. A page belongs to one
node at a time and keeps its id when a node is split, grows or is trimmed, so its hash is stable across all three.

Keys: (lora_id, cache_salt) select separate roots; prompt positions covered by a multimodal input are keyed by
(input hash, offset) instead of the placeholder token, so two images never match each other.

Retention (retention.py): the pages a retaining request commits or hits are recorded by page id in the manager's
retention table, which the tree consults when it evicts (radix_tree.RadixTree.evict).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from prefixkv.cache_miss import CacheMiss
from prefixkv.kvcache.events import block_removed, block_stored
from prefixkv.kvcache.hashing import extend_block_keys, external_block_hash, hash_function
from prefixkv.kvcache.manager import NOTHING_INSERTED, Inserted, PagedKVCache, runs_of
from prefixkv.kvcache.radix_tree import RadixNode, RadixTree
from prefixkv.kvcache.retention import retain_request_pages
from prefixkv.kvcache.summary import CacheSummary, HotPrefix, NamespaceUsage
from prefixkv.request import Request


class _LookupMemo(NamedTuple):
    """Where the last lookup of a request ended, and the tree versions it was valid for."""

    evict_version: int  # tree.evict_version then: the match stands while its own nodes have not shrunk since
    limit: int  # tokens the match was allowed to cover (num_tokens - 1)
    version: int  # tree.version then: unchanged means the answer stands
    hit: int
    node: RadixNode | None  # deepest node matched in full (None: no root for the namespace)
    start: int  # depth of `node`
    end_page: int  # node's last page then (-1: a root): one that grew in place has a new last page, a split
    # keeps it (the lower part keeps the tail), so an unchanged last page means the node still ends at `start`
    inside: RadixNode | None  # the child the match stopped inside, if it did


def _intact(memo: _LookupMemo, evict_version: int) -> bool:
    """Whether no eviction since the memo was made touched its match: evictions take tokens from leaves only,
    so if neither the deepest node matched in full nor the child the match stopped inside has shrunk, every
    node of the match is still in the tree with all its tokens."""
    if memo.evict_version == evict_version:
        return True
    since = memo.evict_version
    node, inside = memo.node, memo.inside
    return (node is None or node.shrunk_at <= since) and (inside is None or inside.shrunk_at <= since)


@dataclass(slots=True)
class _Keys:
    """What lookups learnt about one request: its keys with multimodal positions replaced (None: no multimodal
    input, the token ids are the keys) and the last match."""

    request: Request
    mm_prompt_keys: list[Hashable] | None = None
    memo: _LookupMemo | None = None
    block_keys: list[bytes] = field(default_factory=list)  # hashing.py's chain, with events on only


@dataclass(slots=True)
class _RequestState:
    node: RadixNode  # deepest node of the committed prefix, locked (a root when nothing is committed)
    committed: int  # tokens of the request in the tree (a multiple of page_size)
    pages: list[int]  # page table: tree pages for [0, committed), then private pages


class RadixPrefixCache(PagedKVCache):
    name = "radix"

    def __init__(
        self,
        num_pages: int,
        page_size: int = 1,
        *,
        hash_algo: str = "sha256",
        eviction: str = "lru",
        retained_pool_fraction: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        miss_history: int | None = None,
    ) -> None:
        super().__init__(num_pages, page_size, retained_pool_fraction, clock, miss_history)
        self._hash_fn = hash_function(hash_algo)  # for KV events only: lookups compare tokens
        self._page_hash: list[int] = []  # by page id, for pages in the tree; filled with events on
        self.tree = RadixTree(page_size, eviction, self.retention)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._requests: dict[str, _RequestState] = {}  # by request id, from allocate to free
        self._lookups: dict[str, _Keys] = {}  # by request id, from the first lookup to free

    # -- keys ----------------------------------------------------------------------------------------------
    @staticmethod
    def _namespace(request: Request):
        return request.extra_keys

    def _known(self, request: Request) -> _Keys:
        known = self._lookups.get(request.request_id)
        if known is None or known.request is not request:
            known = self._lookups[request.request_id] = _Keys(request)
        return known

    def _keys(self, request: Request) -> Sequence[Hashable]:
        if not request.mm_hashes:
            return request.token_ids
        known = self._known(request)
        prompt = known.mm_prompt_keys
        if prompt is None:
            prompt = list(request.prompt_token_ids)
            for mm in request.mm_hashes:
                for k in range(mm.offset, min(mm.offset + mm.length, len(prompt))):
                    prompt[k] = (mm.hash, k - mm.offset)
            known.mm_prompt_keys = prompt
        return prompt + request.token_ids[len(prompt) :]

    # -- queries -------------------------------------------------------------------------------------------
    def lookup(self, request: Request) -> int:
        """Longest cached prefix in whole pages, never the last token (its logits are needed).

        Memoised on the request. With insertions but no eviction since, the match can only have grown below
        the deepest node it matched in full, so it resumes there instead of at the root; if it stopped inside
        a child that is still that node's child (not split, so no branch was added inside it), the answer
        stands. Between two engine steps, which mostly insert, re-ordering a long queue then costs a dict
        probe per request instead of re-comparing long prefixes. If that node has grown in place since (its
        last page changed), it no longer ends where the match did: the match starts over at the root.
        Evictions elsewhere in the tree leave the memo valid (see _intact): under pool pressure every step
        evicts, and a queue of thousands would otherwise be matched again from the root each step."""
        limit = request.num_tokens - 1
        if limit <= 0:
            return 0
        tree = self.tree
        known = self._known(request)
        memo = known.memo
        if memo is not None and memo.limit == limit and _intact(memo, tree.evict_version):
            if memo.version == tree.version or memo.hit == limit - limit % self.page_size:
                return memo.hit
            node, start, inside = memo.node, memo.start, memo.inside
            if start == 0:  # the namespace root may have been dropped and made again
                node = tree.roots.get(self._namespace(request))
            elif node is not None and node.pages[-1] != memo.end_page:
                node, start, inside = tree.roots.get(self._namespace(request)), 0, None
        else:
            node, start, inside = tree.roots.get(self._namespace(request)), 0, None
        keys = self._keys(request)
        if (
            memo is not None
            and inside is not None
            and node is not None
            and node.children.get(tree.key(keys, start)) is inside
        ):
            known.memo = memo._replace(version=tree.version)
            return memo.hit
        hit, inside = 0, None
        if node is not None:
            path, hit, node, start = tree.walk(node, keys, start, limit)
            if hit > start:
                inside = path[-1]
        end_page = node.pages[-1] if node is not None and node.pages else -1
        known.memo = _LookupMemo(tree.evict_version, limit, tree.version, hit, node, start, end_page, inside)
        return hit

    def prefix_path(self, request: Request) -> list:
        """Nodes of the cached prefix, root side first: equal nodes mean an equal prefix (dfs-weight builds its
        tree of waiting requests from these). A match ending inside a node splits it there, as SGLang's
        scheduler does, so two requests ending at different points of one node get distinct, nested nodes.
        Splitting moves no KV and changes no lookup result."""
        hit = self.lookup(request)
        if not hit:
            return []
        memo = self._lookups[request.request_id].memo
        node = memo.node if memo is not None and memo.start == hit else None
        # the lookup has just checked that the memo's node is in the tree; an unchanged last page says it still
        # ends at the hit (it may have grown since, and a full match returns without looking)
        if node is None or memo is None or not node.pages or node.pages[-1] != memo.end_page:
            node = self.tree.match_node(self._namespace(request), self._keys(request), hit)
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def page_table(self, request: Request) -> list[int]:
        state = self._requests.get(request.request_id)
        return state.pages if state else []

    def num_free_pages(self) -> int:
        return len(self._free) + self.tree.evictable_tokens // self.page_size

    # -- changes -------------------------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        if len(self._free) < n:
            self._release(self.tree.evict(n - len(self._free)), self.tree.eviction.name)
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        self._invalidated(taken)
        return taken

    def _release(self, evicted: list[int], policy: str) -> None:
        """Evicted tree pages go to the free list, and into the eviction count (policy: what evicted them, for the
        miss listener)."""
        self.stats.evicted_pages += len(evicted)
        retention, misses = self.retention, self.misses
        for page in evicted:
            misses.evicted(page, policy, retention.lapsed(page))
            retention.discard(page)
        if self._events is not None and evicted:
            self._events.append(block_removed([self._page_hash[p] for p in evicted]))
        self._free.extend(evicted)
        self._invalidated(evicted)

    def allocate(self, request: Request, num_new_tokens: int, num_cached_tokens: int = 0) -> bool:
        ps = self.page_size
        state = self._requests.get(request.request_id)
        if state is not None:
            if num_cached_tokens:
                raise ValueError("a cache hit can only be taken at first admission")
            need = self.pages_needed(request, num_new_tokens) - len(state.pages)
            if need > self.num_free_pages():
                return False
            if need > 0:
                state.pages.extend(self._take(need))
            return True

        # first admission (again after a preemption): lock the hit before evicting anything for the rest
        if num_cached_tokens % ps or num_cached_tokens >= max(request.num_tokens, 1):
            raise ValueError(f"cached tokens must be whole pages below num_tokens, got {num_cached_tokens}")
        if num_cached_tokens and request.num_computed_tokens:
            raise ValueError("a request taking a cache hit must start with no computed tokens")
        namespace = self._namespace(request)
        node = self.tree.match_node(namespace, self._keys(request), num_cached_tokens)
        self.tree.lock(node)
        need = self.pages_needed(request, num_new_tokens, num_cached_tokens) - num_cached_tokens // ps
        if need > self.num_free_pages():
            self.tree.unlock(node)
            self.tree.drop_root_if_unused(self.tree.root(namespace))
            return False
        self.tree.touch(node)
        if num_cached_tokens:
            self.tree.record_hit(node)
        self.misses.admitted(request, num_cached_tokens)
        pages = self.tree.path_pages(node) + self._take(max(need, 0))
        self._requests[request.request_id] = _RequestState(node, num_cached_tokens, pages)
        if num_cached_tokens and request.retains:
            self._retain(request, pages[: num_cached_tokens // ps], 0)
        return True

    def _retain(self, request: Request, pages: list[int], first_depth: int) -> None:
        """Tree pages the request hit or committed are retained (the tree reads the table when it evicts)."""
        retain_request_pages(self.retention, request, pages, first_depth, self.page_size)

    def commit(self, request: Request) -> Inserted:
        """Insert the newly computed full pages; this request's writes are the pages the tree took from it (a run
        another request inserted first is shared instead, and this request's copies go back to the free list)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return NOTHING_INSERTED
        ps = self.page_size
        full = min(request.num_computed_tokens, request.num_tokens, len(state.pages) * ps)
        full -= full % ps
        if full <= state.committed:
            return NOTHING_INSERTED
        first = state.committed // ps
        node, tree_pages = self.tree.insert(
            state.node, self._keys(request), state.committed, full, state.pages[first : full // ps]
        )
        stored: list[int] = []  # indices of the request's pages it inserted itself
        for j, tree_page in enumerate(tree_pages):
            mine = state.pages[first + j]
            if mine != tree_page:  # someone cached these tokens first: share theirs, return ours
                self._free.append(mine)
                self._invalidated([mine])
                state.pages[first + j] = tree_page
            else:
                stored.append(first + j)
        state.node, state.committed = node, full
        for i in stored:
            self.misses.stored(state.pages[i], request, i)
        if stored and self._events is not None:
            self._emit_stored(request, self._block_keys(request, stored[-1] + 1), stored)
        if request.retains:
            self._retain(request, tree_pages, first)
        return Inserted(runs_of(stored, ps), ps) if stored else NOTHING_INSERTED

    def _block_keys(self, request: Request, num_pages: int) -> list[bytes]:
        """hashing.py's chain keys of the request's first num_pages pages (at least; memoised until free())."""
        keys = self._known(request).block_keys
        if len(keys) >= num_pages:
            return keys
        return extend_block_keys(
            keys,
            request.token_ids,
            self.page_size,
            num_pages,
            self._hash_fn,
            request.lora_id,
            request.cache_salt,
            request.mm_hashes,
        )

    def _emit_stored(self, request: Request, keys: list[bytes], indices: list[int]) -> None:
        """Record the hashes of the request's pages `indices` (just inserted into the tree) and one BlockStored
        per run of consecutive ones."""
        assert self._events is not None
        ps = self.page_size
        pages = self._requests[request.request_id].pages
        for i in indices:
            self._page_hash[pages[i]] = external_block_hash(keys[i])
        run_start = indices[0]
        for k, i in enumerate(indices):
            if k + 1 == len(indices) or indices[k + 1] != i + 1:
                self._events.append(block_stored(request, keys, run_start, i + 1, ps))
                if k + 1 < len(indices):
                    run_start = indices[k + 1]

    def explain_miss(self, request: Request, num_cached_tokens: int) -> CacheMiss | None:
        return self.misses.explain(request, num_cached_tokens)

    def free(self, request: Request) -> None:
        self._lookups.pop(request.request_id, None)
        self.misses.forget(request.request_id)
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        # tail first, so the next allocations reuse the pages least likely to matter
        uncached = state.pages[state.committed // self.page_size :]
        self._free.extend(reversed(uncached))
        self._invalidated(uncached)
        self.tree.touch(state.node)
        self.tree.unlock(state.node)
        root = state.node
        while root.parent is not None:
            root = root.parent
        self.tree.drop_root_if_unused(root)

    def reset_prefix_cache(self, salt_filter: Callable[[str | None], bool] | None = None) -> bool:
        """Evict every unlocked node (with salt_filter: in the namespaces whose cache_salt it accepts). Unlike
        vLLM (which refuses and keeps everything while blocks are in use) what running requests hold stays
        and the rest goes; False tells the caller something stayed. Events: BlockRemoved for what went, or one
        AllBlocksCleared when nothing stayed cached."""
        if salt_filter is None:
            mark = len(self._events) if self._events is not None else 0
            self._release(self.tree.evict(self.tree.evictable_tokens // self.page_size), "reset")
            if not self.tree.protected_tokens and not self.tree.evictable_tokens:
                self._collapse_full_reset(mark)
            return not self._requests
        chosen = [ns for ns in self.tree.roots if isinstance(ns, tuple) and salt_filter(ns[1])]
        for namespace in chosen:
            self._release(self.tree.evict_namespace(namespace), "reset")
        return not any(ns in self.tree.roots for ns in chosen)

    def enable_events(self) -> None:
        """Page hashes are recorded at insertion only: a tree that already holds pages can't be described."""
        if self._events is None:
            if self.tree.num_nodes:
                raise ValueError("enable KV events before the first request: the radix tree already holds pages")
            self._page_hash = [0] * self.num_pages
        super().enable_events()

    def retain_cached(self, request: Request, seconds: float, priority: int = 0) -> int:
        """The tree reads the table when it evicts: a retained leaf page is spared while anything else can go."""
        if not self.retention.capacity:
            return 0
        pages = self._cached_pages(request)
        self.retention.retain(pages, 0, priority, seconds)
        return len(pages)

    def release_retention(self, request: Request, keep_tokens: int = 0) -> int:
        """The tree reads the table when it evicts: a page out of it is an ordinary leaf page again."""
        if not self.retention:
            return 0
        return len(self.retention.release(self._cached_pages(request)[keep_tokens // self.page_size :]))

    def _cached_pages(self, request: Request) -> list[int]:
        """The tree's pages of request.token_ids' cached prefix (whole pages, never the last token's)."""
        path, matched = self.tree.match(self._namespace(request), self._keys(request), request.num_tokens - 1)
        return [page for node in path for page in node.pages][: matched // self.page_size]

    def num_cached_pages(self) -> int:
        return (self.tree.evictable_tokens + self.tree.protected_tokens) // self.page_size

    def cached_block_hashes(self) -> set[int]:
        if self._events is None:
            return set()
        return {self._page_hash[p] for node in self.tree.nodes() for p in node.pages}

    # -- views ---------------------------------------------------------------------------------------------
    def summary(self, top_k: int = 5) -> CacheSummary:
        out = super().summary()
        tree = self.tree
        out.cached_tokens = tree.evictable_tokens + tree.protected_tokens
        out.running_requests = len(self._requests)
        out.top_prefixes = self.top_prefixes(top_k)
        out.by_namespace = self._by_namespace()
        out.details.update(
            eviction=tree.eviction.name,
            nodes=tree.num_nodes,
            namespaces=len(tree.roots),
            evictable_tokens=tree.evictable_tokens,
            protected_tokens=tree.protected_tokens,
        )
        return out

    def _by_namespace(self) -> list[NamespaceUsage]:
        """Per root: its adapter, cache_salt (tenant), cached tokens and admissions that hit it; largest first."""
        rows = []
        for namespace, root in self.tree.roots.items():
            salt, lora = self._salt_and_lora(namespace)
            tokens, stack = 0, list(root.children.values())
            while stack:
                node = stack.pop()
                tokens += len(node.tokens)
                stack.extend(node.children.values())
            hits = sum(child.hits for child in root.children.values())
            rows.append(NamespaceUsage(salt, lora, tokens, hits))
        rows.sort(key=lambda r: (-r.cached_tokens, str(r.cache_salt)))
        return rows

    def top_prefixes(self, k: int = 5) -> list[HotPrefix]:
        """The most hit prefixes, each reported once: a node whose hits all went on to one listed child is
        only the start of that prefix and is skipped."""
        nodes = sorted((n for n in self.tree.nodes() if n.hits), key=lambda n: (-n.hits, -self.tree.depth(n)))
        listed: list[RadixNode] = []
        for node in nodes:
            if any(c.hits == node.hits for c in node.children.values() if c in listed):
                continue
            listed.append(node)
            if len(listed) == k:
                break
        return [HotPrefix(*self._salt_and_lora(n.namespace), self.tree.depth(n), n.hits, n.lock_ref) for n in listed]

    @staticmethod
    def _salt_and_lora(namespace) -> tuple[str | None, str | None]:
        """A tree namespace as (cache_salt, lora_id): (adapter, salt) when an adapter is set, else the salt."""
        lora, salt = namespace if isinstance(namespace, tuple) else (None, namespace)
        return salt, lora

    def render_tree(self, tokenizer_decode=None, max_depth: int = 3, max_children: int = 5) -> str:
        """The top of the tree as text: per node its tokens, hits, locks and the start of its run."""

        def label(node: RadixNode) -> str:
            run = node.tokens
            if tokenizer_decode is not None:
                ids = [t for t in run[:32] if isinstance(t, int)]
                text = repr(tokenizer_decode(ids))
                if len(text) > 64:
                    text = text[:61] + "..."
            else:
                text = " ".join(map(str, run[:8])) + (" ..." if len(run) > 8 else "")
            return f"+{len(run)} tok  hits={node.hits} locks={node.lock_ref}  {text}"

        lines = [
            f"radix cache: {self.tree.num_nodes} nodes, {self.tree.evictable_tokens + self.tree.protected_tokens}"
            f" cached tokens ({self.tree.protected_tokens} locked), page_size={self.page_size}"
        ]

        def walk(node: RadixNode, prefix: str, depth: int) -> None:
            kids = sorted(node.children.values(), key=lambda c: (-c.hits, -c.last_access))
            shown = kids[:max_children]
            for i, child in enumerate(shown):
                last = i == len(shown) - 1 and len(kids) <= max_children
                lines.append(f"{prefix}{'└─ ' if last else '├─ '}{label(child)}")
                if depth + 1 < max_depth:
                    walk(child, prefix + ("   " if last else "│  "), depth + 1)
                elif child.children:
                    lines.append(f"{prefix}{'   ' if last else '│  '}└─ ... {len(child.children)} more below")
            if len(kids) > max_children:
                lines.append(f"{prefix}└─ ... {len(kids) - max_children} more")

        for namespace, root in sorted(self.tree.roots.items(), key=lambda kv: str(kv[0])):
            lines.append(
                f"namespace lora={namespace[0]!r} salt={namespace[1]!r}"
                if isinstance(namespace, tuple)
                else f"namespace {namespace!r}"
            )
            walk(root, "", 0)
        return "\n".join(lines)

    # -- checks --------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        tree, ps = self.tree, self.page_size
        owner: dict[int, str] = {}

        def own(page: int, who: str) -> None:
            assert 0 <= page < self.num_pages, f"page {page} out of range"
            assert page not in owner, f"page {page} owned by {owner[page]} and {who}"
            owner[page] = who

        for page in self._free:
            own(page, "free list")
        evictable = protected = count = 0
        expected_locks: dict[int, int] = {}
        for state in self._requests.values():
            node: RadixNode | None = state.node
            while node is not None:
                expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                node = node.parent
        for namespace, root in tree.roots.items():
            assert root.parent is None and not root.tokens and not root.pages and root.namespace == namespace
            assert root.lock_ref == expected_locks.get(id(root), 0), "root lock count"
            assert root.children or root.lock_ref, "an empty unused root should have been dropped"
            stack = [root]
            while stack:
                node = stack.pop()
                for key, child in node.children.items():
                    count += 1
                    assert child.parent is node, "parent pointer"
                    assert child.tokens and len(child.tokens) == len(child.pages) * ps, "run/page length mismatch"
                    assert key == tree.key(child.tokens, 0), "child keyed by its first token/page"
                    assert child.namespace == namespace
                    assert child.lock_ref == expected_locks.get(id(child), 0), "lock count != holders"
                    assert child.lock_ref <= node.lock_ref, "a parent is locked at least as often as its child"
                    if child.lock_ref:
                        protected += len(child.tokens)
                    else:
                        evictable += len(child.tokens)
                    for page in child.pages:
                        own(page, "tree")
                    stack.append(child)
        assert count == tree.num_nodes, f"node counter {tree.num_nodes} != {count}"
        assert evictable == tree.evictable_tokens, f"evictable counter {tree.evictable_tokens} != {evictable}"
        assert protected == tree.protected_tokens, f"protected counter {tree.protected_tokens} != {protected}"
        entries = tree.evictable_leaf_priorities()
        for node in tree.nodes():
            if node.lock_ref == 0 and not node.children:
                assert id(node) in entries, "evictable leaf missing from the eviction heap"
                if tree.eviction.name == "lru":
                    assert entries[id(node)] == node.last_access, "stale LRU heap entry"
        for rid, state in self._requests.items():
            assert state.committed % ps == 0 and state.committed == tree.depth(state.node), "committed != node depth"
            assert state.node.parent is not None or tree.roots.get(state.node.namespace) is state.node, "node evicted"
            n = state.committed // ps
            assert state.pages[:n] == tree.path_pages(state.node), f"{rid}: page table disagrees with the tree"
            for page in state.pages[n:]:
                own(page, f"request {rid}")
        assert len(owner) == self.num_pages, f"{self.num_pages - len(owner)} pages leaked"
        self.retention.check()
        assert all(owner[page] == "tree" for page in self.retention.pages()), "a retained page is not in the tree"
        self.misses.check({page for page, who in owner.items() if who == "tree"})
