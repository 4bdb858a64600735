"""Errors as every client of the server reads them: OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
whatever raised them (a refused request, a validation error, an overload, a timeout, a failed forward)."""

from __future__ import annotations

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "overloaded_error",
               504: "timeout_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None, **extra) -> dict:
    """OpenAI's error object for an answer of HTTP `status`; `extra` adds keys beside `error` (the routes on a 404)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else
                                                                     "invalid_request_error"),
                      "param": param, "code": status if code is None else code}, **extra}


class RequestError(Exception):
    """A request the server refuses: its HTTP status, the field at fault (None for the whole body) and why; `extra`
    goes beside the error object, `headers` with the answer."""

    def __init__(self, status: int, param: str | None, message: str, *, code: str | int | None = None,
                 headers: dict[str, str] | None = None, **extra):
        super().__init__(message)
        self.status, self.param, self.message, self.code = status, param, message, code
        self.headers, self.extra = headers or {}, extra

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code, **self.extra)


class RowError(Exception):
    """The failure of one input of a batch: the other inputs of the batch have their results; the request that sent
    this one is answered with a 500."""


__all__ = ["ERROR_TYPES", "RequestError", "RowError", "error_body"]
