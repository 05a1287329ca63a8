"""The orchestrator: `python -m compare_vllm [--rounds N] [--rows offline,serve] [--quick]`, in prefixkv's venv.

`bash scripts/compare_vllm.sh` creates both venvs and the model export, then runs this. Round k runs every
selected row for one engine, then for the other (vLLM first on even rounds, prefixkv first on odd ones), so slow
drift on a shared machine hits both alike; each engine part is a fresh process (offline rows) or a fresh server
(serving rows), so every round starts cold. Medians over rounds, their ratios, the table, JSON and a plot go to
--output-dir; every process's log goes to its logs/ folder.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time

from compare_vllm import report
from compare_vllm.servers import (
    SERVED_MODEL_NAME,
    Server,
    SideFailed,
    free_port,
    log_tail,
    parse_prometheus,
    prometheus_labels,
    running,
    track,
    untrack,
)
from compare_vllm.workloads import FULL, QUICK, Sizes

SCRIPTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(SCRIPTS_DIR)
ROW_GROUPS = ("offline", "serve")
PART_TIMEOUT_S = 3600  # one engine's offline rows or one `vllm bench serve` run; a hang guard, never a target


def served_rows(sizes: Sizes) -> list[tuple[str, int, int, int]]:
    """(name, --random-prefix-len, --random-input-len, client --seed) of each `vllm bench serve` run."""
    return [
        ("serve_shared", sizes.shared_prefix_tokens, sizes.shared_suffix_tokens, 1),
        ("serve_zero_hit", 0, sizes.zero_hit_tokens, 2),
    ]


PREFIX_CACHE_COUNTERS = {"vllm": "vllm:prefix_cache_", "prefixkv": "prefixkv:prefix_cache_"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bash scripts/compare_vllm.sh",
        description="prefixkv side by side with vLLM's CPU build: every row for both engines in alternating "
        "rounds; one table of medians and ratios, plus JSON and a plot",
    )
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds, medians shown (default 3; --quick: 1)")
    p.add_argument("--rows", default="offline,serve", help="which rows: offline, serve or both (comma-separated)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and 1 round: checks the script end to end")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for each engine")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts (the same ids on both engines)")
    p.add_argument(
        "--output-dir",
        default=None,
        help="default: docs/benchmarks/vllm_side_by_side/ (with --quick: bench_results/vllm_side_by_side_quick/)",
    )
    p.add_argument(
        "--skip-vllm-install",
        action="store_true",
        help="(read by compare_vllm.sh) never create the vLLM venv; fail if it is missing",
    )
    args = p.parse_args(argv)
    args.row_groups = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in args.row_groups if r not in ROW_GROUPS]
    if bad or not args.row_groups:
        p.error(f"--rows takes a comma-separated subset of {','.join(ROW_GROUPS)}, got {args.rows!r}")
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.output_dir is None:
        sub = "bench_results/vllm_side_by_side_quick" if args.quick else "docs/benchmarks/vllm_side_by_side"
        args.output_dir = os.path.join(REPO, sub)
    return args


class Runner:
    """Runs one engine's parts as child processes, with the environment each side needs."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes) -> None:
        self.args, self.sizes = args, sizes
        self.vllm_python = os.path.join(os.environ.get("VLLM_VENV", os.path.join(REPO, ".vllm-venv")), "bin", "python")
        self.model_dir = os.environ.get("VLLM_MODEL_DIR", os.path.join(REPO, ".vllm-model"))
        self.log_dir = os.path.join(args.output_dir, "logs")
        shutil.rmtree(self.log_dir, ignore_errors=True)  # this run's logs only: no stale file to misread
        os.makedirs(self.log_dir)
        base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env = {
            # vLLM's venv sees only the comparison modules; binding N cores gives it N OpenMP threads
            "vllm": {
                **base,
                "PYTHONPATH": SCRIPTS_DIR,
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
                "HF_HUB_OFFLINE": "1",
            },
            # this checkout's prefixkv first, whatever the venv's editable install points at
            "prefixkv": {**base, "PYTHONPATH": os.pathsep.join([REPO, SCRIPTS_DIR])},
        }
        self.python = {"vllm": self.vllm_python, "prefixkv": sys.executable}

    def _run(self, engine: str, argv: list[str], log_name: str, what: str) -> str:
        """Runs argv to the end (in a session of its own, so an interrupt stops its workers too); its log path."""
        log_path = os.path.join(self.log_dir, log_name)
        with open(log_path, "w") as log:
            log.write("$ " + shlex.join(argv) + "\n")
            log.flush()
            proc = subprocess.Popen(
                argv, env=self.env[engine], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            track(proc.pid)
            try:
                code = proc.wait(timeout=PART_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                with contextlib.suppress(ProcessLookupError):  # a hung part, or workers that outlived it
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                untrack(proc.pid)
        if code != 0:
            status = "timed out" if code is None else f"exited with status {code}"
            raise SideFailed(f"{engine}: {what} {status}; log {log_path}, last lines:\n{log_tail(log_path)}")
        return log_path

    def versions(self, engine: str) -> dict:
        module = f"compare_vllm.side_{engine}"
        log = self._run(
            engine, [self.python[engine], "-m", module, "versions"], f"{engine}-versions.log", "the version check"
        )
        with open(log) as f:
            return json.loads(f.read().strip().splitlines()[-1])

    def offline(self, engine: str, round_index: int) -> dict:
        out = os.path.join(self.log_dir, f"{engine}-offline-round{round_index}.json")
        sizes = json.dumps(dataclasses.asdict(self.sizes))
        argv = [self.python[engine], "-m", f"compare_vllm.side_{engine}", "offline", "--sizes", sizes]
        argv += ["--out", out, "--seed", str(self.args.seed)]
        argv += ["--model-dir", self.model_dir] if engine == "vllm" else ["--threads", str(self.args.threads)]
        self._run(engine, argv, f"{engine}-offline-round{round_index}.log", "the offline rows")
        with open(out) as f:
            return json.load(f)

    def server(self, engine: str, round_index: int) -> Server:
        s, port = self.sizes, free_port()
        limits = (
            f"--max-num-seqs {s.serve_max_num_seqs} --max-model-len {s.max_model_len} --max-num-batched-tokens "
            f"{s.max_num_batched_tokens} --kv-cache-memory-bytes {s.kv_cache_bytes} --dtype bfloat16 "
            f"--served-model-name {SERVED_MODEL_NAME} --host 127.0.0.1 --port {port} --seed {self.args.seed}"
        ).split()
        if engine == "vllm":
            argv = [self.vllm_python, "-m", "compare_vllm.side_vllm", "cli", "serve", self.model_dir, *limits]
            argv += ["--enable-prefix-caching", "--disable-uvicorn-access-log"]
        else:
            argv = [sys.executable, "-m", "prefixkv.server", *limits]
            argv += ["--num-threads", str(self.args.threads), "--log-level", "warning"]
        log = os.path.join(self.log_dir, f"{engine}-server-round{round_index}.log")
        return Server(engine, argv, self.env[engine], port, log)

    def bench_serve(self, engine: str, server: Server, round_index: int) -> tuple[dict, dict]:
        """Warm the server, then each served row through `vllm bench serve`: (row values, what each row did)."""
        server.warm_up(self.sizes)
        server.check_stream_usage()
        values, detail = {}, {}
        counters = PREFIX_CACHE_COUNTERS[engine]
        for name, prefix, input_len, client_seed in served_rows(self.sizes):
            before = parse_prometheus(server.metrics())
            result_name = f"{engine}-{name}-round{round_index}.json"
            argv = [self.vllm_python, "-m", "compare_vllm.side_vllm", "cli", "bench", "serve"]
            argv += ["--base-url", server.base_url, "--tokenizer", self.model_dir, "--result-dir", self.log_dir]
            # greedy (--temperature 0) as the offline rows: the client no longer sends it unless told
            argv += (
                f"--backend openai --model {SERVED_MODEL_NAME} --dataset-name random --random-prefix-len {prefix} "
                f"--random-input-len {input_len} --random-output-len {self.sizes.output_tokens} --num-prompts "
                f"{self.sizes.num_prompts} --ignore-eos --temperature 0 --seed {client_seed} --disable-tqdm "
                f"--save-result --result-filename {result_name}"
            ).split()
            self._run("vllm", argv, f"{engine}-{name}-round{round_index}.log", f"`vllm bench serve` ({name})")
            after = parse_prometheus(server.metrics())
            with open(os.path.join(self.log_dir, result_name)) as f:
                result = json.load(f)
            if result.get("completed") != self.sizes.num_prompts or result.get("failed", 0):
                raise server.fail(
                    f"{name}: {result.get('completed')} of {self.sizes.num_prompts} requests "
                    f"completed, {result.get('failed')} failed"
                )
            values[f"{name}_tok_s"] = result["output_throughput"]
            values[f"{name}_ttft_ms"] = result["median_ttft_ms"]
            detail[name] = {
                "random_prefix_len": prefix,
                "random_input_len": input_len,
                "duration_s": result.get("duration"),
                "total_input_tokens": result.get("total_input_tokens"),
                "total_output_tokens": result.get("total_output_tokens"),
                "mean_ttft_ms": result.get("mean_ttft_ms"),
                "median_tpot_ms": result.get("median_tpot_ms"),
                "prefix_cache_hit_tokens": after.get(counters + "hits_total", 0)
                - before.get(counters + "hits_total", 0),
                "prefix_cache_query_tokens": after.get(counters + "queries_total", 0)
                - before.get(counters + "queries_total", 0),
            }
        return values, detail


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
    }


def run_round(runner: Runner, args: argparse.Namespace, k: int, config: dict) -> dict:
    order = list(report.ENGINES) if k % 2 == 0 else list(reversed(report.ENGINES))
    record: dict = {"round": k, "order": order}
    for engine in order:
        start = time.monotonic()
        values: dict = {}
        detail: dict = {}
        if "offline" in args.row_groups:
            print(f"round {k + 1}/{args.rounds}: {engine} offline rows ...", flush=True)
            res = runner.offline(engine, k)
            values.update({key: v for key, v in res["rows"].items() if key != "detail"})
            detail["offline"] = res["rows"]["detail"]
            config[engine].setdefault("offline_engine", res["engine"])
        if "serve" in args.row_groups:
            print(f"round {k + 1}/{args.rounds}: {engine} server + vllm bench serve ...", flush=True)
            with running(runner.server(engine, k)) as server:
                vals, det = runner.bench_serve(engine, server, k)
                if engine == "vllm":
                    config["vllm"].setdefault("server_cache_config", _vllm_cache_config(server.metrics()))
            values.update(vals)
            detail["serve"] = det
        record[engine] = {"rows": values, "detail": detail, "wall_s": time.monotonic() - start}
    return record


def _vllm_cache_config(metrics_text: str) -> dict:
    labels = prometheus_labels(metrics_text, "vllm:cache_config_info")
    keep = ("block_size", "enable_prefix_caching", "prefix_caching_hash_algo", "num_gpu_blocks", "cache_dtype")
    return {k: labels[k] for k in keep if k in labels}


def header(config: dict) -> str:
    """One line: both engines' versions and cache settings (vLLM's as it reports them), dtype, threads, machine."""
    v, p = config["vllm"], config["prefixkv"]
    vllm_cache = v.get("offline_engine") or v.get("server_cache_config") or {}
    pkv = p.get("offline_engine") or {}
    prefix_cache = pkv.get("prefix_cache", p["versions"].get("default_prefix_cache"))
    page_size = pkv.get("page_size", p["versions"].get("default_page_size"))
    return (
        f"vLLM {v['versions'].get('vllm')} (torch {v['versions'].get('torch')}): block size "
        f"{vllm_cache.get('block_size', '?')}, prefix caching {vllm_cache.get('enable_prefix_caching', '?')} "
        f"(as vLLM reports them) | prefixkv {p['versions'].get('prefixkv')} (torch {p['versions'].get('torch')}): "
        f"prefix cache {prefix_cache}, page size {page_size} | bf16, {config['threads']} threads each, "
        f"{config['rounds']} round(s), {config['machine']['cpu']} x {config['machine']['cpu_count']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = QUICK if args.quick else FULL
    runner = Runner(args, sizes)
    if not os.path.exists(runner.vllm_python):
        print(
            f"error: no vLLM venv at {os.path.dirname(os.path.dirname(runner.vllm_python))} (set VLLM_VENV, or "
            "run bash scripts/compare_vllm.sh, which creates it)",
            file=sys.stderr,
        )
        return 2
    if not os.path.exists(os.path.join(runner.model_dir, "config.json")):
        print(
            f"error: no exported model at {runner.model_dir} (set VLLM_MODEL_DIR, or run "
            "bash scripts/compare_vllm.sh, which exports it)",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the servers' `finally`
    started = time.monotonic()
    config: dict = {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "bash scripts/compare_vllm.sh " + shlex.join(sys.argv[1:] if argv is None else argv),
        "dtype": "bfloat16",
        "threads": args.threads,
        "rounds": args.rounds,
        "rows": args.row_groups,
        "quick": args.quick,
        "seed": args.seed,
        "sizes": dataclasses.asdict(sizes),
        "served_model_name": SERVED_MODEL_NAME,
        "model_dir": runner.model_dir,
        "machine": machine(),
        "vllm_env": {k: runner.env["vllm"][k] for k in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND")},
    }
    rounds: list[dict] = []
    try:
        for engine in report.ENGINES:
            config[engine] = {"versions": runner.versions(engine)}
        for k in range(args.rounds):
            rounds.append(run_round(runner, args, k, config))
    except SideFailed as exc:
        print(f"\ncompare_vllm: FAILED: {exc}", file=sys.stderr)
        return 1
    config["machine"]["load_average_at_end"] = os.getloadavg()
    config["wall_s"] = time.monotonic() - started

    per_round = {e: [r[e]["rows"] for r in rounds] for e in report.ENGINES}
    summary = report.summarize(report.rows_for(sizes), per_round)
    table = report.format_table(summary)
    title = header(config)
    print("\n" + title + "\n\n" + table + f"\n\n(run took {config['wall_s'] / 60:.1f} min)")

    os.makedirs(args.output_dir, exist_ok=True)
    json_path = os.path.join(args.output_dir, "compare_vllm.json")
    with open(json_path, "w") as f:
        json.dump({"config": config, "rounds": rounds, "summary": summary}, f, indent=2)
    with open(os.path.join(args.output_dir, "compare_vllm.md"), "w") as f:
        f.write(title + "\n\n" + table + "\n")
    png_path = os.path.join(args.output_dir, "compare_vllm.png")
    try:
        report.plot(
            summary,
            png_path,
            f"prefixkv vs vLLM {config['vllm']['versions'].get('vllm')} CPU, bf16, "
            f"{args.threads} threads, median of {args.rounds} round(s)",
        )
    except ImportError:
        png_path = "(no plot: matplotlib is not installed)"
    print(f"wrote {json_path}, {png_path} and the logs in {runner.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
