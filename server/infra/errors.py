"""Domain errors: what went wrong in words a client can act on, and the status it maps to.

The domain core and the services raise these and never touch a transport. The handler pipeline
(`uibus.edge.pipeline`) turns them into the status of whichever transport the call came in on: a gRPC
status, a gRPC-Web trailer, an HTTP status with a JSON body, or a CodeBolt reply. `code` is the
gRPC status name, the one vocabulary every transport shares.
"""

from __future__ import annotations

from typing import ClassVar


class UibusError(Exception):
    """A failure the caller should hear about; `str()` is the message it gets."""

    code: ClassVar[str] = "UNKNOWN"


class InvalidArgument(UibusError):
    code = "INVALID_ARGUMENT"


class NotFound(UibusError):
    code = "NOT_FOUND"


class FailedPrecondition(UibusError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(UibusError):
    code = "RESOURCE_EXHAUSTED"


class AlreadyExists(UibusError):
    code = "ALREADY_EXISTS"


class Unavailable(UibusError):
    """Try again shortly: a dependency is down or the server is shutting down."""

    code = "UNAVAILABLE"


class Unimplemented(UibusError):
    code = "UNIMPLEMENTED"


class Cancelled(UibusError):
    """The call's work was stopped on purpose by someone else (another UI stopped the turn)."""

    code = "CANCELLED"


class Unauthenticated(UibusError):
    code = "UNAUTHENTICATED"


class StoreUnavailable(Unavailable):
    """A networked store cannot be reached right now; the call may succeed if retried."""


class Internal(UibusError):
    code = "INTERNAL"


class PermissionDenied(UibusError):
    """The caller is known (its token is valid) but may not touch what it asked for."""

    code = "PERMISSION_DENIED"


class StoreFull(ResourceExhausted):
    """The store has no room left (disk full, Redis out of memory); writes fail until it has."""


class ConfigError(Exception):
    """A start-up setting that cannot work: `uibus serve` prints `uibus serve: <source>: <what>` and
    exits 2, with no traceback. `source` names what the user set (`--store`, `UIBUS_PORT`, …)."""

    def __init__(self, source: str, what: str) -> None:
        super().__init__(f"{source}: {what}")
        self.source = source
        self.what = what


# The gRPC status numbers (a wire standard), for places that carry a status as a number.
STATUS_NUMBERS: dict[str, int] = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9, "ABORTED": 10,
    "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14, "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}
_BY_CODE: dict[str, type[UibusError]] = {cls.code: cls for cls in (
    InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted, Unavailable, Unimplemented, Unauthenticated,
    Internal, PermissionDenied, AlreadyExists)}
_BY_NUMBER = {number: name for name, number in STATUS_NUMBERS.items()}


def error_of(number: int, message: str) -> UibusError:
    """The error a status number stands for (as another replica reported it)."""
    name = _BY_NUMBER.get(number, "UNKNOWN")
    cls = _BY_CODE.get(name)
    if cls is None:
        error = UibusError(message)
        error.code = name  # type: ignore[misc]
        return error
    return cls(message)
