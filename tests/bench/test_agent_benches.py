"""`prefixkv bench structured` and `prefixkv bench agent-tools` at tiny sizes on the suite's float32 engines: the
JSON's shape, and what the counts say (a schema compiles once, jump-forward's answers are the same text, a
stable tool block hits where a reordered one does not). No speed assertions."""

from __future__ import annotations

import argparse
import json

from prefixkv.bench import agent_tools, structured


def parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.register(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(argv)


def fp32(llm_factory):
    return lambda **options: llm_factory(**options, dtype="float32")


def test_structured_bench(llm_factory):
    argv = "structured --streams 1 --rounds 1 --max-tokens 8 --alone-requests 1 --jump-requests 1".split()
    res = structured.run(parse(structured, argv), llm_factory=fp32(llm_factory))
    json.dumps(res)
    (cost,) = res["cost"]
    assert cost["streams"] == 1 and cost["constrained_vs_unconstrained"]["rounds"] == 1
    assert len(cost["output_tok_s"]["constrained"]["per_round"]) == 1
    assert res["compiles"]["first_request_compiles"] == 1 and res["compiles"]["second_request_compiles"] == 0
    jump = res["jump_forward"]
    assert jump["same_text"] and jump["answers_differing"] == 0 and 0 < jump["forced_share_of_output"] <= 1
    assert jump["speedup_on_vs_off"]["rounds"] == 1


def test_agent_tools_bench(llm_factory):
    argv = "agent-tools --tools 2 --sessions 2 --turns 2 --rounds 1 --call-tokens 32".split()
    res = agent_tools.run(parse(agent_tools, argv), llm_factory=fp32(llm_factory))
    json.dumps(res)
    stable, reordered = res["summary"]["stable"], res["summary"]["reordered"]
    assert res["rounds"]["stable"][0]["requests"] == 4 and res["config"]["tool_block_tokens"] > 200
    assert stable["hit_rate"] > reordered["hit_rate"]  # fixed seed: the same shuffles every run
    assert res["ttft_stable_vs_reordered"]["rounds"] == 1
