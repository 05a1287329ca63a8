"""What the serving path costs per streamed token, the engine left out: the real app under the real uvicorn setup
(make_server) around a model-free engine whose step sleeps --step-ms (the GIL released, as in a forward pass) and
emits one token per running request; the bench client (httpx) streams rounds of --concurrency requests to
/v1/completions. Prints CPU microseconds per token of the server's event loop thread, its engine thread and the
client, read from /proc (schedstat: on-CPU time, kernel work included), and the wall time per step.

    .venv/bin/python scripts/bench_serve_path.py --concurrency 1 --rounds 4

CPU time, not wall time, is the figure: on a shared machine it moves less with the neighbours' load than wall time
does, and every microsecond of it is taken from the engine's cores when client, server and engine share them (as
`prefixkv bench serve --trace` runs on one machine). Linux only (/proc/<pid>/task/<tid>/schedstat).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace


def thread_cpu_s(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def serve(port: int, step_s: float) -> None:
    """The app and uvicorn as `prefixkv serve` builds them, the engine replaced by one that only counts tokens."""
    import prefixkv.server.async_engine as async_engine
    from prefixkv.engine.metrics import EngineStats
    from prefixkv.outputs import CompletionOutput, RequestOutput
    from prefixkv.server.app import build_app
    from prefixkv.server.serving import make_server

    class Tokenizer:
        def encode(self, text: str) -> list[int]:
            return [1] * len(text.split())

        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            return " x" * len(list(ids))

        def max_token_chars(self) -> int:
            return 16

    class ModelFreeEngine:
        model_name = "model-free"
        max_model_len = 1 << 15
        kernels: dict = {}
        config = SimpleNamespace(tokens_per_page=16, prefix_cache="hash", session_policy="none")
        tokenizer = Tokenizer()
        tier_directory = None

        def __init__(self) -> None:
            self.running: dict[str, list] = {}

        def add_request(self, request_id, prompt, params, **_) -> str:
            ids = prompt if isinstance(prompt, list) else prompt["prompt_token_ids"]
            self.running[request_id] = [ids, params.max_tokens, 0]
            return request_id

        def abort(self, request_id: str) -> None:
            self.running.pop(request_id, None)

        def has_unfinished_requests(self) -> bool:
            return bool(self.running)

        def run_timers(self) -> None:
            return None

        def step(self) -> list:
            time.sleep(step_s)
            outputs = []
            for rid, r in list(self.running.items()):
                r[2] += 1
                done = r[2] >= r[1]
                completion = CompletionOutput(0, " tok", [42], "length" if done else None)
                outputs.append(RequestOutput(rid, None, r[0], [completion], finished=done))
                if done:
                    del self.running[rid]
            return outputs

        def get_stats(self) -> EngineStats:
            return EngineStats()

        def close(self) -> None:
            pass

    engine_tid: list[int] = []
    run = async_engine.AsyncEngine._run

    def run_noting_tid(self) -> None:
        engine_tid.append(threading.get_native_id())
        run(self)

    async_engine.AsyncEngine._run = run_noting_tid  # type: ignore[method-assign]
    app = build_app(ModelFreeEngine())  # type: ignore[arg-type]
    main_tid = threading.get_native_id()

    @app.get("/_cpu")
    def cpu() -> dict:
        return {"event_loop": thread_cpu_s(main_tid), "engine_thread": thread_cpu_s(engine_tid[0])}

    app.router.routes.insert(0, app.router.routes.pop())  # before the API's routes
    make_server(app, port=port, log_level="warning").run()


async def measure(base: str, concurrency: int, tokens: int, rounds: int) -> dict:
    import httpx

    from prefixkv.bench.serve_client import Settings, stream_completion

    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        settings = Settings(base, "model-free", None, 0, True, 60)
        await stream_completion(client, settings, [1, 2, 3], 8)  # warm-up
        before = (await client.get("/_cpu")).json()
        client_cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(rounds):
            sent = (stream_completion(client, settings, list(range(100)), tokens) for _ in range(concurrency))
            results = await asyncio.gather(*sent)
            if not all(r.ok and r.output_tokens == tokens for r in results):
                raise RuntimeError(f"a stream failed: {results[0].error}")
        wall = time.perf_counter() - wall
        client_cpu = time.process_time() - client_cpu
        after = (await client.get("/_cpu")).json()
    n = concurrency * tokens * rounds
    return {
        "concurrency": concurrency,
        "tokens": n,
        "wall_ms_per_step": 1e3 * wall / (tokens * rounds),
        "cpu_us_per_token": {
            "server_event_loop": 1e6 * (after["event_loop"] - before["event_loop"]) / n,
            "server_engine_thread": 1e6 * (after["engine_thread"] - before["engine_thread"]) / n,
            "client": 1e6 * client_cpu / n,
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4", help="streams per round, comma-separated runs")
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=10.0, help="the model-free step's sleep")
    p.add_argument("--port", type=int, default=8197)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server half, in its own process
    args = p.parse_args()
    if args.serve:
        serve(args.port, args.step_ms / 1e3)
        return 0
    argv = [sys.executable, __file__, "--serve", "--port", str(args.port), "--step-ms", str(args.step_ms)]
    server = subprocess.Popen(argv)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(200):
            try:
                with urllib.request.urlopen(base + "/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.1)
        for c in args.concurrency.split(","):
            print(json.dumps(asyncio.run(measure(base, int(c), args.tokens, args.rounds))), flush=True)
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
