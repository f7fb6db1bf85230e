"""Which GPU a worker uses, without a GPU: the rule of
:func:`spark_dl.spark.launch.task.devices.choose_gpu` fed environments as Spark's task
services write them and device counts as CUDA would report them; the knob and its
Horovod alias; what the task service puts into a worker's environment; the one fallback
warning; the error for a GPU Spark assigned that the worker cannot see."""

import warnings

import pytest

from spark_dl.config import knobs
from spark_dl.spark.launch.task import devices
from spark_dl.spark.launch.task.devices import (GpuFallbackWarning, GpuNotVisibleError,
                                                choose_gpu, use_local_rank_gpu_index)
from spark_dl.spark.launch.task.environment import child_environment, device_environment

pytestmark = pytest.mark.timeout(60)

KNOB, ALIAS = "SDL_SPARK_USE_LOCAL_RANK_GPU_INDEX", "HOROVOD_SPARK_USE_LOCAL_RANK_GPU_INDEX"


@pytest.fixture(autouse=True)
def fresh_warning(monkeypatch):
    """Each test starts before the process's one fallback warning, with no knob set."""
    for var in (KNOB, ALIAS, "SDL_AVAILABLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    devices._warned.clear()
    yield
    devices._warned.clear()


def spark_task(gpus, **more):
    """The environment a task service gives its worker for Spark's ``gpus``."""
    env = device_environment(gpus, more)
    env.update(more)
    return env


# ----------------------------------------------------------------------------- the knob

def test_knob_row_has_the_horovod_alias():
    row = knobs.table()["spark_use_local_rank_gpu_index"]
    assert (row.env, row.fallback_env, row.type, row.default, row.scope) == (
        KNOB, ALIAS, "bool", False, "launcher")


@pytest.mark.parametrize("env, expected", [
    ({}, False),
    ({KNOB: "1"}, True),
    ({ALIAS: "true"}, True),              # Horovod's name alone
    ({KNOB: "0", ALIAS: "1"}, False),     # ours wins
    ({KNOB: " ", ALIAS: "yes"}, True),    # blank counts as unset
])
def test_local_rank_knob_and_alias(env, expected):
    assert use_local_rank_gpu_index(env) is expected


def test_bad_knob_value_names_the_variable():
    with pytest.raises(ValueError, match=f"{ALIAS}=sometimes: expected a boolean"):
        choose_gpu(True, 0, 2, {ALIAS: "sometimes"})


# ----------------------------------------------------------------------------- environment

def test_task_pins_spark_gpus_unless_the_knob_asks_for_local_rank():
    assert device_environment(["3"], {}) == {"SDL_AVAILABLE_DEVICES": "3",
                                             "CUDA_VISIBLE_DEVICES": "3"}
    assert device_environment([], {}) == {"SDL_AVAILABLE_DEVICES": ""}
    assert device_environment(["3"], {ALIAS: "1"}) == {"SDL_AVAILABLE_DEVICES": "3"}


def test_child_environment_reads_the_knob_from_the_jobs_env(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # the executor's own
    pinned = child_environment({}, ["2"])
    assert pinned["CUDA_VISIBLE_DEVICES"] == "2" and pinned["SDL_AVAILABLE_DEVICES"] == "2"
    local = child_environment({KNOB: "1"}, ["2"])  # e.g. from backend_env
    assert local["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and local[KNOB] == "1"
    monkeypatch.setenv(ALIAS, "1")  # or from the executor's environment
    assert child_environment({}, ["2"])["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


# ----------------------------------------------------------------------------- the rule

@pytest.mark.parametrize("gpus, env, local_rank, count, expected", [
    (["3"], {}, 1, 1, 0),                       # pinned by the task: cuda:0
    (["1", "2"], {}, 0, 2, 0),                  # several assigned: the first
    ([], {}, 3, 2, 1),                          # no Spark GPUs: local rank modulo GPUs
    (["3"], {KNOB: "1"}, 1, 4, 1),              # knob: local rank, whatever Spark said
    (["3"], {ALIAS: "1"}, 6, 4, 2),             # Horovod's name, modulo the GPUs
])
def test_choice(gpus, env, local_rank, count, expected):
    assert choose_gpu(True, local_rank, count, spark_task(gpus, **env)) == expected


def test_assigned_address_maps_through_cuda_visible_devices():
    # An executor that narrowed CUDA_VISIBLE_DEVICES itself (a container with GPUs 2,3).
    env = {"SDL_AVAILABLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert choose_gpu(True, 0, 2, env) == 1
    with pytest.raises(GpuNotVisibleError, match=r"'5'.*CUDA_VISIBLE_DEVICES=2,3 hides it"):
        choose_gpu(True, 0, 2, {"SDL_AVAILABLE_DEVICES": "5", "CUDA_VISIBLE_DEVICES": "2,3"})


def test_assigned_address_that_is_no_cuda_index_is_an_error():
    env = {"SDL_AVAILABLE_DEVICES": "GPU-8f3a"}
    with pytest.raises(GpuNotVisibleError, match="not a CUDA device index.*LOCAL_RANK_GPU"):
        choose_gpu(True, 0, 2, env)
    with pytest.raises(GpuNotVisibleError, match="not a CUDA device index"):
        choose_gpu(True, 0, 2, {"SDL_AVAILABLE_DEVICES": "4"})  # beyond the 2 GPUs
    assert choose_gpu(True, 1, 2, dict(env, **{KNOB: "1"})) == 1


def test_use_gpu_false_is_the_cpu_whatever_spark_assigned():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_gpu(False, 0, 2, spark_task(["0"])) is None
        assert choose_gpu(False, 0, 0, spark_task(["0"])) is None  # no error either


def test_gpu_spark_assigned_but_invisible_is_a_clear_error():
    with pytest.raises(GpuNotVisibleError) as info:
        choose_gpu(True, 0, 0, spark_task(["0", "1"]), what="training")
    text = str(info.value)
    assert "Spark assigned GPU(s) 0,1 to this task" in text
    assert "sees no CUDA device" in text and "CUDA_VISIBLE_DEVICES=0,1" in text
    assert "use_gpu=False" in text


def test_knob_without_any_gpu_falls_back_instead_of_failing():
    # With the knob Spark's assignment is ignored, so a GPU-less host is a plain fallback.
    with pytest.warns(GpuFallbackWarning):
        assert choose_gpu(True, 0, 0, spark_task(["0"], **{KNOB: "1"})) is None


def test_fallback_warns_once_per_process():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            assert choose_gpu(True, 0, 0, {}) is None
    fallbacks = [w for w in seen if issubclass(w.category, GpuFallbackWarning)]
    assert len(fallbacks) == 1
    assert "training runs on the CPU" in str(fallbacks[0].message)
    assert "use_gpu=False" in str(fallbacks[0].message)


def test_fallback_warning_only_where_asked():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert choose_gpu(True, 1, 0, {}, warn=False) is None
    assert not seen
    with pytest.warns(GpuFallbackWarning, match="transform runs on the CPU"):
        choose_gpu(True, 0, 0, {}, what="transform")


# ------------------------------------------------------------- use_gpu left at its default
# The estimators pass None when use_gpu was not set: a GPU when there is one, and on a host
# without one an info line instead of the GpuFallbackWarning an explicit use_gpu=True gives.


def test_default_uses_a_gpu_when_there_is_one():
    assert choose_gpu(None, 1, 2, {}) == 1
    assert choose_gpu(None, 0, 2, spark_task(["1"])) == 0  # Spark's GPU, pinned


def test_default_without_a_gpu_is_one_info_line_and_no_warning(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        for _ in range(3):
            assert choose_gpu(None, 0, 0, {}) is None
        assert choose_gpu(None, 1, 0, {}, warn=False) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["spark_dl: no CUDA device here: training runs on the CPU "
                     "(use_gpu=False chooses the CPU without this line)"]


def test_default_with_a_spark_gpu_the_worker_cannot_see_still_fails():
    with pytest.raises(GpuNotVisibleError):
        choose_gpu(None, 0, 0, spark_task(["0"]))


def test_only_an_explicit_use_gpu_reaches_the_workers():
    pytest.importorskip("pyspark")
    pytest.importorskip("torch")
    from spark_dl.spark.torch import TorchEstimator

    assert TorchEstimator()._use_gpu() is None
    assert TorchEstimator().getUseGpu() is True  # Horovod's getter keeps its default
    assert TorchEstimator(use_gpu=True)._use_gpu() is True
    assert TorchEstimator(use_gpu=False)._use_gpu() is False
