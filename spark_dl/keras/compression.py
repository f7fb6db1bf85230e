"""Gradient compression for Keras tensors of any backend: ``Compression.none`` and ``fp16``.

The casts are ``keras.ops`` calls, so one compressor serves the TensorFlow and the torch
backends (inside a compiled ``tf.function`` too). Interface as in
:mod:`spark_dl.common.compression`: ``compress(t) -> (wire, ctx)`` and
``decompress(wire, ctx)``.
"""

import keras

from spark_dl.common.compression import Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]

_FLOATS = ("float32", "float64", "bfloat16")


class FP16Compressor(Compressor):
    """Sends float32/float64/bfloat16 tensors as float16; other dtypes unchanged."""

    @staticmethod
    def compress(tensor):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if dtype in _FLOATS:
            return keras.ops.cast(tensor, "float16"), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else keras.ops.cast(tensor, ctx)


class Compression:
    """The available compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
