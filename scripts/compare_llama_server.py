"""One stream's decode, prefixkv against llama.cpp's llama-server (issue 26), one weight format at a time.

    PYTHONPATH=scripts .venv/bin/python scripts/compare_llama_server.py --llama-server BIN --gguf-dir DIR

(scripts/compare_llama_server.sh builds llama-server and the GGUF files first, then runs this.)

For each format both servers run at once, side by side: prefixkv's `serve` with --weight-format and llama-server on
the GGUF file holding the same values (bf16: dense bf16 against a BF16 GGUF; q4_1: the shipped Q4_1 file, read as
it is by both; q8_0: weights quantized to q8_0 by each at load / by llama-quantize). Each round sends the same
token-id prompt to each, in alternating order, one request at a time, through this one streaming client
(/v1/completions, greedy, ignore_eos, stream_options.include_usage). Decode tok/s of a request is its output tokens
after the first over the time from the first streamed token to the last; TTFT apart. prefixkv against llama-server
is the median of the per-round ratios (the two requests of a round are seconds apart; never the ratio of the two
medians), every round's ratio listed with what the rounds show (prefixkv.bench.paired: "every round ahead" only
where each is, "a tie within the noise" where the sign test cannot tell the split from chance). The floor of the
format is measured in the same run: the bytes one decode step reads (prefixkv's weights as it stores them) over
the best read pass measured before and after the rounds (bench decode's floor_bandwidth). JSON, a table and a
plot go to --output-dir (default docs/benchmarks/llama_server/<cpu family>/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# the environment the servers inherit, taken before prefixkv is imported (its import sets GOMP_SPINCOUNT)
LAUNCH_ENV = dict(os.environ)

import httpx  # noqa: E402
from compare_vllm.__main__ import cpu_family, machine  # noqa: E402
from compare_vllm.servers import SERVED_MODEL_NAME, Server, SideFailed, free_port  # noqa: E402
from compare_vllm.workloads import TokenSource  # noqa: E402

from prefixkv.bench.paired import Paired, from_ratios, paired, round_ratio  # noqa: E402

# format -> (prefixkv's --weight-format, the GGUF file llama-server reads, under --gguf-dir)
FORMATS = {
    "bf16": ("dense", "smollm2-bf16.gguf"),
    "q4_1": ("gguf", "smollm2-q4_1.gguf"),
    "q8_0": ("q8_0", "smollm2-q8_0.gguf"),
}
ENGINES = ("prefixkv", "llama-server")
BANDWIDTH_MIB = [256, 512, 1024]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="the llama-server binary")
    p.add_argument("--gguf-dir", required=True, help="holds " + ", ".join(f for _, f in FORMATS.values()))
    p.add_argument("--formats", default="bf16,q4_1,q8_0", help="comma-separated, of " + ", ".join(FORMATS))
    p.add_argument(
        "--rounds", type=int, default=3, help="timed requests per engine and format (the median of per-round ratios)"
    )
    p.add_argument("--prompt-tokens", type=int, default=50)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--build-info", default=None, help="a JSON file the build script wrote (flags, version)")
    args = p.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        p.error(f"unknown format(s) {unknown}; choose from {list(FORMATS)}")
    if args.rounds < 1 or args.output_tokens < 2:
        p.error("--rounds must be >= 1 and --output-tokens >= 2")
    return args


def prefixkv_server(args: argparse.Namespace, weight_format: str, log_path: str) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "prefixkv", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", "bfloat16", "--weight-format", weight_format, "--num-threads", str(args.threads)]
    argv += ["--kv-cache-tokens", "8192", "--max-model-len", "4096", "--served-model-name", SERVED_MODEL_NAME]
    return Server("prefixkv", argv, LAUNCH_ENV, port, log_path)


def llama_server(args: argparse.Namespace, gguf: str, log_path: str) -> Server:
    """One slot (-np 1), the threads for both decode and prompt (-t, -tb), a 4096-token context."""
    port = free_port()
    argv = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--alias", SERVED_MODEL_NAME]
    argv += ["-t", str(args.threads), "-tb", str(args.threads), "-np", "1", "-c", "4096"]
    return Server("llama-server", argv, LAUNCH_ENV, port, log_path)


def stream_once(base_url: str, prompt: list[int], output_tokens: int) -> dict:
    """One streamed greedy completion; the times of its first and last token and the usage it ends with."""
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = None
    chunks = 0
    usage: dict = {}
    server_timings: dict = {}
    with httpx.Client(timeout=600) as client:  # built before the clock starts (it loads CA certificates)
        sent = time.perf_counter()
        with client.stream("POST", base_url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{base_url}: HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[len("data: ") :])
                if any(choice.get("text") for choice in chunk.get("choices") or ()):
                    first = first if first is not None else now
                    last = now
                    chunks += 1
                usage = chunk.get("usage") or usage
                server_timings = chunk.get("timings") or server_timings
    tokens = usage.get("completion_tokens", 0)
    if first is None or last is None or tokens != output_tokens:
        raise RuntimeError(f"{base_url}: expected {output_tokens} streamed tokens, usage said {usage!r}")
    out = {
        "ttft_s": first - sent,
        "decode_s": last - first,
        "output_tokens": tokens,
        "chunks": chunks,
        "decode_tok_s": (tokens - 1) / (last - first),
    }
    if server_timings:  # llama-server's own count: tokens after the first over its decode time
        out["server_decode_tok_s"] = server_timings.get("predicted_per_second")
    return out


def floor_bytes(weight_format: str) -> dict:
    """The bytes one decode step reads in prefixkv's layout of this format (bench decode's count)."""
    from prefixkv.bench.decode import weight_bytes
    from prefixkv.llm import LLM

    llm = LLM(dtype="bfloat16", weight_format=weight_format, kv_cache_tokens=256, max_model_len=256)
    runner: Any = llm.llm_engine.runner  # a ModelRunner (typed as the engine's ModelExecutor protocol)
    weights = weight_bytes(runner.model)
    key = "weight_bytes_bf16" if weight_format == "dense" else "bytes_read_as_stored"
    return {"floor_bytes": weights[key], **weights}


def run_format(args: argparse.Namespace, name: str, logs: str) -> dict:
    weight_format, gguf_name = FORMATS[name]
    gguf = os.path.join(args.gguf_dir, gguf_name)
    if not os.path.exists(gguf):
        raise SystemExit(f"error: {gguf} is missing (scripts/compare_llama_server.sh makes it)")
    sides = {
        "prefixkv": prefixkv_server(args, weight_format, os.path.join(logs, f"prefixkv_{name}.log")),
        "llama-server": llama_server(args, gguf, os.path.join(logs, f"llama_server_{name}.log")),
    }
    record: dict = {"prefixkv_weight_format": weight_format, "gguf": gguf_name, "rounds": []}
    with sides["prefixkv"], sides["llama-server"]:
        for side in sides.values():
            side.wait_ready()
        warm = TokenSource(seed=777).tokens(args.prompt_tokens)
        for side in sides.values():  # untimed: first-use costs (thread pools, packing, page faults) land here
            stream_once(side.base_url, warm, 32)
        prompts = TokenSource(seed=2026)
        for k in range(args.rounds):
            prompt = prompts.tokens(args.prompt_tokens)  # new each round: no prompt-cache hit on either side
            order = ENGINES if k % 2 == 0 else ENGINES[::-1]
            row: dict = {"round": k, "order": list(order)}
            for engine in order:
                row[engine] = stream_once(sides[engine].base_url, prompt, args.output_tokens)
                print(f"  {name} round {k + 1}: {engine:12s} {row[engine]['decode_tok_s']:7.1f} tok/s", flush=True)
            record["rounds"].append(row)
    for engine in ENGINES:
        record[engine] = {
            key: statistics.median(r[engine][key] for r in record["rounds"]) for key in ("decode_tok_s", "ttft_s")
        }
    pair = paired_decode(record)
    record["prefixkv_vs_llama_server"] = pair.median  # the median of the per-round ratios
    record["paired_decode"] = pair.as_dict()
    ttft = [(r["prefixkv"]["ttft_s"], r["llama-server"]["ttft_s"]) for r in record["rounds"]]
    record["paired_ttft"] = paired([p for p, _ in ttft], [q for _, q in ttft], higher_is_better=False).as_dict()
    return record


def paired_decode(record: dict) -> Paired:
    """prefixkv against llama-server round by round (> 1: prefixkv decodes faster), from a format's rounds (a
    stored result's too)."""
    return from_ratios(
        [round_ratio(r["prefixkv"]["decode_tok_s"], r["llama-server"]["decode_tok_s"]) for r in record["rounds"]]
    )


def stored_round_ratios(path: str, fmt: str) -> list[float]:
    """A stored run's per-round prefixkv / llama-server decode ratios for one format: from its JSON's rounds, or
    from the "per round" column of a table.md this script wrote (runs kept only as tables: two decimals)."""
    if path.endswith(".json"):
        with open(path) as f:
            return list(paired_decode(json.load(f)["formats"][fmt]).ratios)
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) > 4 and cells[0] == fmt:
                return [float(x) for x in cells[4].split(":")[0].split()]
    raise ValueError(f"{path}: no {fmt} row")


def summarize_floor(record: dict, floor: dict, bandwidth_bytes_s: float) -> None:
    """The format's floor at bandwidth_bytes_s (the run's best read pass), and each engine's median against it."""
    step_floor_s = floor["floor_bytes"] / bandwidth_bytes_s
    record["floor"] = {**floor, "floor_ms_per_step": step_floor_s * 1e3, "floor_tok_s": 1 / step_floor_s}
    for engine in ENGINES:
        record[engine]["times_floor"] = record["floor"]["floor_tok_s"] / record[engine]["decode_tok_s"]


def table(results: dict) -> str:
    lines = [
        f"CPU: {results['machine']['cpu'].get('model', '?')} ({results['machine']['family']}), "
        f"{results['settings']['threads']} threads; bandwidth {results['bandwidth_bytes_s'] / 1e9:.1f} GB/s",
        "| format | prefixkv tok/s | llama-server tok/s | prefixkv / llama-server (median of per-round ratios) | "
        "per round: what the rounds show | floor tok/s | prefixkv x floor | llama-server x floor | "
        "TTFT prefixkv / llama-server |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rec in results["formats"].items():
        p, q = rec["prefixkv"], rec["llama-server"]
        ratio, per_round = rec["prefixkv_vs_llama_server"], ""
        if rec.get("rounds"):  # recomputed from the rounds, so a stored result reads the same way
            pair = paired_decode(rec)
            ratio, per_round = pair.median, f"{pair.per_round()}: {pair.verdict}"
        lines.append(
            f"| {name} | {p['decode_tok_s']:.1f} | {q['decode_tok_s']:.1f} | "
            f"**{ratio:.2f}x** | {per_round} | {rec['floor']['floor_tok_s']:.0f} | "
            f"{p['times_floor']:.2f}x | {q['times_floor']:.2f}x | "
            f"{p['ttft_s'] * 1e3:.0f} / {q['ttft_s'] * 1e3:.0f} ms |"
        )
    return "\n".join(lines)


def plot(results: dict, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["formats"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.27
    for i, (label, values) in enumerate(
        (
            ("prefixkv", [results["formats"][n]["prefixkv"]["decode_tok_s"] for n in names]),
            ("llama-server", [results["formats"][n]["llama-server"]["decode_tok_s"] for n in names]),
            ("floor (weights / bandwidth)", [results["formats"][n]["floor"]["floor_tok_s"] for n in names]),
        )
    ):
        xs = [j + (i - 1) * width for j in range(len(names))]
        bars = ax.bar(xs, values, width, label=label, alpha=0.5 if i == 2 else 1.0)
        if i == 0:  # prefixkv's bars carry the paired figure: the median of the per-round ratios
            notes = []
            for n in names:
                rec = results["formats"][n]
                ratio = paired_decode(rec).median if rec.get("rounds") else rec["prefixkv_vs_llama_server"]
                notes.append(f"{ratio:.2f}x")
            ax.bar_label(bars, labels=notes, fontsize=7, padding=2)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("one stream's decode tok/s (each side's median)")
    cpu = results["machine"]["cpu"].get("model", "?")
    ax.set_title(f"one stream, {results['settings']['output_tokens']} tokens, {cpu}, 2 threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from prefixkv.bench.decode import floor_bandwidth, measure_bandwidth, read_rates

    torch.set_num_threads(args.threads)
    mach = machine()
    out_dir = args.output_dir or os.path.join("docs", "benchmarks", "llama_server", cpu_family(mach["cpu"]))
    logs = os.path.join(out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    bandwidth = [measure_bandwidth(BANDWIDTH_MIB, repeats=5)]
    floors = {name: floor_bytes(FORMATS[name][0]) for name in args.formats}
    formats: dict = {}
    for name in args.formats:
        print(f"== {name}: prefixkv --weight-format {FORMATS[name][0]} vs llama-server {FORMATS[name][1]}", flush=True)
        formats[name] = run_format(args, name, logs)
    bandwidth.append(measure_bandwidth(BANDWIDTH_MIB, repeats=5))
    best = floor_bandwidth([r for b in bandwidth for r in read_rates(b)])  # bench decode's floor statistic
    for name in args.formats:
        summarize_floor(formats[name], floors[name], best)
    build_info = None
    if args.build_info:
        with open(args.build_info) as f:
            build_info = json.load(f)
    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": mach,
        "prefixkv_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip(),
        "llama_server_build": build_info,
        "settings": {
            "threads": args.threads,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "rounds": args.rounds,
            "client": "one streaming httpx client, /v1/completions, token-id prompt, greedy, ignore_eos",
        },
        "definitions": {
            "decode_tok_s": "(output tokens - 1) / (last streamed token's arrival - first's), median over rounds",
            "prefixkv_vs_llama_server": "the median over rounds of each round's prefixkv / llama-server decode_tok_s "
            "(paired_decode: every round's ratio, the counts ahead and behind, the sign test and the verdict)",
            "floor_tok_s": "bandwidth_bytes_s / floor_bytes: every weight of prefixkv's layout read once a step",
            "bandwidth_bytes_s": "the best read pass (native stream_read, else a bf16 sum; copies left out) over "
            "256 MiB-1 GiB buffers, before and after the rounds: bench decode's floor_bandwidth",
        },
        "bandwidth": bandwidth,
        "bandwidth_bytes_s": best,
        "formats": formats,
    }
    with open(os.path.join(out_dir, "llama_server.json"), "w") as f:
        json.dump(results, f, indent=2)
    text = table(results)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(text + "\n")
    plot(results, os.path.join(out_dir, "llama_server.png"))
    print(text)


if __name__ == "__main__":
    try:
        main()
    except SideFailed as exc:
        raise SystemExit(f"error: {exc}") from exc
