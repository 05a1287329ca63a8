"""`prefixkv bench zero-hit`: what prefix caching costs when it never hits.

Design target: with unrelated prompts, throughput with caching on is >= 99% of caching off. A 1% effect is
smaller than the drift of a shared machine, so the modes run interleaved in rotating order (off, hash, radix /
hash, radix, off / ...) on the same prompts, each run from an empty cache; the ratio reported is the median over
rounds of each round's on/off ratio (runs of one round are minutes apart, not the whole benchmark), printed with
every round's ratio and what the rounds show (prefixkv.bench.paired: "every round ahead" only where each is).
With no hits, caching changes nothing the model runner computes (same batches, same shapes): all it can add is
engine work outside the runner (hashing, lookups, block bookkeeping). That time is measured for every run and
reported as a share of the run, the noise-free view of the same question. The block hash is the per-token work
caching adds, so its cost is reported too, per 16-token block, for both algorithms.
"""

from __future__ import annotations

import argparse
import time

from prefixkv.bench import common
from prefixkv.bench.paired import from_ratios, paired
from prefixkv.bench.workloads import median, random_prompts, sampler_for

HASH_BLOCK_SIZE = 16


def register(subparsers) -> None:
    p = subparsers.add_parser("zero-hit", help="throughput with caching on (hash, radix) vs off, no shared prefix")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="rounds; each round runs every mode once")
    p.add_argument("--modes", default="off,hash,radix", help="comma-separated cache kinds to compare")
    p.add_argument("--hash-blocks", type=int, default=4096, help="blocks hashed to time the block hash")
    common.add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict:
    factory = common.factory_for(args, llm_factory)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "off" not in modes:
        modes.insert(0, "off")
    llms = {mode: factory(prefix_cache=mode) for mode in modes}
    sampler = sampler_for(llms["off"], seed=args.seed)
    prompts = random_prompts(sampler, args.num_prompts, args.input_len)
    for llm in llms.values():
        common.warmup(llm, sampler)

    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    order = list(modes)
    for _ in range(max(1, args.repeats)):
        for mode in order:
            runs[mode].append(common.timed_generate(llms[mode], prompts, args.output_len))
        order = order[1:] + order[:1]  # rotate: every mode runs first, middle and last equally often

    summary = {
        mode: {
            "output_tok_s": median([r["output_tok_s"] for r in rs]),
            "total_tok_s": median([r["total_tok_s"] for r in rs]),
            "elapsed_s": median([r["elapsed_s"] for r in rs]),
            "outside_model_s": median([r["outside_model_s"] for r in rs]),
            "outside_model_share": median([r["outside_model_s"] / r["elapsed_s"] for r in rs]),
            "cached_tokens": max(r["cached_tokens"] for r in rs),
            "output_tok_s_runs": [r["output_tok_s"] for r in rs],
        }
        for mode, rs in runs.items()
    }
    pairs = {  # each round's on / off, then the median of those (never a ratio of two medians)
        mode: paired([on["output_tok_s"] for on in rs], [off["output_tok_s"] for off in runs["off"]])
        for mode, rs in runs.items()
        if mode != "off"
    }
    ratios = {mode: p.median for mode, p in pairs.items()}
    off_outside = summary["off"]["outside_model_share"]
    added = {mode: s["outside_model_share"] - off_outside for mode, s in summary.items() if mode != "off"}
    hash_cost = hash_cost_us(sampler, args.hash_blocks)
    results = {
        "config": common.run_config(
            args,
            llms["off"],
            modes=modes,
            input_len=args.input_len,
            output_len=args.output_len,
            num_prompts=args.num_prompts,
            repeats=args.repeats,
        ),
        "modes": summary,
        "ratio_output_tok_s_on_over_off": ratios,
        "paired_output_tok_s_on_over_off": {mode: p.as_dict() for mode, p in pairs.items()},
        "engine_overhead_added_share": added,
        "target_ratio": 0.99,
        "hash_us_per_block": hash_cost,
        "hash_us_per_prompt": {
            algo: c["hash_prompt_blocks"] * (args.input_len // HASH_BLOCK_SIZE) for algo, c in hash_cost.items()
        },
        "reference": {
            "label": common.REFERENCE_LABEL,
            "unrelated_512_output_tok_s": common.REFERENCE["unrelated_512_output_tok_s"],
        },
    }
    _print(results, args)
    return results


def hash_cost_us(sampler, num_blocks: int, rounds: int = 5) -> dict[str, dict[str, float]]:
    """Microseconds per block, best of a few rounds: all of hash_prompt_blocks (serialisation + chaining + hash),
    and the hash function alone on the same bytes, so the Python around the hash shows separately."""
    from prefixkv.kvcache.hashing import HASH_FUNCTIONS, ROOT_KEY, hash_prompt_blocks

    num_blocks = max(1, num_blocks)
    tokens = sampler.tokens(num_blocks * HASH_BLOCK_SIZE)
    payloads = [ROOT_KEY + bytes(4 + 4 * HASH_BLOCK_SIZE) for _ in range(num_blocks)]  # same size as a real block
    cost = {}
    for algo, fn in HASH_FUNCTIONS.items():
        full = _best_of(rounds, lambda a=algo: hash_prompt_blocks(tokens, HASH_BLOCK_SIZE, a))
        bare = _best_of(rounds, lambda f=fn: [f(p) for p in payloads])
        cost[algo] = {"hash_prompt_blocks": full / num_blocks * 1e6, "hash_fn_only": bare / num_blocks * 1e6}
    return cost


def _best_of(rounds: int, fn) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _print(results: dict, args: argparse.Namespace) -> None:
    cfg = results["config"]
    rows = []
    for mode, s in results["modes"].items():
        r = results["ratio_output_tok_s_on_over_off"].get(mode, 1.0)
        rows.append((mode, s["elapsed_s"], s["output_tok_s"], s["total_tok_s"], r, s["cached_tokens"]))
    common.print_table(
        ["cache", "elapsed s", "output tok/s", "total tok/s", "on/off", "cached tokens"],
        rows,
        title=f"zero hit: {args.num_prompts} unrelated prompts x {args.input_len} in + "
        f"{args.output_len} out, median of {args.repeats} interleaved rounds, {cfg['dtype']}, "
        f"{cfg['num_threads']} threads",
    )
    print(f"caching on / off output tok/s, median of per-round ratios (target >= {results['target_ratio']}):")
    for mode, p in results.get("paired_output_tok_s_on_over_off", {}).items():
        print(f"  {mode}: {from_ratios(p['ratios']).describe(3)}")
    outside = ", ".join(
        f"{mode} {s['outside_model_s'] * 1e3:.0f} ms ({s['outside_model_share']:.2%})"
        for mode, s in results["modes"].items()
    )
    added = ", ".join(f"{mode} {a:+.2%}" for mode, a in results["engine_overhead_added_share"].items())
    print(f"engine time outside the model per run: {outside}; added by caching: {added} of the run")
    costs = ", ".join(
        f"{algo} {c['hash_prompt_blocks']:.2f} us/block (hash alone {c['hash_fn_only']:.2f}; "
        f"{results['hash_us_per_prompt'][algo]:.0f} us per {args.input_len}-token prompt)"
        for algo, c in results["hash_us_per_block"].items()
    )
    print(f"block hash ({HASH_BLOCK_SIZE} tokens): {costs}")
    print(
        f"{common.REFERENCE_LABEL}: 32 unrelated 512-token prompts, 32 out: "
        f"{common.REFERENCE['unrelated_512_output_tok_s']:.0f} output tok/s"
    )


def plot(results: dict, png_path: str) -> None:
    """Output tok/s per cache mode (one dot per round), so drift between rounds is visible next to the medians."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results["modes"])
    cfg = results["config"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(modes, [results["modes"][m]["output_tok_s"] for m in modes], color="tab:blue", alpha=0.6)
    for i, m in enumerate(modes):
        runs = results["modes"][m]["output_tok_s_runs"]
        ax.scatter([i] * len(runs), runs, color="black", s=12, zorder=3)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"zero-hit throughput by cache mode ({cfg['dtype']}, {cfg['num_threads']} threads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
