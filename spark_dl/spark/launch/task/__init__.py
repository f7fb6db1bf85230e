"""The executor side of :func:`spark_dl.spark.run`.

- :mod:`~spark_dl.spark.launch.task.main`: what each barrier task runs (hosts a task service,
  registers with the driver, waits for its worker);
- :mod:`~spark_dl.spark.launch.task.service`: the task service (starts and supervises the
  worker);
- :mod:`~spark_dl.spark.launch.task.output`: worker output shipped to the driver;
- :mod:`~spark_dl.spark.launch.task.worker`: the worker bootstrap (runs the user's function);
- :mod:`~spark_dl.spark.launch.task.devices`: :func:`get_available_devices`.

This package imports nothing heavy, so that the worker bootstrap starts fast.
"""

from spark_dl.spark.launch.task.devices import get_available_devices

__all__ = ["get_available_devices"]
