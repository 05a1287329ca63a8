"""The agent-client matrix (issue 41): every pinned SDK and agent framework, unmodified, against a real
`prefixkv serve` on the default model: a forced tool call with valid arguments, its streamed form, a tool
result's round trip that reads the first turn from the cache, and a typed output, on each API.

    .venv/bin/python scripts/agent_matrix.py [--out docs/benchmarks/agents] [-- serve flags...]

Each scenario passes (with what it saw: the call, the cached tokens) or fails (with the error); the table and
the JSON go to --out, named by the CPU and the commit. The suite runs one scenario per client in tests/server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import anthropic
import openai
from google import genai
from google.genai import types
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prefixkv.bench.server_process import serve_process  # noqa: E402
from prefixkv.model import cpu_features  # noqa: E402

SYSTEM = "You are a helpful assistant. Use the tools when they help."
QUESTION = "What is the weather in Paris?"
RESULT = "21 C, clear"
City = Annotated[str, Field(max_length=20)]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city today.", "parameters": WEATHER_SCHEMA},
}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city today."}
RESPONSES_TOOL |= {"parameters": WEATHER_SCHEMA, "strict": True}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city today.", "input_schema": WEATHER_SCHEMA}


class Forecast(BaseModel):
    city: City
    sunny: bool


def _valid(args: dict) -> dict:
    """The call's arguments, checked against WEATHER_SCHEMA's constraints."""
    if set(args) != {"city", "unit"} or args["unit"] not in ("celsius", "fahrenheit") or len(args["city"]) > 20:
        raise AssertionError(f"arguments outside the schema: {args}")
    return args


# --- the openai SDK, Chat Completions


def chat_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def chat_call(base: str, model: str, stream: bool = False) -> dict:
    ask: dict[str, Any] = dict(model=model, tools=[CHAT_TOOL], temperature=0, max_tokens=64)
    ask |= dict(tool_choice="required", parallel_tool_calls=False)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    if not stream:
        (call,) = chat_client(base).chat.completions.create(messages=messages, **ask).choices[0].message.tool_calls
        return {"call": _valid(json.loads(call.function.arguments))}
    arguments, finish = "", None
    for chunk in chat_client(base).chat.completions.create(messages=messages, stream=True, **ask):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls", finish
    return {"call": _valid(json.loads(arguments))}


def chat_round_trip(base: str, model: str) -> dict:
    client = chat_client(base)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ask: dict[str, Any] = dict(model=model, tools=[CHAT_TOOL], temperature=0, max_tokens=64)
    first = client.chat.completions.create(messages=messages, tool_choice="required", parallel_tool_calls=False, **ask)
    message = first.choices[0].message
    (call,) = message.tool_calls
    messages += [message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = client.chat.completions.create(messages=messages, tool_choice="none", **ask)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens // 2, f"only {cached} tokens read from the cache"
    return {"cached_tokens": cached, "prompt_tokens": second.usage.prompt_tokens}


def chat_typed(base: str, model: str) -> dict:
    out = chat_client(base).chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Forecast for Paris."}], response_format=Forecast,
        temperature=0, max_tokens=64,
    )  # fmt: skip
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Forecast), parsed
    return {"parsed": parsed.model_dump()}


# --- the openai SDK, Responses


def responses_call(base: str, model: str, stream: bool = False) -> dict:
    ask: dict[str, Any] = dict(model=model, input=QUESTION, instructions=SYSTEM, tools=[RESPONSES_TOOL])
    ask |= dict(tool_choice="required", parallel_tool_calls=False, temperature=0, max_output_tokens=64)
    if not stream:
        (item,) = [i for i in chat_client(base).responses.create(**ask).output if i.type == "function_call"]
        return {"call": _valid(json.loads(item.arguments))}
    done = [e for e in chat_client(base).responses.create(stream=True, **ask) if e.type == "response.completed"]
    (item,) = [i for i in done[0].response.output if i.type == "function_call"]
    return {"call": _valid(json.loads(item.arguments))}


def responses_round_trip(base: str, model: str) -> dict:
    client = chat_client(base)
    ask: dict[str, Any] = dict(model=model, instructions=SYSTEM, tools=[RESPONSES_TOOL], temperature=0)
    first = client.responses.create(input=QUESTION, tool_choice="required", parallel_tool_calls=False, **ask)
    (item,) = [i for i in first.output if i.type == "function_call"]
    output = {"type": "function_call_output", "call_id": item.call_id, "output": RESULT}
    second = client.responses.create(input=[output], previous_response_id=first.id, tool_choice="none", **ask)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached > first.usage.input_tokens // 2, f"only {cached} tokens read from the cache"
    return {"cached_tokens": cached, "input_tokens": second.usage.input_tokens}


def responses_typed(base: str, model: str) -> dict:
    out = chat_client(base).responses.parse(
        model=model, input="Forecast for Paris.", text_format=Forecast, temperature=0, max_output_tokens=64
    )
    assert isinstance(out.output_parsed, Forecast), out.output_parsed
    return {"parsed": out.output_parsed.model_dump()}


# --- the anthropic SDK, Messages


def anthropic_client(base: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)


ANY_ONE = {"type": "any", "disable_parallel_tool_use": True}
GREEDY = {"temperature": 0}  # anthropic 2.15.0's create() has no temperature argument: it goes in the body


def messages_call(base: str, model: str, stream: bool = False) -> dict:
    ask: dict[str, Any] = dict(model=model, system=SYSTEM, tools=[ANTHROPIC_TOOL], tool_choice=ANY_ONE)
    ask |= dict(messages=[{"role": "user", "content": QUESTION}], max_tokens=64, extra_body=GREEDY)
    if stream:
        with anthropic_client(base).messages.stream(**ask) as events:
            kinds = {e.type for e in events}
            out = events.get_final_message()
        assert "input_json" in kinds, kinds
    else:
        out = anthropic_client(base).messages.create(**ask)
    assert out.stop_reason == "tool_use", out.stop_reason
    (block,) = [b for b in out.content if b.type == "tool_use"]
    return {"call": _valid(dict(block.input))}


def messages_round_trip(base: str, model: str) -> dict:
    client = anthropic_client(base)
    ask: dict[str, Any] = dict(model=model, system=SYSTEM, tools=[ANTHROPIC_TOOL], max_tokens=64, extra_body=GREEDY)
    question = {"role": "user", "content": QUESTION}
    first = client.messages.create(messages=[question], tool_choice=ANY_ONE, **ask)
    (block,) = [b for b in first.content if b.type == "tool_use"]
    turn = [
        question,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": RESULT}]},
    ]
    second = client.messages.create(messages=turn, tool_choice={"type": "none"}, **ask)
    cached = second.usage.cache_read_input_tokens or 0
    assert cached > 0, "nothing read from the cache"
    return {"cache_read_input_tokens": cached, "input_tokens": second.usage.input_tokens}


def messages_typed(base: str, model: str) -> dict:
    out = anthropic_client(base).messages.parse(
        model=model, max_tokens=64, extra_body=GREEDY, messages=[{"role": "user", "content": "Forecast for Paris."}],
        output_format=Forecast,
    )  # fmt: skip
    parsed = out.parsed_output
    assert isinstance(parsed, Forecast), parsed
    return {"parsed": parsed.model_dump()}


# --- the google-genai SDK, generateContent


_GEMINI_CLIENTS: dict[str, genai.Client] = {}


def gemini_models(base: str):
    """The client's models API; the client is kept, as one dropped closes the connection its models use."""
    if base not in _GEMINI_CLIENTS:
        options = types.HttpOptions(base_url=base, api_version="v1beta")
        _GEMINI_CLIENTS[base] = genai.Client(api_key="unused", http_options=options)
    return _GEMINI_CLIENTS[base].models


def gemini_config(mode: str = "ANY", **kwargs) -> types.GenerateContentConfig:
    declaration = types.FunctionDeclaration(
        name="get_weather", description="The weather in a city today.", parameters_json_schema=WEATHER_SCHEMA
    )
    calling = types.FunctionCallingConfig(mode=mode, allowed_function_names=["get_weather"] if mode == "ANY" else None)
    return types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[declaration])],
        tool_config=types.ToolConfig(function_calling_config=calling),
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        system_instruction=SYSTEM, temperature=0, max_output_tokens=64, **kwargs,
    )  # fmt: skip


def gemini_call(base: str, model: str, stream: bool = False) -> dict:
    models = gemini_models(base)
    if stream:
        chunks = models.generate_content_stream(model=model, contents=QUESTION, config=gemini_config())
        calls = [c for chunk in chunks for c in chunk.function_calls or []]
    else:
        calls = models.generate_content(model=model, contents=QUESTION, config=gemini_config()).function_calls or []
    (call,) = calls
    assert call.name == "get_weather", call.name
    return {"call": _valid(dict(call.args or {}))}


def gemini_round_trip(base: str, model: str) -> dict:
    models = gemini_models(base)
    question = types.Content(role="user", parts=[types.Part(text=QUESTION)])
    first = models.generate_content(model=model, contents=[question], config=gemini_config())
    result = types.Part.from_function_response(name="get_weather", response={"result": RESULT})
    turn = [question, first.candidates[0].content, types.Content(role="user", parts=[result])]
    second = models.generate_content(model=model, contents=turn, config=gemini_config("NONE"))
    cached = second.usage_metadata.cached_content_token_count or 0
    assert cached > 0, "nothing read from the cache"
    return {"cached_content_token_count": cached, "prompt_token_count": second.usage_metadata.prompt_token_count}


def gemini_typed(base: str, model: str) -> dict:
    config = types.GenerateContentConfig(
        response_mime_type="application/json", response_schema=Forecast, temperature=0, max_output_tokens=64
    )
    out = gemini_models(base).generate_content(model=model, contents="Forecast for Paris.", config=config)
    return {"parsed": Forecast.model_validate_json(out.text).model_dump()}


# --- the OpenAI Agents SDK


def _run_agent(base: str, make_agent: Callable[[openai.AsyncOpenAI], Any], question: str, max_turns: int) -> Any:
    """Runner.run on its own event loop, with a client closed on that loop (the SDK's own, unmodified)."""
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused") as client:
            return await Runner.run(make_agent(client), question, max_turns=max_turns)

    return asyncio.run(run())


def agents_tool_call(base: str, model: str) -> dict:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool

    asked: list[str] = []

    @function_tool
    def get_weather(city: City) -> str:
        """The weather in a city today."""
        asked.append(city)
        return f"sunny in {city}"

    def agent(client: openai.AsyncOpenAI) -> Agent:
        return Agent(
            name="weather", instructions=SYSTEM, tools=[get_weather], tool_use_behavior="stop_on_first_tool",
            model=OpenAIResponsesModel(model, client),
            model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=48),
        )  # fmt: skip

    result = _run_agent(base, agent, QUESTION, max_turns=2)
    assert result.final_output == f"sunny in {asked[0]}", result.final_output
    return {"tool_ran_with": asked[0]}


def agents_typed(base: str, model: str) -> dict:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel

    def agent(client: openai.AsyncOpenAI) -> Agent:
        return Agent(
            name="forecaster", instructions="Answer with the forecast.", output_type=Forecast,
            model=OpenAIChatCompletionsModel(model, client), model_settings=ModelSettings(temperature=0, max_tokens=64),
        )  # fmt: skip

    out = _run_agent(base, agent, "Forecast for Paris.", max_turns=1).final_output
    assert isinstance(out, Forecast), out
    return {"parsed": out.model_dump()}


# --- LangChain


def _langchain(base: str, model: str):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=base + "/v1", api_key="unused", model=model, temperature=0, max_tokens=64)


def langchain_round_trip(base: str, model: str) -> dict:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    llm = _langchain(base, model)
    messages = [SystemMessage(SYSTEM), HumanMessage(QUESTION)]
    first = llm.bind_tools([CHAT_TOOL], tool_choice="get_weather").invoke(messages)
    (call,) = first.tool_calls
    _valid(call["args"])
    second = llm.bind_tools([CHAT_TOOL], tool_choice="none").invoke(
        [*messages, first, ToolMessage(RESULT, tool_call_id=call["id"])]
    )
    cached = second.response_metadata["token_usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, "nothing read from the cache"
    return {"call": call["args"], "cached_tokens": cached}


def langchain_typed(base: str, model: str) -> dict:
    out = _langchain(base, model).with_structured_output(Forecast, method="json_schema", strict=True)
    parsed = out.invoke("Forecast for Paris.")
    assert isinstance(parsed, Forecast), parsed
    return {"parsed": parsed.model_dump()}


SCENARIOS: dict[tuple[str, str], Callable[[str, str], dict]] = {
    ("openai chat completions", "forced call"): chat_call,
    ("openai chat completions", "streamed call"): lambda b, m: chat_call(b, m, stream=True),
    ("openai chat completions", "tool result round trip"): chat_round_trip,
    ("openai chat completions", "typed output (parse)"): chat_typed,
    ("openai responses", "forced call"): responses_call,
    ("openai responses", "streamed call"): lambda b, m: responses_call(b, m, stream=True),
    ("openai responses", "tool result round trip"): responses_round_trip,
    ("openai responses", "typed output (parse)"): responses_typed,
    ("anthropic messages", "forced call"): messages_call,
    ("anthropic messages", "streamed call"): lambda b, m: messages_call(b, m, stream=True),
    ("anthropic messages", "tool result round trip"): messages_round_trip,
    ("anthropic messages", "typed output (parse)"): messages_typed,
    ("google-genai", "forced call"): gemini_call,
    ("google-genai", "streamed call"): lambda b, m: gemini_call(b, m, stream=True),
    ("google-genai", "tool result round trip"): gemini_round_trip,
    ("google-genai", "typed output (response_schema)"): gemini_typed,
    ("openai-agents (Responses)", "forced call, the tool run"): agents_tool_call,
    ("openai-agents (Chat Completions)", "typed output"): agents_typed,
    ("langchain-openai", "bind_tools call and round trip"): langchain_round_trip,
    ("langchain-openai", "with_structured_output"): langchain_typed,
}


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    names = ("openai", "anthropic", "google-genai", "openai-agents", "langchain-openai", "langchain-core")
    return {name: version(name) for name in names}


def _cpu() -> str:
    """The model name with its family and model numbers (an "AMD EPYC" alone names no generation)."""
    cpu = cpu_features.describe()
    return f"{cpu['model'] or platform.processor()} (family {cpu['family'] or '?'}, model {cpu['model_id'] or '?'})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/benchmarks/agents")
    parser.add_argument("--only", default="", help="run the scenarios whose client or name contains this")
    parser.add_argument("serve_args", nargs="*", help="flags for prefixkv serve (after --)")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = []
    with serve_process(args.serve_args, log_path="/tmp/prefixkv-agent-matrix.log") as base:
        model = chat_client(base).models.list().data[0].id
        for (client, scenario), run in SCENARIOS.items():
            if args.only not in f"{client}: {scenario}":
                continue
            started = time.perf_counter()
            try:
                row = {"ok": True, "saw": run(base, model)}
            except Exception as exc:  # a failed scenario is a row, not the end of the matrix
                row = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
                traceback.print_exc()
            row |= {"client": client, "scenario": scenario, "seconds": round(time.perf_counter() - started, 2)}
            rows.append(row)
            print(f"{'ok  ' if row['ok'] else 'FAIL'} {client}: {scenario} ({row['seconds']} s)", flush=True)
    passed = sum(r["ok"] for r in rows)
    meta = {"cpu": _cpu(), "commit": commit, "date": time.strftime("%Y-%m-%d"), "model": model}
    meta |= {"serve_args": args.serve_args, "versions": _versions(), "passed": passed, "scenarios": len(rows)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"matrix-{commit}"
    (out / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# Agent clients against prefixkv serve: {passed} of {len(rows)} scenarios pass",
        "",
        f"{meta['cpu']}, commit {commit}, {meta['date']}, model {model}, serve flags {args.serve_args or 'none'};",
        "clients: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
        "",
        "| client | scenario | result | what it saw | s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        saw = json.dumps(r["saw"]) if r["ok"] else r["error"].replace("|", "/")
        lines.append(f"| {r['client']} | {r['scenario']} | {'pass' if r['ok'] else 'FAIL'} | {saw} | {r['seconds']} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"{passed} of {len(rows)} scenarios pass; {out / stem}.md")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
