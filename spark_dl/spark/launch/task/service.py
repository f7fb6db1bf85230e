"""The task service: one per barrier task, it starts and supervises that task's worker.

Methods (authenticated, see :mod:`spark_dl.spark.launch.service`). The driver calls:

=================  ====================================================================
``launch``         start a process: the worker bootstrap for ``rank`` (Gloo), or a given
                   command; ``env`` is added on top of the executor's environment
``host_daemon``    MPI: this task hosts its host's MPI daemon; ``env`` is the daemon's
``attach``         MPI: this task's ``rank`` runs under another task's daemon (on this
                   host); the task only waits for the end of the job
``terminate``      stop the process: SIGTERM to its process group, SIGKILL after a grace
``status``         ``{"launched": bool, "exit_code": int or None}``
=================  ====================================================================

and the rsh agent (:mod:`spark_dl.spark.launch.rsh_agent`), which ``mpirun`` runs on the driver
in place of ssh, calls:

=================  ====================================================================
``daemon``         start the daemon command ``mpirun`` gave (``orted ...``) through
                   ``/bin/sh``, as sshd would, with the environment ``host_daemon`` set
``daemon_output``  long poll: the daemon's output since the last call, and its exit
                   code once it ended
=================  ====================================================================

A task makes at most one of ``launch``, ``host_daemon`` or ``attach``.

The secret reaches a launched child on its stdin (first line), never on its command line
or in its environment; the pipe then stays open, and the child's bootstrap kills its
process group when it reaches end of file, i.e. when this task's Python process is gone.
The daemon's ranks are started by the daemon, not by us: they receive the secret from
this task's :class:`~spark_dl.spark.launch.handover.SecretHandover` (whose name is in the
daemon's environment), which answers only processes started under this task. The
runner's :class:`~spark_dl.runner.workers.WorkerGroup` does the supervision (process
group, SIGTERM/SIGKILL escalation, output forwarding, and a watchdog process that stops
the worker if this process is killed, e.g. by a Spark job cancellation).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from spark_dl.config import knobs
from spark_dl.rendezvous.secret import secret_to_hex
from spark_dl.runner.forkserver import ForkServerError, shared_server
from spark_dl.runner.workers import Stopper, WorkerGroup, WorkerSpec
from spark_dl.spark.launch.handover import HANDOVER_VAR, SecretHandover
from spark_dl.spark.launch.service import Endpoint, ServiceClient, ServiceServer
from spark_dl.spark.launch.task.environment import PYTHON_VAR, child_environment
from spark_dl.spark.launch.task.output import DaemonOutput, DriverOutput, TaskOutputForwarder

__all__ = ["TaskService", "worker_command"]

# Largest payload per method (others: the service default, 64 KiB): a launch or a
# daemon's environment may be large.
REQUEST_LIMITS = {"launch": 16 << 20, "host_daemon": 16 << 20, "daemon": 1 << 20}
# Longest wait of one daemon_output call (the agent's calls time out later than this).
MAX_OUTPUT_WAIT_S = 5.0
# On stop, how long the service stays up for the agent to fetch the daemon's exit code
# (else the agent, hence mpirun, would take the daemon for lost).
AGENT_FETCH_S = 3.0


WORKER_MODULE = "spark_dl.spark.launch.task.worker"


def worker_command(job_id: str, rank: int) -> List[str]:
    """The bootstrap's argv: this interpreter; job id and rank, no secret."""
    return [sys.executable, "-m", WORKER_MODULE, "--job", job_id, "--rank", str(rank)]


def warm_modules(env: Mapping[str, str]) -> List[str]:
    """What a fork server for a worker with ``env`` preloads: the bootstrap's own imports,
    then ``SDL_SPARK_WARM_MODULES`` (which the caller resolved from ``auto``)."""
    listed = knobs.value("spark_warm_modules", env)
    extra = [] if listed == "auto" else [m.strip() for m in listed.split(",") if m.strip()]
    return list(dict.fromkeys([WORKER_MODULE] + extra))


class TaskService:
    """Hosts one task's worker.

    Args:
        secret: the job secret.
        job_id: the job's id.
        index: the Spark partition index of this task.
        gpus: the GPU addresses Spark assigned to this task.
        driver: a client of the driver service (for output and the exit report).
        kill_grace: seconds between SIGTERM and SIGKILL.
        prefix_timestamp: put a timestamp before every forwarded line.
        verbose: 2 and more forwards supervision messages too.
        log: diagnostics sink for refused requests.
    """

    def __init__(self, secret: bytes, job_id: str, index: int, gpus: Sequence[str],
                 driver: ServiceClient, kill_grace: float = 3.0,
                 prefix_timestamp: bool = False, verbose: int = 1,
                 log: Optional[Callable[[str], None]] = None, hosts: Sequence[str] = ()):
        self._secret = secret
        self._job_id = job_id
        self._index = index
        self._gpus = list(gpus)
        self._driver = driver
        self._kill_grace = kill_grace
        self._prefix_timestamp = prefix_timestamp
        self._verbose = verbose
        self._log = log
        self._lock = threading.Lock()
        self._stopper = Stopper()
        self._role: Optional[str] = None  # "worker", "daemon" or "attached"
        self._daemon_env: Optional[Dict[str, str]] = None
        self._daemon_output: Optional[DaemonOutput] = None
        self._exit_code: Optional[int] = None
        # The launched process (or daemon) ended and was reported; for an attached task,
        # or one whose process never started, set when it is told to stop.
        self.done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.server = ServiceServer("task", secret, {
            "launch": self._launch, "terminate": self._terminate, "status": self._status,
            "host_daemon": self._host_daemon, "attach": self._attach,
            "daemon": self._daemon, "daemon_output": self._fetch_daemon_output,
        }, hosts=hosts, limits=REQUEST_LIMITS, log=log)

    @property
    def launched(self) -> bool:
        """Whether the driver gave this task its role (a worker, a daemon, or attached)."""
        return self._role is not None

    @property
    def gpus(self) -> List[str]:
        return list(self._gpus)

    def start(self) -> List[Endpoint]:
        return self.server.start()

    def _take_role(self, role: str) -> None:
        with self._lock:
            if self._role is not None:
                raise RuntimeError(f"task {self._index} already launched its process")
            if self._stopper.count:
                raise RuntimeError(f"task {self._index} is stopping")
            self._role = role

    def _launch(self, env: Mapping[str, str], rank: int,
                command: Optional[Sequence[str]] = None) -> None:
        self._take_role("worker")
        argv = list(command) if command else worker_command(self._job_id, rank)
        spec = WorkerSpec(rank, socket.gethostname(), argv, child_environment(env, self._gpus),
                          stdin_data=(secret_to_hex(self._secret) + "\n").encode(),
                          cwd=os.getcwd(), starter=None if command else self._warm_start)
        self._thread = threading.Thread(target=self._supervise, args=(spec,), daemon=True,
                                        name=f"sdl-task-{self._index}-worker")
        self._thread.start()

    def _warm_start(self, spec: WorkerSpec):
        """Forks the worker from this process's fork server (started on the first job, or
        again when the job's modules or environment differ); None: start it the ordinary
        way (turned off, or the server failed: the reason goes to the verbose log)."""
        try:
            if not knobs.value("spark_warm_workers", spec.env):
                return None
            server, _ = shared_server(spec.env, warm_modules(spec.env),
                                      knobs.value("spark_warm_idle_s", spec.env))
            return server.spawn(spec.argv, spec.env, spec.cwd, spec.stdin_data is not None)
        except (ForkServerError, OSError, ValueError) as exc:
            if self._log is not None:
                self._log(f"task {self._index}: starting the worker without a fork server: "
                          f"{exc}")
            return None

    def _supervise(self, spec: WorkerSpec) -> None:
        # Output has a connection of its own, so that a large batch never delays the
        # task's pings or the exit report.
        out_client = ServiceClient("driver", self._secret, self._driver.endpoints,
                                   timeout=self._driver.timeout)
        output = DriverOutput(lambda stream, data: out_client.call(
            "output", stream=stream, data=data))
        forwarder = TaskOutputForwarder(output.stdout, output.stderr, prefix=True,
                                        timestamp=self._prefix_timestamp,
                                        show_launcher_messages=self._verbose >= 2)
        group = WorkerGroup([spec], forwarder, kill_grace=self._kill_grace,
                            stopper=self._stopper, verbose=self._verbose >= 2)
        code = 1
        try:
            code = group.run()
        finally:
            output.close()  # every line reaches the driver before the exit report
            out_client.close()
            self._exit_code = code
            try:
                self._driver.call("worker_exit", index=self._index, rank=spec.rank, code=code)
            except Exception:
                pass  # the driver is gone; the task ends anyway
            self.done.set()

    def _host_daemon(self, env: Mapping[str, str]) -> None:
        self._take_role("daemon")
        self._daemon_env = {str(k): str(v) for k, v in env.items()}

    def _attach(self, rank: int) -> None:
        self._take_role("attached")

    def _daemon(self, command: str) -> None:
        with self._lock:
            if self._role != "daemon":
                raise RuntimeError(f"task {self._index} hosts no MPI daemon")
            if self._daemon_output is not None:
                raise RuntimeError(f"task {self._index} already started its MPI daemon")
            if self._stopper.count:
                raise RuntimeError(f"task {self._index} is stopping")
            self._daemon_output = DaemonOutput()
        try:
            # The daemon's ranks fetch the secret from here (see the module docstring).
            handover = SecretHandover({"secret": secret_to_hex(self._secret)},
                                      label=f"task{self._index}")
        except OSError:
            self._daemon_output.finish(1)
            self.done.set()
            raise
        env = child_environment(self._daemon_env or {}, [])
        env.update({HANDOVER_VAR: handover.address, PYTHON_VAR: sys.executable})
        # mpirun quotes the daemon's arguments for a remote shell: run it through one.
        spec = WorkerSpec(-1, socket.gethostname(), ["/bin/sh", "-c", command], env,
                          cwd=os.getcwd(), label="the MPI daemon")
        self._thread = threading.Thread(target=self._supervise_daemon, args=(spec, handover),
                                        daemon=True, name=f"sdl-task-{self._index}-daemon")
        self._thread.start()

    def _supervise_daemon(self, spec: WorkerSpec, handover: SecretHandover) -> None:
        output = self._daemon_output
        forwarder = TaskOutputForwarder(output.stdout, output.stderr, prefix=False,
                                        show_launcher_messages=self._verbose >= 2)
        group = WorkerGroup([spec], forwarder, kill_grace=self._kill_grace,
                            stopper=self._stopper, verbose=self._verbose >= 2)
        code = 1
        try:
            code = group.run()
        finally:
            handover.close()
            self._exit_code = code
            output.finish(code)
            self.done.set()

    def _fetch_daemon_output(self, wait_s: float = 1.0) -> dict:
        output = self._daemon_output
        if output is None:
            raise RuntimeError(f"task {self._index} runs no MPI daemon")
        return output.fetch(min(max(float(wait_s), 0.0), MAX_OUTPUT_WAIT_S))

    def _terminate(self) -> None:
        with self._lock:
            self._stopper.request(signal.SIGTERM)
            if self._role in (None, "attached") or (self._role == "daemon"
                                                    and self._daemon_output is None):
                self.done.set()

    def _status(self) -> dict:
        return {"launched": self.launched, "exit_code": self._exit_code}

    def stop(self, timeout: float) -> bool:
        """Stops the process (if any) and the server; True if the process ended in time."""
        self._terminate()
        ended = self.done.wait(timeout)
        if self._daemon_output is not None and ended:
            self._daemon_output.end_fetched.wait(AGENT_FETCH_S)
        self.server.stop()
        return ended
