"""TieredKVCache without a model: a fake pool whose "KV" of a position is a digest of the prefix up to it (and the
request's salt), so a slot holds the right KV exactly when a load or a forward pass put the right bytes there.

The driver runs the real scheduler; each step it applies the loads, checks that every scheduled request's context
already holds the right KV (what attention would read), "computes" the new positions, commits, and saves the
queued chunks into the tier, as the engine does. Pool pages are 16 tokens, chunks 32, one token 8 bytes.
"""

from __future__ import annotations

import hashlib
import time

import pytest

from prefixkv.config import EngineConfig
from prefixkv.engine.policy_factory import create_policy
from prefixkv.engine.scheduler import Scheduler
from prefixkv.kvcache.factory import create_kv_cache_manager
from prefixkv.kvcache.offload.disk_tier import DiskTier
from prefixkv.kvcache.offload.host_tier import HostTier
from prefixkv.kvcache.offload.tier import TierManifest
from prefixkv.kvcache.offload.tiered_cache import TieredKVCache
from prefixkv.request import RequestStatus
from tests.kvcache.helpers import make_request

PAGE, CHUNK, TOKEN_BYTES = 16, 32, 8
MANIFEST = TierManifest("fake-model", "float32", CHUNK, TOKEN_BYTES, "sha256")


def kv_of(req, pos: int) -> bytes:
    """The fake KV of position pos of req: a digest of everything attention there depends on."""
    text = f"{req.cache_salt}|{req.lora_id}|{req.token_ids[: pos + 1]}"
    return hashlib.blake2b(text.encode(), digest_size=TOKEN_BYTES).digest()


class FakeEngine:
    def __init__(
        self,
        kind: str,
        num_pages: int,
        tier,
        max_staged_bytes: int = 1 << 20,
        write_policy: str = "write_through",
        clock=time.monotonic,
    ) -> None:
        config = EngineConfig(prefix_cache=kind, page_size=PAGE, kv_cache_tokens=num_pages * PAGE)
        inner = create_kv_cache_manager(kind, num_pages, PAGE, clock=clock)
        self.kv = TieredKVCache(inner, tier, CHUNK, "sha256", write_policy, max_staged_bytes=max_staged_bytes)
        self.tier = tier
        self.scheduler = Scheduler(config, self.kv, create_policy(config))
        self.pool = [b""] * (num_pages * PAGE)

    def slot(self, req, pos: int) -> int:
        return self.kv.page_table(req)[pos // PAGE] * PAGE + pos % PAGE

    def save(self) -> None:
        for save in self.kv.drain_saves():
            self.tier.put(save.key, b"".join(self.pool[s] for s in save.slots))

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.save()  # write_back: what this step's allocations evict, before anything overwrites it
        for load in self.kv.drain_loads():
            for i, slot in enumerate(load.slots):
                t = load.first_token + i
                self.pool[slot] = load.payload[t * TOKEN_BYTES : (t + 1) * TOKEN_BYTES]
        sampled = []
        for req, n in out.scheduled:
            start = req.num_computed_tokens
            for pos in range(start):  # the context attention reads must be the right KV, loaded or computed
                assert self.pool[self.slot(req, pos)] == kv_of(req, pos), f"{req.request_id}: wrong KV at {pos}"
            for pos in range(start, start + n):
                self.pool[self.slot(req, pos)] = kv_of(req, pos)
            done = start + n == req.num_tokens
            sampled.append(sum(req.token_ids) % 1000 if done else None)
        self.scheduler.update(out, sampled)
        self.save()
        for req, _ in out.scheduled:
            if req.num_output_tokens >= req.max_tokens:
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
        self.kv.check_invariants()

    def run(self, req, max_tokens: int = 2):
        """Run req alone to completion; return its cached tokens at admission."""
        req.max_tokens = max_tokens
        self.scheduler.add(req)
        while self.scheduler.has_work():
            self.step()
        return req.num_cached_tokens


def host_tier(chunks: int = 64) -> HostTier:
    return HostTier(chunks * MANIFEST.payload_bytes, MANIFEST)


PROMPT_A = list(range(1000, 1100))  # 100 tokens: chunks [0, 32), [32, 64), [64, 96) are full
PROMPT_B = list(range(2000, 2100))


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_an_evicted_prompt_comes_back_from_the_tier(kind):
    eng = FakeEngine(kind, num_pages=8, tier=host_tier())  # 128 tokens: B evicts A
    assert eng.run(make_request(PROMPT_A)) == 0
    assert eng.tier.stats.entries == 3  # write-through: every full chunk (the 2 outputs end no new chunk)
    assert eng.run(make_request(PROMPT_B)) == 0
    assert eng.kv.inner.lookup(make_request(PROMPT_A)) < 96  # the pool lost A
    again = make_request(PROMPT_A)
    assert eng.run(again) == 96  # the tier gave it back (the driver checked every loaded slot)
    assert eng.kv.tier_stats.hit_tokens > 0 and eng.kv.tier_stats.loaded_bytes > 0


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_a_hit_can_start_in_the_pool_and_go_on_in_the_tier(kind):
    eng = FakeEngine(kind, num_pages=10, tier=host_tier())  # 160 tokens
    eng.run(make_request(PROMPT_A))
    eng.run(make_request(PROMPT_B[:96]))  # evicts A's last 3 full pages only: the pool keeps 48 tokens
    pool_hit = eng.kv.inner.lookup(make_request(PROMPT_A))
    assert pool_hit == 48  # not a chunk boundary: the tier serves the rest of chunk 1, then chunk 2
    again = make_request(PROMPT_A)
    assert eng.run(again) == 96
    assert eng.kv.tier_stats.hit_tokens == 96 - pool_hit and eng.kv.tier_stats.pool_hit_tokens >= pool_hit


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_write_back_saves_a_chunk_when_its_pages_are_reused_and_the_rest_on_demand(kind):
    eng = FakeEngine(kind, num_pages=8, tier=host_tier(), write_policy="write_back")
    eng.run(make_request(PROMPT_A))
    assert eng.tier.stats.entries == 0  # nothing evicted yet: nothing written
    eng.run(make_request(PROMPT_B))  # its allocation reuses a's pages: a's chunks are saved before it computes
    assert eng.tier.stats.entries == 3
    assert eng.run(make_request(PROMPT_A)) == 96  # the driver checked every loaded slot against a's KV
    eng.kv.save_all_pending()  # as the engine does at close: b's chunks (and a's, if evicted again) go now
    eng.save()
    eng.kv.check_invariants()
    assert eng.kv._unsaved == {} and FakeEngine(kind, 8, eng.tier).run(make_request(PROMPT_B)) == 96


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_demote_saves_a_finished_sequence_now_and_its_chunks_are_then_readable(kind):
    eng = FakeEngine(kind, num_pages=8, tier=host_tier(), write_policy="write_back")
    a = make_request(PROMPT_A)
    eng.run(a)
    probe = make_request(PROMPT_A)
    assert eng.kv.readable_chunks(probe) == []  # all in the pool: nothing to read from the tier
    eng.kv.free(probe)
    assert eng.kv.demote(a) == 3 and eng.kv.demote(a) == 0  # its 3 full chunks, once
    eng.save()
    assert eng.tier.stats.entries == 3
    eng.run(make_request(PROMPT_B))  # evicts a's pages: nothing left to save for them
    assert eng.tier.stats.entries == 3
    probe = make_request(PROMPT_A)
    assert len(eng.kv.readable_chunks(probe)) == 3 - eng.kv.inner.lookup(probe) // CHUNK
    eng.kv.free(probe)
    assert eng.run(make_request(PROMPT_A)) == 96  # the driver checked every loaded slot against a's KV


def test_a_new_cache_on_the_same_tier_is_warm_like_after_a_restart():
    tier = host_tier()
    FakeEngine("hash", 8, tier).run(make_request(PROMPT_A))
    for kind in ("hash", "radix"):
        assert FakeEngine(kind, 8, tier).run(make_request(PROMPT_A)) == 96


class _DamagingTier(HostTier):
    """A tier whose entry under `bad` fails verification (get returns None), as a corrupt file would."""

    bad: bytes | None = None

    def get(self, key):
        if key == self.bad:
            self.stats.corrupt += 1
            return None
        return super().get(key)


def test_a_chunk_that_fails_verification_ends_the_hit_and_is_recomputed():
    tier = _DamagingTier(64 * MANIFEST.payload_bytes, MANIFEST)
    first = FakeEngine("hash", 8, tier)
    first.run(make_request(PROMPT_A))
    tier.bad = first.kv._chunk_keys(first.kv._state(make_request(PROMPT_A)), 3)[1]
    eng = FakeEngine("hash", 8, tier)
    again = make_request(PROMPT_A)
    assert eng.run(again) == 32  # chunk 0 only: chunk 1 is damaged, and chunk 2 is not reached
    assert eng.kv.tier_stats.failed_reads == 1


def test_salts_and_adapters_isolate_tier_entries():
    tier = host_tier()
    FakeEngine("hash", 8, tier).run(make_request(PROMPT_A, cache_salt="alice"))
    eng = FakeEngine("hash", 8, tier)
    assert eng.run(make_request(PROMPT_A, cache_salt="bob")) == 0
    assert eng.run(make_request(PROMPT_A, lora_id="x", cache_salt="alice")) == 0
    eng = FakeEngine("radix", 8, tier)
    assert eng.run(make_request(PROMPT_A)) == 0
    assert eng.run(make_request(PROMPT_A, cache_salt="alice")) == 96


def test_staging_is_bounded_and_waiting_lookups_do_not_reread():
    tier = host_tier()
    FakeEngine("hash", 8, tier).run(make_request(PROMPT_A))
    eng = FakeEngine("hash", 8, tier, max_staged_bytes=2 * MANIFEST.payload_bytes)
    waiting = make_request(PROMPT_A)
    assert eng.kv.lookup(waiting) == 96  # two chunks read and staged, the third promised unread (staging full)
    assert tier.stats.hits == 2
    other = make_request(PROMPT_A + [7])
    assert eng.kv.lookup(waiting) == 96 and eng.kv.lookup(other) == 96 and tier.stats.hits == 2  # no re-reads
    eng.kv.check_invariants()
    eng.kv.free(waiting)
    eng.kv.free(other)
    assert eng.kv._staged_bytes == 0
    assert eng.run(make_request(PROMPT_A)) == 96  # the unstaged chunk is read at admission


def test_a_chunk_promised_unread_that_fails_at_admission_is_recomputed():
    tier = _DamagingTier(64 * MANIFEST.payload_bytes, MANIFEST)
    first = FakeEngine("hash", 8, tier)
    first.run(make_request(PROMPT_A))
    tier.bad = first.kv._chunk_keys(first.kv._state(make_request(PROMPT_A)), 3)[2]
    eng = FakeEngine("radix", 8, tier, max_staged_bytes=MANIFEST.payload_bytes)
    req = make_request(PROMPT_A)
    assert eng.kv.lookup(req) == 96  # chunk 0 verified; chunks 1 and 2 promised unread
    assert eng.run(req) == 64  # admission refused once (chunk 2 failed), then the hit ends before chunk 2
    assert eng.kv.tier_stats.failed_reads == 1


class _ThreadRecordingTier(HostTier):
    """Records which thread each get() ran on (the prefetch reads must not run on the caller's)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.get_threads: list[str] = []

    def get(self, key):
        import threading

        self.get_threads.append(threading.current_thread().name)
        return super().get(key)


def test_prefetch_reads_a_new_requests_chunks_in_the_background():
    tier = _ThreadRecordingTier(64 * MANIFEST.payload_bytes, MANIFEST)
    FakeEngine("hash", 8, tier).run(make_request(PROMPT_A))
    eng = FakeEngine("radix", 8, tier, max_staged_bytes=2 * MANIFEST.payload_bytes)
    req = make_request(PROMPT_A)
    eng.kv.prefetch(req)  # two chunks fit the staging bound: those two are read by the prefetch thread
    eng.kv.check_invariants()  # reads in flight count against the bound
    assert eng.run(req) == 96  # the third chunk is read at admission; the driver checked every loaded slot
    assert len(tier.get_threads) == 3 and all("prefetch" in t for t in tier.get_threads[:2])
    assert "prefetch" not in tier.get_threads[2] and eng.kv._staged_bytes == 0

    bad = _DamagingTier(64 * MANIFEST.payload_bytes, MANIFEST)  # a prefetched chunk that fails verification
    FakeEngine("hash", 8, bad).run(make_request(PROMPT_A))
    bad.bad = eng.kv._chunk_keys(eng.kv._state(make_request(PROMPT_A)), 3)[1]
    eng = FakeEngine("hash", 8, bad)
    req, dropped = make_request(PROMPT_A), make_request(PROMPT_A + [5])
    eng.kv.prefetch(req)
    eng.kv.prefetch(dropped)
    eng.kv.free(dropped)  # freed before its reads were used: their bytes leave the bound
    assert eng.run(req) == 32 and eng.kv.tier_stats.failed_reads == 1
    eng.kv.close()
    assert eng.kv._staged_bytes == 0


def test_a_read_ahead_is_taken_by_the_request_it_was_for_and_yields_to_requests_in_hand(tmp_path):
    """Chunks read ahead of any request (TieredKVCache.read_ahead, by chunk key) are loaded by the request whose
    prompt extends them, without another read; they count in the staging bound, where a request's own chunks
    come first (the oldest reads ahead are dropped for room)."""
    tier = DiskTier(str(tmp_path), 64 * MANIFEST.payload_bytes, MANIFEST)
    FakeEngine("hash", 8, tier).run(make_request(PROMPT_A))
    FakeEngine("hash", 8, tier).run(make_request(PROMPT_B))
    eng = FakeEngine("radix", 8, tier, max_staged_bytes=3 * MANIFEST.payload_bytes)
    assert eng.kv.read_ahead(make_request(PROMPT_A)) == 3  # a finished sequence: its next turn extends it
    eng.kv.check_invariants()  # reads ahead count against the bound
    eng.kv.wait_reads()
    reads = tier.stats.hits
    assert eng.run(make_request([*PROMPT_A, 5, 6])) == 96  # the driver checked every loaded slot
    assert tier.stats.hits == reads and eng.kv.tier_stats.read_ahead_loaded_chunks == 3

    eng = FakeEngine("hash", 8, tier, max_staged_bytes=3 * MANIFEST.payload_bytes)
    assert eng.kv.read_ahead(make_request(PROMPT_A)) == 3  # staging full of reads ahead
    eng.kv.prefetch(b := make_request(PROMPT_B))  # a request in hand: A's reads ahead make room for it
    assert eng.kv.tier_stats.read_ahead_dropped_chunks == 3 and eng.run(b) == 96
    assert eng.kv.read_ahead(make_request(PROMPT_A)) == 3
    assert eng.kv.drop_read_ahead(make_request(PROMPT_A), keep_tokens=40) == 2  # chunk 0 is wholly inside 40
    eng.kv.check_invariants()
    tier.close()


def test_a_session_read_ahead_starts_before_its_pause_ends_and_is_dropped_when_superseded_released_or_late(
    tmp_path,
):
    """SessionPins with +prefetch (engine/agent_sessions.py) on its injected clock: a turn announcing a 30 s pause is
    read back from 29 s on (1 s lead, no read measured yet), not at all if the session is back first; what was read
    is dropped when the session (here its parent) is released, or when it is later than the pause x 1.25 + 1 s."""
    from prefixkv.engine.agent_sessions import SessionPins
    from prefixkv.session_hint import SessionHint

    now = [100.0]
    tier = DiskTier(str(tmp_path), 64 * MANIFEST.payload_bytes, MANIFEST)
    FakeEngine("hash", 8, tier).run(make_request(PROMPT_A))
    kv = FakeEngine("hash", 8, tier, clock=lambda: now[0]).kv  # its pool never held A: only the tier does
    with pytest.raises(ValueError, match="needs a tier"):
        SessionPins(kv.inner, "session+prefetch")
    pins = SessionPins(kv, "none+prefetch")
    staged = kv.tier.manifest.payload_bytes * 3

    def turn(session: str, parent: str | None = None, pause: float | None = 30.0, action: str = "keep") -> None:
        request = make_request(PROMPT_A, session=SessionHint(session, parent, pause, action))
        pins.on_add(request)
        pins.on_finish(request)  # answered at once (the clock stands still)

    turn("child", parent="agent")
    assert pins.run_timers() == 29.0 and pins.read_aheads == 0
    now[0] = 110.0
    turn("child", parent="agent")  # back early: the first read-ahead never starts; this one is due at 139
    assert pins.run_timers() == 29.0
    now[0] = 139.0
    assert pins.run_timers() == 9.5 and pins.read_ahead_chunks == 3 and kv._staged_bytes == staged
    turn("agent", pause=None, action="release")  # the parent ends: its subagent's read-ahead goes with it
    assert kv._staged_bytes == 0 and pins.read_ahead_dropped_chunks == 3 and pins.run_timers() is None

    turn("solo")
    now[0] += 29.0
    assert pins.run_timers() == 9.5 and kv._staged_bytes == staged
    now[0] += 9.5  # 38.5 s after the answer: the session is late past the pause policy's horizon
    assert pins.run_timers() is None and kv._staged_bytes == 0 and pins.read_aheads_expired == 1
    assert pins.summary()["session_read_aheads"] == 2 and pins.summary()["session_policy"] == "none+prefetch"
    kv.check_invariants()
    tier.close()


def test_options_are_checked():
    inner = create_kv_cache_manager("hash", 8, PAGE)
    with pytest.raises(ValueError, match="kv_offload_chunk_tokens"):
        TieredKVCache(inner, host_tier(), 24, "sha256")
    with pytest.raises(ValueError, match="prefix cache"):
        TieredKVCache(create_kv_cache_manager("off", 8, PAGE), host_tier(), CHUNK)
    with pytest.raises(ValueError, match="kv_offload_write_policy"):
        TieredKVCache(inner, host_tier(), CHUNK, write_policy="write_around")
    with pytest.raises(ValueError, match="one chunk"):
        HostTier(10, MANIFEST)


def test_the_writer_drops_saves_rather_than_stall_a_step():
    import threading

    from prefixkv.kvcache.offload.writer import TierWriter

    release = threading.Event()

    class SlowTier(HostTier):
        def put(self, key, payload):
            release.wait(10)  # a hang guard only
            super().put(key, payload)

    tier = SlowTier(64 * MANIFEST.payload_bytes, MANIFEST)
    writer = TierWriter(tier, max_pending=2)
    payload = bytes(MANIFEST.payload_bytes)
    results = [writer.submit(bytes([i]) * 32, payload) for i in range(6)]  # one in put, two queued, the rest dropped
    assert results.count(False) == writer.dropped >= 3
    release.set()
    writer.close()
    assert writer.written == tier.stats.entries == 6 - writer.dropped and writer.failed == 0
    assert not writer.submit(b"k" * 32, payload)  # closed: nothing more is stored


def test_config_checks_the_offload_options():
    from prefixkv.config import EngineConfig

    with pytest.raises(ValueError, match="prefix cache"):
        EngineConfig(prefix_cache="off", kv_offload_dir="/tmp/x")
    with pytest.raises(ValueError, match="kv_offload_chunk_tokens"):
        EngineConfig(page_size=16, kv_offload_host_size=1 << 20, kv_offload_chunk_tokens=40)
    with pytest.raises(ValueError, match="kv_offload_size"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_offload_size=0)
    with pytest.raises(ValueError, match="needs a tier"):  # refused, never accepted and ignored
        EngineConfig(session_policy="session+prefetch")
    assert EngineConfig(session_policy="pause+prefetch", kv_offload_host_size=1 << 20).session_policy
    with pytest.raises(ValueError, match="kv_offload_host_size"):
        EngineConfig(kv_offload_host_size=-1)
    with pytest.raises(ValueError, match="set one of them"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_offload_host_size=1 << 20)
    with pytest.raises(ValueError, match="kv_offload_write_policy"):
        EngineConfig(kv_offload_write_policy="write_around")
    with pytest.raises(ValueError, match="kv_offload_on_mismatch"):
        EngineConfig(kv_offload_on_mismatch="maybe")
    assert EngineConfig(page_size=48).kv_offload is False  # chunk size only matters with a tier
    assert EngineConfig(prefix_cache="radix", kv_offload_dir="/tmp/x").kv_offload
