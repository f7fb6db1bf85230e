"""A function that cannot be pickled is named with the path to what holds it back."""

import functools
import threading

import pytest

from spark_dl.spark.launch.pickling import dumps_or_explain, find_unpicklable


class _State:
    def __init__(self):
        self.count = 1
        self.lock = threading.Lock()


_GLOBAL_STATE = _State()


def _uses_global(x):
    return _GLOBAL_STATE.count + x


def test_spark_run_names_the_closure_variable_and_attribute():
    import spark_dl.spark

    state = _State()

    def train(x):
        return state.count + x

    # Raised before Spark is touched (no session exists in this test).
    with pytest.raises(TypeError) as info:
        spark_dl.spark.run(train, args=(1,), num_proc=1)
    text = str(info.value)
    assert "spark_dl.spark.run: the function " in text and "train" in text
    assert "state.lock is a _thread.lock object" in text
    assert "cannot pickle '_thread.lock' object" in text


def test_arguments_globals_and_partials_are_named():
    import spark_dl.spark

    with pytest.raises(TypeError, match=r"argument 0 of .*: args\[0\]\.lock is a _thread"):
        spark_dl.spark.run(lambda s: s.count, args=(_State(),), num_proc=1)
    # A function of the main script (pickled by value) and a global it uses.
    scope = {"__name__": "__main__", "STATE": _State()}
    exec("def train(x):\n    return STATE.count + x\n", scope)
    where, part, _ = find_unpicklable(scope["train"], "train")
    assert where == "STATE.lock" and part is scope["STATE"].lock
    # A module-level function of an importable module pickles by reference.
    assert find_unpicklable(_uses_global, "f") is None
    fn = functools.partial(lambda a, b: a, b={"k": [threading.Lock()]})
    where, _, _ = find_unpicklable(fn, "fn")
    assert where == "fn.keywords['b']['k'][0]"


def test_a_picklable_object_is_pickled():
    assert dumps_or_explain({"a": 1}, "x", "x")
