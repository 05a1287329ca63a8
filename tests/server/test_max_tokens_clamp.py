"""--clamp-max-tokens: a max_tokens past what the context leaves is lowered to what fits on the APIs the server
clamps (by default Anthropic's, whose clients ask for their own maximum: Claude Code sends 32000), and stays a 400
naming max_tokens everywhere else."""

from __future__ import annotations

import argparse

import httpx
import pytest

from prefixkv.engine.prompts import max_tokens_for
from prefixkv.sampling_params import SamplingParams
from prefixkv.server.cli import _clamp_apis
from prefixkv.server.options import CLAMP_APIS, ServingOptions
from tests.server.live_server import running_server

CONTEXT = 64
USER = [{"role": "user", "content": "Hi"}]


def test_max_tokens_for_clamps_to_the_context_and_the_pool_only_when_asked():
    asked = SamplingParams(max_tokens=32000)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        max_tokens_for(10, asked, max_model_len=64, pool_tokens=1024)
    clamped = SamplingParams(max_tokens=32000, clamp_max_tokens=True)
    assert max_tokens_for(10, clamped, max_model_len=64, pool_tokens=1024) == 54
    assert max_tokens_for(10, clamped, max_model_len=64, pool_tokens=40) == 30  # the smaller pool bounds it
    assert max_tokens_for(10, SamplingParams(max_tokens=5, clamp_max_tokens=True), 64, 1024) == 5  # never raised
    with pytest.raises(ValueError, match="max_model_len"):  # a prompt that leaves nothing is still refused
        max_tokens_for(64, clamped, max_model_len=64, pool_tokens=1024)


def test_the_flag_names_apis_all_or_none_and_refuses_others():
    assert _clamp_apis("messages, chat") == {"messages", "chat"}
    assert _clamp_apis("all") == set(CLAMP_APIS)
    assert _clamp_apis("none") == set()
    with pytest.raises(argparse.ArgumentTypeError, match="'chats'"):
        _clamp_apis("chats")
    with pytest.raises(ValueError, match="clamp_max_tokens: unknown API 'embeddings'"):
        ServingOptions(clamp_max_tokens=frozenset({"embeddings"}))


@pytest.fixture(scope="module")
def served(new_engine):
    with running_server(new_engine(max_model_len=CONTEXT, kv_cache_tokens=512)) as (base, engine, _):
        yield base, engine


def test_messages_are_clamped_by_default_and_chat_is_refused(served):
    base, engine = served
    body = {"model": engine.model_name, "messages": USER, "max_tokens": 32000, "temperature": 0}
    answer = httpx.post(f"{base}/v1/messages", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] <= CONTEXT
    assert answer.json()["stop_reason"] in ("max_tokens", "end_turn")

    chat = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert chat.status_code == 400, chat.text
    assert "max_tokens" in chat.json()["error"]["message"]
