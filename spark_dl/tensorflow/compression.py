"""Gradient compression for TensorFlow tensors: ``Compression.none`` and ``Compression.fp16``.

A compressor is a class with two static methods: ``compress(tensor)`` returns
``(wire_tensor, ctx)`` and ``decompress(wire_tensor, ctx)`` restores the original dtype.
Both are ordinary TensorFlow ops, so they run eagerly and inside ``tf.function``.
"""

import tensorflow as tf

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor:
    """Interface of a compressor (used as a class, never instantiated)."""

    @staticmethod
    def compress(tensor):
        """Returns (tensor to send, context needed by :meth:`decompress`)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the received tensor in its original form."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes of float32); others unchanged."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The available compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
