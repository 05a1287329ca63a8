"""`prefixkv bench kv-remote`: a prefix computed on one replica, served on the other, with and without the store.

Each round starts `prefixkv serve --replicas 2 --router round-robin` (a local Ray, one thread per replica) twice,
in alternating order: once with `--kv-remote` on a real redis-server (store_process.py, emptied first) and once
without. Both get the same prompts, random token ids of each length in --lengths (distinct per length and round,
so nothing is cached before). A prompt is sent twice, each time with another last token: round-robin sends the
first to one replica, which computes it, and the second to the other. The benchmark waits until the store holds
the first one's chunks, then times the second: loaded from the store, or recomputed. Time to first token is the
response time of a non-streaming request for one token (prefill, one decode step, HTTP and Ray's hop). Reported
per length: both sides' TTFT of the peer request, its cached tokens, and the median over rounds of the per-round
ratio (recompute / shared, > 1: the store is faster), every round's listed; each answer's replica header is
checked (the two requests of a pair must land on different replicas).

--failover adds a phase to both sides: prompts spread over both replicas, the process of the replica that served
the first killed (SIGKILL) once they are answered, and every prompt sent again, now to the survivor: the hit rate
and TTFT before and after the kill, with the store against without it. (A kill with requests in flight, which the
ingress retries on the survivor, is tests/test_serve_ray.py's test_replica_killed_under_load.)
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import statistics
import sys
import time
from typing import Any

from prefixkv.bench.paired import paired
from prefixkv.bench.server_process import serve_process, wait_for_replicas

READY_TIMEOUT_S = 600.0
VOCAB = range(1000, 40000)  # plain word pieces of SmolLM2's vocabulary (no special tokens)


def register(subparsers) -> None:
    p = subparsers.add_parser("kv-remote", help="2 replicas: a prefix from one served on the other, store vs none")
    p.add_argument("--lengths", default="512,1024,2048,4096,7168", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="each round runs both sides once, in alternating order")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="each replica's pool")
    p.add_argument("--chunk-tokens", type=int, default=256, help="--kv-offload-chunk-tokens")
    p.add_argument("--failover", action="store_true", help="also kill a replica under load (see the docstring)")
    p.add_argument("--failover-prompts", type=int, default=4)
    p.add_argument("--failover-length", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="server logs (default: --output-dir)")
    p.set_defaults(func=run)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(VOCAB) for _ in range(length)]


class Client:
    """The completions endpoint of one running server, for token-id prompts and one-token answers."""

    def __init__(self, base: str) -> None:
        import httpx

        # the headers every answer of `serve --replicas` carries (imported here: serve_ray loads Ray)
        from prefixkv.serve_ray.ingress import RETRIES_HEADER
        from prefixkv.serve_ray.replica import REPLICA_HEADER

        self.replica_header, self.retries_header = REPLICA_HEADER, RETRIES_HEADER
        self.http = httpx.Client(base_url=base, timeout=1200)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def complete(self, prompt: list[int]) -> dict:
        """Send it; its replica, seconds to the answer, and the prompt tokens the server reported cached."""
        started = time.perf_counter()
        response = self.http.post(
            "/v1/completions", json={"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        )
        seconds = time.perf_counter() - started
        response.raise_for_status()
        usage = response.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        retries = int(response.headers.get(self.retries_header, 0))
        return {
            "replica": response.headers.get(self.replica_header),
            "seconds": seconds,
            "cached_tokens": cached,
            "retries": retries,
        }

    def close(self) -> None:
        self.http.close()


def _chunks_held(store_url: str) -> int:
    import redis

    return sum(1 for _ in redis.Redis.from_url(store_url).scan_iter(match="prefixkv:*", count=1000))


def _wait_for_chunks(store_url: str, count: int, timeout_s: float = 60.0) -> float:
    """Wait until the store holds `count` chunk values; the seconds it took (the writer thread's lag)."""
    started = time.monotonic()
    while _chunks_held(store_url) < count:
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"the store never held {count} chunks")
        time.sleep(0.05)
    return time.monotonic() - started


def _serve_args(args: argparse.Namespace, store_url: str | None) -> list[str]:
    serve = ["--replicas", "2", "--router", "round-robin", "--dtype", args.dtype, "--num-threads", "1"]
    serve += ["--kv-cache-tokens", str(args.kv_cache_tokens), "--kv-offload-chunk-tokens", str(args.chunk_tokens)]
    return serve + (["--kv-remote", store_url] if store_url else [])


def _peer_pairs(client: Client, args: argparse.Namespace, round_index: int, store_url: str | None) -> list[dict]:
    """For each length: the first request (computed), then the peer's (from the store, or recomputed)."""
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        prompt = _prompt(args.seed * 1000 + round_index * 100 + length, length)
        held = _chunks_held(store_url) if store_url is not None else 0
        first = client.complete(prompt + [VOCAB[0]])
        lag = None
        if store_url is not None:
            lag = _wait_for_chunks(store_url, held + (length + 1) // args.chunk_tokens)
        peer = client.complete(prompt + [VOCAB[1]])
        pool_hit = client.complete(prompt + [VOCAB[2]])  # back on the first replica: its own pool, the floor
        if peer["replica"] == first["replica"] or pool_hit["replica"] != first["replica"]:
            raise SystemExit(f"round-robin did not alternate the replicas at length {length}")
        rows.append({"length": length, "first": first, "peer": peer, "pool_hit": pool_hit, "store_write_lag_s": lag})
        print(
            f"  {length:>5} tokens: first {first['seconds'] * 1e3:7.0f} ms on {first['replica']}, peer "
            f"{peer['seconds'] * 1e3:7.0f} ms on {peer['replica']} ({peer['cached_tokens']} cached), pool hit "
            f"{pool_hit['seconds'] * 1e3:5.0f} ms"
        )
    return rows


def _warm_up(client: Client, args: argparse.Namespace, store_url: str | None) -> None:
    """A process's first long prefill, first store read and first pool write set themselves up (buffers, the
    store's connection): each replica does each once, untimed, before the pairs (two prompts of a few chunks, each
    sent twice)."""
    length = 3 * args.chunk_tokens
    for i in range(2):
        prompt = _prompt(-1 - i, length)
        held = _chunks_held(store_url) if store_url is not None else 0
        client.complete(prompt + [VOCAB[0]])
        if store_url is not None:
            _wait_for_chunks(store_url, held + (length + 1) // args.chunk_tokens)
        client.complete(prompt + [VOCAB[1]])


def _replica_pids() -> dict[str, int]:
    """The engine replicas' worker processes by replica id, asked of the server's local Ray (as a driver of it)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    pids: dict[str, int] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if name.startswith("SERVE_REPLICA::") and "#EngineReplica#" in name:
            handle = ray.get_actor(name, namespace=actor["namespace"])
            pid: Any = ray.get(handle.__ray_call__.remote(lambda _replica: os.getpid()))
            pids[name.rsplit("#", 1)[1]] = int(pid)
    return pids


def _failover(client: Client, args: argparse.Namespace, round_index: int, store_url: str | None) -> dict:
    """Prompts spread over both replicas, then the one that served the first killed, then every prompt again."""
    prompts = [
        _prompt(args.seed * 1000 + round_index * 100 + 50 + i, args.failover_length)
        for i in range(args.failover_prompts)
    ]
    held = _chunks_held(store_url) if store_url is not None else 0
    before = [client.complete(p + [VOCAB[0]]) for p in prompts]
    if store_url is not None:
        _wait_for_chunks(store_url, held + len(prompts) * ((args.failover_length + 1) // args.chunk_tokens))
    victim = before[0]["replica"]
    pids = _replica_pids()
    if victim not in pids:
        raise SystemExit(f"no process for replica {victim} (found {sorted(pids)})")
    os.kill(pids[victim], signal.SIGKILL)
    import ray

    ray.shutdown()  # the bench's own driver connection, before the server stops its Ray
    after = [client.complete(p + [VOCAB[1]]) for p in prompts]
    lost = [a for b, a in zip(before, after, strict=True) if b["replica"] == victim]
    tokens = args.failover_length + 1

    def summary(rows: list[dict]) -> dict:
        return {
            "hit_rate": sum(r["cached_tokens"] for r in rows) / (tokens * len(rows)),
            "ttft_median_s": statistics.median(r["seconds"] for r in rows),
            "replicas": sorted({r["replica"] for r in rows}),
            "retried": sum(1 for r in rows if r["retries"]),
        }

    return {"victim": victim, "before": summary(before), "after": summary(after), "victims_prompts": summary(lost)}


def run(args: argparse.Namespace) -> dict:
    from prefixkv.kvcache.offload.store_process import RedisServer

    log_dir = args.log_dir or args.output_dir
    os.makedirs(log_dir, exist_ok=True)
    sides = ("shared", "recompute")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    with RedisServer(maxmemory="4gb") as store:
        import redis

        for round_index in range(args.rounds):
            for side in sides if round_index % 2 == 0 else sides[::-1]:
                url = store.url if side == "shared" else None
                redis.Redis.from_url(store.url).flushall()
                log_path = os.path.join(log_dir, f"kv_remote_{side}_round{round_index}.log")
                print(f"round {round_index}, {side}:")
                with serve_process(_serve_args(args, url), "/v1/models", READY_TIMEOUT_S, log_path) as base:
                    wait_for_replicas(base, 2)
                    client = Client(base)
                    _warm_up(client, args, url)
                    result = {"round": round_index, "pairs": _peer_pairs(client, args, round_index, url)}
                    if args.failover:
                        result["failover"] = _failover(client, args, round_index, url)
                        print(f"  failover: {result['failover']}")
                    client.close()
                runs[side].append(result)
    lengths = [int(x) for x in args.lengths.split(",")]
    by_length = {}
    print("\nTTFT of the peer request (median of rounds), and recompute / shared per round")
    for i, length in enumerate(lengths):
        shared = [r["pairs"][i]["peer"]["seconds"] for r in runs["shared"]]
        recompute = [r["pairs"][i]["peer"]["seconds"] for r in runs["recompute"]]
        ratio = paired(shared, recompute, higher_is_better=False)
        by_length[length] = {
            "shared_peer_ttft_s": shared,
            "recompute_peer_ttft_s": recompute,
            "shared_peer_cached_tokens": [r["pairs"][i]["peer"]["cached_tokens"] for r in runs["shared"]],
            "first_ttft_s": {s: [r["pairs"][i]["first"]["seconds"] for r in runs[s]] for s in sides},
            "pool_hit_ttft_s": {s: [r["pairs"][i]["pool_hit"]["seconds"] for r in runs[s]] for s in sides},
            "recompute_over_shared": ratio.as_dict(),
        }
        print(
            f"  {length:>5}: shared {statistics.median(shared) * 1e3:7.0f} ms, recompute "
            f"{statistics.median(recompute) * 1e3:7.0f} ms: {ratio.describe()}"
        )
    config = {k: getattr(args, k) for k in ("lengths", "rounds", "dtype", "kv_cache_tokens", "chunk_tokens", "seed")}
    config.update(replicas=2, threads_per_replica=1, command="prefixkv " + " ".join(sys.argv[1:]))
    return {"config": config, "runs": runs, "by_length": by_length}
