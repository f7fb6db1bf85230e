"""The native core (the C++ extension), loaded once for the whole package.

A source build (``scripts/setup.sh``) has one extension, ``spark_dl._core``, with MPI where
Open MPI's development files were present at build time. The wheel
(``scripts/build_wheel.sh``) carries two builds of the same core: ``_core`` links Open MPI's
``libmpi.so.40``, which the wheel leaves out because it must be the same Open MPI as the
machine's ``mpirun``/``orted``; ``_core_nompi`` has no MPI and is loaded where ``_core``
cannot be (no Open MPI on the machine), so Gloo, shared memory, CUDA and NCCL still work.
Everything in spark_dl reaches the extension through :data:`core`.
"""

import importlib
from typing import Optional, Tuple

__all__ = ["core", "mpi_missing_reason"]


def _load() -> Tuple[object, Optional[str]]:
    try:
        return importlib.import_module("spark_dl._core"), None
    except ImportError as exc:
        with_mpi_error = exc
    try:
        fallback = importlib.import_module("spark_dl._core_nompi")
    except ModuleNotFoundError:
        raise with_mpi_error from None  # a source build: its one extension must load
    return fallback, str(with_mpi_error)


core, _mpi_load_error = _load()


def mpi_missing_reason() -> str:
    """Why this core has no MPI, and what to do; ``""`` when it has MPI."""
    if core.build_info()["mpi"]:
        return ""
    if _mpi_load_error is not None:
        return ("spark_dl's MPI support loads Open MPI's libmpi.so.40, which this machine lacks ("
                f"{_mpi_load_error}): install Open MPI 4.1 or newer (Debian/Ubuntu: apt-get "
                "install openmpi-bin; elsewhere put its lib folder on LD_LIBRARY_PATH)")
    return ("this spark_dl was built without MPI: install Open MPI (Debian/Ubuntu: apt-get "
            "install openmpi-bin libopenmpi-dev) and rebuild it (bash scripts/setup.sh)")
