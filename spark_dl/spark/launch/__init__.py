"""The launch layer: :func:`spark_dl.spark.run` and what it stands on.

Everything that starts and supervises a distributed job on a Spark cluster lives here,
below the estimator layer (:mod:`spark_dl.spark.common`, :mod:`spark_dl.spark.torch`):

- driver side: :mod:`~spark_dl.spark.launch.spark_run` (:func:`run`, the entry point),
  :mod:`~spark_dl.spark.launch.launcher` (the Gloo launcher: rendezvous and worker
  start), :mod:`~spark_dl.spark.launch.driver` (driver service, rank plan, the barrier
  job, the slot check, the failure report);
- task side: :mod:`~spark_dl.spark.launch.task` (what each barrier task runs: the task
  service, the worker bootstrap, output shipping, device discovery);
- services: :mod:`~spark_dl.spark.launch.service` (authenticated request/response
  services), :mod:`~spark_dl.spark.launch.network` (address discovery),
  :mod:`~spark_dl.spark.launch.pickling` (the function, arguments and results on the
  wire);
- MPI: :mod:`~spark_dl.spark.launch.mpi_launcher` (``mpirun`` on the driver, ``orted``
  in the executors), :mod:`~spark_dl.spark.launch.rsh_agent` (the rsh agent ``mpirun``
  calls) and :mod:`~spark_dl.spark.launch.handover` (the job secret for processes Open
  MPI starts);
- executors' Python: :mod:`~spark_dl.spark.launch.executor_python` (local masters run the
  driver's interpreter) and :mod:`~spark_dl.spark.launch.executor_probe` (elsewhere, one
  small job checks that it can run spark_dl before the first real one);
- :mod:`~spark_dl.spark.launch.errors`: the exceptions users catch (:class:`RunError`,
  :class:`WorkerFailedError`, :class:`NotEnoughSlotsError`, ...).

This package may import :mod:`spark_dl.runner`, :mod:`spark_dl.rendezvous` and
:mod:`spark_dl.common`, never the estimator layer above it. Importing it is cheap: the
submodules are loaded on use.
"""
