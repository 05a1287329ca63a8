"""Requests for cache tests without a model: the KV managers only look at token ids and counters."""

from __future__ import annotations

import itertools

from prefixkv.engine.scheduler import admit_request
from prefixkv.request import Request
from prefixkv.request_options import RequestOptions, Retention
from prefixkv.sampling_params import SamplingParams

_ids = itertools.count()


def request_of(request_id: str, tokens, sampling: SamplingParams, mm_hashes=(), **options) -> Request:
    """A Request with RequestOptions from keywords: its fields, and retention_seconds / retention_priority /
    retention_spans for its Retention (the tests' short form)."""
    retention = {k.removeprefix("retention_"): options.pop(k) for k in list(options) if k.startswith("retention_")}
    return Request(
        request_id,
        list(tokens),
        RequestOptions(sampling, retention=Retention(**retention), **options),
        mm_hashes=mm_hashes,
    )


def make_request(tokens, **kw) -> Request:
    return request_of(f"r{next(_ids)}", tokens, SamplingParams(max_tokens=8), **kw)


def admit(kv, req, budget=10**9) -> bool:
    """What the scheduler does at admission: look up the hit, take it and allocate the rest (one chunk)."""
    cached = kv.lookup(req)
    n = min(req.num_tokens - cached, budget)
    return admit_request(kv, req, n, cached)


def compute(kv, req, n=None) -> None:
    """Pretend a forward pass computed the allocated tokens."""
    cap = len(kv.page_table(req)) * kv.page_size
    req.num_computed_tokens = min(req.num_tokens, cap) if n is None else req.num_computed_tokens + n
    kv.commit(req)


def run_to_completion(kv, req) -> None:
    assert admit(kv, req)
    compute(kv, req)
