"""What listens during a ``spark.run(use_mpi=True)`` job on ``local[2]``: only Open MPI's
own daemons (mpirun, orted) on wildcard addresses; the ranks on none."""

import io
import subprocess
import sys

import cloudpickle
import pytest

from spark_dl.spark import run
from spark_dl.spark.launch.mpi_launcher import job_interfaces, spark_mpi_args
from test_run_mpi import _session, needs_mpi

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_mpi_args_name_the_jobs_interfaces():
    args = spark_mpi_args(None, None, ["127.0.0.1", "127.0.0.1"], single_host=True)
    assert " ".join(args).endswith("--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo "
                                   "--mca btl ^tcp,ofi")
    assert job_interfaces(["10.0.0.2", "10.0.0.1", "10.0.0.2"]) == "10.0.0.1/32,10.0.0.2/32"
    args = spark_mpi_args("--mca btl self,vader", ["eth1"], ["10.0.0.1"], single_host=True)
    assert "eth1" in args and args.count("btl") == 1  # the user's choice wins
    multi = spark_mpi_args(None, None, ["10.0.0.1", "10.0.0.2"])
    assert "^tcp,ofi" not in multi  # ranks on several hosts need a network transport


def listeners():
    """Rank 0: the TCP listeners of this job's processes (ranks, orted, mpirun)."""
    import os
    import time

    import numpy as np

    import spark_dl.numpy as sdl

    sdl.init()
    mine = set()
    pid = os.getpid()
    while pid > 1:  # this rank, its orted and the task's process (not Spark's JVM)
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == "java":
                break
        mine.add(pid)
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    marker = f"SDL_JOB_ID={os.environ['SDL_JOB_ID']}".encode()
    for entry in filter(str.isdigit, os.listdir("/proc")):  # mpirun (on the driver)
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read():
                    mine.add(int(entry))
        except OSError:
            pass
    ranks = sdl.allgather_object(os.getpid())
    sdl.allreduce(np.ones(1), op=sdl.Sum)
    found = []
    if sdl.rank() == 0:
        time.sleep(0.5)
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            fields = line.split()
            for pid in mine | set(ranks):
                if f"pid={pid}," in line:
                    name = fields[-1].split('"')[1]
                    found.append((fields[3], "rank" if pid in ranks else name))
    sdl.allreduce(np.ones(1), op=sdl.Sum)
    return found


@pytest.fixture(scope="module")
def local_spark():
    yield from _session("local[2]")


@needs_mpi
def test_only_open_mpis_daemons_listen_widely(local_spark):
    found = run(listeners, num_proc=2, use_mpi=True, stderr=io.StringIO())[0]
    wide = [(addr, who) for addr, who in found
            if not (addr.startswith("127.") or addr.startswith("[::1]")
                    or addr.startswith("[::ffff:127."))]
    # Open MPI 4.1's out-of-band listeners (IPv4 and IPv6) of mpirun and orted bind every
    # interface whatever oob_tcp_if_include says; the ranks listen on nothing.
    assert all(who in ("mpirun", "orted") for _, who in wide), wide
    assert len(wide) <= 4, found
