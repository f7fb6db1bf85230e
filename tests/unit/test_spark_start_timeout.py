"""The Spark launch timeout comes from the knob table, with Horovod's variable as a fallback."""

import pytest

from spark_dl.spark.launch import spark_run


@pytest.mark.parametrize("env,arg,want", [
    ({}, None, 600.0),
    ({"SDL_SPARK_START_TIMEOUT": "42"}, None, 42.0),
    ({"HOROVOD_SPARK_START_TIMEOUT": "7"}, None, 7.0),
    ({"SDL_SPARK_START_TIMEOUT": "42", "HOROVOD_SPARK_START_TIMEOUT": "7"}, None, 42.0),
    ({"SDL_SPARK_START_TIMEOUT": "42"}, 5, 5.0),
])
def test_start_timeout_precedence(monkeypatch, env, arg, want):
    for name in ("SDL_SPARK_START_TIMEOUT", "HOROVOD_SPARK_START_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, text in env.items():
        monkeypatch.setenv(name, text)
    assert spark_run._start_timeout(arg) == want


def test_start_timeout_rejects_bad_values(monkeypatch):
    with pytest.raises(ValueError, match="positive"):
        spark_run._start_timeout(0)
    monkeypatch.setenv("SDL_SPARK_START_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SDL_SPARK_START_TIMEOUT"):
        spark_run._start_timeout(None)
