"""Launch options shared by the CLI, the Python API and every launcher (Gloo, MPI)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import BinaryIO, Optional, Sequence

from spark_dl.config import knobs

CONTROLLERS = knobs.table()["controller"].choices  # auto, gloo, mpi


class LaunchError(RuntimeError):
    """The job cannot be launched as asked (e.g. ``mpirun`` is missing)."""


@dataclass
class LaunchOptions:
    """How to launch one job. Every field has a default, so adding one breaks no caller.

    Attributes:
        controller: which launcher starts the workers: ``"gloo"`` (one process per rank,
            rendezvous server), ``"mpi"`` (through Open MPI's ``mpirun``), or ``"auto"``
            (see :func:`~spark_dl.runner.launch.choose_controller`).
        start_timeout: seconds workers may take to start and register (remote workers
            register with the rendezvous server; workers also receive it as
            ``SDL_START_TIMEOUT`` to bound their own rendezvous). Default: the
            ``start_timeout_s`` knob (``SDL_START_TIMEOUT`` in the launcher's environment,
            else 120).
        output_dir: also write each rank's raw output to ``DIR/rank.<r>/{stdout,stderr}``.
        prefix_output: prefix every forwarded line with ``[<rank>]<stdout>:``.
        prefix_timestamp: put a timestamp before that prefix.
        verbose: report hosts, ranks, commands and rendezvous traffic on stderr.
        ssh_port, ssh_identity_file: passed to ssh for remote hosts.
        ssh_command: the ssh program and fixed arguments (tests substitute a fake).
        rendezvous_addr: address workers use to reach the rendezvous server; default
            127.0.0.1 when every host is local, else this machine's address on the job's
            network (see :mod:`~spark_dl.runner.network`).
        network_interface: the interface every host uses for the job (services and data;
            with MPI, a comma-separated list is passed to Open MPI). Default: the
            ``gloo_iface`` knob (``SDL_GLOO_IFACE``), else
            an automatic choice (:func:`~spark_dl.runner.network.choose_network`).
        kill_grace: seconds between SIGTERM and SIGKILL when stopping workers.
        mpi_args: extra ``mpirun`` arguments, already split (MPI only).
        mpirun: the ``mpirun`` program, looked up on ``PATH`` unless a path (MPI only).
        cwd: working directory of the workers (default: the launcher's).
        stdout, stderr: binary streams receiving forwarded output (default: the
            launcher's own stdout/stderr).
    """

    controller: str = "auto"
    start_timeout: float = field(default_factory=lambda: knobs.value("start_timeout_s"))
    output_dir: Optional[str] = None
    prefix_output: bool = True
    prefix_timestamp: bool = False
    verbose: bool = False
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    ssh_command: Sequence[str] = ("ssh",)
    rendezvous_addr: Optional[str] = None
    network_interface: Optional[str] = None
    kill_grace: float = 3.0
    mpi_args: Sequence[str] = ()
    mpirun: str = "mpirun"
    cwd: Optional[str] = None
    stdout: Optional[BinaryIO] = None
    stderr: Optional[BinaryIO] = None

    def validate(self) -> None:
        """Raises ValueError for an option outside its range."""
        if self.controller not in CONTROLLERS:
            raise ValueError(f"unsupported controller {self.controller!r}; "
                             f"available: {', '.join(CONTROLLERS)}")
        if self.start_timeout <= 0:
            raise ValueError("start_timeout must be positive")
        if self.kill_grace < 0:
            raise ValueError("kill_grace must not be negative")
        if self.ssh_port is not None and not 0 < self.ssh_port < 65536:
            raise ValueError(f"invalid ssh port {self.ssh_port}")
