"""Output kinds (vLLM's RequestOutputKind): cumulative outputs grow, delta outputs carry only what is new, and
final-only requests produce one output; all three generate the same tokens."""

from __future__ import annotations

import pytest

from prefixkv.sampling_params import SamplingParams

SMALL = {"kv_cache_tokens": 4096}


def _drain(engine, rid: str) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def _run(engine, rid: str, kind: str, params: SamplingParams) -> list:
    engine.add_request(rid, "The capital of France is", params, output_kind=kind)
    return _drain(engine, rid)


@pytest.mark.parametrize("n", [1, 2])
def test_delta_outputs_add_up_to_the_cumulative_one(llm_factory, n):
    engine = llm_factory(**SMALL).llm_engine
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=10, n=n, logprobs=2, ignore_eos=True)
    cumulative = _run(engine, f"c{n}", "cumulative", params)
    deltas = _run(engine, f"d{n}", "delta", params)
    final = cumulative[-1]
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    assert len(deltas) == len(cumulative) == 10  # one output per step, as before
    for index in range(n):
        parts = [c for o in deltas for c in o.outputs if c.index == index]
        whole = next(c for c in final.outputs if c.index == index)
        assert [t for c in parts for t in c.token_ids] == whole.token_ids
        assert "".join(c.text for c in parts) == whole.text
        assert [lp for c in parts for lp in c.logprobs] == whole.logprobs
        assert parts[-1].finish_reason == whole.finish_reason == "length"
        assert all(len(c.token_ids) <= 1 for c in parts)  # each step adds one token per sequence
    assert deltas[-1].prompt_token_ids == final.prompt_token_ids


def test_final_only_gives_one_output(llm_factory):
    engine = llm_factory(**SMALL).llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cumulative = _run(engine, "c", "cumulative", params)
    final = _run(engine, "f", "final_only", params)
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids
    assert final[0].outputs[0].text == cumulative[-1].outputs[0].text


def test_abort_of_a_delta_request_reports_the_abort(llm_factory):
    engine = llm_factory(**SMALL).llm_engine
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=50, ignore_eos=True), output_kind="delta")
    first = engine.step()
    engine.abort("a")
    last = [o for o in engine.step() if o.request_id == "a"]
    assert first[0].outputs[0].token_ids and last[0].finished
    assert last[0].outputs[0].finish_reason == "abort" and last[0].outputs[0].token_ids == []
    assert engine.kv.num_used_pages() == 0


def test_unknown_output_kind_is_a_value_error(llm_factory):
    engine = llm_factory(**SMALL).llm_engine
    with pytest.raises(ValueError, match="output_kind"):
        engine.add_request("x", "hi", SamplingParams(max_tokens=2), output_kind="streaming")
    assert not engine.has_unfinished_requests()


def test_vllm_block_size_alias_runs(llm_factory):
    """LLM(block_size=16) is LLM(page_size=16) (vLLM's name)."""
    llm = llm_factory(block_size=8, **SMALL)
    assert llm.config.page_size == 8 and llm.llm_engine.kv.page_size == 8
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_delta_outputs_never_send_what_a_stop_string_cuts(llm_factory):
    """A stop string that begins in one token and is completed by a later one is cut from the final text; delta
    outputs hold its first characters back until they are safe, so the deltas still add up to that text."""
    engine = llm_factory(**SMALL).llm_engine
    free = _run(engine, "free", "cumulative", SamplingParams(temperature=0, max_tokens=12))[-1].outputs[0]
    pieces = [engine.tokenizer.decode([t]) for t in free.token_ids]
    i = next(i for i in range(1, len(pieces) - 1) if pieces[i] and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-1:] + pieces[i + 1][:2]  # spans tokens i and i + 1
    params = SamplingParams(temperature=0, max_tokens=12, stop=[stop], logprobs=0)
    whole = _run(engine, "whole", "cumulative", params)[-1].outputs[0]
    deltas = _run(engine, "parts", "delta", params)
    assert whole.finish_reason == "stop" and len(whole.text) < len("".join(pieces[: i + 2]))
    parts = [c for o in deltas for c in o.outputs]
    assert "".join(c.text for c in parts) == whole.text
    assert [t for c in parts for t in c.token_ids] == whole.token_ids
    assert [lp for c in parts for lp in c.logprobs] == whole.logprobs
