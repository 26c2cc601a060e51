"""OpenAI-shaped errors with an HTTP status: raised by the API, the batch manager and request preparation."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"


class APIError(Exception):
    """An error response: HTTP status, OpenAI's error fields and optional headers."""

    def __init__(self, status_code: int, message: str, *, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status_code, headers=self.headers)


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def not_found(what: str, ident: str, code: str = "not_found") -> APIError:
    return APIError(404, f"No {what} found with id '{ident}'.", code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
