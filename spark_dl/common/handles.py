"""Asynchronous handles: what every ``*_async`` operation returns.

The core works on the caller's memory until the operation finishes, so a
handle keeps its input and output arrays alive until it is synchronized.
"""

from spark_dl import _core
from spark_dl.common.exceptions import OpTimeoutError, error_for, raise_from_core

__all__ = ["Handle", "poll", "synchronize"]

_live = {}  # handle id -> Handle, until synchronized


class Handle:
    """One pending operation.

    Args:
        hid: the core's handle id.
        keep: objects to keep alive while the core uses their memory.
        finish: called with (outputs, ints) when the operation succeeded; its
            return value is the operation's result.
    """

    __slots__ = ("hid", "_keep", "_finish", "_done", "_result", "name")

    def __init__(self, hid, keep, finish, name=""):
        self.hid = hid
        self._keep = keep
        self._finish = finish
        self._done = False
        self._result = None
        self.name = name
        _live[hid] = self

    def poll(self):
        """True when the operation has finished (successfully or not)."""
        if self._done:
            return True
        try:
            return _core.poll(self.hid)
        except _core.CoreError as e:
            raise_from_core(e)

    def wait(self, timeout=None):
        """Blocks until done and returns the result, or raises the operation's error.

        Args:
            timeout: seconds; None waits as long as it takes (a dead peer still
                ends the wait within SDL_TIMEOUT).

        Raises:
            OpTimeoutError: timeout passed first (the operation stays pending).
        """
        if self._done:
            return self._result
        try:
            if not _core.wait(self.hid, -1.0 if timeout is None else float(timeout)):
                raise OpTimeoutError(
                    f"operation '{self.name}' did not finish within {timeout} s; it is still pending")
            code, message, outputs, ints = _core.take(self.hid)
        except _core.CoreError as e:
            raise_from_core(e)
        _live.pop(self.hid, None)
        self._done = True
        self._keep = None
        if code != 0:
            raise error_for(code, message)
        self._result = self._finish(outputs, ints)
        self._finish = None
        return self._result

    def __repr__(self):
        return f"Handle({self.hid}, name={self.name!r}, done={self._done})"


def poll(handle):
    """True when ``handle``'s operation has finished."""
    return handle.poll()


def synchronize(handle, timeout=None):
    """Waits for ``handle`` and returns its result (see :meth:`Handle.wait`)."""
    return handle.wait(timeout)


def _forget_all():
    _live.clear()
