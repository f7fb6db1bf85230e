"""spark_dl.common.native: the core with MPI where Open MPI loads, the one without elsewhere.

The wheel's ``_core`` links Open MPI's ``libmpi.so.40``; where that library is missing the
import fails and spark_dl must load ``_core_nompi`` instead, and every MPI feature must say
what to install. Here the failure is made by an import hook in a child process (the real
missing library is tested on the installed wheel: tests/install/test_wheel.py).
"""

import subprocess
import sys
import textwrap

import pytest

core = pytest.importorskip("spark_dl._core")
nompi = pytest.importorskip("spark_dl._core_nompi",
                            reason="this build has no _core_nompi (SDL_MPI_OPTIONAL=OFF or no MPI)")

BLOCK_CORE = textwrap.dedent("""
    import importlib.abc, sys
    class NoMpiLibrary(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "spark_dl._core":
                raise ImportError("libmpi.so.40: cannot open shared object file: No such file or directory")
    sys.meta_path.insert(0, NoMpiLibrary())
""")


def _run(code):
    proc = subprocess.run([sys.executable, "-c", BLOCK_CORE + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_source_build_loads_core_with_mpi():
    from spark_dl.common import native

    assert native.core is core
    if core.build_info()["mpi"]:
        assert native.mpi_missing_reason() == ""


def test_missing_libmpi_falls_back_and_says_what_to_install():
    out = _run("""
        from spark_dl.common import native
        import spark_dl.numpy as sdl
        print(native.core.__name__, native.core.build_info()["mpi"])
        print(native.mpi_missing_reason())
        try:
            sdl.init(comm=[0])
        except Exception as exc:
            print(type(exc).__name__, exc)
        sdl.init()
        import numpy as np
        print(sdl.allreduce(np.ones(2, np.float32)).tolist())
    """).splitlines()
    assert out[0] == "spark_dl._core_nompi False"
    assert "libmpi.so.40" in out[1] and "install Open MPI" in out[1]
    assert out[2].startswith("InvalidArgumentError") and "libmpi.so.40" in out[2]
    assert out[3] == "[1.0, 1.0]"


def test_other_import_errors_of_a_source_build_are_not_hidden(tmp_path):
    # Without _core_nompi next to it, a failing _core is the error the user sees.
    out = _run("""
        import importlib.abc, sys
        class NoFallback(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "spark_dl._core_nompi":
                    raise ModuleNotFoundError(name=name)
        sys.meta_path.insert(0, NoFallback())
        try:
            import spark_dl.common.native
        except ImportError as exc:
            print("ImportError", exc)
    """)
    assert out.startswith("ImportError libmpi.so.40"), out
