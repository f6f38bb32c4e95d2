"""OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``) for every failure a client can see.

FastAPI's own 422 validation errors (malformed JSON, wrong types, unknown fields) become 400s naming the field, as
OpenAI answers them; an unexpected exception becomes a 500 with the same body, and the server keeps serving.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.serve.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("infer.serve")
# Validation errors listed in one message; the rest are counted.
MAX_LISTED_ERRORS = 3


class ApiError(Exception):
    """A failure answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
        self.headers = headers


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body.model_dump(), status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return error_response(error)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return error_response(validation_api_error(error.errors()))


def validation_api_error(errors) -> ApiError:
    """One 400 for pydantic/FastAPI error dicts; ``param`` is the first offending top-level field."""
    errors = list(errors)
    described = [_describe(item) for item in errors[:MAX_LISTED_ERRORS]]
    if len(errors) > MAX_LISTED_ERRORS:
        described.append(f"and {len(errors) - MAX_LISTED_ERRORS} more")
    fields = [_location(item) for item in errors if _location(item)]
    return ApiError(400, "; ".join(described), param=fields[0].split(".")[0] if fields else None)


def _describe(item: dict) -> str:
    if item.get("type") == "json_invalid":
        return f"malformed JSON body: {item.get('ctx', {}).get('error', item.get('msg'))}"
    location = _location(item)
    if not location:
        return "the request body is missing" if item.get("type") == "missing" else f"request body: {item['msg']}"
    if item.get("type") == "extra_forbidden":
        return f"{location}: unknown field (infer does not support it)"
    return f"{location}: {item['msg']}"


def _location(item: dict) -> str:
    if item.get("type") == "json_invalid":
        return ""
    parts = [str(part) for part in item.get("loc", ()) if part != "body"]
    return ".".join(parts)


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    return error_response(ApiError(error.status_code, str(error.detail), kind, headers=error.headers))


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unexpected error serving %s %s", request.method, request.url.path, exc_info=error)
    return error_response(ApiError(500, f"internal server error: {type(error).__name__}: {error}", "server_error"))
