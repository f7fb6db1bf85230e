"""The GPUs Spark assigned to this worker's task, and which one a worker uses.

Spark's resource scheduling (``spark.task.resource.gpu.amount`` with executor GPU
resources) gives each barrier task its GPU addresses (``TaskContext.resources()``). The
task service passes them to its worker in ``SDL_AVAILABLE_DEVICES`` and pins them with
``CUDA_VISIBLE_DEVICES``, so inside the worker the first assigned GPU is ``cuda:0``.

With ``SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX=1`` (Horovod's
``HOROVOD_SPARK_USE_LOCAL_RANK_GPU_INDEX`` is read when it is unset) the worker ignores
Spark's assignment, ``CUDA_VISIBLE_DEVICES`` is left as the executor had it, and the
worker uses ``cuda:<local rank % GPUs>``.

:func:`choose_gpu` holds the whole rule, framework-free (the caller counts the CUDA
devices), so that the torch, Lightning and Keras estimators and ``transform`` agree and
the rule is tested without a GPU:

=====================================  ================================================
situation                              choice
=====================================  ================================================
``use_gpu`` False                      CPU
no CUDA device, Spark assigned none    CPU; with ``use_gpu=True`` one
                                       :class:`GpuFallbackWarning`, with ``use_gpu``
                                       left unset (None) one info line
no CUDA device, Spark assigned some    :class:`GpuNotVisibleError` (Spark scheduled a
                                       GPU for the task, the worker cannot see one)
the local-rank knob is set             ``local_rank % device_count``
Spark assigned GPUs                    the first one's CUDA ordinal (its position in
                                       ``CUDA_VISIBLE_DEVICES``, else the address)
Spark assigned none                    ``local_rank % device_count``
=====================================  ================================================
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import List, Mapping, Optional

from spark_dl.config import knobs
from spark_dl.spark.launch.task.environment import AVAILABLE_DEVICES_VAR

__all__ = ["get_available_devices", "use_local_rank_gpu_index", "choose_gpu",
           "choose_transform_gpu", "GpuNotVisibleError", "GpuFallbackWarning",
           "LOCAL_RANK_GPU_KNOB"]

#: The knob (``SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX``) that picks the local rank's GPU.
LOCAL_RANK_GPU_KNOB = "spark_use_local_rank_gpu_index"

_warned = threading.Event()  # the fallback is reported once per process


class GpuNotVisibleError(RuntimeError):
    """Spark assigned GPUs to this task, but the worker sees no CUDA device."""


class GpuFallbackWarning(UserWarning):
    """``use_gpu=True`` on a host without a usable CUDA device: running on the CPU."""


def get_available_devices(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """The GPU addresses Spark assigned to this worker's task, e.g. ``['3']``.

    Empty when the task got no GPU (no GPU resources configured) or when not running
    under :func:`spark_dl.spark.run`. These are Spark's (physical) addresses; with
    ``CUDA_VISIBLE_DEVICES`` pinned to them, frameworks number them from 0.
    """
    text = (os.environ if environ is None else environ).get(AVAILABLE_DEVICES_VAR, "")
    return [d for d in text.split(",") if d]


def use_local_rank_gpu_index(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX`` (else Horovod's
    ``HOROVOD_SPARK_USE_LOCAL_RANK_GPU_INDEX``) asks for the local rank's GPU.

    Raises:
        ValueError: the variable is not a boolean (the message names it).
    """
    return bool(knobs.value(LOCAL_RANK_GPU_KNOB, environ))


def _ordinal(address: str, device_count: int, environ: Mapping[str, str]) -> int:
    """The CUDA ordinal of Spark's GPU ``address`` in a process with ``environ``."""
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if d.strip()]
    if visible:
        if address in visible:
            return visible.index(address)
        raise GpuNotVisibleError(
            f"Spark assigned GPU {address!r} to this task, but CUDA_VISIBLE_DEVICES="
            f"{','.join(visible)} hides it from the worker. Let spark_dl set "
            "CUDA_VISIBLE_DEVICES (do not set it in backend_env or the executor "
            "environment), or set SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX=1 to use the local "
            "rank's GPU instead")
    if address.isdigit() and int(address) < device_count:
        return int(address)
    raise GpuNotVisibleError(
        f"Spark assigned GPU {address!r} to this task, which is not a CUDA device index "
        f"here ({device_count} visible). Make the GPU discovery script print CUDA indices "
        "(as nvidia-smi --query-gpu=index does), or set "
        "SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX=1 to use the local rank's GPU")


def choose_gpu(use_gpu: Optional[bool], local_rank: int, device_count: int,
               environ: Optional[Mapping[str, str]] = None, warn: bool = True,
               what: str = "training",
               probe: str = "torch.cuda.is_available()") -> Optional[int]:
    """The CUDA ordinal this worker uses, or None for the CPU (rules: the module doc).

    Args:
        use_gpu: the estimator's (or model's) ``use_gpu``; None (an estimator whose
            ``use_gpu`` was left at its default) is "a GPU when there is one": the same
            choice as True, but a host without one is a plain info line, not a warning
            (the user did not ask for a GPU).
        local_rank: this worker's rank on its host (0 for ``transform``'s tasks).
        device_count: the CUDA devices this process sees (``torch.cuda.device_count()``
            when ``torch.cuda.is_available()``, else 0).
        environ: the environment to read (default ``os.environ``).
        warn: report falling back to the CPU (once per process: the
            :class:`GpuFallbackWarning`, or the info line for ``use_gpu=None``); callers
            pass False on all but one worker of a host.
        what: what runs, for the messages (``"training"``, ``"transform"``).
        probe: the framework's own check that must see the GPU, for the error message
            (``tf.config.list_physical_devices('GPU')`` for Keras on TensorFlow).

    Raises:
        GpuNotVisibleError: Spark assigned GPUs to this task that the worker cannot use.
        ValueError: the local-rank knob has a value that is not a boolean.
    """
    environ = os.environ if environ is None else environ
    if use_gpu is not None and not use_gpu:
        return None
    assigned = get_available_devices(environ)
    local = use_local_rank_gpu_index(environ)
    if device_count <= 0:
        if assigned and not local:
            raise GpuNotVisibleError(
                f"Spark assigned GPU(s) {','.join(assigned)} to this task (spark.task."
                f"resource.gpu.amount), but the worker sees no CUDA device "
                f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): "
                f"check the executor's NVIDIA driver and the framework's CUDA build ({probe} "
                "must find the GPU there), and the GPU discovery script; or "
                f"run {what} on the CPU with use_gpu=False and no GPU resource request")
        if warn and not _warned.is_set():
            _warned.set()
            if use_gpu is None:
                print(f"spark_dl: no CUDA device here: {what} runs on the CPU (use_gpu=False "
                      "chooses the CPU without this line)", flush=True)
                return None
            # Located at "spark_dl" rather than a source line: the warning is one line in the
            # job's output (a worker's stderr), not the line of our code that gave it.
            warnings.warn_explicit(
                f"use_gpu=True, but no CUDA device is available here: {what} runs on the CPU "
                "(set use_gpu=False to silence this)", GpuFallbackWarning, "spark_dl", 0,
                module=__name__)
        return None
    if local or not assigned:
        return local_rank % device_count
    return _ordinal(assigned[0], device_count, environ)


def choose_transform_gpu(use_gpu: bool, device_count: int, what: str = "transform",
                         probe: str = "torch.cuda.is_available()") -> Optional[int]:
    """:func:`choose_gpu` for a ``transform`` task on an executor: Spark's GPU for this
    task (``TaskContext.resources()["gpu"]``), else the task's partition index modulo the
    executor's GPUs, else the CPU, silently (transform has no worker to warn from once).

    Outside a Spark task (the driver) it reads the process environment as it is.

    Raises:
        GpuNotVisibleError: Spark assigned the task a GPU that this process cannot see.
    """
    environ = dict(os.environ)
    local_rank = 0
    try:
        from pyspark import TaskContext

        ctx = TaskContext.get()
    except ImportError:
        ctx = None
    if ctx is not None:
        local_rank = ctx.partitionId()
        try:
            gpu = ctx.resources().get("gpu")
        except Exception:  # resources() is missing in very old pyspark versions
            gpu = None
        environ[AVAILABLE_DEVICES_VAR] = ",".join(gpu.addresses) if gpu else ""
    return choose_gpu(use_gpu, local_rank, device_count, environ, warn=False, what=what,
                      probe=probe)
