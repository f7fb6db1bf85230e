"""The task service: one per barrier task, it starts and supervises that task's worker.

Methods (authenticated, see :mod:`spark_dl.spark.service`), called by the driver:

=============  ========================================================================
``launch``     start a process: the worker bootstrap for ``rank`` (Gloo), or a given
               command (the seam for MPI's ``orted``); ``env`` is added on top of the
               executor's environment; at most one launch per task
``terminate``  stop the process: SIGTERM to its process group, SIGKILL after a grace
``status``     ``{"launched": bool, "exit_code": int or None}``
=============  ========================================================================

The secret reaches the child on its stdin (first line), never on its command line or in
its environment; the pipe then stays open, and the child's bootstrap kills its process
group when it reaches end of file, i.e. when this task's Python process is gone. The
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
from typing import Callable, List, Mapping, Optional, Sequence

from spark_dl.runner.secret import secret_to_hex
from spark_dl.runner.workers import Stopper, WorkerGroup, WorkerSpec
from spark_dl.spark.service import Endpoint, ServiceClient, ServiceServer
from spark_dl.spark.task.environment import child_environment
from spark_dl.spark.task.output import DriverOutput, TaskOutputForwarder

__all__ = ["TaskService", "worker_command"]

MAX_REQUEST = 16 * 1024 * 1024


def worker_command(job_id: str, rank: int) -> List[str]:
    """The bootstrap's argv: this interpreter; job id and rank, no secret."""
    return [sys.executable, "-m", "spark_dl.spark.task.worker", "--job", job_id,
            "--rank", str(rank)]


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
        self._lock = threading.Lock()
        self._stopper = Stopper()
        self._launched = False
        self._exit_code: Optional[int] = None
        self.done = threading.Event()  # the launched process ended and was reported
        self._thread: Optional[threading.Thread] = None
        self.server = ServiceServer("task", secret, {
            "launch": self._launch, "terminate": self._terminate, "status": self._status,
        }, hosts=hosts, max_request=MAX_REQUEST, log=log)

    @property
    def launched(self) -> bool:
        return self._launched

    @property
    def gpus(self) -> List[str]:
        return list(self._gpus)

    def start(self) -> List[Endpoint]:
        return self.server.start()

    def _launch(self, env: Mapping[str, str], rank: int,
                command: Optional[Sequence[str]] = None) -> None:
        with self._lock:
            if self._launched:
                raise RuntimeError(f"task {self._index} already launched its process")
            if self._stopper.count:
                raise RuntimeError(f"task {self._index} is stopping")
            self._launched = True
        argv = list(command) if command else worker_command(self._job_id, rank)
        spec = WorkerSpec(rank, socket.gethostname(), argv, child_environment(env, self._gpus),
                          stdin_data=(secret_to_hex(self._secret) + "\n").encode(),
                          cwd=os.getcwd())
        self._thread = threading.Thread(target=self._supervise, args=(spec,), daemon=True,
                                        name=f"sdl-task-{self._index}-worker")
        self._thread.start()

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

    def _terminate(self) -> None:
        with self._lock:
            self._stopper.request(signal.SIGTERM)
            if not self._launched:
                self.done.set()

    def _status(self) -> dict:
        return {"launched": self._launched, "exit_code": self._exit_code}

    def stop(self, timeout: float) -> bool:
        """Stops the process (if any) and the server; True if the process ended in time."""
        self._terminate()
        ended = self.done.wait(timeout)
        self.server.stop()
        return ended
