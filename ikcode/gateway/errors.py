"""Errors in Anthropic's shape: {"type": "error", "error": {"type": ..., "message": ...}}.

Claude Code decides what to do from the status code and the message: 400 is final (and
"prompt is too long: N tokens > M maximum" starts its own compaction), 429/529/5xx are retried
and honour `retry-after` in integer seconds (above 60 it gives up at once).
"""

from __future__ import annotations

from ikcode.engines.base import (
    EmptyPrompt,
    EngineError,
    EngineOverloaded,
    EngineShutdown,
    InvalidSampling,
    PromptTooLong,
    TokenOutOfVocab,
)

MAX_RETRY_AFTER_S = 60

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class APIError(Exception):
    """An error the gateway answers with; `status` picks the Anthropic error type."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = None if retry_after_s is None else max(1, min(MAX_RETRY_AFTER_S, retry_after_s))

    @property
    def error_type(self) -> str:
        return ERROR_TYPES.get(self.status, "api_error")

    def body(self) -> dict:
        return error_body(self.error_type, self.message)

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.retry_after_s is not None:
            headers["retry-after"] = str(self.retry_after_s)
            headers["x-should-retry"] = "true"
        elif self.status in (400, 404, 413):
            headers["x-should-retry"] = "false"
        return headers


def error_body(error_type: str, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def invalid_request(message: str) -> APIError:
    return APIError(400, message)


def from_engine_error(error: EngineError) -> APIError:
    """Map a typed engine error to what the client should see."""
    if isinstance(error, PromptTooLong | EmptyPrompt | TokenOutOfVocab | InvalidSampling):
        return APIError(400, str(error))
    if isinstance(error, EngineOverloaded):
        return APIError(529, str(error) or "overloaded", retry_after_s=error.retry_after_s)
    if isinstance(error, EngineShutdown):
        return APIError(529, str(error), retry_after_s=5)
    return APIError(500, "internal error in the engine")
