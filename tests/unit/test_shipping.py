"""A model class in the user's own module, which the executors cannot import, travels by
value (spark_dl.spark.common.shipping; issue 33)."""

import os
import subprocess
import sys
import textwrap

import cloudpickle
import pytest

from spark_dl.spark.common import shipping

pytestmark = pytest.mark.timeout(120)

MODULE = '''
import math

SCALE = 3.0


def helper(v):
    return math.floor(v * SCALE)


class Net:
    def __init__(self, bias):
        self.bias = bias

    def __call__(self, v):
        return helper(v) + self.bias
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``sdl_user_models_<id>`` in a folder on this process's sys.path only."""
    name = f"sdl_user_models_{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    yield module
    sys.modules.pop(name, None)


def _call_in_fresh_python(blob: bytes, tmp_path) -> subprocess.CompletedProcess:
    """Unpickles ``blob`` and calls it with 2.0 in a Python that lacks the user's folder."""
    path = tmp_path / "blob.pkl"
    path.write_bytes(blob)
    code = textwrap.dedent(f"""
        import pickle
        with open({str(path)!r}, "rb") as f:
            print(pickle.load(f)(2.0))
    """)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd="/", timeout=60)


def test_the_users_module_is_judged_missing_and_installed_ones_are_not(user_module):
    assert shipping.executors_lack(user_module.__name__)
    for installed in ("numpy", "os", "spark_dl.spark.common.shipping", "cloudpickle",
                      "pytest"):
        __import__(installed)
        assert not shipping.executors_lack(installed), installed


def test_a_package_from_a_site_packages_folder_elsewhere_is_installed(tmp_path, monkeypatch):
    # Cluster and notebook libraries live in site-packages folders that a .pth line
    # (``import site; site.addsitedir(...)``) or the platform puts on sys.path.
    site_dir = tmp_path / "libs" / "lib" / "python3" / "site-packages"
    name = f"sdl_cluster_lib_{os.getpid()}"
    (site_dir / name).mkdir(parents=True)
    (site_dir / name / "__init__.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(site_dir))
    try:
        __import__(name)
        assert not shipping.executors_lack(name)
    finally:
        sys.modules.pop(name, None)


def test_a_class_from_the_users_module_loads_where_the_module_is_missing(user_module,
                                                                        tmp_path):
    net = user_module.Net(bias=1)
    by_reference = _call_in_fresh_python(cloudpickle.dumps(net), tmp_path)
    assert "ModuleNotFoundError" in by_reference.stderr  # what workers met before
    shipped = _call_in_fresh_python(shipping.dumps_for_workers(net), tmp_path)
    assert shipped.returncode == 0, shipped.stderr
    assert shipped.stdout.strip() == "7"
    # The registration was for this call only.
    assert user_module.__name__ not in cloudpickle.list_registry_pickle_by_value()


KERAS_MODULE = '''
import keras


class Doubler(keras.layers.Layer):
    def call(self, x):
        return x * 2.0
'''


def test_a_keras_layer_from_the_users_module_loads_where_the_module_is_missing(tmp_path,
                                                                               monkeypatch):
    pytest.importorskip("keras")
    import keras

    from spark_dl.spark.keras import util

    name = f"sdl_user_layers_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(KERAS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    layers = __import__(name)
    try:
        inp = keras.Input((2,))
        data = util.model_to_bytes(keras.Model(inp, layers.Doubler()(inp)))
        # The .keras file names the class by module: Keras must find it in custom_objects.
        custom = util.with_shipped_classes(data, None)
        assert custom == {"Doubler": layers.Doubler}
        assert util.with_shipped_classes(data, {"Doubler": int}) == {"Doubler": int}
        path = tmp_path / "spec.pkl"
        path.write_bytes(shipping.dumps_for_workers((data, custom)))
    finally:
        sys.modules.pop(name, None)
    code = textwrap.dedent(f"""
        import pickle
        import numpy as np
        from spark_dl.spark.keras import util
        with open({str(path)!r}, "rb") as f:
            data, custom = pickle.load(f)
        model = util.model_from_bytes(data, custom)
        print(model.predict_on_batch(np.array([[1.0, 2.0]], dtype="float32")).tolist())
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd="/", timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[[2.0, 4.0]]"
