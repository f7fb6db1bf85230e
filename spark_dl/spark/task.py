"""Horovod-compatible name for device discovery on a task.

Horovod users write ``from horovod.spark.task import get_available_devices``; the same
line with ``spark_dl.spark.task`` keeps working. The task side itself lives in
:mod:`spark_dl.spark.launch.task`.
"""

from spark_dl.spark.launch.task.devices import get_available_devices

__all__ = ["get_available_devices"]
