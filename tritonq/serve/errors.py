"""The one mapping of exceptions to HTTP statuses (STATUSES), answered with the OpenAI error body {"error":
{message, type, param, code}} (protocol.APIError): whatever a route, the engine loop or the engine raises on a
request's way in or out is answered here, by type, and a streamed reply's error chunk uses the same mapping
(`api_error`). An APIError carries its own status (the routes' own checks, naming the field); pydantic validation
errors become a 400 naming the field, the value and what is allowed; Starlette's (404 route, 405 method) keep
their status; anything else is a 500 naming it, and the server goes on.

ValueError and TypeError are the caller's: every check of a request (GenerationConfig, Engine.check_request /
check_score) raises one of them, naming the value and what to change.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tritonq.engine.engine import EngineDeadError
from tritonq.engine.sequence import RequestTooLong
from tritonq.serve.engine_loop import EngineUnavailable, QueueFull, StepFailed
from tritonq.serve.protocol import APIError
from tritonq.engine.structured import GrammarError

RETRY_AFTER_S = 1  # the Retry-After of a 429: a waiting request usually starts within a second


class ClientGone(Exception):
    """The client disconnected before its reply (499, nginx's status: nobody reads it)."""


# (exception type, HTTP status), the first match by isinstance; an exception of no type here is a 500.
STATUSES: tuple[tuple[type[BaseException], int], ...] = (
    (QueueFull, 429),
    (EngineUnavailable, 503),
    (EngineDeadError, 503),
    (StepFailed, 500),
    (ClientGone, 499),
    (RequestTooLong, 400),
    (GrammarError, 400),
    (ValueError, 400),
    (TypeError, 400),
)


def status_of(exc: BaseException) -> int:
    return next((status for kind, status in STATUSES if isinstance(exc, kind)), 500)


def api_error(exc: BaseException, prefix: str = "", param: str | None = None) -> APIError:
    """exc as the APIError answering it (an APIError is its own); prefix leads the message (what failed)."""
    if isinstance(exc, APIError):
        return exc
    status = status_of(exc)
    unexpected = status == 500 and not isinstance(exc, StepFailed)
    message = f"internal error: {type(exc).__name__}: {exc}" if unexpected else str(exc)
    return APIError(status, prefix + message, param, headers={"Retry-After": str(RETRY_AFTER_S)} if status == 429
                    else None)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for kind, _ in STATUSES:
        app.add_exception_handler(kind, _mapped)
    app.add_exception_handler(Exception, _mapped)  # the rest: 500


async def _api_error(request: Request, exc: APIError):
    return exc.response()


async def _mapped(request: Request, exc: Exception):
    return api_error(exc).response()


# Raised by protocol's model validators: their loc is the object, ctx names the field inside it.
_VALIDATOR_ERRORS = ("unknown_field", "unsupported_field", "lone_surrogate", "invalid_field")


async def _validation_error(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    if first.get("type") in _VALIDATOR_ERRORS:
        param = ".".join(filter(None, [param, str(first["ctx"]["name"])]))
        whole = "." not in param or first["type"] in ("lone_surrogate", "invalid_field")  # message names it
        return APIError(400, first["msg"] if whole else f"{param}: {first['msg']}", param).response()
    if first.get("type") == "json_invalid":
        param = None
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    else:
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
            f"{e.get('msg', '').removeprefix('Value error, ')}"
            + (f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], (dict, list)) else "")
            for e in errors)
    return APIError(400, message, param).response()


async def _http_error(request: Request, exc: StarletteHTTPException):
    return APIError(exc.status_code, str(exc.detail)).response()
