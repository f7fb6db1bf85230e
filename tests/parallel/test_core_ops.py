"""Every operation x dtype x reduce op on 2 and 3 ranks, over shared memory and Gloo,
checked against NumPy (each rank recomputes every rank's inputs)."""

import pytest

from core_cases import cases
from harness import run_once, run_ranks

from spark_dl import _core

TRANSPORTS = {"shm": {"SDL_SHM": "1"}, "gloo": {"SDL_SHM": "0", "SDL_CONTROLLER": "gloo"}}
# Two simulated hosts (the last rank alone on the second): shared memory within
# a host, Gloo/MPI between leaders (hierarchical); with 2 ranks plain Gloo/MPI.
TRANSPORTS["hier"] = {"SDL_SHM": "1", "SDL_CONTROLLER": "gloo"}
# The same with every allreduce over 4 KiB pipelined in 4 KiB chunks (the leader's
# cross-host allreduces on their own thread; 3 ranks only: 2 ranks are not hierarchical).
CHUNKS = {"SDL_HIERARCHICAL_CHUNK_BYTES": "4096"}
TRANSPORTS["hier_chunks"] = {**TRANSPORTS["hier"], **CHUNKS}
if _core.build_info()["mpi"]:
    TRANSPORTS["mpi"] = {"SDL_SHM": "0", "SDL_CONTROLLER": "mpi"}
    TRANSPORTS["hier_mpi"] = {"SDL_SHM": "1", "SDL_CONTROLLER": "mpi"}
    TRANSPORTS["hier_mpi_chunks"] = {**TRANSPORTS["hier_mpi"], **CHUNKS}
EXPECTED_KIND = {t: "hierarchical" if t.startswith("hier") else t for t in TRANSPORTS}


def _env(transport, np_):
    env = dict(TRANSPORTS[transport])
    if transport.startswith("hier"):
        env["SDL_TEST_HOSTS"] = ",".join(["a"] * (np_ - 1) + ["b"])
    return env


def _expected_kind(transport, np_):
    if transport.startswith("hier") and np_ == 2:
        return "mpi" if transport.startswith("hier_mpi") else "gloo"
    return EXPECTED_KIND[transport]
_results = {}


def _matrix(np_, transport):
    return run_once(_results, (np_, transport), lambda: run_ranks(
        "core_workers:op_matrix", np_, env=_env(transport, np_), timeout=240,
        launcher="mpi" if "mpi" in transport else "store"))


@pytest.mark.parametrize("np_,transport", [(np_, t) for t in sorted(TRANSPORTS) for np_ in (2, 3)
                                           if np_ == 3 or not t.endswith("_chunks")])
@pytest.mark.parametrize("case", cases())
def test_op(case, np_, transport):
    per_rank = _matrix(np_, transport)
    kinds = {r["__transport__"] for r in per_rank}
    assert kinds == {_expected_kind(transport, np_)}, kinds
    errors = {rank: r[case] for rank, r in enumerate(per_rank) if r[case] is not None}
    assert not errors, f"{case} on {np_} ranks over {transport}: {errors}"
