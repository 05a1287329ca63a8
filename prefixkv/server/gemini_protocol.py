"""Request bodies of Google's Gemini API (generateContent, countTokens, cachedContents) and their contents as the
chat messages the model's template renders.

Field names are Gemini's JSON (camelCase, what google-genai sends); snake_case is accepted too, as Google's
protobuf JSON parser does. A content is a role ("user", or "model", which becomes "assistant") and text parts,
joined, with functionCall and functionResponse parts and the function declarations written in as
gemini_tools.py says; a systemInstruction becomes a system message first. Other part kinds (inline data, files,
executable code) are 400s that say so.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from prefixkv.sampling_params import SamplingParams
from prefixkv.server.errors import APIError, from_value_error
from prefixkv.server.gemini_tools import ToolSpec, part_text, read_tools
from prefixkv.server.protocol import MAX_CACHED_CONTENT_CHARS, MAX_LOGPROBS
from prefixkv.server.request_fields import GEMINI_GENERATION_CONFIG, GEMINI_REQUEST, TableFields
from prefixkv.server.structured import from_gemini
from prefixkv.tools.grammar import tool_constraint
from prefixkv.tools.prompt import render_messages

MODEL_PREFIX = "models/"
MAX_STOP_SEQUENCES = 5  # Gemini's cap
INT32_MAX = 2**31 - 1  # topK, seed and counts are int32 in Gemini's protos
_ROLES = {"user": "user", "model": "assistant"}
_PART_METADATA = {"thoughtSignature", "thought_signature", "partMetadata", "part_metadata"}  # ride along with text
_CONFIG = ConfigDict(
    extra="forbid",
    strict=True,
    allow_inf_nan=False,
    alias_generator=to_camel,
    validate_by_name=True,
    validate_by_alias=True,
)


def model_name(model: str) -> str:
    """ "models/NAME" or "NAME" -> NAME (the URL and the bodies may carry either)."""
    return model[len(MODEL_PREFIX) :] if model.startswith(MODEL_PREFIX) else model


class Part(BaseModel):
    """A text part. Other kinds stay in model_extra, so the 400 can name the one that came."""

    model_config = ConfigDict(**{**_CONFIG, "extra": "allow"})
    text: str | None = None
    thought: bool | None = None  # a thought summary the model wrote: not sent back to the template


class Content(BaseModel):
    model_config = _CONFIG
    role: str | None = Field(None, max_length=32, description="'user' (the default) or 'model'")
    parts: list[Part] = Field(min_length=1)


class GenerationConfig(TableFields):
    model_config = _CONFIG
    FIELDS = GEMINI_GENERATION_CONFIG
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: float | None = Field(None, ge=1, le=INT32_MAX, description="an integer (google-genai sends 5.0)")
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    candidate_count: int | None = Field(None, ge=1, le=INT32_MAX, description="1: one candidate per request")
    seed: int | None = Field(None, ge=-(2**31), le=INT32_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    response_mime_type: str | None = Field(None, max_length=128, description="text/plain or application/json")
    response_schema: dict[str, Any] | None = None
    response_json_schema: Any = None
    response_logprobs: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives per token; responseLogprobs")


class GenerateContentRequest(TableFields):
    model_config = _CONFIG
    FIELDS = GEMINI_REQUEST
    model: str | None = Field(None, max_length=256, description="ignored: the URL names the model")
    contents: list[Content] = Field(min_length=1)
    system_instruction: Content | None = None
    generation_config: GenerationConfig | None = None
    cached_content: str | None = Field(None, max_length=MAX_CACHED_CONTENT_CHARS, description="cachedContents/ID")
    tools: list[dict[str, Any]] | None = None
    tool_config: dict[str, Any] | None = None

    @cached_property
    def tool_spec(self) -> ToolSpec:
        return read_tools(self.tools, self.tool_config)

    @property
    def reads_calls(self) -> bool:
        return self.tool_spec.choice.reads_calls(self.tool_spec.tools)

    def messages(self) -> list[dict[str, str]]:
        """The chat messages to template (the function declarations written in); 400 for what this server
        cannot render."""
        return render_messages(chat_messages(self.contents, self.system_instruction), self.tool_spec.tools)

    @property
    def logprobs(self) -> int | None:
        """The alternatives per token when responseLogprobs asks for logprobs (None: not asked); as Gemini's,
        logprobs without responseLogprobs is a 400."""
        config = self.generation_config
        if config is None or not config.response_logprobs:
            if config is not None and config.logprobs is not None:
                raise APIError("generationConfig.logprobs needs generationConfig.responseLogprobs to be true")
            return None
        return config.logprobs or 0

    def sampling_params(self) -> SamplingParams:
        """Gemini's knobs; without maxOutputTokens the answer may run to the end of the context (as chat's)."""
        config = self.generation_config or GenerationConfig.model_validate({})
        logprobs = self.logprobs
        if config.candidate_count not in (None, 1):
            raise APIError(f"candidateCount must be 1 on this server, got {config.candidate_count}")
        constraint = from_gemini(config.response_mime_type, config.response_schema, config.response_json_schema)
        try:
            constraint = tool_constraint(self.tool_spec.allowed, self.tool_spec.choice, constraint)
        except ValueError as exc:
            raise APIError(str(exc), param="tools") from None
        if config.top_k is not None and not config.top_k.is_integer():
            raise APIError(f"generationConfig.topK must be an integer, got {config.top_k}")
        try:
            return SamplingParams(
                max_tokens=config.max_output_tokens,
                temperature=1.0 if config.temperature is None else config.temperature,
                top_p=1.0 if config.top_p is None else config.top_p,
                top_k=-1 if config.top_k is None else int(config.top_k),
                seed=config.seed,
                stop=config.stop_sequences,
                logprobs=logprobs,
                structured_outputs=constraint,
                presence_penalty=config.presence_penalty or 0.0,
                frequency_penalty=config.frequency_penalty or 0.0,
            )
        except ValueError as exc:
            raise from_value_error(exc) from None


class CountTokensRequest(BaseModel):
    """countTokens: `contents`, or a whole `generateContentRequest` (then its systemInstruction and cachedContent
    count too), not both."""

    model_config = _CONFIG
    contents: list[Content] | None = Field(None, min_length=1)
    generate_content_request: GenerateContentRequest | None = None

    def request(self) -> GenerateContentRequest:
        if (self.contents is None) == (self.generate_content_request is None):
            raise APIError("give exactly one of 'contents' and 'generateContentRequest'")
        if self.generate_content_request is not None:
            return self.generate_content_request
        assert self.contents is not None
        return GenerateContentRequest.model_validate({"contents": self.contents})


class CreateCachedContentRequest(BaseModel):
    model_config = _CONFIG
    model: str = Field(max_length=256, description="'models/NAME' (or NAME)")
    contents: list[Content] | None = None
    system_instruction: Content | None = None
    ttl: str | None = Field(None, max_length=64, description="a duration, '300s'; not with expireTime")
    expire_time: str | None = Field(None, max_length=64, description="RFC 3339 with a zone; not with ttl")
    display_name: str | None = Field(None, max_length=128)
    tools: list[dict[str, Any]] | None = None
    tool_config: dict[str, Any] | None = None

    def messages(self) -> list[dict[str, str]]:
        """The entry's messages, its function declarations written in (a request on it inherits them)."""
        tools = read_tools(self.tools, self.tool_config).tools
        messages = render_messages(chat_messages(self.contents or [], self.system_instruction), tools)
        if not messages:
            raise APIError("a cached content needs contents or a systemInstruction")
        return messages


class UpdateCachedContentRequest(BaseModel):
    """PATCH: only the expiry changes (as on Gemini); the rest of the resource may come along and is ignored
    (Gemini's clients send the whole resource with an update mask)."""

    model_config = ConfigDict(**{**_CONFIG, "extra": "ignore"})
    ttl: str | None = Field(None, max_length=64, description="a duration, '300s'; exactly one of ttl, expireTime")
    expire_time: str | None = Field(None, max_length=64, description="RFC 3339 with a zone")


def chat_messages(contents: list[Content], system_instruction: Content | None) -> list[dict[str, str]]:
    """Gemini contents as {role, content} chat messages: the system instruction first, "model" as "assistant"."""
    out = []
    if system_instruction is not None:
        out.append({"role": "system", "content": _text(system_instruction.parts, "systemInstruction")})
    for i, content in enumerate(contents):
        role = content.role or "user"
        if role not in _ROLES:
            raise APIError(f"contents[{i}].role must be 'user' or 'model', got {role!r}")
        out.append({"role": _ROLES[role], "content": _text(content.parts, f"contents[{i}]")})
    return out


def _text(parts: list[Part], where: str) -> str:
    text = ""
    after_result = False
    for j, part in enumerate(parts):
        extra = {k: v for k, v in (part.model_extra or {}).items() if v is not None and k not in _PART_METADATA}
        function_text = part_text(extra, f"{where}.parts[{j}]", text) if extra else None
        if function_text is not None:
            text += function_text
            after_result = "functionResponse" in extra or "function_response" in extra
            continue
        if extra:
            raise APIError(
                f"{where}.parts[{j}]: only text, functionCall and functionResponse parts are supported, "
                f"got {next(iter(extra))!r}"
            )
        if part.text is None:
            raise APIError(f"{where}.parts[{j}] has no text")
        if not part.thought:
            text += ("\n" if after_result else "") + part.text
            after_result = False
    return text
