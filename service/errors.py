"""What can go wrong in a request to the service, in terms the API turns into HTTP.

The service knows no HTTP; it raises these, and `api/` maps each kind to a status code
and OpenAI's error envelope. Every message says what was wrong and what to do.
"""

from __future__ import annotations


class ServiceError(Exception):
    kind = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class Unauthorized(ServiceError):
    """No valid bearer token (401)."""


class InvalidRequest(ServiceError):
    """The request cannot be done as asked (400)."""


class NotFound(ServiceError):
    """No such object for this tenant (404; another tenant's objects are not found)."""

    def __init__(self, what: str, ident: str, param: str | None = None) -> None:
        super().__init__(f"No {what} with id '{ident}'.", param=param, code=f"{what}_not_found")


class Conflict(ServiceError):
    """The object's state does not allow it (409): cancel a finished job, reuse a key."""


class TooLarge(ServiceError):
    """An upload over the configured limit (413)."""


class Unavailable(ServiceError):
    """A part the request needs (Ray, the store) cannot be reached now (503)."""

    kind = "service_unavailable"
