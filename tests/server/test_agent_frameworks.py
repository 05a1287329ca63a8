"""Agent frameworks run unmodified against the real server on the default 135M model (issue 41): the OpenAI Agents
SDK (openai-agents 0.24.0) over the Responses API and over Chat Completions, and LangChain (langchain-openai
1.8.1). Each scenario is what an agent developer writes first: a forced tool call the framework executes, a typed
output parsed into its model, and a tool result's second turn that reads the first from the cache.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.server.live_server import running_server

SYSTEM = "You are a helpful assistant. Use the tools when they help."
QUESTION = "What is the weather in Paris?"
CITY_CHARS = 20
asked_for: list[str] = []


class Forecast(BaseModel):
    city: City
    sunny: bool


City = Annotated[str, Field(max_length=CITY_CHARS)]  # the schema bounds it: a 135M model may ramble


@function_tool
def get_weather(city: City) -> str:
    """The weather in a city today.

    Args:
        city: the city's name.
    """
    asked_for.append(city)
    return f"sunny in {city}"


@tool
def weather(city: City) -> str:
    """The weather in a city today."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def served(new_engine):
    set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI
    with running_server(new_engine(kv_cache_tokens=4096)) as (base, engine, _):
        yield base + "/v1", engine.model_name


def _run(base: str, model: str, api: str, question: str, max_turns: int, **agent):
    """Runner.run with the agent on `api`, its client opened and closed on the run's own event loop."""

    async def run():
        async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as client:
            kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
            return await Runner.run(Agent(model=kind(model, client), **agent), question, max_turns=max_turns)

    return asyncio.run(run())


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agents_sdk_runs_a_forced_tool_call(served, api):
    base, model = served
    asked_for.clear()
    result = _run(
        base,
        model,
        api,
        QUESTION,
        max_turns=2,
        name="weather",
        instructions=SYSTEM,
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=48),
        tool_use_behavior="stop_on_first_tool",  # the tool's answer is the run's: no free-text turn to wait on
    )
    (city,) = asked_for
    assert isinstance(city, str) and result.final_output == f"sunny in {city}"


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_agents_sdk_parses_a_typed_output(served, api):
    base, model = served
    result = _run(
        base,
        model,
        api,
        "Forecast for Paris.",
        max_turns=1,
        name="forecaster",
        instructions="Answer with the forecast.",
        output_type=Forecast,
        model_settings=ModelSettings(temperature=0, max_tokens=64),
    )
    assert isinstance(result.final_output, Forecast)


def test_langchain_tool_call_round_trip_reads_the_first_turn_from_the_cache(served):
    base, model = served
    llm = ChatOpenAI(base_url=base, api_key="unused", model=model, temperature=0, max_tokens=48, max_retries=0)
    messages = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    first = llm.bind_tools([weather], tool_choice="weather").invoke(messages)
    (call,) = first.tool_calls
    assert call["name"] == "weather" and isinstance(call["args"]["city"], str)
    turn = [*messages, first, ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])]
    second = llm.bind_tools([weather], tool_choice="none").invoke(turn)
    assert isinstance(second.content, str) and not second.tool_calls
    usage = second.response_metadata["token_usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached >= first.response_metadata["token_usage"]["prompt_tokens"] // 2


def test_langchain_structured_output_parses_into_the_model(served):
    base, model = served
    llm = ChatOpenAI(base_url=base, api_key="unused", model=model, temperature=0, max_tokens=64, max_retries=0)
    out = llm.with_structured_output(Forecast, method="json_schema", strict=True).invoke("Forecast for Paris.")
    assert isinstance(out, Forecast) and len(out.city) <= CITY_CHARS
