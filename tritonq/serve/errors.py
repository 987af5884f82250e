"""Every exception a route can end in, answered with the OpenAI error body {"error": {message, type, param,
code}} (protocol.APIError): pydantic validation errors become a 400 naming the field, the value and what is
allowed; Starlette's (404 route, 405 method) keep their status; anything unexpected is a 500 naming it."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tritonq.serve.protocol import APIError

# Raised by protocol's model validators: their loc is the object, ctx names the field inside it.
_VALIDATOR_ERRORS = ("unknown_field", "unsupported_field", "lone_surrogate", "invalid_field")


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(request: Request, exc: APIError):
    return exc.response()


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


async def _unexpected(request: Request, exc: Exception):
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
