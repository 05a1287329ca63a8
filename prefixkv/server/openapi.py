"""/openapi.json as the server really answers, so a client (or a schema fuzzer) is told every rule it can be.

FastAPI's generated schema declares a 422 the server never sends (errors.py turns validation errors into a 400
in the API's shape: OpenAI's, Anthropic's under /v1/messages, Google's on the Gemini routes), knows nothing of the API
key's 401, the unknown model's 404 or the body limit's 413, and cannot see the caps that are server options (n,
prompts per request). This fills those in from the running server.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from prefixkv.server.errors import is_gemini_path

ERROR_SCHEMA = "ErrorResponse"
_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
_ERROR_BODY = {
    "type": "object",
    "description": "OpenAI's error body: every non-2xx answer of this server has this shape",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STRING,
                "code": _NULLABLE_STRING,
            },
        }
    },
}
ANTHROPIC_ERROR_SCHEMA = "AnthropicErrorResponse"
_ANTHROPIC_ERROR_BODY = {
    "type": "object",
    "description": "Anthropic's error body: every non-2xx answer of /v1/messages and its sub-routes has this shape",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
GEMINI_ERROR_SCHEMA = "GeminiErrorResponse"
_GEMINI_ERROR_BODY = {
    "type": "object",
    "description": "Google's error body: every non-2xx answer of the Gemini API (under /v1beta, and its model "
    "methods under /v1) has this shape",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "status"],
            "properties": {"code": {"type": "integer"}, "message": {"type": "string"}, "status": {"type": "string"}},
        }
    },
}
_WHY = {
    400: "Invalid request: the message names the field (`param`)",
    401: "Missing or invalid API key",
    403: "The endpoint needs an admin API key",
    404: "Unknown model",
    413: "Request body too large",
}
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
_ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # errors in Anthropic's shape
_GEMINI_STREAM_PATHS = ("/v1beta/models/{model}:streamGenerateContent", "/v1/models/{model}:streamGenerateContent")
_GEMINI_MODEL_PATHS = (  # the model is in the path: another one is a 404
    "/v1beta/models/{model}:generateContent",
    "/v1beta/models/{model}:countTokens",
    "/v1/models/{model}:generateContent",
    "/v1/models/{model}:countTokens",
    *_GEMINI_STREAM_PATHS,
    "/v1beta/models/{model}",
)
_MODEL_PATHS = (
    *_GENERATION_PATHS,
    "/v1/messages/count_tokens",
    "/v1/cache/prewarm",
    "/tokenize",
    "/detokenize",
    *_GEMINI_MODEL_PATHS,
)
# what ChatCompletionRequest.template_messages accepts (the model keeps it a plain dict, so a bad message
# gets that method's 400 naming messages[i])
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    },
                },
            ]
        },
    },
}
# one server-sent event (stream: true): a JSON chunk, an error body, or [DONE], in `data`
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}},
    "description": "one server-sent event of a streamed answer",
}
_TEXT_PATHS = {"/metrics": "text/plain", "/cache/tree": "text/plain"}


def install_openapi(app: FastAPI, state: Any) -> None:
    """Replace app.openapi with one that builds the schema once and declares what this server answers."""
    from prefixkv.server.admin import admin_only, public

    public_paths = {getattr(route, "path", "") for route in public.routes}
    admin_paths = {getattr(route, "path", "") for route in admin_only.routes}

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _declare_errors(schema, public_paths, admin_paths, state.keys is not None)
            _declare_limits(schema, state)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _error_response(status: int, path: str = "") -> dict:
    name = ANTHROPIC_ERROR_SCHEMA if path in _ANTHROPIC_PATHS else ERROR_SCHEMA
    if is_gemini_path(path):
        name = GEMINI_ERROR_SCHEMA
    return {
        "description": _WHY[status],
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }


def _declare_errors(schema: dict, public_paths: set[str], admin_paths: set[str], api_key: bool) -> None:
    if api_key:
        schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components[ERROR_SCHEMA] = _ERROR_BODY
    components[ANTHROPIC_ERROR_SCHEMA] = _ANTHROPIC_ERROR_BODY
    components[GEMINI_ERROR_SCHEMA] = _GEMINI_ERROR_BODY
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            if responses.pop("422", None) is not None or path in (*_GENERATION_PATHS, *_GEMINI_MODEL_PATHS):
                responses["400"] = _error_response(400, path)
            if method in ("post", "put", "patch"):
                responses["413"] = _error_response(413, path)
            if path not in public_paths:
                responses["401"] = _error_response(401, path)
                if api_key:
                    op["security"] = [{"bearer": []}]
            if path in admin_paths:
                responses["403"] = _error_response(403, path)
            if path in _TEXT_PATHS:  # answered as text, not JSON
                responses["200"]["content"] = {_TEXT_PATHS[path]: {"schema": {"type": "string"}}}
            if path in _MODEL_PATHS:
                responses["404"] = _error_response(404, path)
            if path == "/v1/responses/{response_id}":
                responses["404"] = {**_error_response(404, path), "description": "No stored response of that id"}
            if path in ("/v1/caches", "/v1beta/cachedContents") and method == "post":
                responses["404"] = _error_response(404, path)  # an unknown model
            if path in ("/v1/caches/{cache_id}", "/v1beta/cachedContents/{cache_id}"):
                responses["404"] = {**_error_response(404, path), "description": "No cache entry of that id visible"}
            if path in (*_GENERATION_PATHS, *_GEMINI_STREAM_PATHS):
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {}).setdefault("text/event-stream", {"schema": _SSE_EVENT})


def _declare_limits(schema: dict, state: Any) -> None:
    """The caps that are server options, and the token-id range the engine enforces."""
    components = schema.get("components", {}).get("schemas", {})
    for path in _GEMINI_MODEL_PATHS:  # the model in the path: any other name is a 404
        for op in schema.get("paths", {}).get(path, {}).values():
            for param in op.get("parameters", []):
                if param.get("name") == "model":
                    param["schema"]["enum"] = [state.served_model_name]
    gemini_model = components.get("CreateCachedContentRequest", {}).get("properties", {}).get("model")
    if gemini_model is not None:
        gemini_model["enum"] = [state.served_model_name, "models/" + state.served_model_name]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components.get(name, {}).get("properties", {})
        if "n" in props:
            props["n"]["maximum"] = state.max_n
        for variant in props.get("model", {}).get("anyOf", []):  # any other name is a 404
            if variant.get("type") == "string":
                variant["enum"] = [state.served_model_name]
    # a required model: any other name is a 404 (FastAPI qualifies CountTokensRequest: Gemini's has that name too)
    for name in ("MessagesRequest", "prefixkv__server__messages_protocol__CountTokensRequest"):
        model = components.get(name, {}).get("properties", {}).get("model")
        if model is not None:
            model["enum"] = [state.served_model_name]
    for name in ("ResponsesRequest", "CreateCacheRequest"):
        for variant in components.get(name, {}).get("properties", {}).get("model", {}).get("anyOf", []):
            if variant.get("type") == "string":
                variant["enum"] = [state.served_model_name]
    cache_props = components.get("CreateCacheRequest", {}).get("properties", {})
    for variant in cache_props.get("messages", {}).get("anyOf", []):  # a /v1/caches entry of chat messages
        if variant.get("type") == "array":
            variant["items"] = _MESSAGE
    for variant in cache_props.get("prompt", {}).get("anyOf", []):  # a /v1/caches entry of a prompt
        if variant.get("type") == "string":
            variant["minLength"] = 1
        elif variant.get("type") == "array":
            variant["minItems"] = 1
            variant["maxItems"] = max(1, state.max_model_len - 1)
    messages = components.get("ChatCompletionRequest", {}).get("properties", {}).get("messages")
    if messages is not None:
        messages["items"] = _MESSAGE
    prompt = components.get("CompletionRequest", {}).get("properties", {}).get("prompt")
    if prompt is None:
        return
    for variant in prompt.get("anyOf", []):
        if variant.get("type") == "string":
            variant["minLength"] = 1
        elif variant.get("type") == "array":
            _bound_prompt_list(variant, state)


def _bound_prompt_list(variant: dict, state: Any) -> None:
    items = variant.get("items", {})
    variant["minItems"] = 1
    if items.get("type") == "integer":  # one prompt as token ids: shorter than the context
        items["minimum"] = 0
        variant["maxItems"] = max(1, state.max_model_len - 1)
        return
    variant["maxItems"] = state.max_prompts_per_request  # a list of prompts
    for inner in items.get("anyOf", []):
        if inner.get("type") == "string":
            inner["minLength"] = 1
        elif inner.get("type") == "array":
            inner["minItems"] = 1
            inner["maxItems"] = max(1, state.max_model_len - 1)
            inner.setdefault("items", {})["minimum"] = 0
