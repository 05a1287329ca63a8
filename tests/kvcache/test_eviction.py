"""Eviction in both prefix caches: the evicted-page counter and the choice of policy."""

import pytest

from prefixkv.kvcache.factory import create_kv_cache_manager
from tests.kvcache.helpers import make_request, run_to_completion


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_evicted_pages_counts_every_cached_page_dropped(kind):
    kv = create_kv_cache_manager(kind, 8, 4)
    first = make_request(range(17))  # 4 full pages cached, a partial fifth page private
    run_to_completion(kv, first)
    kv.free(first)
    assert kv.stats.evicted_pages == 0
    second = make_request(range(100, 125))  # 7 pages: the 4 uncached ones and 3 cached ones
    run_to_completion(kv, second)
    kv.check_invariants()
    assert kv.stats.evicted_pages == 3 and kv.summary()["evicted_pages"] == 3
    kv.free(second)
    assert kv.reset_prefix_cache()
    assert kv.stats.evicted_pages == 3 + 1 + 6  # first's last cached page and second's 6, dropped by the reset
    kv.check_invariants()
