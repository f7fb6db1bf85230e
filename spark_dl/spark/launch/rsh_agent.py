"""The rsh agent of the MPI path: ``mpirun`` runs it in place of ssh.

``mpirun`` (started by :class:`~spark_dl.spark.launch.mpi_launcher.MpiLauncher` on the Spark
driver with ``--mca plm_rsh_agent "<python> -m spark_dl.spark.launch.rsh_agent"``) starts its
daemons by running ``agent <host> orted ...`` once per host. The host names it is given
are the per-host aliases the launcher made (``sdl-<host hash>``), so this agent:

1. fetches the job secret and the alias -> task service table from the driver's
   :class:`~spark_dl.spark.launch.handover.SecretHandover` (its name is in ``mpirun``'s
   environment, ``SDL_SPARK_AGENT_HANDOVER``; it answers only processes started under
   the driver), never from its command line, environment or a file;
2. asks the task service of that host (authenticated, as every call of the launch layer)
   to run the daemon command, through ``/bin/sh`` as sshd would (``mpirun`` quotes its
   arguments for a remote shell);
3. copies the daemon's own output to its stdout/stderr (``mpirun`` shows it, as it shows
   ssh's), and exits with the daemon's exit code: 255, as ssh, when the task service
   cannot be reached or refuses.

A SIGTERM/SIGINT/SIGHUP asks the task service to stop the daemon, then exits 128+N.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import List, Optional, Sequence, Tuple

from spark_dl.spark.launch.handover import fetch_handover
from spark_dl.spark.launch.service import ServiceClient, ServiceError

__all__ = ["main", "AGENT_HANDOVER_VAR", "split_argv"]

AGENT_HANDOVER_VAR = "SDL_SPARK_AGENT_HANDOVER"
# How long one output poll waits in the task service, and how long the service may be
# unreachable before the daemon is given up for lost.
_POLL_S = 1.0
_LOST_S = 20.0
_SSH_FAILURE = 255


def _say(text: str) -> None:
    sys.stderr.write(f"spark_dl.spark.launch.rsh_agent: {text}\n")
    sys.stderr.flush()


def split_argv(argv: Sequence[str]) -> Tuple[str, str]:
    """``[options...] host command...`` -> (host, command as one shell line).

    Options (``plm_rsh_args``) are skipped as ssh would take them; mpirun passes none
    unless told to.
    """
    args = list(argv)
    while args and args[0].startswith("-"):
        args.pop(0)
    if len(args) < 2:
        raise ValueError("usage: python -m spark_dl.spark.launch.rsh_agent HOST COMMAND... "
                         "(run by mpirun under spark_dl.spark.run)")
    return args[0], " ".join(args[1:])


def _task_endpoints(table: dict, host: str) -> Optional[List[Tuple[str, int]]]:
    # Open MPI may shorten a name at its first dot; aliases have none, but accept both.
    for name in (host, host.split(".", 1)[0]):
        if name in table:
            return [(str(h), int(p)) for h, p in table[name]]
    return None


def _copy(answer: dict) -> None:
    for name, stream in (("stdout", sys.stdout.buffer), ("stderr", sys.stderr.buffer)):
        data = answer.get(name)
        if data:
            stream.write(data)
            stream.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        host, command = split_argv(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        _say(str(exc))
        return 2
    address = os.environ.get(AGENT_HANDOVER_VAR)
    if not address:
        _say(f"{AGENT_HANDOVER_VAR} is not set: this agent serves spark_dl.spark.run only")
        return _SSH_FAILURE
    try:
        job = fetch_handover(address)
    except (OSError, ValueError) as exc:
        _say(f"cannot get the job's credentials from the driver: {exc}")
        return _SSH_FAILURE
    endpoints = _task_endpoints(job["hosts"], host)
    if endpoints is None:
        _say(f"host {host!r} is not a host of this job (known: {', '.join(job['hosts'])}); "
             "extra_mpi_args must not name hosts")
        return _SSH_FAILURE
    client = ServiceClient("task", bytes.fromhex(job["secret"]), endpoints, timeout=30.0)

    def stop(signum, _frame) -> None:
        try:
            ServiceClient("task", bytes.fromhex(job["secret"]), endpoints,
                          timeout=5.0).call("terminate")
        except Exception:
            pass
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    try:
        client.call("daemon", command=command)
    except Exception as exc:  # unreachable, or refused: as ssh failing to connect
        _say(f"the task service of {host} ({endpoints}) did not start the MPI daemon: {exc}")
        return _SSH_FAILURE
    last_contact = time.monotonic()
    while True:
        try:
            answer = client.call("daemon_output", wait_s=_POLL_S, timeout=_POLL_S + 30.0)
        except ServiceError as exc:
            if time.monotonic() - last_contact > _LOST_S:
                _say(f"lost the task service of {host} for {_LOST_S:g} s ({exc})")
                return _SSH_FAILURE
            time.sleep(0.5)
            continue
        last_contact = time.monotonic()
        _copy(answer)
        if answer.get("exit_code") is not None:
            client.close()
            return int(answer["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
