"""spark_dl: distributed deep learning on Apache Spark.

Framework front ends: :mod:`spark_dl.numpy` (no framework), and later
``spark_dl.torch`` / ``spark_dl.tensorflow``. Launchers: ``sdlrun``
(:mod:`spark_dl.runner`) and :mod:`spark_dl.spark`.
"""

__version__ = "0.1.0"
