"""Asynchronous handles: what every ``*_async`` operation returns.

The core works on the caller's memory until the operation finishes, so a
handle keeps its input and output arrays alive until it is synchronized.
"""

import time

from spark_dl.common.native import core as _core
from spark_dl.common.exceptions import OpTimeoutError, ShutdownError, error_for

__all__ = ["Handle", "CompositeHandle", "BatchHandle", "poll", "synchronize"]

_live = {}  # handle id -> Handle, until synchronized
_runtime_generation = 0  # bumped by every shutdown: a handle belongs to one runtime
_NOT_INITIALIZED = _core.ERROR_CODES["not_initialized"]


def _raise_pending(exc, handle):
    """Re-raises a ``_core.CoreError`` met while waiting on ``handle``.

    A handle exists only while the runtime runs, so the core's "not initialized"
    means the runtime was shut down (by this thread or another) before the result
    was taken: the operation failed with the shutdown, and that is what is raised.
    """
    code, message = exc.args
    if code == _NOT_INITIALIZED:
        raise _shutdown_error(handle) from None
    raise error_for(code, message) from None


def _shutdown_error(handle):
    return ShutdownError(
        f"operation '{handle.name}' did not finish: spark_dl was shut down (shutdown() in "
        "this or another thread) before its result was taken")


def _check_runtime(handle):
    """Raises the shutdown error when ``handle``'s runtime has been shut down (a later
    ``init()`` starts a new runtime whose handle ids may repeat the old ones)."""
    if handle._generation != _runtime_generation:
        raise _shutdown_error(handle)


class Handle:
    """One pending operation.

    Args:
        hid: the core's handle id.
        keep: objects to keep alive while the core uses their memory.
        finish: called with (outputs, ints) when the operation succeeded; its
            return value is the operation's result.
        count: how many operations the core numbered consecutively from ``hid`` (1;
            :class:`BatchHandle` holds more).
    """

    __slots__ = ("hid", "_keep", "_finish", "_done", "_result", "name", "_generation",
                 "count")

    def __init__(self, hid, keep, finish, name="", count=1):
        self.hid = hid
        self.count = count
        self._keep = keep
        self._finish = finish
        self._done = False
        self._result = None
        self.name = name
        self._generation = _runtime_generation
        _live[hid] = self

    def poll(self):
        """True when the operation has finished (successfully or not)."""
        if self._done:
            return True
        _check_runtime(self)
        try:
            return _core.poll(self.hid)
        except _core.CoreError as e:
            _raise_pending(e, self)

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
        _check_runtime(self)
        try:
            if not _core.wait(self.hid, -1.0 if timeout is None else float(timeout)):
                raise OpTimeoutError(
                    f"operation '{self.name}' did not finish within {timeout} s; it is still pending")
            _check_runtime(self)  # a shutdown and init() in another thread during the wait
            code, message, outputs, ints = _core.take(self.hid)
        except _core.CoreError as e:
            _raise_pending(e, self)
        _live.pop(self.hid, None)
        self._done = True
        self._keep = None
        if code != 0:
            raise error_for(code, message)
        self._result = self._finish(outputs, ints)
        self._finish = None
        return self._result

    def __call__(self):
        """``handle()`` is ``handle.wait()``: Horovod's ``sparse_allreduce_async`` returns a
        function to call for the result, and code written for it calls the handle."""
        return self.wait()

    def __repr__(self):
        return f"Handle({self.hid}, name={self.name!r}, done={self._done})"


class CompositeHandle(Handle):
    """Several core operations presented as one handle (grouped operations).

    Its result is ``combine([result of each member])``. If a member fails, the
    others are still waited for (so nothing stays pending) and the first error
    is raised. A timeout bounds the whole wait, not each member's.
    """

    __slots__ = ("_members", "_error")

    def __init__(self, members, combine, name):  # noqa: D107 - members are the registered handles
        self.hid = None
        self._keep = None
        self._members = members
        self._finish = combine
        self._done = False
        self._result = None
        self._error = None
        self.name = name

    def poll(self):
        if self._done or self._error is not None:
            return True
        return all(m.poll() for m in self._members)

    def wait(self, timeout=None):
        if self._error is not None:
            raise self._error
        if self._done:
            return self._result
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        results = []
        for m in self._members:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results.append(m.wait(left))
            except OpTimeoutError:
                raise  # members stay pending; a later wait picks up where this one stopped
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other members
                self._error = self._error or e
        self._members = None
        if self._error is not None:
            raise self._error
        self._result = self._finish(results)
        self._finish = None
        self._done = True
        return self._result

    def __repr__(self):
        return f"CompositeHandle(name={self.name!r}, done={self._done})"


class BatchHandle(Handle):
    """Many core operations enqueued by one call (:func:`spark_dl.common.ops.submit_many`),
    presented as one handle.

    The core numbers a batch's operations consecutively, so this holds two integers
    (``hid`` is the first, ``count`` how many; ``BatchHandle(first, keep, finish, name,
    count)``) instead of one handle object per tensor;
    :meth:`wait` waits for all of them and takes their results in one call each.
    ``finish(outputs)`` builds the result: ``outputs`` is None when no operation
    returned buffers (in-place allreduces), else one list of DLPack outputs per
    operation. When some operations fail, the others are still waited for and
    taken (nothing stays pending) and the first failure is raised.
    """

    # Handle's constructor serves as it is (no second one calling it): per-tensor loops
    # make one of these per tensor per step (spark_dl.common.ops.allreduce_host).
    __slots__ = ()

    def poll(self):
        if self._done:
            return True
        _check_runtime(self)
        try:
            return _core.wait_range(self.hid, self.count, 0.0)
        except _core.CoreError as e:
            _raise_pending(e, self)

    def wait(self, timeout=None):
        if self._done:
            return self._result
        _check_runtime(self)
        try:
            limit = -1.0 if timeout is None else float(timeout)
            if not _core.wait_range(self.hid, self.count, limit):
                raise OpTimeoutError(
                    f"{self.count} operations '{self.name}' did not all finish within {timeout} s; "
                    "they are still pending")
            _check_runtime(self)  # a shutdown and init() in another thread during the wait
            failures, outputs = _core.take_range(self.hid, self.count)
        except _core.CoreError as e:
            _raise_pending(e, self)
        _live.pop(self.hid, None)
        self._done = True
        self._keep = None
        if failures:
            _, code, message = failures[0]
            raise error_for(code, message)
        self._result = self._finish(outputs)
        self._finish = None
        return self._result

    def __repr__(self):
        return f"BatchHandle({self.hid}+{self.count}, name={self.name!r}, done={self._done})"


def poll(handle):
    """True when ``handle``'s operation has finished."""
    return handle.poll()


def synchronize(handle, timeout=None):
    """Waits for ``handle`` and returns its result (see :meth:`Handle.wait`)."""
    return handle.wait(timeout)


def _forget_all():
    """At shutdown: the runtime's handles are dropped, and any still held fail with
    the shutdown error instead of reaching a later runtime."""
    global _runtime_generation
    _runtime_generation += 1
    _live.clear()
