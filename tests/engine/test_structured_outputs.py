"""Structured outputs on the Python API: every kind holds, a constrained row keeps prefixkv's guarantees (the same
answer warm or cold, alone or in a batch beside unconstrained rows), a grammar that cannot finish within max_tokens
ends with `length` on a valid prefix, and bad constraints are ValueErrors that queue nothing.
"""

from __future__ import annotations

import json
import re

import pytest

from prefixkv.sampling_params import SamplingParams
from prefixkv.structured_outputs import StructuredOutputs
from tests import kernels

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"enum": [1, 2, 3]}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
SYSTEM = "You are a geography assistant. Answer only in JSON. " * 8


def prompts(tok) -> list[list[int]]:
    questions = ["Which city is the capital of France?", "Name a big city in Japan.", "Name a port in Italy."]
    return [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in questions]


def test_every_kind_holds(llm_factory):
    llm = llm_factory(prefix_cache="hash")
    tok = llm.get_tokenizer()
    (prompt, *_) = prompts(tok)
    cases = [
        (StructuredOutputs(json=SCHEMA), lambda t: set(json.loads(t)) == {"city", "rank"}),
        (StructuredOutputs(regex=r"[A-Z][a-z]{2,8}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}", t)),
        (StructuredOutputs(choice=["Paris", "Rome"]), lambda t: t in ("Paris", "Rome")),
        (StructuredOutputs(grammar='start: "The answer is " ("Paris" | "Rome") "."'), lambda t: t.endswith(".")),
    ]
    for k, (so, valid) in enumerate(cases):
        for params in (
            SamplingParams(temperature=0, max_tokens=32, structured_outputs=so),
            # sampled; and greedy ignoring EOS: it ends when the grammar does
            SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=32, structured_outputs=so)
            if k % 2
            else SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, structured_outputs=so),
        ):
            out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
            for completion in out.outputs:
                assert completion.finish_reason == "stop" and valid(completion.text), (so.kind, completion.text)


def test_a_grammar_cut_by_max_tokens_ends_with_length_on_a_valid_prefix(llm_factory):
    llm = llm_factory(prefix_cache="hash")
    so = StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}")
    out = llm.generate("Call me at", SamplingParams(temperature=0, max_tokens=2, structured_outputs=so), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.finish_reason == "length" and re.fullmatch(r"[0-9]{1,3}(-[0-9]{0,4})?", completion.text)


def _answers(llm, ps, params, with_free_rows=False):
    batch = [{"prompt_token_ids": p} for p in ps]
    free = SamplingParams(temperature=0, max_tokens=8)
    if with_free_rows:  # unconstrained rows beside them in the same steps
        outs = llm.generate(batch + batch, [params] * len(ps) + [free] * len(ps), use_tqdm=False)[: len(ps)]
    else:
        outs = llm.generate(batch, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("bfloat16", marks=kernels.NATIVE_ATTENTION)], ids=["fp32", "bf16"]
)
def test_constrained_answers_are_the_same_warm_or_cold_alone_or_batched(llm_factory, dtype):
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputs(json=SCHEMA))
    cold_llm = llm_factory(prefix_cache="off", dtype=dtype)
    ps = prompts(cold_llm.get_tokenizer())
    alone = [_answers(cold_llm, [p], params)[0] for p in ps]
    warm_llm = llm_factory(prefix_cache="hash", dtype=dtype)
    warm_llm.reset_prefix_cache()
    _answers(warm_llm, ps[:1], params)  # caches the shared system prompt
    assert _answers(warm_llm, ps, params) == alone  # warm, one batch
    assert _answers(warm_llm, ps, params, with_free_rows=True) == alone  # beside unconstrained rows


def test_greedy_rows_checked_after_sampling_equal_rows_masked_before(llm_factory, monkeypatch):
    """A greedy row without logprobs samples unmasked and tests its token against the mask, applying the mask
    only when the grammar refuses the token; asking logprobs masks every step. Same tokens, fewer rows masked."""
    import prefixkv.model.runner as runner

    masked_rows = []
    mask = runner._mask_disallowed
    monkeypatch.setattr(runner, "_mask_disallowed", lambda logits, rows: masked_rows.extend(rows) or mask(logits, rows))
    llm = llm_factory(prefix_cache="off", jump_forward=False)  # every key token sampled, none forced
    ps = prompts(llm.get_tokenizer())
    so = StructuredOutputs(json=SCHEMA)
    checked = _answers(llm, ps, SamplingParams(temperature=0, max_tokens=24, structured_outputs=so))
    checked_rows = len(masked_rows)
    masked_rows.clear()
    masked = _answers(llm, ps, SamplingParams(temperature=0, max_tokens=24, logprobs=0, structured_outputs=so))
    assert checked == masked
    assert checked_rows < len(masked_rows)  # masked before: every sampled token's row


def test_bad_constraints_are_value_errors_that_queue_nothing(llm_factory):
    llm = llm_factory(prefix_cache="hash")
    engine = llm.llm_engine
    for so, match in (
        (StructuredOutputs(regex="a{"), "regex"),
        (StructuredOutputs(json={"type": "wrong"}), "json"),
        (StructuredOutputs(grammar="start: missing_rule"), "grammar"),
    ):
        with pytest.raises(ValueError, match=match):
            engine.add_request(None, "hi", SamplingParams(max_tokens=4, structured_outputs=so))
        assert not engine.has_unfinished_requests()
    for kwargs, match in (
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty strings"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1]}, "JSON Schema"),
    ):
        with pytest.raises(ValueError, match=match):
            StructuredOutputs(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputs"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]


def test_a_source_compiles_once_whatever_its_key_order():
    a = StructuredOutputs(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutputs(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert a.key() == b.key() and a.kind == "json"
    assert StructuredOutputs(choice=["a", "b"]).key() != StructuredOutputs(choice=["b", "a"]).key()
