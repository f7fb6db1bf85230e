"""Framework-neutral layer over the native core: init, topology, process sets,
handles, errors and knobs. Front ends re-export what they need from here."""

from spark_dl.common.basics import *  # noqa: F401,F403
from spark_dl.common.exceptions import *  # noqa: F401,F403
from spark_dl.common.handles import Handle, poll, synchronize  # noqa: F401
from spark_dl.common.ops import Adasum, Average, Max, Min, Product, Sum  # noqa: F401
from spark_dl.common.process_sets import (  # noqa: F401
    ProcessSet, add_process_set, global_process_set, remove_process_set)
