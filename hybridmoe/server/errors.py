"""JSON errors with an HTTP status that says whose fault it was, in the OpenAI error shape.

Body: {"error": {"message", "type", "param", "code"}, "object": "error", "message"} — the
`error` object is what OpenAI clients read; the top-level `message` is what SGLang clients read.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """Raise from a route to answer with this status and message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    err_type = _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"object": "error", "message": message,
            "error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def format_validation_errors(errors: list[dict[str, Any]]) -> str:
    """pydantic/FastAPI errors -> one line naming each bad field."""
    parts = []
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
            continue
        where = ".".join(loc) or "body"
        parts.append(f"{where}: {e.get('msg')}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request"
