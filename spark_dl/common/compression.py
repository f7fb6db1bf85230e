"""The compressor interface every framework binding shares, and the no-op compressor.

A compressor is a class with two static methods: ``compress(tensor)`` returns
``(wire_tensor, ctx)`` and ``decompress(wire_tensor, ctx)`` restores the original form.
Each binding (``spark_dl.torch``, ``spark_dl.tensorflow``, ``spark_dl.keras``) adds its
casting compressors and exposes them as ``Compression.none`` / ``Compression.fp16``.
"""

__all__ = ["Compressor", "NoneCompressor"]


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
