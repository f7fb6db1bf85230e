"""Gradient compression applied around allreduce: ``Compression.none`` and ``Compression.fp16``.

A compressor is a class with two static methods: ``compress(tensor)`` returns
``(wire_tensor, ctx)`` and ``decompress(wire_tensor, ctx)`` restores the
original dtype. Pass one as ``compression=`` to
:func:`~spark_dl.torch.mpi_ops.allreduce` or
:class:`~spark_dl.torch.optimizer.DistributedOptimizer`.
"""

import torch

from spark_dl.common.compression import Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class _CastCompressor(Compressor):
    wire_dtype = None

    @classmethod
    def compress(cls, tensor):
        # Only wider floating types are cast; integers and bool must stay exact.
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire_dtype:
            return tensor.to(cls.wire_dtype), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16 (half the bytes of float32)."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16 (float32's range, fewer mantissa bits).

    Not in Horovod's PyTorch API; safer than fp16 for gradients with large values.
    """

    wire_dtype = torch.bfloat16


class Compression:
    """The available compressors, by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
