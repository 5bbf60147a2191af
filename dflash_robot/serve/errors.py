"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`, and the HTTP
status each failure maps to. Bad input is always a 4xx; only a bug is a 500."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from dflash_robot.errors import DFlashError


class ApiError(Exception):
    """An error answered with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class Cancelled(Exception):
    """The client went away; the request was dropped."""


class ShuttingDown(Exception):
    """The server stopped before the request ran."""


def from_exception(e: BaseException, retry_after_s: int = 1) -> ApiError:
    """The ApiError for a failure raised while preparing or running a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, DFlashError):
        return ApiError(400, str(e))
    if isinstance(e, Cancelled):
        return ApiError(499, "the client closed the request", "cancelled")
    if isinstance(e, ShuttingDown):
        return ApiError(503, "the server is shutting down", "server_error", code="shutting_down",
                        headers={"Retry-After": str(retry_after_s)})
    return ApiError(500, f"internal error: {type(e).__name__}", "server_error")
