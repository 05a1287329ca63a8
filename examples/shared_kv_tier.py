"""Two replicas, one shared KV store: a prompt computed on one replica is served from the store on the other.

Starts a redis-server (prefixkv/kvcache/offload/store_process.py) and `prefixkv serve --replicas 2 --router
round-robin --kv-remote URL`, sends one long prompt twice (round-robin puts the second on the other replica), and
prints, for each answer, the replica that gave it, its time and how many prompt tokens it found cached. Both
processes are stopped at the end. Run it with `bash scripts/demo_shared_tier.sh`.
"""

from __future__ import annotations

import sys
import time

import httpx

from prefixkv.bench.server_process import serve_process
from prefixkv.kvcache.offload.store_process import RedisServer
from prefixkv.serve_ray.replica import REPLICA_HEADER  # every answer names the replica that gave it

TOOLS = "".join(f"Tool {i}: look up order {i} by its number and return its status, date and items. " for i in range(80))


def main() -> None:
    log = "/tmp/prefixkv-demo-shared-tier.log"
    with RedisServer() as store:
        serve = ["--replicas", "2", "--router", "round-robin", "--dtype", "bfloat16", "--kv-remote", store.url]
        print(f"store at {store.url}; prefixkv serve {' '.join(serve)} (log: {log})")
        with serve_process(serve, "/v1/models", log_path=log) as base:
            model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            seen: set[str] = set()
            deadline = time.monotonic() + 600
            while len(seen) < 2:  # the server answers once one replica is up: wait for the second
                if time.monotonic() > deadline:
                    sys.exit("the second replica did not come up (see the log)")
                # each replica's first forward pass sets itself up: done here, not in what is shown
                answer = httpx.post(base + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
                seen.add(answer.headers[REPLICA_HEADER])
            for question in ("Which tool finds order 7?", "Which tool finds order 9?"):
                started = time.perf_counter()
                body = {"model": model, "prompt": TOOLS + question, "max_tokens": 8, "temperature": 0}
                answer = httpx.post(base + "/v1/completions", json=body, timeout=600)
                seconds = time.perf_counter() - started
                usage = answer.json()["usage"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                print(
                    f"replica {answer.headers[REPLICA_HEADER]}: {seconds * 1e3:.0f} ms, {cached} of "
                    f"{usage['prompt_tokens']} prompt tokens cached"
                )


if __name__ == "__main__":
    main()
