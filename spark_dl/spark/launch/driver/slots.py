"""Fail fast when the cluster cannot run ``num_proc`` barrier tasks at once.

Spark itself refuses a barrier stage larger than the free slots, but it retries the check
for up to ``40 x 15 s`` (``spark.scheduler.barrier.maxConcurrentTasksCheck.*``) in case
executors are still coming. So ``run`` checks first:

- the slots the registered executors offer now (``SparkContext.maxNumConcurrentTasks``,
  which counts cores and custom resources such as GPUs): enough -> go;
- the capacity the configuration promises (``local[N]``, ``local-cluster[n,c,m]``,
  ``spark.executor.instances x spark.executor.cores``, divided by ``spark.task.cpus`` and
  by each task resource amount): too small -> a clear error at once;
- it promises enough: executors may still be registering, so wait for them (bounded);
- it does not say (e.g. dynamic allocation, which barrier mode refuses at once): leave
  it to Spark's own check.

Under Spark Connect the registered executors cannot be asked from the client: only the
configuration's promise is checked (too small -> the same clear error).

Spark's local mode offers its tasks no custom resources: with a task resource amount set
(``spark.task.resource.gpu.amount``) every task waits forever, and
``maxNumConcurrentTasks`` still counts the cores. ``run`` refuses that at once.
"""

from __future__ import annotations

import math
import os
import re
import time
from typing import Mapping, Optional

from spark_dl.spark.launch.errors import NotEnoughSlotsError

__all__ = ["check_slots", "available_slots", "configured_slots"]

_LOCAL = re.compile(r"local(?:\[(\*|\d+)(?:\s*,\s*\d+)?\])?$")
_LOCAL_CLUSTER = re.compile(r"local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]$")
_TASK_RESOURCE = re.compile(r"spark\.task\.resource\.([^.]+)\.amount$")


def available_slots(sc) -> Optional[int]:
    """Task slots the registered executors offer now, or None if Spark cannot tell us.

    Uses ``SparkContext.maxNumConcurrentTasks(defaultResourceProfile)`` through py4j
    (public in the JVM since Spark 3.1, unchanged in 3.5 and 4.x).
    """
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:  # an API change must not stop the job: Spark's own check remains
        return None


def configured_slots(master: str, conf: Mapping[str, str]) -> Optional[int]:
    """The slots the configuration ``conf`` (all Spark settings) promises, or None when
    it does not say."""
    conf_get = conf.get
    task_cpus = int(conf_get("spark.task.cpus") or 1)
    match = _LOCAL.match(master)
    if match:
        cores = match.group(1)
        n = 1 if cores is None else (os.cpu_count() or 1) if cores == "*" else int(cores)
        return n // task_cpus
    match = _LOCAL_CLUSTER.match(master)
    if match:
        executors, cores = int(match.group(1)), int(match.group(2))
    else:
        if (conf_get("spark.dynamicAllocation.enabled") or "").lower() == "true":
            return None
        instances, cores = conf_get("spark.executor.instances"), conf_get("spark.executor.cores")
        if not instances or not cores:
            return None
        executors, cores = int(instances), int(cores)
    per_executor = cores // task_cpus
    # A task resource (e.g. GPUs) may bound the slots of an executor further.
    for key, value in conf.items():
        match = _TASK_RESOURCE.match(key)
        if not match:
            continue
        amount = float(value)
        executor_amount = float(conf_get(f"spark.executor.resource.{match.group(1)}.amount")
                                or 0)
        if executor_amount > 0 and amount > 0:
            per_executor = min(per_executor, math.floor(executor_amount / amount + 1e-9))
    return executors * per_executor


_HINT = ("a barrier stage needs all of its tasks running at once: lower num_proc, or "
         "give the application more executors/cores (spark.executor.instances, "
         "spark.executor.cores, spark.task.cpus, task resource amounts)")


def _check_local_task_resources(master: str, conf: Mapping[str, str]) -> None:
    """Raises when a local master is asked for task resources it never offers."""
    if not _LOCAL.match(master):
        return
    asked = sorted(f"{key}={value}" for key, value in conf.items()
                   if _TASK_RESOURCE.match(key) and float(value or 0) > 0)
    if asked:
        raise NotEnoughSlotsError(
            f"{', '.join(asked)} is set, but Spark's local mode (master {master}) gives its "
            "tasks no custom resources, so no task would ever start: unset it for local "
            "runs, or use a cluster (local-cluster[...] or a real one) whose workers "
            "announce the resource")


def check_slots(spark, num_proc: int, wait_s: float, poll_s: float = 0.5) -> None:
    """Returns when ``num_proc`` barrier tasks can run at once; raises otherwise.

    Args:
        spark: the SparkSession (classic or Connect).

    Raises:
        NotEnoughSlotsError: the cluster is (or is configured) too small, or a local
            master is asked for task resources; at once when the configuration already
            says so, else after ``wait_s`` seconds of waiting for the promised executors
            to register.
    """
    from spark_dl.spark.launch.session import conf_of, master_of, spark_context

    sc = spark_context(spark)
    master = master_of(spark)
    hint = _HINT
    if sc is None:  # Spark Connect: the configuration's promise is all we can see
        conf = conf_of(spark) if master else {}
        if master:
            _check_local_task_resources(master, conf)
        promised = configured_slots(master, conf) if master else None
        if promised is not None and num_proc > promised:
            raise NotEnoughSlotsError(f"num_proc={num_proc} exceeds the {promised} task "
                                      f"slots this Spark application is configured for "
                                      f"(master {master}); {hint}")
        return
    if _LOCAL.match(master):
        _check_local_task_resources(master, dict(sc.getConf().getAll()))
    have = available_slots(sc)
    if have is None or have >= num_proc:
        return
    if _LOCAL.match(master):  # local mode: the slots are all there from the start
        raise NotEnoughSlotsError(f"num_proc={num_proc} exceeds the {have} task slots of "
                                  f"this Spark application (master {master}); {hint}")
    promised = configured_slots(master, dict(sc.getConf().getAll()))
    if promised is None:
        return  # the configuration does not say: Spark's own barrier check decides
    if num_proc > promised:
        raise NotEnoughSlotsError(f"num_proc={num_proc} exceeds the {promised} task slots "
                                  f"this Spark application is configured for (master "
                                  f"{master}); {hint}")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        have = available_slots(sc) or 0
        if have >= num_proc:
            return
    raise NotEnoughSlotsError(
        f"num_proc={num_proc} but the registered executors offer only {have} task slots "
        f"after waiting {wait_s:g} s (master {master}); {hint}")
