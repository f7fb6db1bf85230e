"""The GPUs Spark assigned to this worker's task.

Spark's resource scheduling (``spark.task.resource.gpu.amount`` with executor GPU
resources) gives each barrier task its GPU addresses (``TaskContext.resources()``). The
task service passes them to its worker in ``SDL_AVAILABLE_DEVICES`` and pins them with
``CUDA_VISIBLE_DEVICES``, so inside the worker the first assigned GPU is ``cuda:0``.
"""

from __future__ import annotations

import os
from typing import List, Mapping, Optional

from spark_dl.spark.launch.task.environment import AVAILABLE_DEVICES_VAR

__all__ = ["get_available_devices"]


def get_available_devices(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """The GPU addresses Spark assigned to this worker's task, e.g. ``['3']``.

    Empty when the task got no GPU (no GPU resources configured) or when not running
    under :func:`spark_dl.spark.run`. These are Spark's (physical) addresses; with
    ``CUDA_VISIBLE_DEVICES`` pinned to them, frameworks number them from 0.
    """
    text = (os.environ if environ is None else environ).get(AVAILABLE_DEVICES_VAR, "")
    return [d for d in text.split(",") if d]
