"""JSON errors with an HTTP status that says whose fault it was, in one shape for every error.

Body: {"error": {"message", "type", "param", "code"}, "object": "error", "message"} — the
`error` object is what OpenAI clients read; the top-level `message` is what SGLang clients read.
`install_error_handlers` gives FastAPI's and Starlette's own errors (404, 405, body parsing,
validation, unhandled exceptions) the same shape.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridmoe.engine.request import SamplingParams

log = logging.getLogger(__name__)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 408: "RequestTimeoutError", 409: "ConflictError",
          413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError", 422: "UnprocessableEntityError",
          429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
# pydantic error types whose message is complete (it names its field); see strict.py
_SELF_CONTAINED = frozenset({"not_implemented", "invalid_unicode", "bad_request"})


class APIError(Exception):
    """Raise from a route to answer with this status and message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def _printable(message: str) -> str:
    """A message that encodes as UTF-8 whatever user text it quotes (lone surrogates escaped)."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


# ---------------------------------------------------------------- the engine's field names -> a route's `param`

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class ParamNames:
    """How one route (and one prompt of a batch) names the engine's fields in an error's `param`: the native
    routes by their own paths (`text`, `input_ids.3`, `sampling_params.top_k`), the OpenAI routes by OpenAI's
    names (`prompt`, `messages`, `max_tokens`, `logprobs`, `response_format`)."""

    prompt: str  # the field holding the prompt (the engine's input_ids)
    sampling: str = ""  # prefix of a sampling parameter's name ("sampling_params." natively)
    renames: Mapping[str, str] = field(default_factory=dict)  # engine field -> this route's name

    def __call__(self, name: str | None) -> str | None:
        if name is None:
            return None
        if name in self.renames:
            return self.renames[name]
        if name == "input_ids":
            return self.prompt
        return self.sampling + name if name in SAMPLING_FIELDS else name

    def error(self, e: Exception) -> APIError:
        """APIError(400) for an engine RequestError, naming the field its message is about: in `param`, and in the
        message where the route spells it otherwise (`min_tokens=5 is invalid`, `prompt.1: input_ids must be...`)."""
        message, name = str(e), getattr(e, "field", None)  # the engine's RequestError names its field
        param = self(name)
        if name in SAMPLING_FIELDS and name in self.renames and message.startswith(name):
            message = self.renames[name] + message[len(name):]
        elif name == "input_ids" and param != name:
            message = f"{param}: {message}"
        return APIError(400, message, param=param)


NATIVE_TEXT = ParamNames("text", "sampling_params.")


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    err_type = _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    message = _printable(message)
    return {"object": "error", "message": message,
            "error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def path_part(x: object) -> str:
    """One step of a field path: a name or index as is; any other key (a client's) quoted, shortened."""
    if isinstance(x, int) or (isinstance(x, str) and x.isidentifier()):
        return str(x)
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _where(loc: tuple | list) -> str:
    """A pydantic error location as a dotted path; the body itself and the union branch tags of
    strict.py (`<one>`, `<list>`, ...) are left out."""
    parts = [x for i, x in enumerate(loc) if not (i == 0 and x == "body")]
    return ".".join(path_part(x) for x in parts if not (isinstance(x, str) and x.startswith("<") and x.endswith(">")))


def _param(error: dict[str, Any]) -> str | None:
    """The field an error is about (OpenAI's `param`)."""
    if error.get("type") == "json_invalid":  # its loc is ("body", byte offset): no field (was param "9")
        return None
    name = (error.get("ctx") or {}).get("name")
    parts = [p for p in (_where(error.get("loc", ())), name if isinstance(name, str) else None) if p]
    return ".".join(parts) or None


def format_validation_errors(errors: list[dict[str, Any]]) -> str:
    """pydantic/FastAPI errors -> one line naming each bad field."""
    parts = []
    for e in errors:
        kind = e.get("type")
        if kind == "json_invalid":
            parts.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
            continue
        where, msg = _where(e.get("loc", ())), str(e.get("msg"))
        if kind in _SELF_CONTAINED:
            parts.append(f"{where}.{msg}" if where and kind == "not_implemented" else
                         f"{where}: {msg}" if where else msg)
        elif kind == "extra_forbidden":
            parts.append(f"{where}: unknown field (not part of this API; check the spelling)")
        else:
            parts.append(f"{where or 'body'}: {msg}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request"


def _http_message(request: Request, e: StarletteHTTPException) -> str:
    method, path = request.method, request.url.path
    if e.status_code == 404:
        return f"no route {method} {path}; see /docs for the API"
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow") or (e.headers or {}).get("allow")
        return f"{method} is not allowed on {path}" + (f"; use {allowed}" if allowed else "")
    return str(e.detail)


def install_error_handlers(app: FastAPI) -> None:
    """APIError, FastAPI's validation and HTTP errors and unhandled exceptions -> the error shape.

    Validation errors are 400 (FastAPI's default 422 is not what OpenAI or SGLang clients expect).
    """

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = list(e.errors())
        message = format_validation_errors(errors)
        content_type = request.headers.get("content-type", "")
        if content_type and "json" not in content_type:
            message = f"send the body as JSON with 'Content-Type: application/json' (got {content_type!r}); {message}"
        return error_response(400, message, param=_param(errors[0]) if errors else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, _http_message(request, e), headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")
