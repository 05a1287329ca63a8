"""Tool calls on the Python side of every door: the built-in prompt, the grammar each tool choice gets, and the
reader, on the real model. A forced call from the 135M model parses and fits its schema; auto lets it answer in
text; a streamed answer gives the same text and calls as the whole one; bad tool lists are ValueErrors.
"""

from __future__ import annotations

import itertools
import json

import pytest

from prefixkv.sampling_params import SamplingParams
from prefixkv.structured_outputs import StructuredOutputs
from prefixkv.tools.grammar import tool_constraint
from prefixkv.tools.parse import CallStream, split_answer
from prefixkv.tools.prompt import call_text, render_messages, tool_block
from prefixkv.tools.spec import Tool, ToolCall, ToolChoice, check_tools

WEATHER = Tool(
    "get_weather",
    "The weather in a city today.",
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
TIME = Tool(
    "get_time",
    "The local time in a city.",
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
)
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def generate(llm, messages, choice, max_tokens=64, text=None, **sampling):
    tok = llm.get_tokenizer()
    prompt = tok.encode_chat(render_messages(messages, TOOLS))
    so = tool_constraint(TOOLS, choice, text)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so, **sampling)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]


@pytest.mark.parametrize(
    "choice",
    [ToolChoice("required"), ToolChoice("required", name="get_time"), ToolChoice("required", parallel=False)],
    ids=["required", "named", "one-call"],
)
def test_a_forced_call_is_valid(llm_factory, choice):
    out = generate(llm_factory(prefix_cache="hash"), QUESTION, choice).outputs[0]
    text, calls = split_answer(out.text, ids())
    # parallel calls may go on until max_tokens (the 135M model repeats its call): the complete ones count; a named
    # choice is one call
    one_call = not choice.parallel or choice.name is not None
    assert text == "" and calls and (out.finish_reason == "stop" or not one_call), out.text
    for call in calls:
        args = json.loads(call.arguments)
        assert call.name in ("get_weather", "get_time") and "city" in args, out.text
        if call.name == "get_weather":
            assert args["unit"] in ("celsius", "fahrenheit") and set(args) == {"city", "unit"}
    if choice.name:
        assert {c.name for c in calls} == {"get_time"}
    if one_call:
        assert len(calls) == 1
    # the call written back into the next turn is the text the model wrote, character for character
    assert out.text.startswith("\n".join(call_text(c) for c in calls))


def test_auto_answers_in_text_or_calls_and_a_call_it_starts_is_valid(llm_factory):
    llm = llm_factory(prefix_cache="hash")
    hello = [{"role": "user", "content": "Say hello."}]
    out = generate(llm, hello, ToolChoice("auto"), max_tokens=24).outputs[0]
    text, calls = split_answer(out.text, ids())
    assert text == out.text and not calls and "<tool_call>" not in text
    # with the call tag already written, auto must finish a valid call
    tok = llm.get_tokenizer()
    prompt = tok.encode_chat(render_messages(QUESTION, TOOLS))
    so = tool_constraint(TOOLS, ToolChoice("auto"), None)
    matcher = llm.llm_engine.grammars.start(so)  # the grammar itself: text, then the tag, then a valid call
    for t in tok.hf.encode(
        'Sure. <tool_call>\n{"name":"get_time","arguments":{"city":"Oslo"}}\n</tool_call>', add_special_tokens=False
    ):
        matcher.accept(t)
    assert matcher.error is None
    assert prompt  # the prompt renders with the tag


def test_none_leaves_the_answer_free_and_keeps_the_tool_block(llm_factory):
    assert tool_constraint(TOOLS, ToolChoice("none"), None) is None
    rendered = render_messages(QUESTION, TOOLS)
    assert rendered[0]["content"] == tool_block(TOOLS)


def test_a_json_response_format_replaces_the_free_text(llm_factory):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}}, "required": ["answer"]}
    out = generate(
        llm_factory(prefix_cache="hash"),
        [{"role": "user", "content": "Say hello in JSON."}],
        ToolChoice("auto"),
        text=StructuredOutputs(json=schema),
    ).outputs[0]
    text, calls = split_answer(out.text, ids())
    assert calls or set(json.loads(text)) == {"answer"}, out.text
    with pytest.raises(ValueError, match="regex cannot be combined with tools"):
        tool_constraint(TOOLS, ToolChoice("auto"), StructuredOutputs(regex="a+"))


def test_the_stream_reader_gives_the_whole_answer_in_any_split():
    answer = (
        'Let me look. <tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}\n</tool_call>'
        '\n<tool_call>\n{"name":"get_time","arguments":{"city":"Paris"}}\n</tool_call>'
    )
    whole_text, whole_calls = split_answer(answer, ids())
    for size in (1, 2, 3, 5, 7, 13, len(answer)):
        stream, events = CallStream(ids()), []
        for at in range(0, len(answer), size):
            events += stream.feed(answer[at : at + size])
        events += stream.finish()
        text = "".join(e.text for e in events if e.kind == "text")
        names = [e.text for e in events if e.kind == "call"]
        args = ["".join(e.text for e in events if e.kind == "arguments" and e.index == i) for i in range(len(names))]
        assert text == whole_text == "Let me look. "
        assert names == [c.name for c in whole_calls] and args == [c.arguments for c in whole_calls]
    stream = CallStream(ids())  # plain text with a lone "<" passes through once it cannot be a tag
    assert "".join(e.text for e in stream.feed("a <b") + stream.feed("> c") + stream.finish()) == "a <b> c"


def test_calls_and_results_render_in_one_canonical_form():
    call = ToolCall("call_0", "get_time", '{ "city": "Oslo" }')
    messages = [
        {"role": "system", "content": "Be brief."},
        *QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "12:00"},
        {"role": "tool", "content": "13:00"},
    ]
    rendered = render_messages(messages, list(reversed(TOOLS)))
    assert rendered[0]["content"].startswith(tool_block(list(reversed(TOOLS))))
    assert rendered[0]["content"].endswith("\n\nBe brief.")
    assert rendered[2]["content"] == '<tool_call>\n{"name":"get_time","arguments":{"city":"Oslo"}}\n</tool_call>'
    assert rendered[3] == {
        "role": "user",
        "content": "<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n</tool_response>",
    }
    # the same definitions written with other key orders give the same block
    shuffled = Tool("get_time", TIME.description, dict(reversed(list(TIME.parameters.items()))))
    assert tool_block([shuffled]) == tool_block([TIME])


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        ([WEATHER, WEATHER], ToolChoice(), "two tools are named 'get_weather'"),
        (TOOLS, ToolChoice("required", name="nope"), "tool_choice names 'nope'"),
        ([], ToolChoice("required"), "no tools were given"),
    ],
)
def test_bad_tool_lists_are_value_errors(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        check_tools(tools, choice)


def test_bad_tools_are_value_errors():
    with pytest.raises(ValueError, match="must be 1-64 letters"):
        Tool("has space")
    with pytest.raises(ValueError, match="of type object"):
        Tool("f", parameters={"type": "string"})
    with pytest.raises(ValueError, match="not valid JSON"):
        call_text(ToolCall("c", "f", "{nope"))
