"""POST /v1/responses (and GET / DELETE of a stored one) through the official `openai` SDK against the real app:
the response and its streamed events, a store + previous_response_id chain whose cached tokens cover the session
so far, prompt_cache_key and prompt_cache_retention accepted, 400s in OpenAI's shape (an unknown
previous_response_id, unsupported items), and stored responses kept per tenant. One server for the module, on
the suite's shared engine."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.server.live_server import running_server, wait_no_pages_held

KEY_FILE = "alice-key alice\nbob-key bob\nops-key ops admin\n"
ADMIN = {"Authorization": "Bearer ops-key"}


@pytest.fixture(scope="module")
def served(new_engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEY_FILE)
    with running_server(new_engine(), api_key_file=str(path)) as (base, engine, _):
        yield base, engine.model_name


def client(served, key: str = "alice-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=key, max_retries=0)


def instructions() -> str:
    tag = uuid.uuid4().hex[:8]
    return f"[{tag}] You answer in one short sentence. " + " ".join(f"Rule {i} of {tag}." for i in range(30))


def test_a_response_and_its_usage(served):
    reply = client(served).responses.create(
        model=served[1],
        instructions=instructions(),
        input="Say hello.",
        max_output_tokens=5,
        temperature=0,
        prompt_cache_key="session-1",
        prompt_cache_retention="24h",
    )
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.output_text
    assert reply.status in ("completed", "incomplete") and reply.usage.output_tokens <= 5
    assert reply.usage.input_tokens_details.cached_tokens == 0  # instructions nobody sent before
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.prompt_cache_key == "session-1"


def test_a_chain_of_stored_responses_reads_the_session_from_the_cache(served):
    c, rules = client(served), instructions()
    first = c.responses.create(
        model=served[1], instructions=rules, input="Name a colour.", max_output_tokens=4, temperature=0
    )
    second = c.responses.create(
        model=served[1],
        instructions=rules,
        previous_response_id=first.id,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And another one?"}]}],
        max_output_tokens=4,
        temperature=0,
    )
    third = c.responses.create(
        model=served[1],
        instructions=rules,
        previous_response_id=second.id,
        input="One more.",
        max_output_tokens=4,
        temperature=0,
    )
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn is part of the prompt
    # each turn's prompt starts with the previous turn's, which the cache holds (all but its partial last page)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 32
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 32
    assert c.responses.retrieve(second.id).output_text == second.output_text
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="not found") as info:
        c.responses.create(model=served[1], previous_response_id=first.id, input="Go on.", max_output_tokens=2)
    assert info.value.body["code"] == "previous_response_not_found"


def test_streamed_events(served):
    c = client(served)
    kinds, text = [], ""
    stream = c.responses.create(
        model=served[1],
        instructions=instructions(),
        input="Count to three.",
        max_output_tokens=6,
        temperature=0,
        stream=True,
    )
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.done" in kinds
    assert text and final.output_text == text and final.usage.output_tokens <= 6
    assert c.responses.retrieve(final.id).output_text == text  # stored once streamed


def test_stored_responses_and_errors_stay_with_their_tenant(served):
    alice, bob = client(served, "alice-key"), client(served, "bob-key")
    mine = alice.responses.create(model=served[1], input="Hi.", max_output_tokens=2, temperature=0)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        bob.responses.create(model=served[1], previous_response_id=mine.id, input="Go on.", max_output_tokens=2)
    unsupported = [
        ([{"type": "reasoning", "summary": []}], "got type 'reasoning'"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}], "only text parts"),
    ]
    for given, message in unsupported:
        with pytest.raises(openai.BadRequestError, match=message) as info:
            alice.responses.create(model=served[1], input=given, max_output_tokens=2)
        assert info.value.body["param"] == "input"
    wait_no_pages_held(served[0], ADMIN)


def test_logprobs_plain_and_streamed(served):
    """include asks for logprobs: the message's output_text carries each generated token's, top_logprobs
    alternatives each (greedy: the chosen token is the first), and the streamed deltas carry the same tokens."""
    c = client(served)
    ask = {
        "model": served[1],
        "input": "Name three fruits.",
        "max_output_tokens": 6,
        "temperature": 0,
        "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
        "top_logprobs": 2,
    }
    reply = c.responses.create(**ask)
    logprobs = reply.output[0].content[0].logprobs
    assert len(logprobs) == reply.usage.output_tokens and reply.top_logprobs == 2
    assert "".join(lp.token for lp in logprobs) == reply.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token for lp in logprobs)
    streamed, done = [], None
    for event in c.responses.create(**ask, stream=True):
        if event.type == "response.output_text.delta":
            streamed += event.logprobs
        if event.type == "response.output_text.done":
            done = event.logprobs
    assert [lp.token for lp in streamed] == [lp.token for lp in done] == [lp.token for lp in logprobs]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-3)
    plain = c.responses.create(**{**ask, "include": None, "top_logprobs": None})
    assert plain.output[0].content[0].logprobs is None and plain.output_text == reply.output_text

    for field, extra in (("include", {"include": ["file_search_call.results"]}), ("top_logprobs", {"top_logprobs": 2})):
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model=served[1], input="x", max_output_tokens=1, **extra)
        assert err.value.body["param"] == field, err.value.body
