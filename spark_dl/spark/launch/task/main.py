"""What each barrier task of :func:`spark_dl.spark.run` runs.

1. Start a task service on this executor (see :mod:`spark_dl.spark.launch.network` for the
   addresses) and register with the driver: partition index, host hash, endpoints, the
   GPUs Spark assigned.
2. Wait while the driver launches the worker through the service and the worker runs,
   pinging the driver every second. The task ends when its worker ended (and was
   reported); when the driver answers ``stop``; when the driver is unreachable for
   ``driver_lost_s`` (the driver is gone: the worker is stopped); or when no launch came
   within the start timeout.
3. Always stop the worker and the service before returning, so that a reused Python
   worker of Spark keeps nothing of this job.

The secret travels to the executor inside this object, i.e. inside Spark's serialized
task (protect it with ``spark.authenticate`` and ``spark.network.crypto.enabled`` on
untrusted networks); it is never logged.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from spark_dl.spark.launch.network import address_network, host_hash, task_bind_addresses
from spark_dl.spark.launch.service import Endpoint, ServiceClient, ServiceError, log_to_stderr
from spark_dl.spark.launch.task.service import TaskService

__all__ = ["TaskSettings", "TaskMain"]


@dataclass
class TaskSettings:
    """Everything a task needs, shipped inside the Spark task."""

    job_id: str
    secret: bytes = field(repr=False)
    driver_endpoints: List[Endpoint]
    start_timeout: float
    nics: Optional[Sequence[str]] = None
    verbose: int = 1
    prefix_timestamp: bool = False
    kill_grace: float = 3.0
    ping_s: float = 1.0
    driver_lost_s: float = 15.0


def _assigned_gpus(ctx) -> List[str]:
    try:
        info = ctx.resources().get("gpu")
    except Exception:  # resources() is missing in very old pyspark versions
        return []
    return [str(a) for a in info.addresses] if info is not None else []


class TaskMain:
    """One task's role in the job: its task service, from registration to the end.

    Every task of the barrier job runs this (task 0 on a thread beside its
    :class:`~spark_dl.spark.launch.coordinator.Coordinator`). It never raises: a task that
    fails reports to the coordinator when it can, and returns its report otherwise (a
    raising task would fail the barrier stage and lose task 0's account of the job).
    """

    def __init__(self, settings: TaskSettings):
        self.settings = settings

    def __call__(self, index: int, gpus: List[str]) -> Optional[dict]:
        """Runs the task's role; returns None, or a report of a failure it could not
        send to the coordinator."""
        s = self.settings
        log = log_to_stderr(f"spark_dl task {index}") if s.verbose >= 2 else None
        driver = ServiceClient("driver", s.secret, s.driver_endpoints, timeout=30.0)
        service = None
        try:
            service = TaskService(s.secret, s.job_id, index, gpus, driver,
                                  kill_grace=s.kill_grace, prefix_timestamp=s.prefix_timestamp,
                                  verbose=s.verbose, log=log,
                                  hosts=task_bind_addresses([h for h, _ in s.driver_endpoints],
                                                            s.nics))
            endpoints = service.start()
            answer = driver.call("register", index=index, host_hash=host_hash(),
                                 hostname=socket.gethostname(), endpoints=endpoints,
                                 gpus=service.gpus, pid=os.getpid(),
                                 networks=[address_network(h) for h, _ in endpoints])
            if answer.get("accepted"):
                self._wait(service, driver, index)
            return None
        except BaseException:
            text = traceback.format_exc()
            try:
                driver.call("task_failed", index=index, traceback=text, timeout=5.0)
                return None
            except Exception:
                return {"index": index, "host": socket.gethostname(), "traceback": text}
        finally:
            if service is not None:
                service.stop(timeout=s.kill_grace + 5.0)
            try:
                driver.call("task_end", index=index, timeout=2.0)
            except Exception:
                pass
            driver.close()

    def _wait(self, service: TaskService, driver: ServiceClient, index: int) -> None:
        s = self.settings
        launch_deadline = time.monotonic() + s.start_timeout + 60.0
        last_contact = time.monotonic()
        while not service.done.wait(s.ping_s):
            now = time.monotonic()
            if not service.launched and now > launch_deadline:
                raise TimeoutError(f"task {index}: the coordinator did not launch a worker "
                                   f"within {s.start_timeout:g} s of the start timeout")
            try:
                stop = driver.call("ping", index=index, timeout=5.0)["stop"]
                last_contact = now
            except ServiceError as exc:
                if now - last_contact < s.driver_lost_s:
                    continue
                sys.stderr.write(f"spark_dl task {index}: the coordinator (task 0) is "
                                 f"unreachable for {s.driver_lost_s:g} s ({exc}); stopping "
                                 "the worker\n")
                return  # the caller's finally stops the worker
            if stop:
                return
