"""The driver's progress display: which bar it picks (notebook, terminal, plain lines), the
notebook forms (tqdm's widget, else an updated IPython display, else nothing) under a
simulated Jupyter kernel, and the Spark console bar's pause under Spark Connect."""

import io
import sys
import types

import pytest

from spark_dl.spark.common import progress
from spark_dl.spark.common.progress import MARK, ProgressDisplay, bar_kind


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _ipython(monkeypatch, kernel=True, display=None):
    """A fake IPython in sys.modules whose shell has a kernel (a Jupyter kernel) or not (a
    terminal IPython); ``display`` replaces ``IPython.display.display``."""
    shell = types.SimpleNamespace(kernel=object() if kernel else None)
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: shell
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    if display is not None:
        mod = types.ModuleType("IPython.display")
        mod.display = display
        monkeypatch.setitem(sys.modules, "IPython.display", mod)


def _no_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm.notebook", None)  # import raises ImportError


def _fit(display: ProgressDisplay, epochs=2, steps=10, worker_line=True, quiet_epochs=()):
    """The lines of a fit with ``epochs`` epochs, as the workers' stdout carries them
    (epochs in ``quiet_epochs`` are too short for a step report)."""
    out = display.stream("stdout")
    out.write(f'[0]<stdout>:{MARK}{{"kind": "start", "epochs": {epochs}}}\n')
    for epoch in range(1, epochs + 1):
        for step in () if epoch in quiet_epochs else (3, 7):
            out.write(f'[0]<stdout>:{MARK}{{"kind": "step", "epoch": {epoch}, "step": {step},'
                      f' "steps": {steps}, "loss": 0.5}}\n')
        if worker_line:
            out.write("[1]<stdout>:a worker's print\n")
        out.write(f'[0]<stdout>:{MARK}{{"kind": "epoch", "epoch": {epoch}, "logs": '
                  f'{{"loss": 0.25, "val_loss": 0.5}}, "rows_per_s": 1000, "seconds": 1.0}}\n')
    display.close()


# ---------------------------------------------------------------------------- bar_kind

def test_bar_kind_plain_for_pipes_and_files_terminal_for_a_tty():
    assert bar_kind(io.StringIO()) == "plain"
    assert bar_kind(_Tty()) == "terminal"


def test_bar_kind_notebook_under_a_kernel_for_stdout_only(monkeypatch):
    _ipython(monkeypatch, kernel=True)
    assert bar_kind() == "notebook"
    assert bar_kind(sys.stdout) == "notebook"
    # A stream of the caller's own gets lines, even inside a notebook.
    assert bar_kind(io.StringIO()) == "plain"


def test_bar_kind_terminal_ipython_is_not_a_notebook(monkeypatch):
    _ipython(monkeypatch, kernel=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert bar_kind() == "plain"
    monkeypatch.setattr(sys, "stdout", _Tty())
    assert bar_kind() == "terminal"


def test_bar_kind_without_ipython_or_with_a_broken_one(monkeypatch):
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert bar_kind() == "plain"
    broken = types.ModuleType("IPython")
    broken.get_ipython = lambda: 1 / 0
    monkeypatch.setitem(sys.modules, "IPython", broken)
    assert bar_kind() == "plain"


# ---------------------------------------------------------------------------- plain and tty

def test_plain_lines_only_when_not_a_terminal():
    out = io.StringIO()
    _fit(ProgressDisplay(1, out=out, err=io.StringIO()))
    text = out.getvalue()
    assert "\r" not in text and "[====" not in text
    assert text.count("Epoch 1/2: loss 0.25, val_loss 0.5 | 1,000 rows/s | 1.0s\n") == 1
    assert "[1]<stdout>:a worker's print\n" in text and MARK not in text


def test_terminal_bar_is_cleared_before_other_lines():
    out = _Tty()
    _fit(ProgressDisplay(1, out=out, err=io.StringIO()))
    text = out.getvalue()
    assert "\rEpoch 1/2 [========>" in text and "7/10 - loss 0.5" in text
    # Every line printed after a bar starts on a cleared line.
    assert "\r\x1b[K[1]<stdout>:a worker's print\n" in text
    out = _Tty()
    _fit(ProgressDisplay(1, out=out, err=io.StringIO()), worker_line=False)
    assert "\r\x1b[KEpoch 2/2: loss 0.25" in out.getvalue()
    assert out.getvalue().endswith("| 1.0s\n")


# ---------------------------------------------------------------------------- notebook

class _Handle:
    def __init__(self, calls):
        self.calls = calls

    def update(self, obj, **kwargs):
        self.calls.append(("update", obj, kwargs))


def test_notebook_without_tqdm_updates_one_ipython_display(monkeypatch, capsys):
    calls = []

    def display(obj, **kwargs):
        calls.append(("display", obj, kwargs))
        return _Handle(calls)

    _ipython(monkeypatch, display=display)
    _no_tqdm(monkeypatch)
    _fit(ProgressDisplay(1))
    assert [c[0] for c in calls].count("display") == 1  # one bar for the whole fit
    for _, obj, kwargs in calls:
        # A raw text/plain bundle: shown as text, never as a quoted string or ''.
        assert kwargs.get("raw") is True and set(obj) == {"text/plain"}
        assert obj["text/plain"].startswith("Epoch ") and "'" not in obj["text/plain"]
    assert calls[0][2].get("display_id") is True
    # Each epoch's bar ends full (the step reports are throttled short of the end).
    texts = [c[1]["text/plain"] for c in calls]
    assert "Epoch 1/2 [============================] 10/10 - loss 0.25" in texts
    assert texts[-1] == "Epoch 2/2 [============================] 10/10 - loss 0.25"
    out = capsys.readouterr().out
    assert "\r" not in out and "''" not in out
    assert out.count("Epoch 2/2: loss 0.25, val_loss 0.5") == 1
    assert "[1]<stdout>:a worker's print\n" in out


class _FakeTqdm:
    """tqdm.notebook.tqdm's surface that the display uses, recording what it was told."""
    made = []

    def __init__(self, total, desc, **kwargs):
        self.total, self.desc, self.kwargs, self.n = total, desc, kwargs, 0
        self.log, self.closed = [], False
        _FakeTqdm.made.append(self)

    def reset(self, total=None):
        self.total, self.n = total, 0
        self.log.append(("reset", total))

    def set_description(self, desc, refresh=True):
        self.desc = desc

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def refresh(self):
        self.log.append((self.desc, self.n, self.total, self.postfix))

    def close(self):
        self.closed = True


def test_notebook_with_tqdm_reuses_one_widget_bar(monkeypatch, capsys):
    displayed = []
    _ipython(monkeypatch, display=lambda *a, **k: displayed.append(a))
    fake = types.ModuleType("tqdm.notebook")
    fake.tqdm = _FakeTqdm
    monkeypatch.setitem(sys.modules, "tqdm.notebook", fake)
    _FakeTqdm.made = []
    _fit(ProgressDisplay(1), epochs=3, quiet_epochs=(3,))
    assert len(_FakeTqdm.made) == 1 and not displayed
    bar = _FakeTqdm.made[0]
    assert bar.kwargs["leave"] is True and bar.closed
    drawn = [entry for entry in bar.log if entry[0] != "reset"]
    assert drawn[0] == ("Epoch 1/3", 3, 10, "loss 0.5")
    assert ("Epoch 1/3", 10, 10, "loss 0.25") in drawn          # full at the epoch's end
    # An epoch without step reports still ends with its bar full.
    assert drawn[-1] == ("Epoch 3/3", 10, 10, "loss 0.25")
    assert [e for e in bar.log if e[0] == "reset"] == [("reset", 10)] * 3
    assert capsys.readouterr().out.count("Epoch 1/3: loss 0.25") == 1


def test_notebook_display_failure_leaves_the_epoch_lines(monkeypatch, capsys):
    def display(obj, **kwargs):
        raise RuntimeError("no frontend")

    _ipython(monkeypatch, display=display)
    _no_tqdm(monkeypatch)
    _fit(ProgressDisplay(1))
    out = capsys.readouterr().out
    assert out.count("Epoch 1/2: loss 0.25") == 1 and out.count("Epoch 2/2: loss 0.25") == 1


def test_verbose_zero_draws_nothing(monkeypatch, capsys):
    calls = []
    _ipython(monkeypatch, display=lambda *a, **k: calls.append(a))
    _no_tqdm(monkeypatch)
    _fit(ProgressDisplay(0))
    assert not calls
    assert capsys.readouterr().out == "[1]<stdout>:a worker's print\n" * 2


# ---------------------------------------------------------------------------- Spark's bar

def test_spark_bar_pause_is_a_no_op_under_spark_connect(monkeypatch):
    pyspark = pytest.importorskip("pyspark")

    class _NoJsc:
        @property
        def _jsc(self):
            raise AssertionError("a Spark Connect session must not reach sc._jsc")

    monkeypatch.setattr(pyspark.SparkContext, "_active_spark_context", _NoJsc())
    monkeypatch.setattr(progress, "_spark_connect", lambda: True)
    with progress.spark_console_progress_paused() as paused:
        assert paused is False


def test_spark_connect_is_told_by_the_active_session(monkeypatch):
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    remote = type("SparkSession", (), {"__module__": "pyspark.sql.connect.session"})()
    monkeypatch.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: remote))
    assert progress._spark_connect() is True
    monkeypatch.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: None))
    monkeypatch.delenv("SPARK_CONNECT_MODE_ENABLED", raising=False)
    monkeypatch.delenv("SPARK_CONNECT_MODE", raising=False)
    assert progress._spark_connect() is False
    # No session and no context: nothing to pause, no error.
    with progress.spark_console_progress_paused() as paused:
        assert paused is False
