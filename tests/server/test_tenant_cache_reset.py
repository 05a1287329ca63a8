"""The cache surface behind `/reset_prefix_cache?tenant=NAME`: reset_prefix_cache(salt_filter) on both prefix
caches, without a model. One tenant's namespaces go (those a running request holds stay, and the call says so);
every other namespace keeps its hits; the page accounting stays exact."""

from __future__ import annotations

import pytest

from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from tests.kvcache.helpers import admit, compute, make_request, run_to_completion

PROMPT = list(range(1, 50))


def _alice(salt: str | None) -> bool:
    return salt is not None and salt.startswith("alice")


@pytest.mark.parametrize("make", [lambda: HashPrefixCache(256, 4), lambda: RadixPrefixCache(256, 4)])
def test_reset_one_tenant(make):
    kv = make()
    for salt in ("alice-1", "alice-2", "bob", None):
        req = make_request(PROMPT, cache_salt=salt)
        run_to_completion(kv, req)
        kv.free(req)
    running = make_request(PROMPT + [7, 7, 7, 7], cache_salt="alice-3")  # holds its pages through the reset
    assert admit(kv, running)
    compute(kv, running)
    kv.check_invariants()

    assert kv.reset_prefix_cache(_alice) is False  # alice-3 is still held
    kv.check_invariants()
    for salt, hit in (("alice-1", 0), ("alice-2", 0), ("bob", 48), (None, 48), ("alice-3", 48)):
        assert kv.lookup(make_request(PROMPT + [9], cache_salt=salt)) == hit, salt
    if isinstance(kv, HashPrefixCache):
        assert {row.cache_salt for row in kv.summary().by_namespace} == {"bob", None, "alice-3"}

    kv.free(running)
    assert kv.reset_prefix_cache(_alice) is True
    kv.check_invariants()
    assert kv.lookup(make_request(PROMPT + [9], cache_salt="alice-3")) == 0
    assert kv.lookup(make_request(PROMPT + [9], cache_salt="bob")) == 48
    assert {row.cache_salt for row in kv.summary().by_namespace} == {"bob", None}
