"""Errors raised by spark_dl operations.

Every error names the tensor, the ranks and what differed where the core knows
them. Classes keep Horovod's names where Horovod has one, so code that catches
``HorovodInternalError`` keeps working.
"""

from spark_dl.common.native import core as _core

__all__ = [
    "SdlError", "NotInitializedError", "InvalidArgumentError", "MismatchError",
    "PeerFailureError", "ShutdownError", "DuplicateNameError", "OpTimeoutError",
    "HorovodInternalError", "raise_from_core",
]


class SdlError(RuntimeError):
    """Base class of every spark_dl error."""


class NotInitializedError(SdlError, ValueError):
    """An operation was called before ``init()`` or after ``shutdown()``."""


class InvalidArgumentError(SdlError, ValueError):
    """A call was invalid on this rank (raised before anything was enqueued)."""


class MismatchError(SdlError):
    """Ranks disagreed on a tensor: operation, dtype, shape, root or reduce op."""


class PeerFailureError(SdlError):
    """A rank died, hung past ``SDL_TIMEOUT``, or the transport broke.

    After this error the runtime is unusable; shut down (or let the launcher
    stop the job).
    """


class ShutdownError(SdlError):
    """The runtime was shut down (on this rank or another) while work was pending."""


class DuplicateNameError(SdlError, ValueError):
    """An operation with the same name is already in flight on this rank."""


class OpTimeoutError(SdlError, TimeoutError):
    """``synchronize(handle, timeout=...)`` expired; the operation is still pending."""


HorovodInternalError = PeerFailureError

_BY_CODE = {
    _core.ERROR_CODES["invalid_argument"]: InvalidArgumentError,
    _core.ERROR_CODES["mismatch"]: MismatchError,
    _core.ERROR_CODES["peer_failure"]: PeerFailureError,
    _core.ERROR_CODES["shutdown"]: ShutdownError,
    _core.ERROR_CODES["not_initialized"]: NotInitializedError,
    _core.ERROR_CODES["duplicate_name"]: DuplicateNameError,
    _core.ERROR_CODES["timeout"]: OpTimeoutError,
}


def error_for(code, message):
    """Returns the exception instance for a core error code and message."""
    return _BY_CODE.get(code, SdlError)(message)


def raise_from_core(exc):
    """Re-raises a ``_core.CoreError`` as the matching spark_dl exception."""
    code, message = exc.args
    raise error_for(code, message) from None
