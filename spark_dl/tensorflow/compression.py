"""Gradient compression for TensorFlow tensors: ``Compression.none`` and ``Compression.fp16``.

A compressor is a class with two static methods: ``compress(tensor)`` returns
``(wire_tensor, ctx)`` and ``decompress(wire_tensor, ctx)`` restores the original dtype.
Both are ordinary TensorFlow ops, so they run eagerly and inside ``tf.function``.
"""

import tensorflow as tf

from spark_dl.common.compression import Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


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
