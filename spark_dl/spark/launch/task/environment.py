"""What a task service adds to its worker's environment, beyond the rank variables.

================================  ====================================================
``SDL_SPARK_DRIVER``              the driver service's endpoints, ``host:port,...``
``SDL_AVAILABLE_DEVICES``         the GPU addresses Spark assigned to the task
``CUDA_VISIBLE_DEVICES``          the same, when there are any (unless
                                  ``SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX`` is set: then
                                  the executor's own value is kept)
``PYTHONPATH``                    the task's import path (pyspark, ``--py-files``)
================================  ====================================================

The rank variables themselves (``SDL_RANK`` ... ``SDL_JOB_ID``, without
``SDL_SECRET_KEY``) come from the driver's launcher, with the user's ``env``.

On the MPI path the task that hosts its host's MPI daemon (``orted``) starts it with the
executor's environment, the import path, ``SDL_SPARK_DRIVER`` and ``SDL_HOST_ID`` (from
the launcher), and:

================================  ====================================================
``SDL_SPARK_HANDOVER``            where the daemon's ranks fetch the secret (see
                                  :mod:`spark_dl.spark.launch.handover`)
``SDL_SPARK_PYTHON``              this task's interpreter, which runs the ranks'
                                  bootstrap
================================  ====================================================

Each rank's own GPUs (``SDL_AVAILABLE_DEVICES``, ``CUDA_VISIBLE_DEVICES``) are set by its
bootstrap in-process, from the driver.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from spark_dl.config import knobs

__all__ = ["DRIVER_VAR", "AVAILABLE_DEVICES_VAR", "PYTHON_VAR", "format_endpoints",
           "parse_endpoints", "child_environment", "device_environment"]

DRIVER_VAR = "SDL_SPARK_DRIVER"
AVAILABLE_DEVICES_VAR = "SDL_AVAILABLE_DEVICES"
PYTHON_VAR = "SDL_SPARK_PYTHON"
# Executor variables not passed on: pyspark's own worker-factory plumbing, and any
# secret of an enclosing launcher.
_NOT_INHERITED_PREFIXES = ("PYTHON_WORKER_FACTORY_",)
_NOT_INHERITED = {"SDL_SECRET_KEY"}


def format_endpoints(endpoints: Sequence[Tuple[str, int]]) -> str:
    """``host:port,host:port`` (IPv6 hosts in brackets)."""
    return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in endpoints)


def parse_endpoints(text: str) -> List[Tuple[str, int]]:
    """Inverse of :func:`format_endpoints`."""
    result = []
    for item in filter(None, text.split(",")):
        host, _, port = item.rpartition(":")
        result.append((host.strip("[]"), int(port)))
    return result


def child_environment(extra: Mapping[str, str], gpus: Sequence[str]) -> Dict[str, str]:
    """The executor's environment, the task's import path and GPUs, then ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _NOT_INHERITED and not k.startswith(_NOT_INHERITED_PREFIXES)}
    # Spark adds pyspark and --py-files archives to this process's path only.
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in sys.path if p))
    extra = {str(k): str(v) for k, v in extra.items()}
    # The knob is read where the worker will read it: the executor's environment with the
    # job's variables (backend_env, run(env=...)) on top.
    env.update(device_environment(gpus, {**env, **extra}))
    env.update(extra)
    return env


def device_environment(gpus: Sequence[str],
                       environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``SDL_AVAILABLE_DEVICES``, and ``CUDA_VISIBLE_DEVICES`` when there are GPUs.

    ``CUDA_VISIBLE_DEVICES`` is not set when ``environ`` (default ``os.environ``) asks for
    the local rank's GPU (``SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX``): the worker then picks
    among every GPU the executor sees (:func:`~spark_dl.spark.launch.task.devices.choose_gpu`).
    """
    env = {AVAILABLE_DEVICES_VAR: ",".join(gpus)}
    if gpus and not knobs.value("spark_use_local_rank_gpu_index", environ):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env
