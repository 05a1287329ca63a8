"""Each API's way of asking for structured output, read into one StructuredOutputs (prefixkv/structured_outputs.py).

- OpenAI Chat Completions and Completions: `response_format` {"type": "text" | "json_object" | "json_schema",
  "json_schema": {"name", "schema", "strict"}}; vLLM's `structured_outputs` {json, regex, choice, grammar,
  json_object}. vLLM's removed `guided_*` fields are a 400 naming the replacement.
- OpenAI Responses: `text.format` {"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}.
- Anthropic Messages: `output_config.format` (or the beta's `output_format`) {"type": "json_schema", "schema"}.
- Gemini: generationConfig `responseJsonSchema` (JSON Schema), `responseSchema` (its OpenAPI subset: type names
  in capitals, read as JSON Schema), `responseMimeType` "application/json" alone: any JSON object.
`strict: false` is enforced all the same: a grammar either holds or is not asked for (the answer always parses).
"""

from __future__ import annotations

from typing import Any

from prefixkv.server.errors import APIError
from prefixkv.structured_outputs import KINDS, StructuredOutputs

# vLLM's guided decoding fields, removed in favour of structured_outputs (vLLM 0.11): field -> its replacement
REMOVED_GUIDED = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_decoding_backend": "structured_outputs (the server's grammar engine is llguidance)",
    "guided_whitespace_pattern": "structured_outputs (JSON is compiled without free whitespace)",
}


def _bad(message: str, param: str) -> APIError:
    return APIError(message, param=param, code="invalid_value")


def _structured(param: str, **kwargs: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**kwargs)
    except ValueError as exc:
        raise _bad(f"{param}: {exc}", param) from None


def _schema(value: Any, param: str) -> StructuredOutputs:
    if not isinstance(value, dict):
        raise _bad(f"{param} must be a JSON Schema object", param)
    return _structured(param, json=value)


def from_openai(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
) -> StructuredOutputs | None:
    """Chat Completions' and Completions' fields (at most one of the two)."""
    if response_format is not None and structured_outputs is not None:
        raise _bad("give response_format or structured_outputs, not both", "structured_outputs")
    if structured_outputs is not None:
        unknown = sorted(set(structured_outputs) - set(KINDS))
        if unknown:
            raise _bad(f"structured_outputs: unknown field(s) {', '.join(unknown)}", "structured_outputs")
        return _structured("structured_outputs", **structured_outputs)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format.json_schema must be an object with a schema", "response_format")
        return _schema(spec.get("schema", {"type": "object"}), "response_format.json_schema.schema")
    raise _bad(f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format")


def from_responses_text(text: dict[str, Any] | None) -> StructuredOutputs | None:
    """Responses' text.format."""
    if text is None:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise _bad(f"text: unknown field(s) {', '.join(unknown)}", "text")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt.get("type") == "json_schema":
        return _schema(fmt.get("schema"), "text.format.schema")
    raise _bad(f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}", "text.format")


def from_anthropic(
    output_config: dict[str, Any] | None, output_format: dict[str, Any] | None
) -> StructuredOutputs | None:
    """Messages' output_config.format (output_config.effort has no effect on this server's models: accepted), or
    the structured-outputs beta's output_format."""
    if output_config is not None:
        unknown = sorted(set(output_config) - {"format", "effort"})
        if unknown:
            raise _bad(f"output_config: unknown field(s) {', '.join(unknown)}", "output_config")
        if output_format is not None and output_config.get("format") is not None:
            raise _bad("give output_config.format or output_format, not both", "output_format")
        output_format = output_config.get("format") or output_format
    if output_format is None:
        return None
    if output_format.get("type") != "json_schema":
        raise _bad(f"output_format.type must be json_schema, got {output_format.get('type')!r}", "output_format")
    return _schema(output_format.get("schema"), "output_format.schema")


def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


_INT64_KEYWORDS = {"maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties"}


def openapi_to_json_schema(schema: Any) -> Any:
    """Gemini's responseSchema (OpenAPI 3.0 subset: "OBJECT", "STRING", nullable, ...) as JSON Schema."""
    if isinstance(schema, list):
        return [openapi_to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        key = _camel(key)  # google-genai sends the schema's own keywords snake_case (max_length, any_of)
        if key == "type" and isinstance(value, str):
            out["type"] = value.lower()
        elif key in ("properties",) and isinstance(value, dict):
            out[key] = {name: openapi_to_json_schema(v) for name, v in value.items()}
        elif key in ("items", "anyOf"):
            out[key] = openapi_to_json_schema(value)
        elif key == "propertyOrdering":
            continue  # the grammar keeps the properties' order as given
        elif key == "nullable":
            continue
        elif key in _INT64_KEYWORDS and isinstance(value, str) and value.isdigit():
            out[key] = int(value)  # protobuf JSON writes int64 as a string (google-genai sends "20")
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("additionalProperties", False)  # the subset has no extra properties: only those declared
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def from_gemini(mime: str | None, openapi: Any, json_schema: Any) -> StructuredOutputs | None:
    """generationConfig's responseMimeType, responseSchema and responseJsonSchema."""
    mime = mime or "text/plain"
    if json_schema is not None and openapi is not None:
        raise APIError(
            "give responseSchema or responseJsonSchema, not both", param="generationConfig", code="invalid_value"
        )
    if (json_schema is not None or openapi is not None) and mime != "application/json":
        raise APIError(
            "responseSchema and responseJsonSchema need responseMimeType application/json",
            param="generationConfig.responseMimeType",
            code="invalid_value",
        )
    if json_schema is not None:
        return _schema(json_schema, "generationConfig.responseJsonSchema")
    if openapi is not None:
        return _schema(openapi_to_json_schema(openapi), "generationConfig.responseSchema")
    if mime == "application/json":
        return StructuredOutputs(json_object=True)
    if mime not in ("text/plain", "text/x.enum"):
        raise APIError(
            f"responseMimeType {mime!r} is not supported (text/plain or application/json)",
            param="generationConfig.responseMimeType",
            code="invalid_value",
        )
    return None
