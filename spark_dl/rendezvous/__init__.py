"""How the processes of one job find each other and authenticate: the lowest Python layer.

- :mod:`~spark_dl.rendezvous.client`: :class:`KVStoreClient`, the rendezvous client the
  core uses at start-up, and :func:`client_from_env`;
- :mod:`~spark_dl.rendezvous.protocol`: the store's wire protocol (paths, headers, tags),
  shared with the server (:mod:`spark_dl.runner.kvstore`);
- :mod:`~spark_dl.rendezvous.secret`: the per-job secret and message authentication
  (MACs, replay protection), used by the store and by the Spark launch services;
- :mod:`~spark_dl.rendezvous.frames`: the launch services' frames, whose small header is
  authenticated before the body is read, with one deadline per frame;
- :mod:`~spark_dl.rendezvous.admission`: the rules for connections that have not
  authenticated yet (deadline, per-peer and total bounds), shared by the launch services
  and the rendezvous server.

Layering: this package uses only the standard library and, from spark_dl, only the knob
table (:mod:`spark_dl.config`, for the start timeout); :mod:`spark_dl.common` (the
runtime), :mod:`spark_dl.runner` (``sdlrun`` and the server) and
:mod:`spark_dl.spark.launch` stand on it.
"""

from spark_dl.rendezvous.client import KVStoreClient, KVStoreError, client_from_env

__all__ = ["KVStoreClient", "KVStoreError", "client_from_env"]
