"""`prefixkv bench serve`: drive any OpenAI-compatible server with streaming chat requests and measure it.

Four workloads where prefix caching matters:
  system-prompt  every request shares one long system prompt and asks its own short question
  multi-tenant   --tenants system prompts, one per tenant, each request a random tenant's (with
                 --tenant-api-keys, each tenant sends its own key: the server's tenant salts apply); sized so
                 the prompts overflow one replica's pool, it shows what cache-aware routing buys
  multi-turn     conversations that resend their growing history each turn (TTFT per turn shows whether
                 the history is recomputed)
  --trace FILE   a production trace (Mooncake, Qwen-Bailian) rescaled by prefixkv.sim.traces and replayed at its
                 wall-clock arrival times (open loop) as token-id prompts to /v1/completions, so the server's
                 cache sees exactly the prefixes the trace shares
Measured from the client side, over SSE: TTFT (request sent -> first content), time per output token after
the first, end-to-end latency, output throughput, and the cached prompt tokens the server reports in
usage.prompt_tokens_details (prefixkv and vLLM do; others report nothing and the field stays 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

from prefixkv.bench.session_replay import add_session_arguments, print_summary, replay_live
from prefixkv.sim.agent_traces import is_agent_trace
from prefixkv.sim.bounds import unbounded_hit_tokens
from prefixkv.sim.traces import FORMATS, ScaledRequest, Trace, TraceScaling, load_trace, scale_trace

DEFAULT_CONCURRENCY = 8

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact water room mother area money story month lot right study "
    "book job word business issue side kind head house service friend father power hour game line end member "
    "law car city community name president team minute idea kid body information back parent face others "
    "level office door health art war history party result change morning reason research girl guy moment "
    "air teacher force education"
).split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds from sending to the first content
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    turn: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class Settings:
    base_url: str
    model: str | None
    api_key: str | None
    output_tokens: int
    ignore_eos: bool
    timeout: float
    headers: dict = field(default_factory=dict)


def filler_text(num_words: int, seed: int) -> str:
    """About one token per word for BPE tokenizers; the server's usage gives the exact count."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


async def stream_chat(
    client: httpx.AsyncClient, s: Settings, messages: list[dict], turn: int = 0, headers: dict | None = None
) -> RequestResult:
    body = {
        "model": s.model,
        "messages": messages,
        "max_tokens": s.output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if s.ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    result = RequestResult(ok=False, turn=turn)
    parts: list[str] = []

    def on_event(event: dict) -> None:
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                if not parts:
                    result.ttft = time.perf_counter() - start
                parts.append(content)

    if await _stream(client, "/v1/chat/completions", body, s.timeout, result, on_event, headers):
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or len(parts)  # servers without usage: one token per chunk
        result.text = "".join(parts)
        result.ok = True
    return result


async def stream_completion(
    client: httpx.AsyncClient,
    s: Settings,
    prompt: list[int],
    max_tokens: int,
    start: float | None = None,
    headers: dict | None = None,
) -> RequestResult:
    """One streamed /v1/completions request with a token-id prompt; TTFT counts from `start` (the moment the
    request was due, so a client-side wait counts too) up to the first generated token's event."""
    body = {
        "model": s.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": s.ignore_eos,
    }
    start = time.perf_counter() if start is None else start
    result = RequestResult(ok=False)
    events = 0

    def on_event(event: dict) -> None:
        nonlocal events
        if event.get("choices"):  # one event per generated token (its text may still be empty)
            if not events:
                result.ttft = time.perf_counter() - start
            events += 1

    if await _stream(client, "/v1/completions", body, s.timeout, result, on_event, headers):
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or events
        result.ok = True
    return result


async def _stream(
    client: httpx.AsyncClient,
    path: str,
    body: dict,
    timeout: float,
    result: RequestResult,
    on_event,
    headers: dict | None = None,
) -> bool:
    """POST a streamed request and hand each server-sent event to on_event; usage goes into `result`. False, with
    result.error set, on an HTTP error, an error event, or a broken stream."""
    try:
        async with client.stream("POST", path, json=body, timeout=timeout, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])
                    return False
                on_event(event)
                usage = event.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens") or 0
                    result.output_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return False
    return True


async def _trace_workload(client, s: Settings, args, requests: list[ScaledRequest]) -> list[RequestResult]:
    """Open loop: each request is sent at its (scaled) arrival time, whatever is still running; --concurrency,
    if given, caps the requests in flight, and a request held back by it counts its wait in its TTFT."""
    sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    t0 = time.perf_counter()

    async def one(req: ScaledRequest) -> RequestResult:
        due = t0 + req.arrival_s
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        if sem is None:
            return await stream_completion(client, s, req.prompt_tokens(), req.output_len, start=due)
        async with sem:
            return await stream_completion(client, s, req.prompt_tokens(), req.output_len, start=due)

    return await asyncio.gather(*(one(r) for r in requests))


def load_trace_slice(args) -> tuple[Trace, TraceScaling, list[ScaledRequest]]:
    trace = load_trace(args.trace, args.trace_format)
    scaling = TraceScaling(
        tokens_per_block=args.tokens_per_block,
        time_scale=args.time_scale,
        output_scale=args.output_scale,
        max_requests=args.max_requests,
        start_s=args.trace_start,
        duration_s=args.trace_duration,
    )
    return trace, scaling, scale_trace(trace, scaling, seed=args.seed)


async def _system_prompt_workload(client, s: Settings, args) -> list[RequestResult]:
    system = filler_text(args.system_prompt_tokens, seed=args.seed)
    sem = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> RequestResult:
        async with sem:
            question = f"Question {i}: {filler_text(12, seed=args.seed + 1 + i)}. Answer briefly."
            return await stream_chat(
                client, s, [{"role": "system", "content": system}, {"role": "user", "content": question}]
            )

    return await asyncio.gather(*(one(i) for i in range(args.num_requests)))


async def _multi_tenant_workload(client, s: Settings, args) -> list[RequestResult]:
    """Each request a seeded-random tenant's system prompt and its own question, closed loop at --concurrency."""
    systems = [
        f"Tenant {t}. " + filler_text(args.system_prompt_tokens, seed=args.seed + 7919 * (t + 1))
        for t in range(args.tenants)
    ]
    keys = args.tenant_api_keys.split(",") if args.tenant_api_keys else []
    rng = random.Random(args.seed)
    tenants = [rng.randrange(args.tenants) for _ in range(args.num_requests)]
    sem = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> RequestResult:
        tenant = tenants[i]
        headers = {"Authorization": f"Bearer {keys[tenant % len(keys)]}"} if keys else None
        async with sem:
            question = f"Question {i}: {filler_text(12, seed=args.seed + 1 + i)}. Answer briefly."
            messages = [{"role": "system", "content": systems[tenant]}, {"role": "user", "content": question}]
            return await stream_chat(client, s, messages, headers=headers)

    return await asyncio.gather(*(one(i) for i in range(args.num_requests)))


async def _multi_turn_workload(client, s: Settings, args) -> list[RequestResult]:
    num_conversations = max(1, -(-args.num_requests // args.turns))
    sem = asyncio.Semaphore(args.concurrency)

    async def conversation(c: int) -> list[RequestResult]:
        async with sem:
            messages = [{"role": "system", "content": f"Conversation {c}. You are a helpful assistant."}]
            results = []
            for turn in range(1, args.turns + 1):
                text = filler_text(args.turn_tokens, seed=args.seed + 1000 * c + turn)
                messages.append({"role": "user", "content": text})
                res = await stream_chat(client, s, messages, turn=turn)
                results.append(res)
                if not res.ok:
                    break
                messages.append({"role": "assistant", "content": res.text})
            return results

    per_conv = await asyncio.gather(*(conversation(c) for c in range(num_conversations)))
    return [r for conv in per_conv for r in conv]


WORKLOADS = {
    "system-prompt": _system_prompt_workload,
    "multi-tenant": _multi_tenant_workload,
    "multi-turn": _multi_turn_workload,
}


def _dist(values: list[float], scale: float = 1000.0) -> dict:
    """mean / p50 / p90 / p99 in milliseconds (nearest-rank percentiles)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = sorted(values)

    def pct(p: float) -> float:
        return v[max(0, math.ceil(p / 100 * len(v)) - 1)] * scale

    return {"mean": statistics.fmean(v) * scale, "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    summary = {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "ttft_ms": _dist([r.ttft for r in ok]),
        "tpot_ms": _dist([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": _dist([r.e2e for r in ok]),
        "output_tokens": out_tokens,
        "output_throughput_tok_s": out_tokens / duration if duration > 0 else None,
        "request_throughput_req_s": len(ok) / duration if duration > 0 else None,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cached_fraction": cached / prompt_tokens if prompt_tokens else None,
    }
    turns = sorted({r.turn for r in ok if r.turn})
    if turns:
        summary["per_turn"] = {
            t: {
                "ttft_ms": _dist([r.ttft for r in ok if r.turn == t])["mean"],
                "prompt_tokens": statistics.fmean([r.prompt_tokens for r in ok if r.turn == t]),
                "cached_tokens": statistics.fmean([r.cached_tokens for r in ok if r.turn == t]),
            }
            for t in turns
        }
    return summary


async def _resolve_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_async(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if args.trace and is_agent_trace(args.trace):

        async def settings_for(client: httpx.AsyncClient) -> Settings:
            model = args.model or await _resolve_model(client)
            return Settings(base, model, args.api_key, 0, True, args.timeout)  # ignore_eos: the trace fixes lengths

        return await replay_live(args, base, headers, settings_for, stream_completion)
    if args.trace:
        return await _replay_trace(args, base, headers)
    if args.concurrency is None:
        args.concurrency = DEFAULT_CONCURRENCY
    limits = httpx.Limits(max_connections=args.concurrency + 2, max_keepalive_connections=args.concurrency + 2)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=args.timeout) as client:
        model = args.model or await _resolve_model(client)
        s = Settings(base, model, args.api_key, args.output_tokens, args.ignore_eos, args.timeout)
        workload = WORKLOADS[args.workload]
        start = time.perf_counter()
        results = await workload(client, s, args)
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary["config"] = {
        k: getattr(args, k)
        for k in (
            "base_url",
            "workload",
            "concurrency",
            "num_requests",
            "system_prompt_tokens",
            "tenants",
            "output_tokens",
            "turns",
            "turn_tokens",
            "ignore_eos",
            "seed",
        )
    }
    summary["config"]["model"] = model
    return summary


async def _replay_trace(args: argparse.Namespace, base: str, headers: dict) -> dict:
    try:
        trace, scaling, requests = load_trace_slice(args)
    except (OSError, ValueError) as e:  # TraceFormatError is a ValueError; the message names file, line, field
        raise SystemExit(f"prefixkv bench serve: {e}") from None
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=args.timeout) as client:
        model = args.model or await _resolve_model(client)
        # ignore_eos always: the trace fixes every output length
        s = Settings(base, model, args.api_key, 0, True, args.timeout)
        start = time.perf_counter()
        results = await _trace_workload(client, s, args, requests)
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary["scaling"] = scaling.describe(trace.block_size)
    summary["config"] = {
        "base_url": args.base_url,
        "workload": "trace",
        "trace": trace.path,
        "trace_format": trace.format,
        "trace_requests": len(trace.requests),
        "scaling": asdict(scaling),
        "concurrency": args.concurrency,
        "ignore_eos": True,
        "seed": args.seed,
        "model": model,
    }
    summary["expected_prompt_tokens"] = sum(r.prompt_len for r in requests)
    summary["expected_output_tokens"] = sum(r.output_len for r in requests)
    bound = unbounded_hit_tokens(requests, args.bound_page_size)
    summary["unbounded_hit_rate"] = bound.rate  # what an infinite cache, cold at the start, could hit
    summary["bound_page_size"] = args.bound_page_size
    return summary


def run(args: argparse.Namespace) -> dict:
    summary = asyncio.run(run_async(args))
    if "jct_s" in summary:  # agent sessions
        print_summary(summary)
        return summary
    t = summary["ttft_ms"]
    if "scaling" in summary:
        print(f"trace {summary['config']['trace']} ({summary['config']['trace_format']}): {summary['scaling']}")
    hit = summary["cached_fraction"]
    print(
        f"{summary['num_ok']}/{summary['num_requests']} ok in {summary['duration_s']:.1f} s; "
        f"TTFT mean {_ms(t['mean'])} p50 {_ms(t['p50'])} p90 {_ms(t['p90'])} p99 {_ms(t['p99'])}; "
        f"TPOT mean {_ms(summary['tpot_ms']['mean'])}; "
        f"{summary['output_throughput_tok_s'] or 0:.1f} output tok/s; "
        f"cached {summary['cached_tokens']}/{summary['prompt_tokens']} prompt tokens "
        f"(hit rate {'n/a' if hit is None else f'{hit:.1%}'})"
    )
    if "unbounded_hit_rate" in summary:
        print(
            f"unbounded-cache hit rate of this slice at {summary['bound_page_size']}-token pages: "
            f"{summary['unbounded_hit_rate']:.1%} (a cold cache, compulsory misses only; docs/traces.md)"
        )
    return summary


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def plot(results: dict, path: str) -> None:
    """TTFT per turn (multi-turn) or the TTFT/TPOT distribution (system-prompt), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if "jct_s" in results:  # agent sessions: measured JCT per session beside the simulator's
        x = range(len(results["sessions"]))
        ax.bar([i - 0.2 for i in x], results["jct_s"], width=0.4, label="measured")
        if "simulated" in results:
            ax.bar([i + 0.2 for i in x], results["simulated"]["jct_s"], width=0.4, label="simulated")
        ax.set_xticks(list(x), results["sessions"], rotation=30, fontsize=7)
        ax.set_ylabel("job completion time (s)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return
    if results.get("per_turn"):
        turns = sorted(results["per_turn"], key=int)
        ax.plot([int(t) for t in turns], [results["per_turn"][t]["ttft_ms"] for t in turns], marker="o")
        ax.set_xlabel("turn")
        ax.set_ylabel("mean TTFT (ms)")
    else:
        labels = ["mean", "p50", "p99"]
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], [results["ttft_ms"][k] or 0 for k in labels], width=0.4, label="TTFT")
        ax.bar([i + 0.2 for i in x], [results["tpot_ms"][k] or 0 for k in labels], width=0.4, label="TPOT")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("ms")
        ax.legend()
    cfg = results.get("config", {})
    ax.set_title(
        f"{cfg.get('workload', '')} @ {cfg.get('base_url', '')}, concurrency {cfg.get('concurrency', '')}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a /v1 suffix is fine)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--workload", choices=tuple(WORKLOADS), default="system-prompt")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help=f"requests in flight (default {DEFAULT_CONCURRENCY}; a --trace replay is open loop unless given)",
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--system-prompt-tokens", type=int, default=2048, help="approximate (words)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--tenants", type=int, default=4, help="multi-tenant: system prompts, one per tenant")
    p.add_argument(
        "--tenant-api-keys", default=None, help="multi-tenant: comma-separated keys, tenant i sends key i mod count"
    )
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=64, help="approximate user tokens per turn (words)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos so every answer is full length")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0, help="also picks the token runs a trace's hash ids map to")
    t = p.add_argument_group("trace replay (docs/traces.md)")
    t.add_argument(
        "--trace",
        default=None,
        help="replay this trace file instead of a synthetic --workload; a directory of agent sessions (or one "
        ".json session) is replayed closed loop",
    )
    t.add_argument("--trace-format", choices=tuple(FORMATS), default=None, help="default: detected")
    t.add_argument("--tokens-per-block", type=int, default=None, help="default: the trace's own block size")
    t.add_argument("--time-scale", type=float, default=1.0, help="multiplies arrival times (2 = half the load)")
    t.add_argument("--output-scale", type=float, default=None, help="default: the prompts' scale factor")
    t.add_argument("--max-requests", type=int, default=None, help="the first N requests of the window")
    t.add_argument("--trace-start", type=float, default=0.0, help="window start, trace seconds")
    t.add_argument("--trace-duration", type=float, default=None, help="window length, trace seconds")
    t.add_argument(
        "--bound-page-size", type=int, default=16, help="the server's page size, for the unbounded hit rate printed"
    )
    add_session_arguments(t)


def register(subparsers) -> argparse.ArgumentParser:
    """Add `serve` to the `prefixkv bench` subcommands."""
    p = subparsers.add_parser("serve", help="benchmark a running OpenAI-compatible server over HTTP")
    add_arguments(p)
    p.set_defaults(func=run)
    return p
