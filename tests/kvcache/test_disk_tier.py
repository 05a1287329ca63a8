"""DiskTier: round trips, restart, manifest checks, damage, kill -9 mid-write, LRU capacity, the directory lock."""

from __future__ import annotations

import array
import dataclasses
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from prefixkv.kvcache.offload.disk_tier import (
    HEADER_BYTES,
    DiskTier,
    TierLockedError,
    TierMismatchError,
)
from prefixkv.kvcache.offload.tier import TierManifest

REPO = Path(__file__).resolve().parents[2]
MANIFEST = TierManifest(model_digest="ab" * 16, dtype="bfloat16", chunk_tokens=4, bytes_per_token=8, hash_algo="sha256")
PAYLOAD = MANIFEST.payload_bytes  # 32 B
ENTRY = HEADER_BYTES + PAYLOAD  # 96 B on disk


def key(i: int, size: int = 16) -> bytes:
    """A chain-key-like key: spread over the fan-out folders like real ones."""
    return hashlib.sha256(str(i).encode()).digest()[:size]


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(PAYLOAD))


def entry_file(path: Path, k: bytes) -> Path:
    return path / k.hex()[:2] / k.hex()


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def entry_files(path: Path) -> list[Path]:
    return [p for p in path.glob("??/*") if not p.name.startswith(".")]


def test_round_trip_contains_and_reopen(tmp_path):
    with DiskTier(tmp_path, 1 << 20, MANIFEST) as tier:
        assert tier.name == "disk" and not tier.contains(key(1)) and tier.get(key(1)) is None
        tier.put(key(1), payload(1))
        tier.put(key(2, 32), bytearray(payload(2)))  # 32-byte keys, any bytes-like payload
        tier.put(key(1), payload(1))  # already held: only touched
        tier.put(key(3), memoryview(array.array("f", range(PAYLOAD // 4))))  # any C-contiguous buffer
        assert tier.get(key(3)) == array.array("f", range(PAYLOAD // 4)).tobytes()
        assert tier.contains(key(1)) and tier.contains(key(2, 32))
        assert tier.get(key(1)) == payload(1) and tier.get(key(2, 32)) == payload(2)
        assert (tier.stats.entries, tier.stats.bytes, tier.stats.hits, tier.stats.misses) == (3, 3 * PAYLOAD, 3, 1)
        assert tier.stats.bytes_written == 3 * ENTRY and tier.stats.bytes_read == 3 * ENTRY
        assert tier.describe()["state"] == "ready" and tier.describe()["used_bytes"] == 3 * ENTRY
    assert tier.describe()["state"] == "closed" and not tier.contains(key(1)) and tier.get(key(1)) is None
    tier.put(key(4), payload(4))  # after close: nothing happens
    assert entry_files(tmp_path) and not entry_file(tmp_path, key(4)).exists()

    with DiskTier(tmp_path, 1 << 20, MANIFEST) as again:
        assert again.stats.entries == 3 and again.get(key(1)) == payload(1) and again.get(key(2, 32)) == payload(2)
        assert not again.contains(key(4))


def test_bad_payload_length_and_key_raise(tmp_path):
    with DiskTier(tmp_path, 1 << 20, MANIFEST) as tier:
        with pytest.raises(ValueError, match="payload is 31 B; this tier stores exactly 32 B"):
            tier.put(key(1), payload(1)[:-1])
        with pytest.raises(ValueError, match="payload is 33 B"):
            tier.put(key(1), payload(1) + b"x")
        with pytest.raises(ValueError, match="key"):
            tier.put(b"", payload(1))
        with pytest.raises(ValueError, match="key"):
            tier.put(bytes(33), payload(1))
        assert tier.stats.entries == 0 and not entry_files(tmp_path)
    with pytest.raises(ValueError, match="on_mismatch"):
        DiskTier(tmp_path, 1 << 20, MANIFEST, on_mismatch="drop")  # type: ignore[arg-type]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        DiskTier(tmp_path / "file", 1 << 20, MANIFEST)


def test_manifest_mismatch_is_refused_naming_every_field(tmp_path):
    DiskTier(tmp_path, 1 << 20, MANIFEST).close()
    other = TierManifest(model_digest="cd" * 16, dtype="float32", chunk_tokens=4, bytes_per_token=8, hash_algo="sha256")
    with pytest.raises(TierMismatchError) as refused:
        DiskTier(tmp_path, 1 << 20, other)
    message = str(refused.value)
    assert str(tmp_path) in message and "model_digest" in message and "dtype" in message and "delete" in message
    assert "chunk_tokens" not in message and isinstance(refused.value, ValueError)
    # KV from other kernels (an AMX machine's directory on an AVX-512 one) is not what a recompute here gives
    amx = dataclasses.replace(MANIFEST, kernels="matmul amx, attention amx")
    with pytest.raises(TierMismatchError, match="kernels: 'matmul amx, attention amx' != ''"):
        DiskTier(tmp_path, 1 << 20, amx)


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{not json", "unreadable"),
        ('["a list"]', "unreadable"),
        ('{"format": "something-else"}', "not a prefixkv-disk-tier manifest"),
        ('{"format": "prefixkv-disk-tier", "format_version": 1, "dtype": "bfloat16"}', "model_digest"),
    ],
)
def test_unreadable_or_foreign_manifest_is_refused(tmp_path, content, problem):
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(TierMismatchError, match=problem):
        DiskTier(tmp_path, 1 << 20, MANIFEST)


def test_directory_of_other_files_is_refused_without_a_trace(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(TierMismatchError, match="no manifest.json but other files"):
        DiskTier(tmp_path, 1 << 20, MANIFEST)
    assert snapshot(tmp_path) == {"notes.txt": b"mine"}  # not even a lock file


def test_ignore_mismatch_leaves_the_directory_untouched(tmp_path, caplog):
    with DiskTier(tmp_path, 1 << 20, MANIFEST) as owner:
        owner.put(key(1), payload(1))
    before = snapshot(tmp_path)
    other = TierManifest(
        model_digest="ef" * 16, dtype="bfloat16", chunk_tokens=4, bytes_per_token=8, hash_algo="xxhash"
    )
    with DiskTier(tmp_path, 1 << 20, other, on_mismatch="ignore") as ignored:
        assert "hash_algo" in caplog.text and str(tmp_path) in caplog.text
        assert ignored.describe()["state"] == "ignored" and "hash_algo" in ignored.disabled_reason
        assert not ignored.contains(key(1)) and ignored.get(key(1)) is None and ignored.stats.misses == 1
        ignored.put(key(2), payload(2))
        assert ignored.stats.entries == 0
        with DiskTier(tmp_path, 1 << 20, MANIFEST) as owner:  # an ignoring tier does not hold the lock
            assert owner.get(key(1)) == payload(1)
    assert snapshot(tmp_path) == before


def _flip(offset: int):
    def damage(path: Path) -> None:
        """Bit rot: one byte changes, the mtime (the entry's recency) does not."""
        mtime = path.stat().st_mtime_ns
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x40
        path.write_bytes(bytes(data))
        os.utime(path, ns=(mtime, mtime))

    return damage


@pytest.mark.parametrize(
    "damage",
    [
        _flip(HEADER_BYTES + 5),  # a payload byte
        _flip(0),  # the magic
        _flip(6),  # the key length
        _flip(20),  # the key
        _flip(HEADER_BYTES - 1),  # the checksum
        lambda p: p.write_bytes(p.read_bytes()[:-1]),  # truncated
        lambda p: p.write_bytes(p.read_bytes()[:10]),  # truncated inside the header
        lambda p: p.write_bytes(p.read_bytes() + b"\0"),  # too long
        lambda p: p.write_bytes(b"garbage!" * (ENTRY // 8)),  # right size, no header
        lambda p: shutil.copyfile(entry_file(p.parents[1], key(2)), p),  # another key's (valid) entry
    ],
    ids=[
        "payload",
        "magic",
        "key-length",
        "key",
        "checksum",
        "truncated",
        "truncated-header",
        "long",
        "garbage",
        "other-key",
    ],
)
def test_damaged_entry_is_dropped_never_served(tmp_path, damage, caplog):
    with DiskTier(tmp_path, 1 << 20, MANIFEST) as tier:
        tier.put(key(1), payload(1))
        tier.put(key(2), payload(2))
        damage(entry_file(tmp_path, key(1)))
        assert tier.contains(key(1))  # found only by reading
        assert tier.get(key(1)) is None
        assert tier.stats.corrupt == 1 and tier.stats.hits == 0 and tier.stats.entries == 1
        assert not entry_file(tmp_path, key(1)).exists() and not tier.contains(key(1))
        assert "damaged entry" in caplog.text
        assert tier.get(key(1)) is None and tier.stats.misses == 1 and tier.stats.corrupt == 1
        assert tier.get(key(2)) == payload(2)
        tier.put(key(1), payload(1))  # recomputed and stored again
        assert tier.get(key(1)) == payload(1)


def test_open_removes_stale_temp_files_and_wrong_size_entries(tmp_path):
    with DiskTier(tmp_path, 1 << 20, MANIFEST) as tier:
        for i in range(3):
            tier.put(key(i), payload(i))
    folder = entry_file(tmp_path, key(0)).parent
    half_written = folder / f".{key(0).hex()}.999.1.tmp"
    half_written.write_bytes(entry_file(tmp_path, key(0)).read_bytes()[:50])
    (tmp_path / ".manifest.json.999.tmp").write_text("{")
    entry_file(tmp_path, key(1)).write_bytes(entry_file(tmp_path, key(1)).read_bytes()[:-3])
    (folder / "README").write_text("not an entry")  # foreign files are neither indexed nor deleted
    with DiskTier(tmp_path, 1 << 20, MANIFEST) as tier:
        assert not list(tmp_path.rglob("*.tmp"))
        assert tier.stats.corrupt == 1 and tier.stats.entries == 2 and not tier.contains(key(1))
        assert tier.get(key(0)) == payload(0) and tier.get(key(2)) == payload(2)
        assert (folder / "README").exists()


KILL_SCRIPT = """
import sys
from prefixkv.kvcache.offload.disk_tier import DiskTier
from prefixkv.kvcache.offload.tier import TierManifest
manifest = TierManifest(model_digest="ab" * 16, dtype="bfloat16", chunk_tokens=1024, bytes_per_token=512,
                        hash_algo="sha256")
tier = DiskTier(sys.argv[1], 1 << 30, manifest)
i = int(sys.argv[2])
while True:
    tier.put(i.to_bytes(16, "big"), bytes([i % 251]) * manifest.payload_bytes)
    print(i, flush=True)
    i += 1
"""


def test_kill_9_mid_write_leaves_only_complete_entries(tmp_path):
    """Writers SIGKILLed while they store 512 KiB entries in a loop (most of their time is spent writing; the
    kill comes a few ms after an entry completed, so it mostly lands inside a write): on reopen every indexed
    entry verifies, no temp file is left, and each lock died with its process."""
    manifest = TierManifest(
        model_digest="ab" * 16, dtype="bfloat16", chunk_tokens=1024, bytes_per_token=512, hash_algo="sha256"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for start in (0, 1000, 2000):  # three writers in turn; each one's open cleans up after the one before
        command = [sys.executable, "-c", KILL_SCRIPT, str(tmp_path), str(start)]
        writer = subprocess.Popen(command, stdout=subprocess.PIPE, env=env)
        try:
            assert writer.stdout is not None
            for line in writer.stdout:
                if int(line) >= start + 10:
                    break
            if start == 0:  # the lock holds across processes and names the holder
                with pytest.raises(TierLockedError, match=f"pid {writer.pid}"):
                    DiskTier(tmp_path, 1 << 30, manifest)
            time.sleep(0.002 * (start // 1000 + 1))
            os.kill(writer.pid, signal.SIGKILL)
        finally:
            writer.kill()
            writer.wait(timeout=60)
        entry_bytes = HEADER_BYTES + manifest.payload_bytes
        assert all(p.stat().st_size == entry_bytes for p in entry_files(tmp_path))  # partial data: temp files only
    with DiskTier(tmp_path, 1 << 30, manifest) as tier:
        assert not list(tmp_path.rglob("*.tmp"))
        assert tier.stats.entries >= 33 and tier.stats.corrupt == 0
        for i in [start + j for start in (0, 1000, 2000) for j in range(200)]:
            got = tier.get(i.to_bytes(16, "big"))
            assert got is None or got == bytes([i % 251]) * manifest.payload_bytes
        assert tier.stats.hits == tier.stats.entries and tier.stats.corrupt == 0


def test_capacity_keeps_the_most_recently_used(tmp_path):
    capacity = 3 * ENTRY + ENTRY // 2  # room for three entries
    with DiskTier(tmp_path, capacity, MANIFEST) as tier:
        for i in (1, 2, 3):
            tier.put(key(i), payload(i))
        assert tier.get(key(1)) == payload(1)  # 2 is now the least recently used
        tier.put(key(4), payload(4))
        assert [tier.contains(key(i)) for i in (1, 2, 3, 4)] == [True, False, True, True]
        tier.put(key(3), payload(3))  # a put of a held key touches it: 1 is now the least recently used
        assert tier.stats.evicted == 1 and tier.stats.entries == 3
        assert sum(p.stat().st_size for p in entry_files(tmp_path)) <= capacity
    with DiskTier(tmp_path, capacity, MANIFEST) as tier:  # recency survives the restart
        tier.put(key(5), payload(5))
        assert [tier.contains(key(i)) for i in (1, 2, 3, 4, 5)] == [False, False, True, True, True]
    with DiskTier(tmp_path, 2 * ENTRY, MANIFEST) as tier:  # a smaller capacity evicts at open
        assert [tier.contains(key(i)) for i in (3, 4, 5)] == [True, False, True] and tier.stats.evicted == 1
    assert len(entry_files(tmp_path)) == 2


def test_a_failed_write_is_logged_not_raised(tmp_path, caplog):
    k = key(1)
    with DiskTier(tmp_path, 1 << 20, MANIFEST) as tier:
        (tmp_path / k.hex()[:2]).write_text("a file where the entry's folder should be")
        tier.put(k, payload(1))
        tier.put(k, payload(1))
        assert caplog.text.count("an entry was not stored") == 1  # once per kind of error
        assert not tier.contains(k) and tier.stats.entries == 0 and not list(tmp_path.rglob("*.tmp"))
        tier.put(key(2), payload(2))
        assert tier.get(key(2)) == payload(2)


def test_payload_larger_than_capacity_is_not_stored(tmp_path, caplog):
    with DiskTier(tmp_path, ENTRY - 1, MANIFEST) as tier:
        assert "below one entry" in caplog.text
        tier.put(key(1), payload(1))
        assert not tier.contains(key(1)) and not entry_files(tmp_path) and tier.stats.bytes_written == 0


def test_a_locked_directory_is_refused_naming_the_holder(tmp_path):
    first = DiskTier(tmp_path, 1 << 20, MANIFEST)
    with pytest.raises(TierLockedError, match=f"pid {os.getpid()}") as locked:
        DiskTier(tmp_path, 1 << 20, MANIFEST)
    assert str(tmp_path) in str(locked.value) and isinstance(locked.value, ValueError)
    first.close()
    DiskTier(tmp_path, 1 << 20, MANIFEST).close()


def test_put_from_a_writer_thread_while_reading(tmp_path):
    """The engine thread reads while a background writer stores and evicts: every payload read is the right one."""
    with DiskTier(tmp_path, 20 * ENTRY, MANIFEST) as tier:

        def write() -> None:
            for i in range(100):
                tier.put(key(i), payload(i))

        writer = threading.Thread(target=write)
        writer.start()
        while writer.is_alive():
            for i in range(100):
                got = tier.get(key(i))
                assert got is None or got == payload(i)
        writer.join()
        assert tier.stats.entries == 20 and tier.stats.corrupt == 0 and len(entry_files(tmp_path)) == 20


class DiskTierVersusModel(RuleBasedStateMachine):
    """Random puts, gets, byte flips and restarts against an LRU dict of what must be held."""

    CAPACITY_ENTRIES = 3

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="disk-tier-"))
        self.tier = DiskTier(self.dir, self.CAPACITY_ENTRIES * ENTRY, MANIFEST)
        self.model: OrderedDict[int, bool] = OrderedDict()  # key -> intact, least recently used first

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.dir)

    @rule(i=st.integers(0, 5))
    def put(self, i: int) -> None:
        self.tier.put(key(i), payload(i))
        if i not in self.model and len(self.model) == self.CAPACITY_ENTRIES:
            self.model.popitem(last=False)
        self.model.setdefault(i, True)
        self.model.move_to_end(i)

    @rule(i=st.integers(0, 5))
    def get(self, i: int) -> None:
        got = self.tier.get(key(i))
        if self.model.get(i):
            assert got == payload(i)
            self.model.move_to_end(i)
        else:
            assert got is None
            self.model.pop(i, None)

    @rule(i=st.integers(0, 5), offset=st.integers(0, ENTRY - 1))
    def damage(self, i: int, offset: int) -> None:
        if i in self.model and self.model[i]:  # flipping the same bit again would repair the entry
            _flip(offset)(entry_file(self.dir, key(i)))
            self.model[i] = False

    @rule()
    def restart(self) -> None:
        self.tier.close()
        self.tier = DiskTier(self.dir, self.CAPACITY_ENTRIES * ENTRY, MANIFEST)

    @invariant()
    def holds_what_the_model_holds(self) -> None:
        assert [i for i in range(6) if self.tier.contains(key(i))] == sorted(self.model)
        assert len(entry_files(self.dir)) == len(self.model) <= self.CAPACITY_ENTRIES


TestDiskTierVersusModel = DiskTierVersusModel.TestCase
TestDiskTierVersusModel.settings = settings(max_examples=20, stateful_step_count=20, deadline=None)
