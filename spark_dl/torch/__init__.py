"""spark_dl for PyTorch: Horovod's ``horovod.torch`` API over spark_dl's core.

Switching from Horovod is a change of import::

    import spark_dl.torch as hvd

    hvd.init()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

and the job starts with ``sdlrun -np 4 python train.py`` (or from Spark with
``spark_dl.spark.run``). Tensors reach the C++ core through DLPack, so
nothing here is compiled against PyTorch: any PyTorch 2.x works as installed.
See docs/torch.md for what differs from Horovod.
"""

from spark_dl.common.basics import autotune_state, flight_recorder  # noqa: F401
from spark_dl.common.exceptions import (  # noqa: F401
    DuplicateNameError, HorovodInternalError, InvalidArgumentError, MismatchError,
    NotInitializedError, OpTimeoutError, PeerFailureError, SdlError, ShutdownError)
from spark_dl.torch.compression import Compression  # noqa: F401
from spark_dl.torch.functions import (  # noqa: F401
    allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters)
from spark_dl.torch.mpi_ops import *  # noqa: F401,F403
from spark_dl.torch.mpi_ops import __all__ as _ops_all
from spark_dl.torch.optimizer import DistributedOptimizer  # noqa: F401
from spark_dl.torch.sync_batch_norm import SyncBatchNorm  # noqa: F401
from spark_dl.torch import elastic  # noqa: F401,E402 - hvd.elastic.run, hvd.elastic.TorchState

__all__ = list(_ops_all) + [
    "Compression", "DistributedOptimizer", "SyncBatchNorm", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather_object", "SdlError",
    "HorovodInternalError", "PeerFailureError", "MismatchError", "DuplicateNameError",
    "InvalidArgumentError", "NotInitializedError", "OpTimeoutError", "ShutdownError",
    "flight_recorder", "autotune_state", "elastic",
]
