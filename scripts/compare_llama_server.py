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

--model DIR runs a Hugging Face checkpoint (e.g. one `prefixkv checkpoint --shape ...` wrote) instead of the default
model: llama-server reads GGUF files converted from that same checkpoint (<shape>-bf16.gguf by llama.cpp's
convert_hf_to_gguf.py, <shape>-q4_1.gguf and <shape>-q8_0.gguf from it by llama-quantize; the .sh makes them),
prefixkv reads the checkpoint itself for bf16 and q8_0 and the converted Q4_1 file for q4_1, and the results go to
a subfolder named after the shape, so they never overwrite the default model's.
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
from compare_vllm.__main__ import checkpoint_arg, cpu_family, describe_model, machine, model_label  # noqa: E402
from compare_vllm.servers import SERVED_MODEL_NAME, Server, SideFailed, free_port  # noqa: E402
from compare_vllm.workloads import TokenSource  # noqa: E402

from prefixkv.bench.paired import Paired, from_ratios, paired, round_ratio  # noqa: E402
from prefixkv.model.shapes import model_record  # noqa: E402

# format -> (prefixkv's --weight-format, the GGUF file llama-server reads, under --gguf-dir, for the default model)
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
    p.add_argument(
        "--gguf-dir",
        required=True,
        help="holds " + ", ".join(f for _, f in FORMATS.values()) + " (with --model: <shape>-bf16.gguf etc.)",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a Hugging Face checkpoint directory both sides run (llama-server: the GGUF files converted from it); "
        "default: the embedded SmolLM2",
    )
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
    args.model, args.model_shape = checkpoint_arg(p, args.model)
    return args


def gguf_name(args: argparse.Namespace, fmt: str) -> str:
    """The GGUF file llama-server reads for a format: the default model's, or <shape>-<format>.gguf converted from
    --model's checkpoint (compare_llama_server.sh names them so)."""
    if args.model_shape is None:
        return FORMATS[fmt][1]
    return f"{model_label(args.model_shape)}-{fmt}.gguf"


def prefixkv_model(args: argparse.Namespace, fmt: str) -> str | None:
    """What prefixkv's side loads for a format: --model's checkpoint, or for q4_1 (--weight-format gguf: the file's
    own blocks) the Q4_1 file converted from it, which llama-server reads too; None: the default model's GGUF."""
    if args.model is None:
        return None
    return os.path.join(args.gguf_dir, gguf_name(args, fmt)) if FORMATS[fmt][0] == "gguf" else args.model


def prefixkv_server(args: argparse.Namespace, weight_format: str, log_path: str, model: str | None = None) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "prefixkv", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", "bfloat16", "--weight-format", weight_format, "--num-threads", str(args.threads)]
    argv += ["--kv-cache-tokens", "8192", "--max-model-len", "4096", "--served-model-name", SERVED_MODEL_NAME]
    if model is not None:
        argv += ["--model", model]
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


def floor_bytes(weight_format: str, model: str | None = None) -> dict:
    """The bytes one decode step reads in prefixkv's layout of this format (bench decode's count)."""
    from prefixkv.bench.decode import weight_bytes
    from prefixkv.llm import LLM

    llm = LLM(model=model, dtype="bfloat16", weight_format=weight_format, kv_cache_tokens=256, max_model_len=256)
    runner: Any = llm.llm_engine.runner  # a ModelRunner (typed as the engine's ModelExecutor protocol)
    weights = weight_bytes(runner.model)
    key = "weight_bytes_bf16" if weight_format == "dense" else "bytes_read_as_stored"
    return {"floor_bytes": weights[key], **weights}


def run_format(args: argparse.Namespace, name: str, logs: str) -> dict:
    weight_format, file_name = FORMATS[name][0], gguf_name(args, name)
    gguf = os.path.join(args.gguf_dir, file_name)
    model = prefixkv_model(args, name)
    for path in {gguf, model or gguf}:
        if not os.path.exists(path):
            raise SystemExit(f"error: {path} is missing (scripts/compare_llama_server.sh makes it)")
    sides = {
        "prefixkv": prefixkv_server(args, weight_format, os.path.join(logs, f"prefixkv_{name}.log"), model),
        "llama-server": llama_server(args, gguf, os.path.join(logs, f"llama_server_{name}.log")),
    }
    record: dict = {"prefixkv_weight_format": weight_format, "prefixkv_model": model, "gguf": file_name, "rounds": []}
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
    shape = describe_model(results.get("model_shape"))
    lines = [
        (shape + "; " if shape else "")
        + f"CPU: {results['machine']['cpu'].get('model', '?')} ({results['machine']['family']}), "
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
    model = model_label(results["model_shape"]) + ", " if results.get("model_shape") else ""
    threads = results["settings"]["threads"]
    ax.set_title(
        f"{model}one stream, {results['settings']['output_tokens']} tokens, {cpu}, {threads} threads", fontsize=9
    )
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
    if args.output_dir is None and args.model_shape is not None:  # never over the default model's results
        out_dir = os.path.join(out_dir, model_label(args.model_shape))
    logs = os.path.join(out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    bandwidth = [measure_bandwidth(BANDWIDTH_MIB, repeats=5)]
    floors = {name: floor_bytes(FORMATS[name][0], prefixkv_model(args, name)) for name in args.formats}
    formats: dict = {}
    for name in args.formats:
        print(
            f"== {name}: prefixkv --weight-format {FORMATS[name][0]} vs llama-server {gguf_name(args, name)}",
            flush=True,
        )
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
        "model": args.model,  # --model (null: the default model)
        # the shape both sides ran (prefixkv.model.shapes.model_record), as every bench record names it
        "model_shape": args.model_shape or model_record(None),
        "gguf_source": (
            "the shipped Q4_1 file; BF16 and Q8_0 made from it by llama-quantize"
            if args.model is None
            else "BF16 by llama.cpp's convert_hf_to_gguf.py from --model; Q4_1 (token embedding Q8_0, as in the "
            "shipped file) and Q8_0 from the BF16 file by llama-quantize"
        ),
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
