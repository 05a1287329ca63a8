"""Every failure leaves the server as an error in its API's shape, so each SDK raises the right exception.

OpenAI's shape: {"error": {"message", "type", "param", "code"}}; Anthropic's, on /v1/messages:
{"type": "error", "error": {"type", "message"}}; Google's, under /v1beta and on Gemini's model methods under /v1
(its SDK reads code and status): {"error": {"code", "message", "status"}}. The path picks the shape (body_for).
FastAPI's own 422 for body validation is replaced by a 400 naming the offending field, as OpenAI, Anthropic,
Google and vLLM answer.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixkv.server.async_engine import EngineDeadError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_error",
    500: "server_error",
}


# Anthropic's error types by status (its SDK maps the status to an exception class; the type names the cause)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"  # the routes that answer in Anthropic's shape (and those under it)

# Google's canonical status names by HTTP status (google.rpc.Code), as the Gemini API writes them
_GEMINI_STATUSES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    500: "INTERNAL",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
GEMINI_PATH = "/v1beta/"  # every route under it answers in Gemini's shape
# Gemini's v1 routes share /v1 with OpenAI's: only the model methods served there (gemini.py) are Gemini's
GEMINI_V1_METHODS = re.compile(r"/v1/models/[^/]+:(?:generateContent|streamGenerateContent|countTokens)")


class APIError(Exception):
    """Raised anywhere in a handler; becomes the JSON error response with its status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"), "message": self.message},
        }

    def gemini_body(self) -> dict:
        status = _GEMINI_STATUSES.get(self.status, "INTERNAL" if self.status >= 500 else "FAILED_PRECONDITION")
        return {"error": {"code": self.status, "message": self.message, "status": status}}

    def body_for(self, path: str) -> dict:
        """The body in the shape of the API that `path` belongs to."""
        if is_gemini_path(path):
            return self.gemini_body()
        if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
            return self.anthropic_body()
        return self.body()

    def response(self, anthropic: bool = False) -> JSONResponse:
        return self._response(self.anthropic_body() if anthropic else self.body())

    def response_for(self, request: Request) -> JSONResponse:
        """In the shape of the API `request` called."""
        return self._response(self.body_for(request.url.path))

    def _response(self, body: dict) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


def is_gemini_path(path: str) -> bool:
    """A Gemini route's path (a route template, `{model}`, matches too)."""
    return path.startswith(GEMINI_PATH) or GEMINI_V1_METHODS.fullmatch(path) is not None


def is_anthropic(request: Request) -> bool:
    path = request.url.path
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


_PARAMS = {
    "prompt",
    "prompt_cache_key",
    "prompt_cache_retention",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "priority",
    "cache_salt",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
}


def from_value_error(exc: ValueError) -> APIError:
    """Engine and SamplingParams messages name the field ("temperature must be >= 0", "the prompt has ...")."""
    message = str(exc) or "invalid request"
    words = re.findall(r"[A-Za-z_]+", message)
    param = next((w for w in words if w in _PARAMS), None)
    return APIError(message, status=400, param=param, code="invalid_value")


# pydantic error types for a value of the right type outside its range (NaN and infinities included)
_OUT_OF_RANGE = {
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "finite_number",
    "too_short",
    "too_long",
    "string_too_short",
    "string_too_long",
}


def unknown_field(name: str, path: str) -> APIError:
    """A field the API does not know, refused in that API's own words (the SDKs and users know them)."""
    if is_gemini_path(path):
        message = f'Invalid JSON payload received. Unknown name "{name}": Cannot find field.'
    elif path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        message = f"{name}: Extra inputs are not permitted"
    elif path.startswith("/v1/responses"):
        message = f"Unknown parameter: '{name}'."
    else:
        message = f"Unrecognized request argument supplied: {name}"
    return APIError(message, param=name, code="unknown_parameter")


def from_validation_error(exc: RequestValidationError, path: str = "") -> APIError:
    """Turn pydantic's first complaint into one readable sentence that names the field (path: the route, which
    picks the API's wording for an unknown field)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    err = errors[0]
    kind = err.get("type", "")
    loc = [str(p) for p in err.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):  # where it was, not what it was
        loc = loc[1:]
    param = loc[0] if loc else None
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(f"Malformed JSON body: {detail}".rstrip(": "), param=None, code="invalid_json")
    if not loc:
        return APIError("Request body must be a JSON object", code="invalid_body")
    if kind == "extra_forbidden":
        return unknown_field(".".join(loc), path)
    if kind == "missing":
        return APIError(f"Missing required field '{param}'", param=param, code="missing_field")
    if sum(1 for e in errors if tuple(e.get("loc", ()))[1:2] == (param,)) > 1:  # no member of a union fits
        return APIError(
            f"Invalid value for '{param}': it matches none of the accepted types", param=param, code="invalid_type"
        )
    code = "invalid_value" if kind in _OUT_OF_RANGE else "invalid_type"
    return APIError(f"Invalid value for '{'.'.join(loc)}': {err.get('msg', 'invalid')}", param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response_for(request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc, request.url.path).response_for(request)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return from_value_error(exc).response_for(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(str(exc.detail), status=exc.status_code).response_for(request)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return APIError(str(exc), status=503, code="engine_dead").response_for(request)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return APIError(f"Internal server error: {type(exc).__name__}: {exc}", status=500).response_for(request)
