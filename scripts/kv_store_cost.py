"""What the shared KV tier costs on this machine: a chunk over the wire against recomputing it, bytes and memory.

Starts a redis-server (prefixkv/kvcache/offload/store_process.py) and the default model (bf16), then measures,
for the chunk sizes given:
- a chunk written (EXISTS + SET NX) and read back (GET + verify) through RedisTier, the median of --chunks of them;
- the store's memory for those chunks (INFO used_memory, before and after) against their KV bytes in the pool;
- bytes written per prompt token (value = manifest digest + entry header + payload);
- recomputing one chunk here: the prefill of one more chunk after a prefix of --context tokens (what a hit saves
  at that depth), the median of --rounds, with --threads threads.
Writes JSON to --out and prints a table. `python scripts/kv_store_cost.py --out docs/benchmarks/kv_remote/...`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from prefixkv.kvcache.offload.remote_tier import RedisTier, encode_value
from prefixkv.kvcache.offload.store_process import RedisServer
from prefixkv.kvcache.offload.tier import TierManifest
from prefixkv.llm import LLM
from prefixkv.model import cpu_features
from prefixkv.model.runner import ModelRunner
from prefixkv.sampling_params import SamplingParams


def store_costs(url: str, manifest: TierManifest, chunks: int) -> dict:
    import redis

    tier = RedisTier(url, manifest)
    r = redis.Redis.from_url(url)
    r.flushall()
    before = int(r.info("memory")["used_memory"])
    keys = [os.urandom(32) for _ in range(chunks)]
    payload = os.urandom(manifest.payload_bytes)
    writes, reads = [], []
    for key in keys:
        started = time.perf_counter()
        tier.put(key, payload)
        writes.append(time.perf_counter() - started)
    for key in keys:
        started = time.perf_counter()
        assert tier.get(key) == payload
        reads.append(time.perf_counter() - started)
    used = int(r.info("memory")["used_memory"]) - before
    value_bytes = len(encode_value(tier.digest, keys[0], payload))
    tier.close()
    return {
        "write_s": statistics.median(writes),
        "read_s": statistics.median(reads),
        "value_bytes": value_bytes,
        "bytes_written_per_token": value_bytes / manifest.chunk_tokens,
        "store_memory_per_kv_byte": used / (chunks * manifest.payload_bytes),
    }


def recompute_s(llm: LLM, chunk: int, context: int, rounds: int) -> float:
    """Seconds to prefill `chunk` more tokens after `context` cached ones (fresh random tokens each round)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for i in range(rounds):
        rng = random.Random(i)
        prefix = [rng.randrange(1000, 40000) for _ in range(context)]
        tail = [rng.randrange(1000, 40000) for _ in range(chunk)]
        llm.generate({"prompt_token_ids": prefix}, params, use_tqdm=False)  # cached now
        started = time.perf_counter()
        llm.generate({"prompt_token_ids": prefix + tail}, params, use_tqdm=False)
        one_token = time.perf_counter() - started
        started = time.perf_counter()
        llm.generate({"prompt_token_ids": prefix + tail[:1]}, params, use_tqdm=False)  # the floor: one new token
        times.append(one_token - (time.perf_counter() - started))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-tokens", default="16,64,256")
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="as a `serve --replicas` replica has (1)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = LLM(dtype="bfloat16", num_threads=args.threads, kv_cache_tokens=args.context * 2 + 1024)
    bytes_per_token = ModelRunner.kv_bytes_per_token(llm.llm_engine.model_config, "bfloat16")
    rows = []
    with RedisServer(maxmemory="4gb") as store:
        for chunk in [int(c) for c in args.chunk_tokens.split(",")]:
            manifest = TierManifest("x" * 32, "bfloat16", chunk, bytes_per_token, "sha256")
            row = {"chunk_tokens": chunk, "payload_bytes": manifest.payload_bytes}
            row.update(store_costs(store.url, manifest, args.chunks))
            row["recompute_s"] = recompute_s(llm, chunk, args.context, args.rounds)
            row["recompute_over_read"] = row["recompute_s"] / row["read_s"]
            rows.append(row)
            print(
                f"{chunk:>4}-token chunk ({manifest.payload_bytes / 1e6:.2f} MB): read {row['read_s'] * 1e3:.2f} ms, "
                f"write {row['write_s'] * 1e3:.2f} ms, recompute at {args.context} tokens of context "
                f"{row['recompute_s'] * 1e3:.1f} ms ({row['recompute_over_read']:.1f}x the read); "
                f"{row['bytes_written_per_token']:.0f} B written per token, store memory "
                f"{row['store_memory_per_kv_byte']:.3f}x the KV"
            )
    result = {
        "cpu": cpu_features.describe(),
        "model": "SmolLM2-135M-Instruct (the default), bfloat16",
        "kv_bytes_per_token_in_pool": bytes_per_token,
        "threads": args.threads,
        "context_tokens": args.context,
        "rows": rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
