"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, for every /v1 path:
the API's own refusals, and FastAPI's (a bad path or query, an unknown route) rewritten so."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from lifecycle.core.errors import LifecycleError

PREFIX = "/v1/"

# OpenAI's `type` by status, where an error does not name its own.
TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
}
CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class OpenAIError(LifecycleError):
    """A /v1 request refused or failed, with what OpenAI's error object carries."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind or TYPES.get(status, "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body(), headers=self.headers)


def invalid_fields(problems: Sequence[tuple[str, str]]) -> OpenAIError:
    """400 naming every invalid field, and why, in one message; `param` is the first."""
    message = "; ".join(f"{param}: {why}" for param, why in problems)
    return OpenAIError(400, message, code="invalid_value", param=problems[0][0])


def is_v1(request: Request) -> bool:
    return request.url.path.startswith(PREFIX)


async def _openai_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _answered(handler: Any, request: Request, exc: Exception) -> Response:
    """What a handler installed before answers (Starlette takes plain functions too)."""
    answer = handler(request, exc)
    if inspect.isawaitable(answer):
        answer = await answer
    assert isinstance(answer, Response)
    return answer


def install_error_handlers(app: FastAPI) -> None:
    """Answer /v1 paths in OpenAI's shape, leaving every other path's answers as they were
    (the handlers installed before this one)."""
    app.add_exception_handler(OpenAIError, _openai_error)
    validation = app.exception_handlers.get(RequestValidationError)
    http = app.exception_handlers.get(HTTPException)

    async def refused_request(request: Request, exc: Exception) -> Response:
        if is_v1(request) or validation is None:
            assert isinstance(exc, RequestValidationError)
            problems = [
                (".".join(str(p) for p in error["loc"][1:]) or str(error["loc"][0]), error["msg"])
                for error in exc.errors()
            ]
            return invalid_fields(problems or [("body", "invalid request")]).response()
        return await _answered(validation, request, exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        if is_v1(request) or http is None:
            assert isinstance(exc, HTTPException)
            detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
            return OpenAIError(
                exc.status_code,
                f"{request.method} {request.url.path}: {detail}",
                code=CODES.get(exc.status_code),
                headers=dict(exc.headers) if exc.headers else None,
            ).response()
        return await _answered(http, request, exc)

    app.add_exception_handler(RequestValidationError, refused_request)
    app.add_exception_handler(HTTPException, http_error)
