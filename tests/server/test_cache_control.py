"""Cache control on a real server and the Python API (issue 13): prompt_cache_key / prompt_cache_retention, the
prewarm endpoint, `serve --prewarm FILE`, and usage.prompt_tokens_details.cached_tokens on every response.

One small-pool engine (the one test_request_validation uses) and one in-process server for the module; every
prompt carries a fresh marker so what another test cached never makes a request here warm.
"""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from prefixkv.cache_miss import CAUSES
from prefixkv.prewarm import prewarm_from_file, read_prewarm_file
from prefixkv.sampling_params import SamplingParams
from prefixkv.server.cli import main as serve_main
from tests.server.live_server import metric_samples, running_server, wait_no_pages_held

KEY = "cache-control-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
SYSTEM = (
    "You are a careful assistant for a bicycle repair shop. Answer in one short sentence, name the tool needed, "
    "and never recommend a part the customer did not ask about."
)


def fresh_messages(question: str = "How do I fix a flat tyre?") -> list[dict]:
    return [{"role": "system", "content": f"[{uuid.uuid4().hex}] {SYSTEM}"}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def llm(llm_factory):
    llm = llm_factory(kv_cache_tokens=4096)
    yield llm
    llm.reset_prefix_cache()  # other modules share this engine: leave no retained pages behind


@pytest.fixture(scope="module")
def server(llm):
    with running_server(llm.llm_engine, api_key=KEY) as (base, _, _app):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, headers=AUTH, content=json.dumps(body), timeout=120)


def _assert_400_naming(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error", err


def test_cached_tokens_on_every_response_and_prewarm_makes_a_hit(client, server, llm):
    model = llm.llm_engine.model_name
    messages = fresh_messages()
    cold = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0  # present, and 0 on a cold prompt
    prompt = f"[{uuid.uuid4().hex}] Once upon a time"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=2, n=2)
    assert plain.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(
        model=model,
        prompt=f"[{uuid.uuid4().hex}] A list of colours:",
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens_details.cached_tokens == 0

    warm_messages = fresh_messages()
    r = _post(server, "/v1/cache/prewarm", {"messages": warm_messages, "prompt_cache_retention": "24h"})
    assert r.status_code == 200, r.text
    warmed = r.json()
    assert warmed["hit_tokens"] == 0 and 0 < warmed["cached_tokens"] <= warmed["prompt_tokens"]
    chat = client.chat.completions.create(
        model=model,
        messages=warm_messages,
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_cache_key": "bike-shop", "prompt_cache_retention": "in_memory"},
    )
    assert chat.usage.prompt_tokens == warmed["prompt_tokens"]
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    summary = wait_no_pages_held(server, AUTH)
    assert summary["retained_pages"] > 0  # the 24h prewarm retained its pages
    metrics = httpx.get(server + "/metrics", headers=AUTH).text
    assert "prefixkv:prompt_cache_key_requests_total" in metrics and "bike-shop" not in metrics


BAD_FIELDS = [
    ("/v1/chat/completions", {"prompt_cache_retention": "48h"}, "prompt_cache_retention"),
    ("/v1/chat/completions", {"prompt_cache_retention": 24}, "prompt_cache_retention"),
    ("/v1/completions", {"prompt_cache_key": 5}, "prompt_cache_key"),
    ("/v1/completions", {"prompt_cache_key": "k" * 5000}, "prompt_cache_key"),
    ("/v1/cache/prewarm", {"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ("/v1/cache/prewarm", {"prompt": None}, "prompt"),  # neither prompt nor messages
    ("/v1/cache/prewarm", {"messages": [{"role": "user", "content": "hi"}]}, "prompt"),  # both
]


def test_bad_cache_fields_get_400_naming_them(server):
    with httpx.stream(  # a request in flight while the bad ones are refused: it finishes normally
        "POST",
        server + "/v1/completions",
        headers=AUTH,
        json={"prompt": "Count: one, two,", "max_tokens": 6, "ignore_eos": True, "stream": True},
        timeout=120,
    ) as running:
        for path, fields, param in BAD_FIELDS:
            base = {"messages": fresh_messages()} if path == "/v1/chat/completions" else {"prompt": "Hello"}
            body = {**base, **fields} if path == "/v1/cache/prewarm" else {**base, "max_tokens": 2, **fields}
            _assert_400_naming(_post(server, path, body), param)
        lines = [line for line in running.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2].replace(" ", "")
    wait_no_pages_held(server, AUTH)


def test_prewarmed_generation_equals_cold_fp32(llm):
    """Greedy tokens after LLM.prewarm == cold tokens, and the prewarm made the second run a cache hit."""
    params = SamplingParams(max_tokens=6, temperature=0)
    prompt = f"[{uuid.uuid4().hex}] The three laws of motion, stated briefly, are as follows. First,"
    cold = llm.generate(prompt, params, use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    assert llm.reset_prefix_cache()
    (cached,) = llm.prewarm(prompt)
    n = len(cold.prompt_token_ids)
    assert cached == n - n % llm.config.tokens_per_page > 0
    assert llm.cache_summary().retained_pages == 0
    warm = llm.generate(prompt, params, use_tqdm=False, retention_seconds=60.0)[0]
    assert warm.num_cached_tokens > 0
    assert llm.cache_summary().retained_pages >= cached // llm.config.tokens_per_page  # hit and computed pages
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    with pytest.raises(ValueError, match="retention_seconds"):
        llm.prewarm(prompt, retention_seconds=-1)


def test_prewarm_file(tmp_path, llm, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"prompt": f"[{uuid.uuid4().hex}] {SYSTEM}"})
        + "\n\n"
        + json.dumps({"messages": fresh_messages(), "prompt_cache_retention": "24h", "cache_salt": "t1"})
        + "\n"
    )
    num_prompts, num_cached = prewarm_from_file(llm.llm_engine, str(good))
    assert num_prompts == 2 and num_cached > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"promt": "typo"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: unknown field"):
        read_prewarm_file(str(bad))
    assert serve_main(["--prewarm", str(bad)]) == 2  # refused before any model loads
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_a_miss_is_explained_when_asked_and_counted_by_cause(client, server, llm):
    """usage.prompt_tokens_details.cache_miss on request (chat, completions streamed, Responses, Messages): a cold
    prompt is never_seen, the same prompt again misses only its last page (granularity), and the causes add up to
    the missed tokens; a router's held-elsewhere header makes the pages it covers routed (a bad value is a 400);
    /metrics counts missed tokens by cause, summing to queries - hits."""
    model = llm.llm_engine.model_name
    messages = fresh_messages("Which spanner fits a pedal?")
    explain = {"explain_cache_miss": True}
    cold = client.chat.completions.create(model=model, messages=messages, max_tokens=1, extra_body=explain)
    warm = client.chat.completions.create(model=model, messages=messages, max_tokens=1, extra_body=explain)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert "cache_miss" not in (plain.usage.prompt_tokens_details.model_extra or {})  # only when asked
    for usage, cause in ((cold.usage, "never_seen"), (warm.usage, "granularity")):
        miss = usage.prompt_tokens_details.model_extra["cache_miss"]
        details = usage.prompt_tokens_details
        assert miss["cause"] == cause and miss["first_missed_token"] == details.cached_tokens, miss
        assert sum(miss["tokens_by_cause"].values()) == usage.prompt_tokens - details.cached_tokens
    stream = client.completions.create(
        model=model,
        prompt=f"[{uuid.uuid4().hex}] Spokes:",
        max_tokens=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=explain,
    )
    (usage,) = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert usage.prompt_tokens_details.model_extra["cache_miss"]["cause"] == "never_seen"
    r = _post(server, "/v1/responses", {"model": model, "input": "Chain oil?", "max_output_tokens": 1, **explain})
    assert r.status_code == 200, r.text
    assert "cause" in r.json()["usage"]["input_tokens_details"]["cache_miss"]
    r = _post(server, "/v1/messages", {"model": model, "max_tokens": 1, "messages": messages[1:], **explain})
    assert r.status_code == 200, r.text
    assert "cause" in r.json()["usage"]["cache_miss"]
    held = {"x-prefixkv-held-elsewhere": "16"}  # a router's word: another replica holds the first 16 tokens
    routed = client.completions.create(
        model=model, prompt=f"[{uuid.uuid4().hex}] {SYSTEM}", max_tokens=1, extra_body=explain, extra_headers=held
    )
    miss = routed.usage.prompt_tokens_details.model_extra["cache_miss"]
    assert miss["cause"] == "routed" and miss["tokens_by_cause"]["routed"] == 16, miss
    for value in ("-1", "lots"):
        r = httpx.post(
            server + "/v1/completions",
            headers={**AUTH, "x-prefixkv-held-elsewhere": value},
            content=json.dumps({"model": model, "prompt": "Spokes:", "max_tokens": 1}),
            timeout=60,
        )
        _assert_400_naming(r, "x-prefixkv-held-elsewhere")
    wait_no_pages_held(server, AUTH)
    samples = metric_samples(server, AUTH)
    missed = {k: v for k, v in samples.items() if k.startswith("prefixkv:prefix_cache_missed_tokens_total{")}
    assert len(missed) == len(CAUSES) and missed[next(k for k in missed if 'cause="never_seen"' in k)] > 0
    assert missed[next(k for k in missed if 'cause="routed"' in k)] >= 16
    (queries,) = [v for k, v in samples.items() if k.startswith("prefixkv:prefix_cache_queries_total{")]
    (hits,) = [v for k, v in samples.items() if k.startswith("prefixkv:prefix_cache_hits_total{")]
    assert sum(missed.values()) == queries - hits


def test_session_hints_pin_a_turn_until_the_next_and_let_go_at_the_end(server, client, llm):
    """x-session-* headers (docs/agent_traces.md): an answer pins the turn's sequence (prompt + answer) for the
    announced pause, the next turn finds it cached, and the turn sent with action release ends the session."""
    pins = llm.llm_engine.sessions
    model = client.models.list().data[0].id
    session = {"x-session-id": f"agent-{uuid.uuid4().hex}", "x-session-expected-pause-s": "30"}
    messages = fresh_messages("Which tool opens a bottom bracket?")
    before = pins.summary()
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, temperature=0, extra_headers=session
    )
    pinned = pins.summary()
    assert pinned["tracked_sessions"] == before["tracked_sessions"] + 1
    assert pinned["session_pinned_pages"] > before["session_pinned_pages"]
    assert len(llm.llm_engine.kv.retention) > 0
    turn = [*messages, {"role": "assistant", "content": first.choices[0].message.content}]
    second = client.chat.completions.create(
        model=model,
        messages=[*turn, {"role": "user", "content": "And the torque?"}],
        max_tokens=2,
        temperature=0,
        extra_headers={**session, "x-session-action": "release"},
    )
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    ended = pins.summary()
    assert ended["tracked_sessions"] == before["tracked_sessions"]
    assert ended["session_released_pages"] > pinned["session_released_pages"]
    for headers, param in (
        ({"x-session-id": "a", "x-session-expected-pause-s": "soon"}, "x-session-expected-pause-s"),
        ({"x-session-action": "release"}, "x-session-action"),
        ({"x-session-id": "a", "x-session-action": "forget"}, "x-session-action"),
        ({"x-session-id": "a", "x-session-expected-pause-s": "-1"}, "x-session-expected-pause-s"),
    ):
        r = httpx.post(
            server + "/v1/chat/completions",
            headers={**AUTH, **headers},
            content=json.dumps({"model": model, "messages": messages, "max_tokens": 1}),
            timeout=60,
        )
        _assert_400_naming(r, param)
