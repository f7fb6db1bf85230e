"""Launching jobs without Spark: the ``sdlrun`` command and the rendezvous store.

Modules, each named after what it holds:

- :mod:`~spark_dl.runner.launch`: the ``sdlrun`` CLI and :func:`run_command`;
- :mod:`~spark_dl.runner.options`: :class:`LaunchOptions`;
- :mod:`~spark_dl.runner.hosts`: ``-H``/hostfile parsing and rank assignment;
- :mod:`~spark_dl.runner.gloo_run`: the Gloo launcher (worker environments);
- :mod:`~spark_dl.runner.mpi_run`: the MPI launcher (``mpirun``'s command line, output
  and failure reports);
- :mod:`~spark_dl.runner.workers`: worker processes, failure and signal handling;
- :mod:`~spark_dl.runner.output`: rank-prefixed output forwarding (and demultiplexing of
  output that ``mpirun`` tagged);
- :mod:`~spark_dl.runner.remote`: ssh launch and the remote-side bootstrap;
- :mod:`~spark_dl.runner.kvstore`: the authenticated rendezvous server (its client and
  the message authentication live below, in :mod:`spark_dl.rendezvous`).

Only the standard library is used, so that this package works before the native core is
built and on hosts that only launch (the MPI launcher needs Open MPI's ``mpirun``).
"""

from spark_dl.rendezvous.client import KVStoreClient, client_from_env
from spark_dl.runner.kvstore import KVStoreServer
from spark_dl.runner.launch import main, run_command
from spark_dl.runner.options import LaunchOptions

__all__ = ["KVStoreClient", "KVStoreServer", "LaunchOptions", "client_from_env", "main",
           "run_command"]
