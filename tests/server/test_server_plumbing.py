"""The server's plumbing on the real engine (default model, fp32), in-process so a test can reach the engine.

What test_server_e2e.py (the server as a subprocess) already checks is not repeated here. This file covers
what needs the engine at hand or is not checked there: several prompts with n > 1, the tenant salt and vLLM
extensions as the engine receives them, a client that drops a non-streaming request, the names and values of
every metric, the bad inputs e2e does not send, and a step that fails inside the real engine (a fault injected
into its model runner) turning into a 500 while the server keeps serving.

One engine and one server for the module; every test leaves the engine idle with no page held by a request.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from prefixkv.model import native
from prefixkv.sampling_params import SamplingParams
from tests.server.live_server import cache_summary, metric_samples, running_server, wait_no_pages_held

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
# long enough (> 2 pages of 16 tokens) for the prefix cache to serve a repeat of it
LONG_PROMPT = (
    "A lighthouse keeper writes in her logbook every evening: the weather, the ships that passed, "
    "the state of the lamp, and one sentence about the sea. Tonight she wrote:"
)


@pytest.fixture(scope="module")
def engine(new_engine):
    return new_engine()  # the default model, fp32, hash prefix cache: what `prefixkv serve` runs (smaller pool)


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine, api_key=KEY, tenant_isolation="api-key") as (base, _, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(llm_factory):
    """The same greedy requests, run by the in-process LLM (shared with the e2e and engine tests)."""
    return llm_factory(prefix_cache="off")


def _post(base: str, path: str, body, timeout: float = 60) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(base + path, headers=AUTH, timeout=timeout, **kwargs)


def _summary(base: str) -> dict:
    return cache_summary(base, AUTH)


def _wait_no_pages_held(base: str, timeout: float = 20.0) -> dict:
    return wait_no_pages_held(base, AUTH, timeout)


def _metrics(base: str) -> dict[str, float]:
    return metric_samples(base, AUTH)


def test_multi_prompt_and_n(client, engine, reference):
    """Two prompts (text and token ids) with n=2 in one request: four choices, each the sequential greedy text."""
    text_prompt, ids_prompt = "The capital of France is", engine.tokenizer.encode("Water boils at")
    params = SamplingParams(temperature=0, max_tokens=5)
    expected = reference.generate([text_prompt, ids_prompt], params, use_tqdm=False)
    out = client.completions.create(
        model=engine.model_name, prompt=[text_prompt, ids_prompt], max_tokens=5, n=2, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:  # index = prompt * n + completion
        want = expected[choice.index // 2].outputs[0]
        assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason), choice.index
    assert out.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)  # once per prompt, not per n
    assert out.usage.prompt_tokens == len(engine.tokenizer.encode(text_prompt)) + len(ids_prompt)
    assert out.usage.completion_tokens == 2 * sum(len(o.outputs[0].token_ids) for o in expected)


def test_tenant_salt_and_extensions_reach_engine(server, client, engine, monkeypatch):
    """With tenant isolation on, the engine gets a salt bound to the API key (never the client's raw one);
    the vLLM extensions arrive as given; and the salt really partitions the prefix cache."""
    received: list = []
    real_add = engine.add_request

    def add_request(request_id, prompt, options=None, **kwargs):  # records, then the real thing runs
        received.append(options)
        return real_add(request_id, prompt, options, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)

    def ask(**extra):
        return client.completions.create(
            model=engine.model_name, prompt=LONG_PROMPT, max_tokens=1, temperature=0, extra_body=extra or None
        )

    first = ask(cache_salt="s1", priority=3, top_k=5, ignore_eos=True, stop_token_ids=[7])
    got = received[-1]
    assert got.priority == 3
    assert (got.sampling.top_k, got.sampling.ignore_eos, got.sampling.stop_token_ids) == (5, True, [7])
    salted = got.cache_salt
    assert re.fullmatch(r"[0-9a-f]{32}", salted) and salted != "s1"  # the tenant's hash, not the client's salt

    again = ask(cache_salt="s1")
    assert received[-1].cache_salt == salted and received[-1].priority == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 32  # same tenant and salt: the pages are shared
    assert first.usage.prompt_tokens == again.usage.prompt_tokens

    unsalted = ask()
    tenant_only = received[-1].cache_salt
    assert tenant_only is not None and tenant_only != salted  # no client salt: still the tenant's own salt
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0  # another salt never finds those pages
    _wait_no_pages_held(server)


@pytest.mark.parametrize(
    "path, body, param",
    [  # the bad inputs test_server_e2e.py does not send
        ("/v1/completions", b"[1, 2]", None),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", ""]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_input_then_good(server, client, engine, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    assert client.completions.create(model=engine.model_name, prompt="Hi", max_tokens=2, temperature=0).choices[0].text


def test_non_stream_disconnect_aborts(server, engine):
    """A client that gives up on a plain (non-streaming) request: the engine request is aborted, pages freed."""
    abort_key = f'prefixkv:request_success_total{{finished_reason="abort",model_name="{engine.model_name}"}}'
    before = _metrics(server).get(abort_key, 0.0)
    body = {"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # 2000 tokens take far longer than this on the CPU
        _post(server, "/v1/completions", body, timeout=1.0)
    _wait_no_pages_held(server)  # long before the 2000 tokens could have been generated
    assert _metrics(server)[abort_key] == before + 1


def test_metrics_names_and_values(server, client, engine):
    """Every metric is exposed under its vLLM-style name, and one request moves each by what it did."""
    model = engine.model_name
    lbl = f'{{model_name="{model}"}}'
    before = _metrics(server)
    out = client.completions.create(
        model=model, prompt="Count to ten: one, two,", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    _wait_no_pages_held(server)
    after = _metrics(server)

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    for name in ("num_requests_running", "num_requests_waiting", "kv_pages_used", "kv_cache_usage_perc"):
        assert after[f"prefixkv:{name}{lbl}"] == 0.0, name
    assert after[f"prefixkv:kv_pages_total{lbl}"] == _summary(server)["kv_pages_total"] > 0
    assert 0.0 <= after[f"prefixkv:prefix_cache_hit_rate{lbl}"] <= 1.0
    assert delta(f"prefixkv:prompt_tokens_total{lbl}") == out.usage.prompt_tokens
    assert delta(f"prefixkv:generation_tokens_total{lbl}") == 4
    assert delta(f"prefixkv:prefix_cache_queries_total{lbl}") >= out.usage.prompt_tokens - 1
    assert delta(f"prefixkv:prefix_cache_hits_total{lbl}") >= 0
    assert f"prefixkv:num_preemptions_total{lbl}" in after
    assert delta(f'prefixkv:request_success_total{{finished_reason="length",model_name="{model}"}}') == 1
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"prefixkv:{hist}_count{lbl}") == 1, hist
        assert delta(f"prefixkv:{hist}_sum{lbl}") > 0, hist
        assert f'prefixkv:{hist}_bucket{{le="+Inf",model_name="{model}"}}' in after, hist
    # the machine and kernels the numbers come from: one info series (as vLLM's cache_config_info)
    (info,) = [key for key in after if key.startswith("prefixkv:kernel_info{")]
    assert after[info] == 1.0
    kernels = engine.kernels  # fp32 here: torch's attention (matmul too, but on the AVX2 build), no cache invariance
    fp32_matmul = "avx2" if native.gemm_f32() is not None else "torch"
    assert (kernels["matmul"], kernels["cache_invariant"]) == (fp32_matmul, "off")
    for label, value in kernels.items():
        assert f'{label}="{value}"' in info, label


def test_engine_step_failure_fails_requests_not_server(server, engine, reference, monkeypatch):
    """A step that raises inside the real engine (its model runner, once) fails the requests in it with a 500;
    their pages are freed, the engine thread lives on, and the next request gets the right greedy text."""
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def execute(items):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real_execute(items)

    monkeypatch.setattr(engine.runner, "execute", execute)
    r = _post(server, "/v1/completions", {"prompt": "This step will fail", "max_tokens": 3})
    assert r.status_code == 500, r.text
    assert "injected step failure" in r.json()["error"]["message"]
    _wait_no_pages_held(server)
    assert httpx.get(server + "/health").json() == {"status": "ok"}

    prompt = "The sun is a"
    want = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    ok = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == want.text
    assert calls["n"] > 1  # the real runner served it
    _wait_no_pages_held(server)


def test_cache_tree_endpoint_and_cli(server, new_engine):
    """The hash cache has no tree (a 400 naming the fix); a radix server renders its tree for the CLI."""
    r = httpx.get(server + "/cache/tree", headers=AUTH)
    assert r.status_code == 400 and "radix" in r.json()["error"]["message"]

    import contextlib
    import io

    from prefixkv.cli import main

    radix = new_engine(prefix_cache="radix", kv_cache_tokens=1024)  # two short prompts: a small pool holds them
    with running_server(radix) as (base, _, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        for q in ("one", "two"):
            client.completions.create(model=radix.model_name, prompt=LONG_PROMPT + q, max_tokens=2, temperature=0)
        text = httpx.get(base + "/cache/tree").text
        assert text.startswith("radix cache:") and "lighthouse keeper" in text and "hits=1" in text
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["cache-tree", "--url", base]) == 0
        assert "lighthouse keeper" in out.getvalue()


# -- item 10: the engine sends the server deltas, never cumulative copies ------------------------------------------


def _record_engine(engine, monkeypatch) -> tuple[dict[str, str], dict[str, list]]:
    """Record, by engine request id, the output_kind each request was added with and every output it got."""
    kinds: dict[str, str] = {}
    outputs: dict[str, list] = {}
    real_add, real_step = engine.add_request, engine.step

    def add_request(request_id, prompt, sampling_params=None, **kwargs):
        kinds[request_id] = getattr(kwargs.get("output_kind"), "value", kwargs.get("output_kind"))
        return real_add(request_id, prompt, sampling_params, **kwargs)

    def step():
        got = real_step()
        for o in got:
            outputs.setdefault(o.request_id, []).append(o)
        return got

    monkeypatch.setattr(engine, "add_request", add_request)
    monkeypatch.setattr(engine, "step", step)
    return kinds, outputs


def _stream_completion(base: str, body: dict) -> tuple[dict[int, dict], dict | None]:
    """Stream a completion over raw HTTP: per choice its text, logprob tokens and values and finish reason, and
    the usage event."""
    choices: dict[int, dict] = {}
    usage = None
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        headers=AUTH,
        timeout=300,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for c in event["choices"]:
                got = choices.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [], "finish": []})
                got["text"] += c["text"]
                if c["logprobs"] is not None:
                    got["tokens"] += c["logprobs"]["tokens"]
                    got["token_logprobs"] += c["logprobs"]["token_logprobs"]
                if c["finish_reason"] is not None:
                    got["finish"].append(c["finish_reason"])
    return choices, usage


LONG_STREAM_TOKENS = 32  # long enough for many steps of deltas; each token costs a decode step in fp32


def test_streams_get_deltas_and_a_long_stream_is_intact(server, engine, reference, monkeypatch):
    """A stream's engine request is added with output_kind="delta" (each output holds one step's token), a plain
    request's with "final_only" (one output); 32 streamed tokens with logprobs equal the plain answer and the
    greedy reference."""
    kinds, outputs = _record_engine(engine, monkeypatch)
    body = {
        "prompt": "Write a long story about a lighthouse.",
        "max_tokens": LONG_STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    streamed, stream_usage = _stream_completion(server, body)
    plain = _post(server, "/v1/completions", body, timeout=300).json()
    want = reference.generate(
        [body["prompt"]], SamplingParams(temperature=0, max_tokens=LONG_STREAM_TOKENS, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]

    stream_id, plain_id = kinds  # the two requests, in the order they were added
    assert (kinds[stream_id], kinds[plain_id]) == ("delta", "final_only")
    assert len(outputs[stream_id]) == LONG_STREAM_TOKENS and all(
        len(o.outputs[0].token_ids) == 1 for o in outputs[stream_id]
    )
    assert len(outputs[plain_id]) == 1 and len(outputs[plain_id][0].outputs[0].token_ids) == LONG_STREAM_TOKENS

    choice = plain["choices"][0]
    assert streamed[0]["text"] == choice["text"] == want.text and len(want.token_ids) == LONG_STREAM_TOKENS
    assert streamed[0]["tokens"] == choice["logprobs"]["tokens"] and len(streamed[0]["tokens"]) == LONG_STREAM_TOKENS
    assert streamed[0]["token_logprobs"] == choice["logprobs"]["token_logprobs"]
    assert streamed[0]["finish"] == [choice["finish_reason"]] == ["length"]
    assert stream_usage == plain["usage"] and plain["usage"]["completion_tokens"] == LONG_STREAM_TOKENS
    _wait_no_pages_held(server)


def test_stop_string_across_tokens_streams_the_plain_text(server, client, engine, reference):
    """A stop string that begins in one token and ends in a later one: the stream never sends its first
    characters (the engine holds them back until they are safe), so it equals the plain answer and the reference."""
    prompt = "The capital of France is"
    free = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    pieces = [engine.tokenizer.decode([t]) for t in free.token_ids]
    i = next(i for i in range(1, len(pieces) - 1) if pieces[i] and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-1:] + pieces[i + 1][:2]  # spans tokens i and i + 1
    want = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert want.finish_reason == "stop" and len(want.text) < len("".join(pieces[: i + 2]))

    plain = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    streamed, _ = _stream_completion(server, {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]})
    assert streamed[0]["text"] == plain.choices[0].text == want.text
    assert streamed[0]["finish"] == [plain.choices[0].finish_reason] == ["stop"]
    chunks = client.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=12,
        temperature=0,
        stop=[stop],
        stream=True,
    )
    chat_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chat_plain = client.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0, stop=[stop]
    )
    assert chat_text == chat_plain.choices[0].message.content
    _wait_no_pages_held(server)


def test_stream_metrics_count_every_completion(server, engine):
    """n = 2 streamed completions that finish at different steps: the last delta lists only the later one, yet
    /metrics counts both finishes and observes TPOT from all the tokens generated."""
    lbl = f'{{model_name="{engine.model_name}"}}'
    before = _metrics(server)
    body = {
        "prompt": "My favourite animal is",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 0,
        "n": 2,
        "stop": ["."],
        "logprobs": 0,
    }
    streamed, usage = _stream_completion(server, body)
    _wait_no_pages_held(server)
    after = _metrics(server)

    lengths = sorted(len(streamed[i]["tokens"]) for i in (0, 1))
    assert lengths[0] < lengths[1], streamed  # the two finished at different steps
    assert usage["completion_tokens"] == sum(lengths)
    finishes = [reason for i in (0, 1) for reason in streamed[i]["finish"]]
    assert len(finishes) == 2

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    for reason in set(finishes):
        key = f'prefixkv:request_success_total{{finished_reason="{reason}",model_name="{engine.model_name}"}}'
        assert delta(key) == finishes.count(reason), reason
    assert delta(f"prefixkv:time_per_output_token_seconds_count{lbl}") == 1  # the last delta alone: 1 token, no TPOT
    assert delta(f"prefixkv:e2e_request_latency_seconds_count{lbl}") == 1
