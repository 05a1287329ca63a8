"""Every field a client of each API may send, in one of three kinds: honoured (a field of the request model),
accepted with no effect (and the reason), or refused with a 400 that names it (and the reason). Any other field
is refused too, in the wording the API itself uses for an unknown field, so nothing a client sends is dropped
without a word. docs/server.md's field table is written from here (field_docs.py);
tests/server/test_request_fields.py walks the pinned SDKs' request parameters against it.

A refused field passes when it holds a value that asks for nothing (its `neutral` values: null, false, the
default), so a client that always sends the default is not turned away.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, model_validator

from prefixkv.server.errors import APIError
from prefixkv.server.openai_tools import REMOVED
from prefixkv.server.structured import REMOVED_GUIDED


@dataclass(frozen=True)
class Refused:
    why: str  # the rest of the sentence after the field's name
    neutral: tuple[Any, ...] = (None,)


@dataclass(frozen=True)
class FieldTable:
    no_effect: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, Refused] = field(default_factory=dict)
    spell: Callable[[str], str] = str  # a body key as the table writes it (Gemini: camelCase)


class TableFields(BaseModel):
    """A request body that reads its FIELDS before validation: no-effect fields are set aside, refused ones are a
    400 naming them; the model's own fields are the honoured ones, and extra="forbid" refuses the rest."""

    FIELDS: ClassVar[FieldTable] = FieldTable()

    @model_validator(mode="before")
    @classmethod
    def _sort_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        table = cls.FIELDS
        kept = {}
        for key, value in data.items():
            name = table.spell(key)
            refused = table.refused.get(name)
            if refused is not None and not any(_same(value, n) for n in refused.neutral):
                raise APIError(f"{key} {refused.why}", param=key, code="unsupported")
            if name not in table.no_effect and refused is None:
                kept[key] = value
        return kept


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same kind (0 is not False, 1 is not True)."""
    return type(value) is type(neutral) and value == neutral


_TEXT_ONLY = "is not served: this server generates text only"
_NOT_STORED = "is kept only with stored completions, and this server stores none"
_NO_REASONING = "changes nothing: the chat template is rendered without a reasoning switch"
_ONE_TIER = "changes nothing: there is one service tier (the `priority` extension orders requests)"
_NO_MONITORING = "changes nothing: this server runs no abuse monitoring (`user` keys tenant isolation)"
_NO_BEAM = "is not served: beam search is not implemented"

# OpenAI's fields on both generation routes, and vLLM's extensions to them (vLLM 0.32's protocol.py)
_OPENAI_NO_EFFECT = {
    "store": "changes nothing: this server keeps no chat completions to list or distil later",
    "metadata": _NOT_STORED,
    "service_tier": _ONE_TIER,
    "safety_identifier": _NO_MONITORING,
    "prediction": "changes nothing: a predicted output only speeds up OpenAI's answer, which is the same without it",
    "reasoning_effort": _NO_REASONING,
    "verbosity": "changes nothing: a length hint that only OpenAI's reasoning models read",
    "include_reasoning": "changes nothing: no reasoning parser runs, so there is no reasoning to include",
}
_OPENAI_REFUSED = {
    "audio": Refused(_TEXT_ONLY),
    "web_search_options": Refused("is not served: this server has no web search"),
    "moderation": Refused("is not served: this server runs no moderation model"),
    "prompt_cache_options": Refused(
        "is not served yet (explicit breakpoints and TTLs); prompt_cache_retention and prompt_cache_key are"
    ),
    **{name: Refused(f"is deprecated and not served; use {new}") for name, new in REMOVED.items()},
    **{name: Refused(f"was removed (as in vLLM); use {new}") for name, new in REMOVED_GUIDED.items()},
    "use_beam_search": Refused(_NO_BEAM, (None, False)),
    "length_penalty": Refused(_NO_BEAM, (None, 1.0, 1)),
    "best_of": Refused("is not served: one sequence is generated per completion (use n)", (None, 1)),
    "min_tokens": Refused("is not served", (None, 0)),
    "truncate_prompt_tokens": Refused("is not served: a prompt longer than the context is a 400"),
    "prompt_logprobs": Refused("is not served: logprobs covers the generated tokens"),
    "allowed_token_ids": Refused("is not served; logit_bias raises or lowers named tokens"),
    "bad_words": Refused("is not served", (None, [])),
    "spaces_between_special_tokens": Refused("is not served (special tokens are joined as decoded)", (None, True)),
    "request_id": Refused("is not served: the server names its requests (the response id)"),
    "logits_processors": Refused("is not served: this server loads no custom logits processors"),
    "return_tokens_as_token_ids": Refused("is not served", (None, False)),
    "return_token_ids": Refused("is not served; /tokenize gives a text's token ids", (None, False)),
    "kv_transfer_params": Refused("is not served: this server has no disaggregated prefill"),
    "vllm_xargs": Refused("is not served: this server has no extension arguments", (None, {})),
    "max_repetition_pattern_size": Refused("is not served", (None, 0)),
    "min_repetition_pattern_size": Refused("is not served", (None, 0)),
    "repetition_min_count": Refused("is not served", (None, 0)),
    "mm_processor_kwargs": Refused("is not served: this server takes no images or audio", (None, {})),
    "prompt_embeds": Refused("is not served: prompts are text or token ids"),
}
_CHAT_ONLY_REFUSED = {
    "echo": Refused("is not served (vLLM's: continue the last message)", (None, False)),
    "add_generation_prompt": Refused("is not served: the assistant's turn is always opened", (None, True)),
    "continue_final_message": Refused("is not served: a final assistant message is a 400", (None, False)),
    "add_special_tokens": Refused("is not served: the chat template adds the special tokens", (None, False)),
    "documents": Refused("is not served: the chat template is rendered without documents"),
    "chat_template": Refused("is not served: the model's own chat template renders every chat"),
    "chat_template_kwargs": Refused("is not served: the chat template takes no extra arguments", (None, {})),
}
_COMPLETION_ONLY_REFUSED = {
    "suffix": Refused("is not served: this server does not fill in the middle"),
    "add_special_tokens": Refused("is not served: a completion's prompt is tokenized as given", (None, True)),
    "echo": Refused("is not served", (None, False)),
}
CHAT = FieldTable(_OPENAI_NO_EFFECT, {**_OPENAI_REFUSED, **_CHAT_ONLY_REFUSED})
COMPLETIONS = FieldTable(_OPENAI_NO_EFFECT, {**_OPENAI_REFUSED, **_COMPLETION_ONLY_REFUSED})

RESPONSES = FieldTable(
    {
        "service_tier": _ONE_TIER,
        "safety_identifier": _NO_MONITORING,
        "reasoning": _NO_REASONING,
        "truncation": "changes nothing unless it must: an input longer than the context is a 400, as 'disabled'",
        "image": "changes nothing: this server takes no images",
        "access_programs": "changes nothing: there are no access programs on this server",
    },
    {
        "background": Refused("is not served: every response runs in the foreground", (None, False)),
        "background_options": Refused("is not served: every response runs in the foreground"),
        "conversation": Refused("is not served: chain responses with previous_response_id"),
        "max_tool_calls": Refused("is not served: only function calls exist here, and each is the client's"),
        "prompt": Refused("is not served: this server keeps no prompt templates"),
        "stream_options": Refused("is not served on /v1/responses"),
        "context_management": Refused("is not served: the server compacts no conversation"),
        "moderation": Refused("is not served: this server runs no moderation model"),
        "prompt_cache_options": Refused(
            "is not served yet (explicit breakpoints and TTLs); prompt_cache_retention and prompt_cache_key are"
        ),
    },
)

_ANTHROPIC_NO_EFFECT = {
    "service_tier": _ONE_TIER,
    "speed": "changes nothing: there is one speed",
    "inference_geo": "changes nothing: the server runs where it runs",
    "workspace_id": "changes nothing: there are no workspaces (tenant isolation keys on metadata.user_id)",
    "user_profile_id": "changes nothing: there are no user profiles (tenant isolation keys on metadata.user_id)",
    "betas": "changes nothing: the features served are served without a beta flag",
    "billing_policy": "changes nothing: nothing is billed",
    "thinking": "changes nothing: the served models do not think (no thinking blocks come back)",
    "context_management": "changes nothing: no tool results or thinking are cleared, the whole conversation is used",
}
_ANTHROPIC_REFUSED = {
    "container": Refused("is not served: this server runs no code containers"),
    "mcp_servers": Refused("is not served: this server connects to no MCP servers", (None, [])),
    "diagnostics": Refused("is not served yet; explain_cache_miss says why a prompt missed the cache"),
    "compaction": Refused("is not served: the server compacts no conversation"),
    "fallbacks": Refused("is not served: there is one model", (None, [])),
    "fallback_credit_token": Refused("is not served: there is one model"),
    "thread": Refused("is not served: send the conversation's messages"),
}
MESSAGES = FieldTable(_ANTHROPIC_NO_EFFECT, _ANTHROPIC_REFUSED)
_NO_FORMAT_TOKENS = "changes no count: a grammar holds the answer's format, which adds no prompt tokens here"
COUNT_TOKENS = FieldTable(
    {**_ANTHROPIC_NO_EFFECT, "output_config": _NO_FORMAT_TOKENS, "output_format": _NO_FORMAT_TOKENS},
    _ANTHROPIC_REFUSED,
)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)


GEMINI_REQUEST = FieldTable(
    {
        "safetySettings": "changes nothing: this server filters nothing (no safetyRatings come back)",
        "labels": "changes nothing: labels go with billing, and nothing is billed",
        "serviceTier": "changes nothing: there is one service tier",
        "store": "changes nothing: this server logs no requests",
    },
    {
        "modelArmorConfig": Refused("is not served: this server screens no prompts or answers"),
        "continuationToken": Refused("is not served: an answer never ends with finish reason CONTINUATION"),
        "generationOutputConfig": Refused("is not served: this server writes no output assets"),
    },
    _camel,
)
GEMINI_GENERATION_CONFIG = FieldTable(
    {
        "thinkingConfig": "changes nothing: the served models do not think (no thought parts come back)",
        "mediaResolution": "changes nothing: it applies to media inputs, which are a 400 here",
        "audioTimestamp": "changes nothing: it applies to audio inputs, which are a 400 here",
        "routingConfig": "changes nothing: there is one model to route to",
        "modelSelectionConfig": "changes nothing: there is one model to select",
        "enableEnhancedCivicAnswers": "changes nothing: this server has no civic-answer mode",
    },
    {
        "responseModalities": Refused(_TEXT_ONLY, (None, [], ["TEXT"], ["text"])),
        "speechConfig": Refused(_TEXT_ONLY),
        "imageConfig": Refused(_TEXT_ONLY),
        "audioTranscriptionConfig": Refused("is not served: this server takes no audio"),
    },
    _camel,
)


def markdown(tables: Mapping[str, tuple[type[BaseModel], FieldTable]]) -> str:
    """Each request body's honoured, no-effect and refused fields, as docs/server.md lists them."""
    lines = []
    for title, (model, table) in tables.items():
        honoured = sorted(f.alias or name for name, f in model.model_fields.items())
        lines += [f"**{title}**", "", f"- honoured: {', '.join(f'`{n}`' for n in honoured)}"]
        lines += [f"- `{name}` (no effect) {why}" for name, why in sorted(table.no_effect.items())]
        lines += [f"- `{name}` (refused) {r.why}" for name, r in sorted(table.refused.items())]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
