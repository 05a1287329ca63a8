"""Cache writes in the usage of every API that has a field for them: Anthropic's cache_creation_input_tokens (and
its 5m / 1h split), OpenAI's prompt_tokens_details.cache_write_tokens (chat and completions, streamed usage too)
and input_tokens_details.cache_write_tokens (Responses) are the engine's own count (RequestOutput.cache_writes),
which is what the cache gained while the request ran. One server on a hash cache with 16-token pages; the engine's
step and add_request are wrapped to see each request's final output and retention spans."""

from __future__ import annotations

import uuid

import anthropic
import openai
import pytest

from prefixkv.request_options import RequestOptions
from tests.server.live_server import running_server

PAGE = 16


@pytest.fixture(scope="module")
def served(new_engine):
    engine = new_engine(page_size=PAGE)
    finals: list = []  # each request's final output, in order
    spans: list = []  # each engine request's retention spans
    step, add = engine.step, engine.add_request

    def recording_step():
        outputs = step()
        finals.extend(o for o in outputs if o.finished)
        return outputs

    def recording_add(request_id, prompt, options=None, **kw):
        spans.append(options.retention.spans if isinstance(options, RequestOptions) else ())
        return add(request_id, prompt, options, **kw)

    engine.step, engine.add_request = recording_step, recording_add
    with running_server(engine) as (base, engine, _):
        yield base, engine, finals, spans


def inserted_pages(engine) -> int:
    """What the cache has inserted so far: pages held now plus pages evicted (max_tokens=1 computes no generated
    token, so over one request alone the difference is that request's prompt pages)."""
    return engine.kv.num_cached_pages() + engine.kv.stats.evicted_pages


def tag() -> str:
    return uuid.uuid4().hex[:8]


def test_anthropic_usage_is_the_engine_count_split_by_ttl(served):
    """A 1h breakpoint on the system prompt, a 5m one on the message, a prompt of whole pages: the first request's
    writes are what the cache inserted, split at the 1h breakpoint's whole pages; the same request again reads all
    but the last page and writes nothing (it computes that page again, but it was cached: input, not a write)."""
    base, engine, finals, spans = served
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    system = [{"type": "text", "text": f"[{tag()}] Rules: " + " ".join(f"rule {i}." for i in range(40))}]
    system[0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    body = {"model": engine.model_name, "system": system}
    for pad in range(PAGE * 2):  # a user turn that makes the prompt whole pages
        text = "Answer briefly." + " ok" * pad
        messages = [
            {"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]}
        ]
        prompt_tokens = client.messages.count_tokens(**body, messages=messages).input_tokens
        if prompt_tokens % PAGE == 0:
            break
    assert prompt_tokens % PAGE == 0

    before = inserted_pages(engine)
    first = client.messages.create(**body, messages=messages, max_tokens=1).usage
    final, hour_end = finals[-1], max(pos for pos, seconds in spans[-1] if seconds >= 3600)
    assert first.cache_creation_input_tokens == final.num_written_tokens == (inserted_pages(engine) - before) * PAGE
    assert first.cache_read_input_tokens == 0 and first.input_tokens == 0  # whole pages, all written
    hour = final.cache_writes.tokens_below(hour_end // PAGE * PAGE)
    assert first.cache_creation.ephemeral_1h_input_tokens == hour > 0
    assert first.cache_creation.ephemeral_5m_input_tokens == first.cache_creation_input_tokens - hour > 0

    again = client.messages.create(**body, messages=messages, max_tokens=1).usage
    assert (again.cache_read_input_tokens, again.cache_creation_input_tokens) == (prompt_tokens - PAGE, 0)
    assert again.input_tokens == PAGE and finals[-1].num_written_tokens == 0
    assert again.cache_creation.ephemeral_1h_input_tokens == again.cache_creation.ephemeral_5m_input_tokens == 0


def test_openai_usage_is_the_engine_count(served):
    base, engine, finals, _ = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = engine.model_name

    def written(usage_details, before: int) -> int:
        got = usage_details.cache_write_tokens
        assert got == (inserted_pages(engine) - before) * PAGE
        return got

    messages = [{"role": "user", "content": f"[{tag()}] " + "Tell me about bicycles. " * 8}]
    before = inserted_pages(engine)
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert written(chat.usage.prompt_tokens_details, before) == finals[-1].num_written_tokens > 0
    before = inserted_pages(engine)
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, stream=True, stream_options={"include_usage": True}
    )
    assert written(list(stream)[-1].usage.prompt_tokens_details, before) == 0  # all read but the last page

    ids = [2000 + i for i in range(5 * PAGE)]
    before = inserted_pages(engine)
    stream = client.completions.create(
        model=model, prompt=[ids, ids], max_tokens=1, stream=True, stream_options={"include_usage": True}
    )
    usage = list(stream)[-1].usage
    assert written(usage.prompt_tokens_details, before) == 5 * PAGE  # two prompts in flight, one writes
    assert sorted(f.num_written_tokens for f in finals[-2:]) == [0, 5 * PAGE]

    before = inserted_pages(engine)
    reply = client.responses.create(model=model, input=f"[{tag()}] " + "Name a river. " * 10, max_output_tokens=1)
    assert written(reply.usage.input_tokens_details, before) == finals[-1].num_written_tokens > 0
