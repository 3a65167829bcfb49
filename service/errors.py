"""What can go wrong in a request to the service, in terms the API turns into HTTP.

The service knows no HTTP; it raises these, and `api/` maps each kind to a status code
and OpenAI's error envelope. Every message says what was wrong and what to do.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

# pydantic puts a union member's tag into an error's location ("literal['auto']",
# "function-after[...]", "constrained-float"), and "[key]" after a dict key that is itself
# wrong: not fields a client can name
_LOC_TAG = re.compile(r"^(\w+(-\w+)*\[.*\]|constrained-\w+|int|float|str|bool|none|\[key\])$")


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


class UnknownCursor(NotFound):
    """A list's `after` names an object the list does not hold (404, as its id would)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        ServiceError.__init__(self, message, param=param, code=code)


class NotAvailable(NotFound):
    """The object exists, but not in the form asked for (404): a checkpoint variant that
    was never written or has been removed; the message says which forms there are."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        ServiceError.__init__(self, message, param=param, code=code)


class NotServedHere(NotFound):
    """A model this route does not serve (404): `/v1/embeddings` naming another model than
    the embedding model, or asked where none is configured; the message says which it
    serves."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        ServiceError.__init__(self, message, param=param, code="model_not_found")


class Forbidden(ServiceError):
    """The tenant sees the object but may not do this to it (403): delete a base model."""

    kind = "permission_error"


class Conflict(ServiceError):
    """The object's state does not allow it (409): cancel a finished job, reuse a key."""


class Gone(ServiceError):
    """The object existed and has ended (410): a training session finished or ended idle;
    the message says how and what to do instead."""


class TooLarge(ServiceError):
    """An upload over the configured limit (413)."""


class QuotaExceeded(ServiceError):
    """The tenant is at one of its limits (429): the message names the limit, its setting
    and the current use."""

    kind = "insufficient_quota"


class Unavailable(ServiceError):
    """A part the request needs (Ray, the store) cannot be reached now (503)."""

    kind = "service_unavailable"


def describe_invalid(errors: Sequence[Mapping[str, Any]]) -> tuple[list[str], str, int]:
    """(location, what is wrong, how many other fields are wrong) for pydantic's errors.

    The location is the first wrong field's, without union-member tags. A value that fits
    no member of a union gets one error per member: their requirements are joined
    ("Input should be 'auto' or less than or equal to 50"), not reported as more errors.
    """
    if not errors:
        return [], "invalid", 0

    def where(err: Mapping[str, Any]) -> list[str]:
        return [str(x) for x in err.get("loc", ()) if not _LOC_TAG.match(str(x))]

    def why(err: Mapping[str, Any]) -> str:
        if err.get("type") == "missing":
            return "is required"
        if err.get("type") == "extra_forbidden":
            return "unknown field; see the API reference for the fields allowed here"
        return str(err.get("msg", "invalid")).removeprefix("Value error, ")

    first = where(errors[0])
    same = [why(e) for e in errors if where(e) == first]
    message = same[0] + "".join(
        " or " + m.removeprefix("Input should be ") for m in dict.fromkeys(same[1:])
    )
    others = len({tuple(where(e)) for e in errors} - {tuple(first)})
    return first, message, others
