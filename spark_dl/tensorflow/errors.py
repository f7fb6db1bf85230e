"""Errors of :mod:`spark_dl.tensorflow`: TensorFlow's error types and spark_dl's at once.

Horovod's TensorFlow ops fail with ``tf.errors`` types: ``FailedPreconditionError`` when
ranks disagree on a collective (shape, dtype, root rank, reduce op) and
``InvalidArgumentError`` for a bad argument (splits, process set). spark_dl's core raises
its own :mod:`spark_dl.common.exceptions`. Each class here subclasses both, so
``except tf.errors.OpError``, ``except tf.errors.FailedPreconditionError`` and
``except spark_dl.tensorflow.MismatchError`` all catch the same error.

Inside ``tf.function`` the collective runs as a ``tf.numpy_function`` op and TensorFlow
rebuilds the error from the op's status, not from the Python exception: there an argument
error arrives as ``tf.errors.InvalidArgumentError`` (the same type Horovod raises) and any
other error as ``tf.errors.UnknownError`` whose message starts with the class name (for a
mismatch ``MismatchError: ...``). TensorFlow gives a Python function no way to set another
status code (docs/keras.md, "Errors").
"""

import functools

import tensorflow as tf

from spark_dl.common import exceptions as _sdl

__all__ = ["MismatchError", "InvalidArgumentError", "XlaNotSupportedError", "as_tf_error",
           "translate_errors"]


class _DualError:
    """Mixin: constructible from the message alone, as spark_dl's errors are
    (``MismatchError("...")``), and with TensorFlow's ``(node_def, op, message, ...)``, the
    signature AutoGraph needs to re-raise an ``OpError`` from traced code as its own type."""

    _tf_base = None

    def __init__(self, node_def=None, op=None, message=None, *args):  # noqa: D107
        if message is None and op is None and not hasattr(node_def, "name"):
            node_def, message = None, node_def  # the message alone
        self._tf_base.__init__(self, node_def, op, "" if message is None else str(message),
                               *args)

    def __reduce__(self):
        return self.__class__, (self.message,)


class MismatchError(_DualError, tf.errors.FailedPreconditionError, _sdl.MismatchError):
    """Ranks disagreed on a collective (shape, dtype, root rank, reduce op)."""

    _tf_base = tf.errors.FailedPreconditionError


class InvalidArgumentError(_DualError, tf.errors.InvalidArgumentError, _sdl.InvalidArgumentError):
    """A call was invalid on this rank (bad splits, a process set it cannot use, ...)."""

    _tf_base = tf.errors.InvalidArgumentError


class XlaNotSupportedError(InvalidArgumentError):
    """A collective was traced inside an XLA-compiled function."""


_BY_TYPE = ((_sdl.MismatchError, MismatchError),
            (_sdl.InvalidArgumentError, InvalidArgumentError))


def as_tf_error(error):
    """The TensorFlow-typed twin of a spark_dl error (the error itself when it has none)."""
    if isinstance(error, tf.errors.OpError):
        return error
    for sdl_type, tf_type in _BY_TYPE:
        if isinstance(error, sdl_type):
            twin = tf_type(str(error))
            twin.__cause__ = error.__cause__
            return twin
    return error


def translate_errors(fn):
    """Decorator: spark_dl errors leaving ``fn`` become their TensorFlow-typed twins."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _sdl.SdlError as e:
            twin = as_tf_error(e)
            if twin is e:
                raise
            raise twin.with_traceback(e.__traceback__) from None
    return wrapper
