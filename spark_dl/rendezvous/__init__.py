"""How the processes of one job find each other and authenticate: the lowest Python layer.

- :mod:`~spark_dl.rendezvous.client`: :class:`KVStoreClient`, the rendezvous client the
  core uses at start-up, and :func:`client_from_env`;
- :mod:`~spark_dl.rendezvous.protocol`: the store's wire protocol (paths, headers, tags),
  shared with the server (:mod:`spark_dl.runner.kvstore`);
- :mod:`~spark_dl.rendezvous.secret`: the per-job secret and message authentication
  (MACs, replay protection, sealed frames), used by the store and by the Spark launch
  services.

Layering: this package uses only the standard library and, from spark_dl, only the knob
table (:mod:`spark_dl.config`, for the start timeout); :mod:`spark_dl.common` (the
runtime), :mod:`spark_dl.runner` (``sdlrun`` and the server) and
:mod:`spark_dl.spark.launch` stand on it.
"""

from spark_dl.rendezvous.client import KVStoreClient, KVStoreError, client_from_env

__all__ = ["KVStoreClient", "KVStoreError", "client_from_env"]
