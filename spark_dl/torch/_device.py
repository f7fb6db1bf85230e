"""Where torch tensors cross into the core, by device: the one place that knows about CUDA.

CPU tensors go to the core as they are (the core reads them through ``__dlpack__``).
A CUDA tensor goes the same way, ``__dlpack__()`` without a stream (so PyTorch adds no
synchronization of its own), and :func:`stream_of` gives the core the number of PyTorch's
current stream on its device (``spark_dl.common.ops.submit`` asks it for every tensor): at
enqueue the core records an event on that stream, and its streams wait on that event before
reading (no device-wide synchronize, no wait for work queued after the enqueue); the stream
waits for the core's result before its later work. Results come back as DLPack capsules on
the tensor's device and are wrapped with ``torch.from_dlpack`` without a copy.

Until the core reports that it takes CUDA tensors (:func:`core_cuda_support`), a CUDA
tensor is refused here with one error naming the tensor, its device and what to do.
Other devices (``mps``, ``xpu``, ``meta`` ...) are always refused: the core has no path
for them.

DLPack's stream numbering for CUDA: 1 is the legacy default stream (0 is ambiguous and
not allowed), 2 the per-thread default stream, anything else a ``cudaStream_t``; -1 asks
the producer for no synchronization at all.
"""

from typing import Optional, Tuple

import torch

from spark_dl.common.native import core as _core
from spark_dl.common import ops as _ops
from spark_dl.common.exceptions import InvalidArgumentError

__all__ = ["core_cuda_support", "device_error", "check_device", "device_scope",
           "dlpack_stream", "host_array", "order_after", "stream_of"]

# The core's run-time answer to "can you take CUDA tensors now" (CUDA and NCCL loaded, a
# device present). The native side names it; until it exists, build_info()["cuda"] alone
# cannot say yes, since the enqueue path still takes CPU memory only.
_RUNTIME_QUERY = "cuda_usable"


_CUDA_SUPPORTED = False  # once the core said yes: a process's CUDA devices do not change


def core_cuda_support() -> Tuple[bool, str]:
    """(whether the core takes CUDA tensors, why not when it does not). Asked for every CUDA
    tensor a collective takes, so a yes is remembered."""
    global _CUDA_SUPPORTED
    if _CUDA_SUPPORTED:
        return True, ""
    info = _core.build_info()
    if not info.get("cuda"):
        return False, ("this spark_dl build has no CUDA support (it was built without the "
                       "CUDA toolkit and NCCL)")
    query = getattr(_core, _RUNTIME_QUERY, None)
    if query is None:
        return False, ("this spark_dl core was built with CUDA but does not accept CUDA "
                       "tensors yet")
    if query():
        _CUDA_SUPPORTED = True
        return True, ""
    return False, ("the core cannot use CUDA on this host (no driver or device, or "
                   "libcudart/libnccl not found)")


def device_error(what: str, device: str, name: Optional[str] = None,
                 support: Optional[Tuple[bool, str]] = None) -> Optional[str]:
    """The message refusing a tensor on ``device`` (e.g. ``"cuda:1"``), or None when the
    core takes it. ``support`` defaults to :func:`core_cuda_support` (asked only for CUDA
    tensors)."""
    kind = device.split(":", 1)[0]
    label = f"{what} ({name!r})" if name else what
    if kind == "cpu":
        return None
    if kind == "cuda":
        ok, why = support if support is not None else core_cuda_support()
        if ok:
            return None
        return (f"{label} is on {device}, but {why}. Rebuild spark_dl where the CUDA toolkit "
                "(nvcc) and the NCCL headers are present (docs/gpu.md), or move the tensor to "
                "the CPU (tensor.cpu(); estimators: use_gpu=False)")
    return (f"{label} is on {device}; spark_dl's core takes CPU and CUDA tensors only: move "
            "it to the CPU (tensor.cpu()) or to a CUDA device")


def check_device(tensor: torch.Tensor, what: str = "tensor", name: Optional[str] = None) -> None:
    """Raises :class:`InvalidArgumentError` when the core cannot take ``tensor``'s device."""
    if tensor.device.type == "cpu":
        return
    message = device_error(what, str(tensor.device), name)
    if message is not None:
        raise InvalidArgumentError(message)


def dlpack_stream(device: torch.device) -> int:
    """The DLPack stream number of PyTorch's current stream on CUDA ``device``."""
    handle = torch.cuda.current_stream(device).cuda_stream
    return 1 if handle == 0 else handle  # the legacy default stream is 1 in DLPack


def stream_of(tensor) -> int:
    """The stream number the core orders a tensor's reads after: the current stream of a
    CUDA tensor's device (the tensor itself crosses through ``__dlpack__()`` without a
    stream, so PyTorch adds no synchronization), 0 for anything else."""
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        return dlpack_stream(tensor.device)
    return 0


def order_after(tensor, stream: int) -> None:
    """Makes PyTorch's current stream on ``tensor``'s device wait for DLPack stream number
    ``stream`` (the one the tensor was enqueued from, which the core made wait for the
    result) when they differ: the result may be read on another stream than it was
    produced on (gradient hooks run on autograd's device thread, ``step()`` on the
    caller's). Nothing to do for the per-thread default stream (2): the core finished
    such work on the host before the handle completed."""
    if stream == 2 or dlpack_stream(tensor.device) == stream:
        return
    if stream == 1:
        source = torch.cuda.default_stream(tensor.device)
    else:
        source = torch.cuda.ExternalStream(stream, device=tensor.device)
    torch.cuda.current_stream(tensor.device).wait_stream(source)


def host_array(tensor: torch.Tensor):
    """``tensor`` (a model output, any device) as a NumPy array on the host; bfloat16,
    which NumPy lacks, as float32 (exact)."""
    t = tensor.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def device_scope(tensor):
    """Makes a CUDA tensor's device current while the core takes it, when another device
    is: PyTorch's ``__dlpack__`` refuses to export a tensor that is not on the current
    device (a process using several GPUs, or one that never called
    ``torch.cuda.set_device``). None when nothing needs to change."""
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda \
            and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return None


_ops.set_stream_provider(stream_of, device_scope, order_after)
