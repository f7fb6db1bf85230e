"""``python -m spark_dl.runner``: the same as the ``sdlrun`` command."""

import sys

from spark_dl.runner.launch import main

if __name__ == "__main__":
    sys.exit(main())
