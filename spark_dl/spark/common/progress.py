"""Training progress: rank 0 reports events on its stdout, the driver shows them.

Workers' output reaches the driver line by line, prefixed with the rank
(``[0]<stdout>:...``). Rank 0's :class:`Reporter` prints events as one marked JSON line
each; the estimator hands a :class:`ProgressDisplay` to the backend as the workers' output
stream, and the display turns marked lines into

- one plain line per epoch (epoch, loss, val_loss, metrics, rows/s, seconds), always;
- a live progress bar, where :func:`bar_kind` finds one fits: in a Jupyter notebook (a
  kernel) one bar per fit, updated in place for each epoch above the epoch lines (tqdm's
  notebook bar over ipywidgets, else an updated IPython display); in a terminal a line
  redrawn with ``\\r``; elsewhere (pipes, files, CI logs) none;

and passes every other line through unchanged. A custom backend that does not forward
output simply shows nothing.

While the workers train, :func:`spark_console_progress_paused` keeps Spark's own console
progress bar (``[Stage 4:> (0 + 2) / 2]``, on by default in sessions started from Python)
from drawing over these lines.
"""

import contextlib
import json
import math
import sys
import threading
import time
from typing import Callable, Dict, Iterator, Optional, Sequence, TextIO

__all__ = ["MARK", "Reporter", "ProgressDisplay", "bar_kind", "format_metrics",
           "spark_console_progress_paused"]

#: Prefix of an event line on rank 0's stdout.
MARK = "@@spark_dl.progress@@ "
_STEP_INTERVAL_S = 0.5   # rank 0 reports a step at most this often
_BAR_WIDTH = 28


class Reporter:
    """Prints events (rank 0 only; elsewhere every call is a no-op)."""

    def __init__(self, enabled: bool, out: Optional[TextIO] = None, steps: bool = True):
        self.enabled = enabled
        self.steps = steps
        self._out = out
        self._last_step = 0.0

    def event(self, kind: str, **fields) -> None:
        if self.enabled:
            out = self._out or sys.stdout
            out.write(MARK + json.dumps({"kind": kind, **fields}, default=float) + "\n")
            out.flush()

    def step_due(self) -> bool:
        """Whether a step report is due (so the caller computes its numbers only then)."""
        if not (self.enabled and self.steps):
            return False
        now = time.monotonic()
        if now - self._last_step < _STEP_INTERVAL_S:
            return False
        self._last_step = now
        return True

    def note(self, text: str) -> None:
        self.event("note", text=text)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def format_metrics(logs: Dict[str, float]) -> str:
    """``loss 0.1234, val_loss 0.2, mae 0.05`` (loss first, then the rest in order)."""
    keys = [k for k in ("loss", "val_loss") if k in logs]
    keys += [k for k in logs if k not in keys]
    return ", ".join(f"{k} {_fmt(logs[k])}" for k in keys)


def bar_kind(out: Optional[TextIO] = None) -> str:
    """Which live bar suits ``out`` (None: ``sys.stdout``).

    Returns:
        ``"notebook"`` where ``out`` is this process's stdout and the process is a Jupyter
        kernel (IPython with a kernel: a terminal IPython has none), ``"terminal"`` where
        ``out`` is a terminal, else ``"plain"`` (pipes, files, CI logs: no bar, only the
        epoch lines).
    """
    if out is None or out is sys.stdout:
        # A kernel has imported IPython long before this; elsewhere IPython is not imported
        # just to find out.
        ipython = sys.modules.get("IPython")
        try:
            shell = ipython.get_ipython() if ipython is not None else None
        except Exception:  # a half-imported or replaced IPython: no notebook
            shell = None
        if getattr(shell, "kernel", None) is not None:
            return "notebook"
    try:
        tty = bool((out or sys.stdout).isatty())
    except Exception:  # a stream without isatty, or a closed one
        tty = False
    return "terminal" if tty else "plain"


def _bar_text(epoch, epochs, done: int, steps: int, loss) -> str:
    filled = int(_BAR_WIDTH * done / steps)
    bar = "=" * filled + (">" if filled < _BAR_WIDTH else "") + \
          " " * max(_BAR_WIDTH - filled - 1, 0)
    return f"Epoch {epoch}/{epochs or '?'} [{bar}] {done}/{steps} - loss {_fmt(loss)}"


class _TerminalBar:
    """A terminal line redrawn with ``\\r``; cleared before any other line is printed."""

    def __init__(self, out: TextIO):
        self.out = out
        self.shown = False

    def update(self, epoch, epochs, done: int, steps: int, loss) -> None:
        self.out.write("\r" + _bar_text(epoch, epochs, done, steps, loss) + "\x1b[K")
        self.out.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self.shown = False

    close = clear


class _NotebookBar:
    """One bar per fit in a notebook cell, updated in place for each epoch.

    The bar is an output of its own: lines printed meanwhile (the epoch lines, workers'
    prints) go below it, so it is never cleared, and it stays at its last state when the
    fit ends. It is tqdm's notebook bar (an ipywidgets progress bar) where tqdm and
    ipywidgets import, else a text line in an updated IPython display (a raw
    ``text/plain`` bundle: no quoted string). Any failure to draw turns the bar off; the
    epoch lines go on.
    """

    def __init__(self):
        self._tqdm = None
        self._handle = None
        self._epoch = None
        self._broken = False

    def update(self, epoch, epochs, done: int, steps: int, loss) -> None:
        if self._broken:
            return
        try:
            self._update(epoch, epochs, done, steps, loss)
        except Exception:  # a display problem must not stop training's output
            self._broken = True

    def _update(self, epoch, epochs, done, steps, loss) -> None:
        desc = f"Epoch {epoch}/{epochs or '?'}"
        if self._tqdm is None and self._handle is None:
            try:
                from tqdm.notebook import tqdm  # raises ImportError without ipywidgets

                self._tqdm = tqdm(total=steps, desc=desc, unit="step", leave=True)
            except Exception:
                self._tqdm = None
        if self._tqdm is not None:
            bar = self._tqdm
            if epoch != self._epoch:
                bar.reset(total=steps)
                bar.set_description(desc, refresh=False)
            bar.n = done
            bar.set_postfix_str(f"loss {_fmt(loss)}", refresh=False)
            bar.refresh()
        else:
            from IPython.display import display

            bundle = {"text/plain": _bar_text(epoch, epochs, done, steps, loss)}
            if self._handle is None:
                self._handle = display(bundle, raw=True, display_id=True)
            else:
                self._handle.update(bundle, raw=True)
        self._epoch = epoch

    def clear(self) -> None:
        pass  # see the class doc

    def close(self) -> None:
        if self._tqdm is not None:
            try:
                self._tqdm.close()  # red if the last epoch did not finish, else green
            except Exception:
                pass
            self._tqdm = None


def _make_bar(out: Optional[TextIO]):
    kind = bar_kind(out)
    if kind == "notebook":
        return _NotebookBar()
    return _TerminalBar(out or sys.stdout) if kind == "terminal" else None


class ProgressDisplay:
    """The driver side: text streams for the workers' stdout/stderr (see the module doc).

    Args:
        verbose: 0 passes worker output through and shows nothing else; >= 1 shows epochs
            and the bar.
        out, err: where lines go (default: ``sys.stdout`` / ``sys.stderr`` at write time).
        listeners: functions called with every event (a dict with ``kind``), whatever
            ``verbose`` is.
    """

    def __init__(self, verbose: int = 1, out: Optional[TextIO] = None,
                 err: Optional[TextIO] = None, listeners: Sequence[Callable] = ()):
        self.verbose = verbose
        self.listeners = list(listeners)
        self._out = out
        self._err = err
        self._lock = threading.RLock()
        self._buffers = {"stdout": "", "stderr": ""}
        self._bar = _make_bar(out) if verbose else None
        self._epochs = None
        self._steps = None  # steps per epoch, from the last step event
        self.events = []  # every event seen, for callers that want them

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    def stream(self, name: str) -> "_Stream":
        """The text stream to give the backend as ``stdout`` or ``stderr``."""
        return _Stream(self, name)

    def _write(self, name: str, text: str) -> None:
        with self._lock:
            buf = self._buffers[name] + text
            *lines, rest = buf.split("\n")
            self._buffers[name] = rest
            for line in lines:
                self._line(name, line)

    def close(self) -> None:
        """Flushes partial lines and removes the bar."""
        with self._lock:
            for name, rest in self._buffers.items():
                if rest:
                    self._line(name, rest)
                self._buffers[name] = ""
            if self._bar:
                self._bar.close()

    def _line(self, name: str, line: str) -> None:
        _, mark, payload = line.partition(MARK)
        if mark:
            try:
                event = json.loads(payload)
            except ValueError:
                event = None
            if event is not None:
                self.events.append(event)
                for listener in self.listeners:
                    listener(event)
                if self.verbose:
                    self._event(event)
                return
        if self._bar:
            self._bar.clear()
        sink = self.out if name == "stdout" else self.err
        sink.write(line + "\n")
        sink.flush()

    def print(self, text: str) -> None:
        """A line of the estimator's own (a terminal's bar is cleared first)."""
        with self._lock:
            if self._bar:
                self._bar.clear()
            self.out.write(text + "\n")
            self.out.flush()

    def _event(self, e: dict) -> None:
        kind = e.get("kind")
        if kind == "start":
            self._epochs = e.get("epochs")
        elif kind == "step" and self._bar:
            steps = self._steps = max(int(e.get("steps") or 1), 1)
            self._bar.update(e.get("epoch"), self._epochs, min(int(e.get("step", 0)), steps),
                             steps, e.get("loss"))
        elif kind == "epoch":
            logs = e.get("logs", {})
            if isinstance(self._bar, _NotebookBar) and self._steps:
                # Step reports come at most every 0.5 s: the last one falls short of the
                # epoch's end, and a short epoch has none.
                self._bar.update(e.get("epoch"), self._epochs, self._steps, self._steps,
                                 logs.get("loss"))
            self.print(f"Epoch {e.get('epoch')}/{self._epochs or '?'}: {format_metrics(logs)}"
                       f" | {e.get('rows_per_s', 0):,.0f} rows/s | {e.get('seconds', 0):.1f}s")
        elif kind == "note":
            self.print(str(e.get("text")))


class _Stream:
    """A write-only text stream feeding one named stream of a ProgressDisplay."""

    def __init__(self, display: ProgressDisplay, name: str):
        self._display = display
        self._name = name

    def write(self, text: str) -> int:
        self._display._write(self._name, text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


#: How often :func:`spark_console_progress_paused` resets Spark's bar: under the 500 ms a
#: stage must run before Spark draws it.
_SPARK_BAR_RESET_S = 0.2


def _spark_connect() -> bool:
    """Whether this process talks to Spark through Spark Connect (Databricks' standard and
    serverless compute, ``builder.remote(...)``): the jobs then run in a server whose
    console bar is not ours, and there is no SparkContext to reach. When it cannot tell,
    True: leaving Spark alone is the safe side."""
    try:
        from pyspark.sql import SparkSession
        from pyspark.sql.utils import is_remote

        if is_remote():
            return True
        active = SparkSession.getActiveSession()
    except Exception:  # a Connect-only client (pyspark-client), or another pyspark
        return True
    return active is not None and type(active).__module__.startswith("pyspark.sql.connect")


@contextlib.contextmanager
def spark_console_progress_paused() -> Iterator[bool]:
    """Keeps the active SparkContext's console progress bar from drawing during the block.

    ``spark.ui.showConsoleProgress`` is read once, when the SparkContext starts (pyspark
    turns it on for sessions started from Python), and no runtime setting hides the bar.
    What Spark does offer: the bar's ``finishAll()`` (called after every job) clears it
    and suppresses it for the next 500 ms. A daemon thread calls it every 200 ms while the
    block runs, so the bar neither draws nor glues itself to the lines printed meanwhile;
    after the block the bar works as before. Yields whether there was a bar to pause (no
    active context, Spark Connect or the bar turned off: nothing to do).
    """
    bar = None
    try:
        from pyspark import SparkContext

        sc = None if _spark_connect() else SparkContext._active_spark_context
        if sc is not None and getattr(sc, "_jsc", None) is not None:
            option = sc._jsc.sc().progressBar()
            bar = option.get() if option.isDefined() else None
    except Exception:  # not a classic py4j session, or another Spark: leave it alone
        bar = None
    if bar is None:
        yield False
        return
    stop = threading.Event()

    def reset():
        while True:
            try:
                bar.finishAll()
            except Exception:  # the context stopped under us
                return
            if stop.wait(_SPARK_BAR_RESET_S):
                return

    thread = threading.Thread(target=reset, name="spark_dl-spark-bar", daemon=True)
    thread.start()
    try:
        yield True
    finally:
        stop.set()
        thread.join(timeout=5)
