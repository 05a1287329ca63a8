"""Cache entries (/v1/caches, Gemini's cachedContents) behind the ingress, answered as one server answers them.

An entry lives in the store of the replica that created it, so the ingress sends everything naming it there: its
own routes (GET/PATCH/DELETE by id or name) and every request naming it in `cached_content` (Gemini:
`cachedContent`). A listing is every replica's, merged. This module is the pure part (ingress.py makes the Ray
calls):

- `cache_call`: what a request does with entries: create one, list them, act on one by its path, or use one.
- `EntryPins`: entry id -> the replica holding it, learned from the create answers the ingress forwarded (or, for
  an entry it never saw created, e.g. after an ingress restart, by asking the replicas); with the entry's prefix
  (its messages or prompt tokens) while there is room, so a request using it routes on the prompt the engine
  will see.
- the listing merge: the same page asked of each replica (from its own page token), merged newest first by create
  time (each replica's own order kept). The merged page token carries, per replica with rows left, that
  replica's token right after the last row the merged page took from it (each row's token comes in
  PAGE_TOKENS_HEADER), so paging resumes exactly as on one server, deletions and creations meanwhile included:
  entries created after the first page, like one server's, are not in the later pages.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixkv.server.cache_store import entry_id_of
from prefixkv.server.caches import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE

OPENAI_CACHES = "/v1/caches"
GEMINI_CACHES = "/v1beta/cachedContents"
INVALID_PAGE_TOKEN = "0"  # every replica refuses it (its tokens are sequence numbers from 1), in its own shape
_TOKEN_TAG = "pkv1."  # the ingress's merged page tokens start with it; anything else is not one it gave out


@dataclass(frozen=True)
class CacheCall:
    """What one request does with cache entries. kind: "create", "list", "entry" (a route of its own, by path) or
    "use" (a generation naming one); api: "openai" (/v1/caches) or "gemini" (cachedContents), whose shapes differ."""

    kind: str
    api: str = "openai"
    entry_id: str | None = None


def cache_call(method: str, path: str, body: Any) -> CacheCall | None:
    """The request's cache call, or None for a request that names no entry (routed as before)."""
    method = method.upper()
    for base, api in ((OPENAI_CACHES, "openai"), (GEMINI_CACHES, "gemini")):
        if path == base:
            return {"POST": CacheCall("create", api), "GET": CacheCall("list", api)}.get(method)
        if path.startswith(base + "/"):
            name = path[len(base) + 1 :]
            return CacheCall("entry", api, entry_id_of(name)) if name and method in ("GET", "PATCH", "DELETE") else None
    used = named_content(body) if method == "POST" else None
    return None if used is None else CacheCall("use", entry_id=entry_id_of(used))


def named_content(body: Any) -> str | None:
    """The entry a generation body names: `cached_content` (OpenAI and Anthropic shapes, prefixkv's extension),
    Gemini's `cachedContent`, or either inside countTokens' `generateContentRequest`."""
    if not isinstance(body, dict):
        return None
    for key in ("cached_content", "cachedContent"):
        if isinstance(body.get(key), str):
            return body[key]
    for key in ("generateContentRequest", "generate_content_request"):
        if isinstance(body.get(key), dict):
            return named_content(body[key])
    return None


def created_entry_id(api: str, answer_body: bytes) -> str | None:
    """The id of the entry a create answer (status 200) describes: /v1/caches' `id`, Gemini's `name`."""
    try:
        body = json.loads(answer_body)
    except ValueError:
        return None
    name = body.get("id" if api == "openai" else "name") if isinstance(body, dict) else None
    return entry_id_of(name) if isinstance(name, str) else None


@dataclass(frozen=True)
class EntryPrefix:
    """What an entry puts before a request's own prompt: a "messages" entry's messages (rendered with the
    request's by the chat template) or a "prompt" entry's token ids."""

    kind: str
    token_ids: tuple[int, ...] = ()
    messages: tuple[Any, ...] = ()


def entry_prefix(create_body: Any, prompt_tokens: Sequence[int]) -> EntryPrefix | None:
    """The prefix a /v1/caches create body makes (prompt_tokens: its prompt's ids, as the ingress tokenized them;
    empty without a tokenizer, then None: routing does not read prompts)."""
    if not isinstance(create_body, dict) or not prompt_tokens:
        return None
    messages = create_body.get("messages")
    if isinstance(messages, list) and messages:
        return EntryPrefix("messages", messages=tuple(messages))
    if create_body.get("prompt") is not None:
        return EntryPrefix("prompt", token_ids=tuple(prompt_tokens))
    return None


class EntryPins:
    """Entry id -> the replica holding it, least recently used dropped past max_entries (a dropped entry is found
    again by asking the replicas); prefixes are kept for the max_prefixes most recent only (they can be long)."""

    def __init__(self, max_entries: int = 65536, max_prefixes: int = 4096) -> None:
        self.max_entries, self.max_prefixes = max_entries, max_prefixes
        self._replicas: OrderedDict[str, str] = OrderedDict()
        self._prefixes: OrderedDict[str, EntryPrefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replicas)

    def pin(self, entry_id: str, replica_id: str, prefix: EntryPrefix | None = None) -> None:
        self._replicas[entry_id] = replica_id
        self._replicas.move_to_end(entry_id)
        if len(self._replicas) > self.max_entries:
            dropped, _ = self._replicas.popitem(last=False)
            self._prefixes.pop(dropped, None)
        if prefix is not None:
            self._prefixes[entry_id] = prefix
            self._prefixes.move_to_end(entry_id)
            if len(self._prefixes) > self.max_prefixes:
                self._prefixes.popitem(last=False)

    def replica(self, entry_id: str) -> str | None:
        replica = self._replicas.get(entry_id)
        if replica is not None:
            self._replicas.move_to_end(entry_id)
        return replica

    def prefix(self, entry_id: str) -> EntryPrefix | None:
        return self._prefixes.get(entry_id)

    def unpin(self, entry_id: str) -> None:
        self._replicas.pop(entry_id, None)
        self._prefixes.pop(entry_id, None)


# -- listings -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ListShape:
    """How one API spells a listing: its query parameters and body keys."""

    size_param: str
    token_param: str
    rows_key: str
    next_key: str
    time_key: str


SHAPES = {
    "openai": ListShape("page_size", "page_token", "data", "next_page_token", "create_time"),
    "gemini": ListShape("pageSize", "pageToken", "cachedContents", "nextPageToken", "createTime"),
}

Cursor = dict[str, str | None]  # replica id -> its page token (None: from its newest entry)


@dataclass(frozen=True)
class ListQuery:
    size: int
    cursor: Cursor | None  # None: the first page, from every live replica


def list_query(api: str, params: Mapping[str, str]) -> ListQuery | None:
    """The page asked for, or None when a replica must answer the query (a size or token it would refuse: the
    ingress forwards it with the token made INVALID_PAGE_TOKEN, so the error is the replica's own, in the API's
    shape). /v1/caches: page_size 1-1000, default 100; Gemini: pageSize 0 (the default, 100) and up, at most 1000."""
    shape = SHAPES[api]
    raw_size = params.get(shape.size_param)
    try:
        size = int(raw_size) if raw_size is not None else (DEFAULT_PAGE_SIZE if api == "openai" else 0)
    except ValueError:
        return None
    if api == "gemini":
        if size < 0:
            return None
        size = min(size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    elif not 1 <= size <= MAX_PAGE_SIZE:
        return None
    token = params.get(shape.token_param)
    if token is None or (api == "gemini" and token == ""):
        return ListQuery(size, None)
    cursor = decode_cursor(token)
    return None if cursor is None else ListQuery(size, cursor)


def encode_cursor(cursor: Cursor) -> str:
    text = json.dumps(cursor, separators=(",", ":"), sort_keys=True)
    return _TOKEN_TAG + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(token: str) -> Cursor | None:
    """The cursor a merged page token carries; None for a token the ingress did not give out."""
    if not token.startswith(_TOKEN_TAG):
        return None
    data = token[len(_TOKEN_TAG) :]
    try:
        cursor = json.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
    except (ValueError, binascii.Error):
        return None
    if not isinstance(cursor, dict) or not cursor:
        return None
    for value in cursor.values():
        if value is not None and not (isinstance(value, str) and value.isdigit()):
            return None
    return cursor


@dataclass
class ReplicaPage:
    """One replica's page of a listing, asked for from `token` (its own; None: its newest)."""

    token: str | None
    rows: list[dict]
    row_tokens: list[str]  # each row's page token (PAGE_TOKENS_HEADER), one per row
    more: bool  # the replica has rows past this page


def replica_page(api: str, token: str | None, body: bytes, row_tokens_header: str | None) -> ReplicaPage:
    """A replica's 200 answer as a ReplicaPage; ValueError when it is not a listing with one token per row."""
    shape = SHAPES[api]
    parsed = json.loads(body)
    rows = parsed.get(shape.rows_key) if isinstance(parsed, dict) else None
    row_tokens = [t for t in (row_tokens_header or "").split(",") if t]
    if not isinstance(rows, list) or len(row_tokens) != len(rows):
        raise ValueError(f"a replica's listing has no page token per row ({len(row_tokens)} for {rows!r:.80})")
    return ReplicaPage(token, rows, row_tokens, bool(parsed.get(shape.next_key)))


async def gather_pages(
    cursor: Cursor,
    fetch: Callable[[str, str | None], Awaitable[ReplicaPage | Any | None]],
    late: Callable[[], Iterable[str]] | None = None,
) -> tuple[dict[str, ReplicaPage], list[Any]]:
    """Each cursor replica's page from its token, one replica after another (two calls of one request in flight at
    once confuse Ray Serve's routing: ingress.py's docstring): `fetch(replica, token)` gives a ReplicaPage, None (the
    replica is gone, its entries with it) or its refusal (anything else, returned in the second list). `late`:
    replicas learned while asking (the router's latest view), asked too from their newest (first pages only)."""
    cursor = dict(cursor)
    pages: dict[str, ReplicaPage] = {}
    refused: list[Any] = []
    asked: set[str] = set()
    while todo := [rid for rid in cursor if rid not in asked]:
        for rid in todo:
            asked.add(rid)
            got = await fetch(rid, cursor[rid])
            if isinstance(got, ReplicaPage):
                pages[rid] = got
            elif got is not None:
                refused.append(got)
        for rid in late() if late is not None else ():
            cursor.setdefault(rid, None)
    return pages, refused


def merge_pages(api: str, pages: Mapping[str, ReplicaPage], size: int) -> tuple[list[dict], Cursor]:
    """Up to `size` rows from the replicas' pages (each asked for `size` rows), newest first by create time, each
    replica's own order kept (ties: the replica first by id); and the cursor resuming each replica with rows left
    right after the last row taken from it (empty: this was the last page)."""
    time_key = SHAPES[api].time_key
    order = sorted(pages)
    taken = dict.fromkeys(order, 0)
    rows: list[dict] = []
    while len(rows) < size:
        heads = [rid for rid in order if taken[rid] < len(pages[rid].rows)]
        if not heads:
            break
        rid = max(heads, key=lambda r: str(pages[r].rows[taken[r]].get(time_key) or ""))
        rows.append(pages[rid].rows[taken[rid]])
        taken[rid] += 1
    cursor: Cursor = {}
    for rid in order:
        page, k = pages[rid], taken[rid]
        if k < len(page.rows) or page.more:
            cursor[rid] = page.row_tokens[k - 1] if k else page.token
    return rows, cursor


def listing_body(api: str, rows: list[dict], cursor: Cursor) -> dict:
    """The merged page as one server words it: /v1/caches' next_page_token is null on the last page, Gemini's
    nextPageToken absent."""
    token = encode_cursor(cursor) if cursor else None
    if api == "openai":
        return {"object": "list", "data": rows, "next_page_token": token}
    return {"cachedContents": rows, **({"nextPageToken": token} if token else {})}
