"""The driver side of :func:`spark_dl.spark.run`.

- :mod:`~spark_dl.spark.launch.driver.service`: the driver service (registrations, code,
  results, errors, output, exit reports);
- :mod:`~spark_dl.spark.launch.driver.plan`: rank assignment grouped by host;
- :mod:`~spark_dl.spark.launch.driver.job`: the barrier-mode Spark job hosting the tasks;
- :mod:`~spark_dl.spark.launch.driver.slots`: the fail-fast check of the cluster's task slots;
- :mod:`~spark_dl.spark.launch.driver.report`: the text of a failed job's error (root cause
  first, consequences labelled).
"""
