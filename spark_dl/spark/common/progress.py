"""Training progress: rank 0 reports events on its stdout, the driver shows them.

Workers' output reaches the driver line by line, prefixed with the rank
(``[0]<stdout>:...``). Rank 0's :class:`Reporter` prints events as one marked JSON line
each; the estimator hands a :class:`ProgressDisplay` to the backend as the workers' output
stream, and the display turns marked lines into

- one line per epoch (epoch, loss, val_loss, metrics, rows/s, seconds), always;
- a live progress bar during each epoch, when the driver's stdout is a terminal (redrawn in
  place with ``\\r``) or a Jupyter notebook (an updated display);

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

__all__ = ["MARK", "Reporter", "ProgressDisplay", "format_metrics",
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


class _Bar:
    """Where the live bar is drawn: a terminal line, a notebook display, or nowhere."""

    def __init__(self, out: TextIO):
        self.out = out
        self.kind = None
        self.handle = None
        self.shown = False
        if getattr(out, "isatty", lambda: False)():
            self.kind = "tty"
        else:
            try:
                from IPython import get_ipython

                shell = get_ipython()
                if shell is not None and getattr(shell, "kernel", None) is not None:
                    self.kind = "notebook"
            except Exception:  # no IPython: no notebook bar
                pass

    def draw(self, text: str) -> None:
        if self.kind == "tty":
            self.out.write("\r" + text + "\x1b[K")
            self.out.flush()
            self.shown = True
        elif self.kind == "notebook":
            from IPython.display import display

            if self.handle is None:
                self.handle = display(text, display_id=True)
            else:
                self.handle.update(text)
            self.shown = True

    def clear(self) -> None:
        if not self.shown:
            return
        if self.kind == "tty":
            self.out.write("\r\x1b[K")
            self.out.flush()
        elif self.kind == "notebook" and self.handle is not None:
            self.handle.update("")
            self.handle = None
        self.shown = False


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
        self._bar = _Bar(self.out) if verbose else None
        self._epochs = None
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
                self._bar.clear()

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
        """A line of the estimator's own (the bar is cleared first)."""
        with self._lock:
            if self._bar:
                self._bar.clear()
            self.out.write(text + "\n")
            self.out.flush()

    def _event(self, e: dict) -> None:
        kind = e.get("kind")
        if kind == "start":
            self._epochs = e.get("epochs")
        elif kind == "step" and self._bar and self._bar.kind:
            steps = max(int(e.get("steps") or 1), 1)
            done = min(int(e.get("step", 0)), steps)
            filled = int(_BAR_WIDTH * done / steps)
            bar = "=" * filled + (">" if filled < _BAR_WIDTH else "") + \
                  " " * max(_BAR_WIDTH - filled - 1, 0)
            text = (f"Epoch {e.get('epoch')}/{self._epochs or '?'} [{bar}] {done}/{steps}"
                    f" - loss {_fmt(e.get('loss'))}")
            self._bar.draw(text)
        elif kind == "epoch":
            logs = e.get("logs", {})
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

        sc = SparkContext._active_spark_context
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
