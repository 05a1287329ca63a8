"""POST /v1/messages and /v1/messages/count_tokens through the official `anthropic` SDK against the real app:
the response and event shapes, cache breakpoints (retained prefixes, usage that adds up, 5m / 1h buckets),
Anthropic's 400s (a 5th breakpoint, a 1h after a 5m, unsupported blocks), prewarm with max_tokens 0, errors
in Anthropic's shape, x-api-key auth, a stream's cache_miss and count_tokens on a cached_content. One server for
the module, on the suite's shared engine."""

from __future__ import annotations

import uuid

import anthropic
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.live_server import running_server, wait_no_pages_held

KEY = "sk-messages-test"


@pytest.fixture(scope="module")
def served(new_engine):
    engine = new_engine()
    with running_server(engine, api_key=KEY) as (base, engine, _):
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
        yield client, engine, base


def model_of(served) -> str:
    return served[1].model_name


def system_text(words: int = 64) -> str:
    """A system prompt no other test sends (so its first request misses), several pages long."""
    tag = uuid.uuid4().hex[:8]
    return f"[{tag}] You are a careful assistant. " + " ".join(f"rule {i} of {tag}." for i in range(words // 4))


def create(served, **kw):
    client = served[0]
    kw.setdefault("model", model_of(served))
    kw.setdefault("max_tokens", 4)
    kw.setdefault("extra_body", {"temperature": 0.0})  # this SDK's create() has no sampling arguments
    return client.messages.create(**kw)


def adds_up(usage, prompt_tokens: int) -> None:
    parts = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert parts == prompt_tokens
    creation = usage.cache_creation
    assert creation.ephemeral_5m_input_tokens + creation.ephemeral_1h_input_tokens == usage.cache_creation_input_tokens


def count(served, **kw) -> int:
    kw.setdefault("model", model_of(served))
    return served[0].messages.count_tokens(**kw).input_tokens


def test_a_message_and_its_usage(served):
    system = system_text()
    messages = [{"role": "user", "content": "Say hello."}]
    reply = create(served, system=system, messages=messages, metadata={"user_id": "u1"})
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens <= 4
    adds_up(reply.usage, count(served, system=system, messages=messages))
    assert reply.usage.cache_read_input_tokens == 0  # a system prompt nobody sent before
    assert reply.usage.cache_creation_input_tokens > 0  # its whole pages were written (never reported as 0)


def test_breakpoints_retain_their_prefix_and_the_second_request_reads_it(served):
    engine = served[1]
    system = [{"type": "text", "text": system_text(), "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = create(served, system=system, messages=[{"role": "user", "content": "What is 2 + 2?"}])
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation.ephemeral_1h_input_tokens > 0  # the system prompt's whole pages
    assert len(engine.kv.retention) > 0  # retained for the hour
    messages = [{"role": "user", "content": "And what is 3 + 3?"}]
    second = create(served, system=system, messages=messages)
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation.ephemeral_1h_input_tokens
    adds_up(second.usage, count(served, system=system, messages=messages))


def test_streaming_events_and_usage(served):
    system = system_text()
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Count to three.", "cache_control": {"type": "ephemeral"}}],
        }
    ]
    with served[0].messages.stream(
        model=model_of(served), max_tokens=6, system=system, messages=messages, extra_body={"temperature": 0.0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.usage.output_tokens == 6 or final.stop_reason == "end_turn"
    adds_up(final.usage, count(served, system=system, messages=messages))
    assert final.usage.cache_creation.ephemeral_5m_input_tokens > 0
    assert "cache_miss" not in (final.usage.model_extra or {})  # only when asked


def test_a_stream_explains_its_miss_when_asked(served):
    """explain_cache_miss on a stream: message_delta's usage carries cache_miss, as a plain answer's usage does, and
    so does message_start's, which the SDK's final message keeps."""
    system = system_text()
    explain = {"temperature": 0.0, "explain_cache_miss": True}
    with served[0].messages.stream(
        model=model_of(served),
        max_tokens=2,
        system=system,
        messages=[{"role": "user", "content": "Hi."}],
        extra_body=explain,
    ) as stream:
        (delta,) = [event for event in stream if event.type == "message_delta"]
        final = stream.get_final_message()
    miss = delta.usage.model_extra["cache_miss"]
    assert miss["cause"] == "never_seen" and final.usage.model_extra["cache_miss"] == miss
    usage = final.usage
    assert miss["first_missed_token"] == usage.cache_read_input_tokens
    assert sum(miss["tokens_by_cause"].values()) == usage.input_tokens + usage.cache_creation_input_tokens


def test_max_tokens_zero_prewarms(served):
    system = system_text()
    warm = create(served, max_tokens=0, system=system, messages=[{"role": "user", "content": "x"}])
    assert warm.content == [] and warm.stop_reason == "max_tokens" and warm.usage.output_tokens == 0
    later = create(served, system=system, messages=[{"role": "user", "content": "Now answer."}])
    # the system prompt's pages: all the prewarm wrote but the last two, where the user turns part ways
    page = served[1].kv.page_size
    assert later.usage.cache_read_input_tokens >= warm.usage.cache_creation_input_tokens - 2 * page > 0


def test_anthropic_400s_lose_nothing(served):
    long_first = {"type": "ephemeral", "ttl": "5m"}
    cases = [
        (
            dict(
                system=[{"type": "text", "text": "a", "cache_control": long_first}],
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "b", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
                    }
                ],
            ),
            "longer TTLs come first",
        ),
        (
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": str(i), "cache_control": long_first} for i in range(5)],
                    }
                ]
            ),
            "maximum of 4",
        ),
        (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "got 'image'"),
        (dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "pre"}]), "last message"),
        (
            dict(
                messages=[{"role": "user", "content": "hi"}],
                tools=[{"name": "t", "input_schema": {"type": "object"}}],
                tool_choice={"type": "tool", "name": "u"},
            ),
            "not among the tools",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(anthropic.BadRequestError, match=message) as info:
            create(served, **kwargs)
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        create(served, model="claude-unknown", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    wait_no_pages_held(served[2], {"Authorization": f"Bearer {KEY}"})


def test_count_tokens_counts_a_cached_content_as_messages_serves_it(served):
    """cached_content on count_tokens: the entry's messages, then the request's, as /v1/messages builds the prompt;
    an unknown name, or one made under another cache_salt, is the same Anthropic 400 on both routes."""
    base, auth = served[2], {"Authorization": f"Bearer {KEY}"}
    manual = [{"role": "system", "content": system_text()}]
    made = httpx.post(base + "/v1/caches", headers=auth, json={"messages": manual, "ttl": "300s", "cache_salt": "s1"})
    assert made.status_code == 200, made.text
    name = made.json()["name"]
    messages = [{"role": "user", "content": "Which rule comes first?"}]
    on = {"cached_content": name, "cache_salt": "s1"}
    counted = count(served, messages=messages, extra_body=on)
    assert counted > count(served, messages=messages)
    reply = create(served, max_tokens=1, messages=messages, extra_body={"temperature": 0.0, **on})
    adds_up(reply.usage, counted)
    for body, why in (({"cached_content": "cache_unknown"}, "not found"), ({"cached_content": name}, "cache_salt")):
        with pytest.raises(anthropic.BadRequestError, match=why) as counting:
            count(served, messages=messages, extra_body=body)
        with pytest.raises(anthropic.BadRequestError) as creating:
            create(served, messages=messages, extra_body=body)
        assert counting.value.body == creating.value.body and counting.value.body["type"] == "error"
    assert httpx.delete(f"{base}/v1/caches/{name}", headers=auth).status_code == 200


def test_keys_as_anthropic_sends_them(served):
    base = served[2]
    bad = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model=model_of(served), max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "authentication_error"
    raw = httpx.post(
        base + "/v1/messages", json={"model": model_of(served), "messages": []}, headers={"x-api-key": KEY}
    )
    assert raw.status_code == 400 and raw.json()["error"]["message"].startswith("Missing required field 'max_tokens'")


def test_top_level_cache_control_retains_the_whole_conversation(served):
    engine = served[1]
    messages = [{"role": "user", "content": system_text(48)}]
    before = len(engine.kv.retention)
    first = create(served, messages=messages, cache_control={"type": "ephemeral"})
    assert len(engine.kv.retention) > before and first.usage.cache_creation.ephemeral_5m_input_tokens > 0
    again = create(served, messages=messages, cache_control={"type": "ephemeral"})
    # all of it but the last page, when the prompt ends on a page boundary (one token is always computed)
    page = engine.kv.page_size
    assert again.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens - page > 0
    adds_up(again.usage, count(served, messages=messages, cache_control={"type": "ephemeral"}))


TTLS = [None, "5m", "1h"]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    system_ttls=st.lists(st.sampled_from(TTLS), min_size=1, max_size=3),
    message_ttls=st.lists(st.sampled_from(TTLS), min_size=1, max_size=3),
    top=st.sampled_from(TTLS),
    repeat=st.booleans(),
)
def test_usage_adds_up_on_any_breakpoint_layout(served, system_ttls, message_ttls, top, repeat):
    """Random breakpoint layouts, sent once or twice (the second a hit): Anthropic's 400 exactly when its rules
    are broken, else usage that adds up to the prompt, with the creation buckets adding up to the creation."""

    def blocks(ttls, text):
        return [
            {
                "type": "text",
                "text": f"{text} part {i}. " * 4,
                **({"cache_control": {"type": "ephemeral", "ttl": t}} if t else {}),
            }
            for i, t in enumerate(ttls)
        ]

    body = dict(
        system=blocks(system_ttls, system_text(20)),
        messages=[{"role": "user", "content": blocks(message_ttls, "q")}],
    )
    if top:
        body["cache_control"] = {"type": "ephemeral", "ttl": top}
    order = [{"5m": 300, "1h": 3600}[t] for t in [*system_ttls, *message_ttls, top] if t]
    broken = len(order) > 4 or any(b > a for a, b in zip(order, order[1:]))
    for _ in range(1 + repeat):
        if broken:
            with pytest.raises(anthropic.BadRequestError):
                create(served, max_tokens=1, **body)
            continue
        reply = create(served, max_tokens=1, **body)
        adds_up(reply.usage, count(served, **body))


class VirtualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_breakpoint_expires_within_a_second_of_its_ttl_and_a_hit_refreshes_it(new_engine):
    """On a virtual clock (the engine takes one): a 5m entry is retained at 299 s, gone at 301 s; a hit at 200 s
    moves its end to 500 s. /cache/summary reports the retained pages as of the clock's now."""
    clock = VirtualClock()
    engine = new_engine(clock=clock, kv_cache_tokens=1024)
    admin = {"Authorization": f"Bearer {KEY}"}
    with running_server(engine, api_key=KEY) as (base, _, _):
        client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)

        system = [{"type": "text", "text": system_text(), "cache_control": {"type": "ephemeral"}}]

        def send(question: str) -> None:
            client.messages.create(
                model=engine.model_name, max_tokens=1, system=system, messages=[{"role": "user", "content": question}]
            )

        def retained() -> int:
            return httpx.get(base + "/cache/summary", headers=admin).json()["retained_pages"]

        send("first")
        pages = retained()
        assert pages > 0
        clock.now += 299
        assert retained() == pages
        clock.now += 2
        assert retained() == 0
        send("again")  # its pages were still cached, only no longer retained: retained again until 601 s
        clock.now += 200
        send("hit")  # a hit at 501 s refreshes it to 801 s
        clock.now += 299
        assert retained() == pages
        clock.now += 2
        assert retained() == 0
