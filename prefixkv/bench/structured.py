"""`prefixkv bench structured`: what a grammar costs and what jump-forward gives back (issue 41's numbers).

- cost: greedy answers to a JSON Schema, grammar-constrained with jump-forward off, against the same prompts
  unconstrained with each row held to its constrained answer's length (EOS ignored), so both sides compute the
  same tokens and what differs is the mask: output tok/s at 1 stream (requests one at a time) and at 16 (one
  batch), the sides in rounds that alternate their order, the median of the per-round ratios with every round;
- compiles: a schema never seen compiles once (LLGuidanceGrammars.compiles), the same schema again compiles
  nothing; the time to start a matcher either way;
- jump-forward: a schema of long fixed keys, each request alone, wall time with jump-forward off against on, in
  alternating rounds; the answers' text must be the same both ways, and the forced tokens are the engine's count.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from prefixkv.bench import common
from prefixkv.bench.paired import paired
from prefixkv.bench.workloads import median, ratio

ORDER_SCHEMA = {  # the cost workload: free strings and numbers between a few keys
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 24},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 24}, "qty": {"type": "integer"}},
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
            "minItems": 2,
            "maxItems": 3,
        },
        "note": {"type": "string", "maxLength": 60},
    },
    "required": ["customer", "city", "items", "note"],
    "additionalProperties": False,
}
LONG_KEYS_SCHEMA = {  # the jump-forward workload: most of the answer is its keys
    "type": "object",
    "properties": {
        "customer_full_legal_name": {"type": "string", "maxLength": 24},
        "shipping_address_postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "is_priority_delivery_requested": {"type": "boolean"},
        "preferred_delivery_window_start_hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "gift_wrapping_requested_for_order": {"type": "boolean"},
        "customer_support_ticket_reference": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    },
    "required": [
        "customer_full_legal_name",
        "shipping_address_postal_code",
        "is_priority_delivery_requested",
        "preferred_delivery_window_start_hour",
        "gift_wrapping_requested_for_order",
        "customer_support_ticket_reference",
    ],
    "additionalProperties": False,
}
QUESTIONS = [
    "Write an order for Alice Smith in Boston: two books and a lamp, delivered before noon.",
    "Make up an order from Carlos Diaz in Madrid for three kinds of coffee beans.",
    "Record an order: Mei Tanaka in Osaka wants a kettle and four cups as a gift.",
    "Create an order for Omar Haddad in Lyon with a bicycle helmet and gloves, priority.",
    "Log an order for Grace Okafor in Lagos: a phone case and a charger, deliver in the evening.",
    "Draft an order for Lars Nilsson in Oslo for ski wax and goggles, support ticket ABC-1234.",
    "Enter an order for Priya Raman in Pune: a yoga mat, two towels and a water bottle.",
    "Write an order for Tom Becker in Hamburg, a printer and paper, postal code 20095.",
]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "structured", help="constrained decoding's cost, compile reuse and jump-forward's gain (JSON Schema)"
    )
    p.add_argument("--streams", default="1,16", help="comma-separated stream counts for the cost comparison")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per comparison")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens per answer")
    p.add_argument("--alone-requests", type=int, default=4, help="requests per round at 1 stream (one at a time)")
    p.add_argument("--jump-requests", type=int, default=4, help="requests per round of the jump-forward comparison")
    common.add_engine_args(p, exclude=("jump_forward",))
    p.set_defaults(func=run, dtype="bfloat16")


def _chats(llm, n: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(n)]


def _timed(llm, prompts: list[list[int]], params: list[Any], one_at_a_time: bool) -> tuple[float, list]:
    """Wall time of the requests from an empty cache (one batch, or each alone), and their outputs."""
    llm.reset_prefix_cache()
    batch = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate(b, s, use_tqdm=False)[0] for b, s in zip(batch, params, strict=True)]
    else:
        outs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0] for o in outs]


def _cost(llm, streams: int, rounds: int, max_tokens: int, alone_requests: int) -> dict:
    from prefixkv.sampling_params import SamplingParams
    from prefixkv.structured_outputs import StructuredOutputs

    alone = streams == 1
    prompts = _chats(llm, alone_requests if alone else streams)  # 1 stream: one at a time; else one batch
    constrained = SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputs(json=ORDER_SCHEMA)
    )
    _, first = _timed(llm, prompts, [constrained] * len(prompts), alone)  # compiles the schema, learns lengths
    lengths = [len(c.token_ids) for c in first]
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    sides: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    for r in range(rounds):
        order = ["constrained", "unconstrained"] if r % 2 == 0 else ["unconstrained", "constrained"]
        for side in order:
            params = [constrained] * len(prompts) if side == "constrained" else free
            seconds, outs = _timed(llm, prompts, params, alone)
            assert [len(c.token_ids) for c in outs] == lengths, "both sides must compute the same tokens"
            sides[side].append(ratio(sum(lengths), seconds))
    cmp = paired(sides["constrained"], sides["unconstrained"])
    return {
        "streams": streams,
        "requests": len(prompts),
        "output_tokens_per_round": sum(lengths),
        "output_tok_s": {side: {"per_round": v, "median": median(v)} for side, v in sides.items()},
        "constrained_vs_unconstrained": cmp.as_dict(),
        "cost_pct": round((1 - cmp.median) * 100, 2),
        "line": f"{streams} stream(s): constrained / unconstrained output tok/s {cmp.describe(3)}",
    }


def _compiles(llm) -> dict:
    from prefixkv.structured_outputs import StructuredOutputs

    grammars: Any = llm.llm_engine.grammars
    schema = {**ORDER_SCHEMA, "title": f"order-{time.time_ns()}"}  # a source never seen
    fresh = StructuredOutputs(json=schema)
    before = grammars.compiles
    t0 = time.perf_counter()
    grammars.start(fresh)
    first_s = time.perf_counter() - t0
    after_first = grammars.compiles
    t0 = time.perf_counter()
    grammars.start(StructuredOutputs(json=json.dumps(dict(reversed(schema.items())))))  # the same, keys reordered
    second_s = time.perf_counter() - t0
    return {
        "first_request_compiles": after_first - before,
        "second_request_compiles": grammars.compiles - after_first,
        "first_start_ms": round(first_s * 1000, 3),
        "second_start_ms": round(second_s * 1000, 3),
    }


def _jump_forward(sampling, jumping, rounds: int, requests: int, max_tokens: int) -> dict:
    from prefixkv.sampling_params import SamplingParams
    from prefixkv.structured_outputs import StructuredOutputs

    prompts = _chats(sampling, requests)
    params = [
        SamplingParams(
            temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputs(json=LONG_KEYS_SCHEMA)
        )
    ] * requests
    llms = {"off": sampling, "on": jumping}
    for llm in llms.values():
        _timed(llm, prompts[:1], params[:1], True)  # the compile and the lazy initialisation, untimed
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    texts: dict[str, list[str]] = {}
    forced_before = jumping.llm_engine.get_stats().jump_forward_tokens_total
    output_tokens = 0
    for r in range(rounds):
        for side in ["off", "on"] if r % 2 == 0 else ["on", "off"]:
            elapsed, outs = _timed(llms[side], prompts, params, True)
            seconds[side].append(elapsed / requests)
            texts[side] = [c.text for c in outs]
            if side == "on":
                output_tokens += sum(len(c.token_ids) for c in outs)
    forced = jumping.llm_engine.get_stats().jump_forward_tokens_total - forced_before
    cmp = paired(seconds["on"], seconds["off"], higher_is_better=False)
    return {
        "requests_per_round": requests,
        "seconds_per_request": {side: {"per_round": v, "median": median(v)} for side, v in seconds.items()},
        "speedup_on_vs_off": cmp.as_dict(),
        "same_text": texts["on"] == texts["off"],
        "answers_differing": sum(a != b for a, b in zip(texts["on"], texts["off"], strict=True)),
        "forced_share_of_output": round(forced / output_tokens, 4) if output_tokens else 0.0,
        "sample_answer": texts["on"][0],
        "line": f"jump-forward on vs off, wall time per request: {cmp.describe(2)}",
    }


def run(args: argparse.Namespace, llm_factory: common.LLMFactory | None = None) -> dict:
    factory = common.factory_for(args, llm_factory)
    sampling = factory(prefix_cache="hash", jump_forward=False)
    jumping = factory(prefix_cache="hash", jump_forward=True)
    streams = [int(s) for s in args.streams.split(",") if s.strip()]
    cost = [_cost(sampling, s, args.rounds, args.max_tokens, args.alone_requests) for s in streams]
    compiles = _compiles(sampling)
    jump = _jump_forward(sampling, jumping, args.rounds, args.jump_requests, args.max_tokens)
    for row in cost:
        print(row["line"])
    print(f"compiles: first request {compiles['first_request_compiles']}, second {compiles['second_request_compiles']}")
    print(jump["line"] + f"; same text: {jump['same_text']}; forced share {jump['forced_share_of_output']:.0%}")
    return {
        "config": common.run_config(args, sampling, streams=streams, rounds=args.rounds, max_tokens=args.max_tokens),
        "cost": cost,
        "compiles": compiles,
        "jump_forward": jump,
    }
