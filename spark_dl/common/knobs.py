"""The configuration knobs (:mod:`spark_dl.config.knobs`), under the runtime's name.

The table and its grammar live in :mod:`spark_dl.config.knobs` (below the runtime, so
launchers read it without loading the native core); this module re-exports them::

    >>> from spark_dl.common import knobs
    >>> knobs.value("fusion_threshold")        # environment, else default
    134217728
"""

from spark_dl.config.knobs import *  # noqa: F401,F403
from spark_dl.config.knobs import __all__  # noqa: F401
