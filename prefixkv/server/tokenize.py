"""POST /tokenize and /detokenize, as vLLM's server has them: clients count a prompt's tokens before they send it
and look up the ids that `logit_bias` takes.

/tokenize takes a `prompt` (encoded as /v1/completions encodes it) or chat `messages` with optional `tools`
(rendered as /v1/chat/completions renders them, so `count` is the prompt_tokens that route would report), and
answers {count, max_model_len, tokens, token_strs}. `add_special_tokens` (default true) is honoured for a
prompt; with messages the chat template writes the special tokens, so it has no effect there. /detokenize takes
`tokens` and answers {prompt}. A prompt longer than the context is refused with the same 400 the generating
routes give, as vLLM refuses it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, model_validator

from prefixkv.server.errors import APIError
from prefixkv.server.openai_tools import read_tools
from prefixkv.server.protocol import template_messages
from prefixkv.server.request_fields import FieldTable, Refused, TableFields
from prefixkv.server.state import server_state

router = APIRouter()

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_TEMPLATE_ONLY = Refused("is not served: the model's own chat template renders every chat", (None, {}))

TOKENIZE = FieldTable(
    refused={
        "chat_template": _TEMPLATE_ONLY,
        "chat_template_kwargs": _TEMPLATE_ONLY,
        "mm_processor_kwargs": Refused("is not served: prompts are text only", (None, {})),
        "continue_final_message": Refused(
            "is not served: a chat prompt ends with the generation prompt or the last message's end of turn",
            (None, False),
        ),
    }
)
DETOKENIZE = FieldTable()


class TokenizeRequest(TableFields):
    FIELDS = TOKENIZE
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt", code="invalid_value")
        if self.tools is not None and self.messages is None:
            raise APIError("tools are rendered into chat messages: give messages", param="tools", code="invalid_value")
        return self


class DetokenizeRequest(TableFields):
    FIELDS = DETOKENIZE
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> dict:
    state = server_state(raw)
    state.check_model(body.model)  # an omitted model is the served one
    if body.messages is not None:
        tools, _ = read_tools(body.tools, None, None)
        ids = await state.tokenize_chat(template_messages(body.messages, tools), body.add_generation_prompt)
    else:
        assert body.prompt is not None
        ids = await state.encode(body.prompt, body.add_special_tokens)
    token_strs = state.tokenizer.token_strings(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": token_strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> dict:
    state = server_state(raw)
    state.check_model(body.model)  # an omitted model is the served one
    vocab = state.tokenizer.vocab_size
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab:
            raise APIError(
                f"tokens[{i}] = {t} is not a token id (0 to {vocab - 1})", param="tokens", code="invalid_value"
            )
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}
