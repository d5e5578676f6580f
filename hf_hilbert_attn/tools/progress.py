"""Progress of the long commands (eval, calibrate, quality, bench), whatever stderr is.

On a terminal a stage is a tqdm bar, as before. When stderr is not a terminal (a log file, a
pipe, a CI job) a bar would be silent, so a stage prints lines instead: one when it starts, one
when it ends, and while it runs at most one every ``HF_HILBERT_PROGRESS_SECONDS`` seconds
(default 10) — also when a single step takes longer than that::

    calibrate (needle mass): started, 0/30 prompts
    calibrate (needle mass): 12/30 prompts, 40s elapsed, ~1m00s left
    calibrate (needle mass): done, 30/30 prompts in 1m41s

:func:`progress_bar` takes tqdm's arguments (``iterable``, ``total``, ``desc``, ``unit``,
``disable``, ...) and returns an object with tqdm's ``update``, ``set_postfix_str``,
``set_description``, ``close``, iteration and ``with``. :func:`stage` prints one line (only when
stderr is not a terminal). Nothing here imports torch; tqdm is imported only for a terminal.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Iterable, Optional, Sequence, TextIO

__all__ = ["progress_bar", "stage", "is_terminal", "interval_seconds", "format_seconds",
           "LineProgress", "INTERVAL_ENV"]

INTERVAL_ENV = "HF_HILBERT_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 10.0


def interval_seconds() -> float:
    """Seconds between two progress lines of one stage (``HF_HILBERT_PROGRESS_SECONDS``,
    default 10; 0: a line per step)."""
    try:
        v = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL))
    except ValueError:
        return DEFAULT_INTERVAL
    return v if v >= 0 else DEFAULT_INTERVAL


def is_terminal(stream: Optional[TextIO] = None) -> bool:
    """Whether ``stream`` (default: stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed stream
        return False


def format_seconds(s: float) -> str:
    """``8s``, ``2m10s``, ``1h02m``."""
    s = int(round(max(0.0, s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _write(stream: TextIO, line: str) -> None:
    try:
        stream.write(line + "\n")
        stream.flush()
    except (ValueError, OSError):  # the stream went away (closed log, test capture ended)
        pass


def stage(text: str, *, enabled: bool = True, stream: Optional[TextIO] = None) -> None:
    """One line, ``text``, on stderr when it is not a terminal (a terminal has the bars)."""
    stream = sys.stderr if stream is None else stream
    if enabled and not is_terminal(stream):
        _write(stream, text)


class _Null:
    """A disabled bar: tqdm's interface, no output."""

    def __init__(self, iterable=None):
        self.iterable = iterable
        self.n = 0

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_description(self, desc: str = "", refresh: bool = True) -> None:
        pass

    def write(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LineProgress(_Null):
    """A bar for a stream that is not a terminal: progress as whole lines, at a bounded rate.

    A line when it starts, one when it closes, and in between at most one every ``interval``
    seconds: on :meth:`update`, or from a timer thread while one step runs longer than that.
    A line: ``DESC: N/TOTAL UNIT (POSTFIX), ELAPSED elapsed, ~LEFT left``. ``weights``: each
    step's expected cost (``total`` of them; e.g. a benchmark's lengths squared): the time left
    is the finished steps' seconds per unit of cost times the cost to come, not an average step.
    """

    def __init__(self, iterable: Optional[Iterable] = None, *, total: Optional[int] = None,
                 desc: str = "", unit: str = "it", stream: Optional[TextIO] = None,
                 interval: Optional[float] = None, weights: Optional[Sequence[float]] = None,
                 **_tqdm_kwargs):
        super().__init__(iterable)
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        if weights is not None and (len(weights) != total or min(weights, default=1) <= 0):
            raise ValueError(f"weights must be {total} positive numbers, got {weights}")
        self.total, self.desc, self.unit, self.weights = total, desc, unit, weights
        self.stream = sys.stderr if stream is None else stream
        self.interval = interval_seconds() if interval is None else float(interval)
        self.postfix = ""
        self.t0 = self.last = self.stepped = time.monotonic()  # (stepped: the last update)
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        count = f"0/{total} {unit}" if total is not None else unit
        _write(self.stream, f"{desc}: started, {count}")
        self._timer = None
        if self.interval > 0:
            self._timer = threading.Thread(target=self._beat, name="hf-hilbert-progress",
                                           daemon=True)
            self._timer.start()

    # -- lines
    def _count(self) -> str:
        if self.total is not None:
            return f"{self.n}/{self.total} {self.unit}"
        return f"{self.n} {self.unit}"

    def _line(self) -> str:
        elapsed = time.monotonic() - self.t0
        text = f"{self.desc}: {self._count()}"
        if self.postfix:
            text += f" ({self.postfix})"
        text += f", {format_seconds(elapsed)} elapsed"
        if self.total and 0 < self.n < self.total:
            text += f", ~{format_seconds(self._left(elapsed))} left"
        return text

    def _left(self, elapsed: float) -> float:
        if self.weights is None:
            return elapsed / self.n * (self.total - self.n)
        done, now = sum(self.weights[:self.n]), self.stepped - self.t0
        rate = now / done  # seconds per unit of cost, over the finished steps
        after = rate * sum(self.weights[self.n + 1:])  # the steps after the running one
        return max(rate * self.weights[self.n] - (elapsed - now), 0.0) + after

    def _maybe_emit(self) -> None:
        with self._lock:
            now = time.monotonic()
            if self._closed or now - self.last < self.interval:
                return
            self.last = now
            _write(self.stream, self._line())

    def _beat(self) -> None:
        while not self._stop.wait(min(self.interval, 1.0) if self.interval else 1.0):
            self._maybe_emit()

    # -- tqdm's interface
    def update(self, n: int = 1) -> None:
        self.n += n
        self.stepped = time.monotonic()
        self._maybe_emit()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def set_description(self, desc: str = "", refresh: bool = True) -> None:
        self.desc = str(desc)

    def write(self, s: str) -> None:
        _write(self.stream, s)

    def __iter__(self):
        try:
            for x in super().__iter__():
                yield x
                self.update(1)
        finally:
            self.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(timeout=2.0)
        took = format_seconds(time.monotonic() - self.t0)
        _write(self.stream, f"{self.desc}: done, {self._count()} in {took}")


def progress_bar(iterable: Optional[Iterable] = None, *, desc: str = "",
                 total: Optional[int] = None, unit: str = "it", disable: bool = False,
                 leave: Optional[bool] = None, stream: Optional[TextIO] = None,
                 terminal_bar: bool = True, weights: Optional[Sequence[float]] = None,
                 **tqdm_kwargs):
    """A progress bar for one stage of a long command, with tqdm's arguments.

    ``disable``: no output at all (``--no-progress``, a non-zero rank). Otherwise, stderr (or
    ``stream``) a terminal: a tqdm bar (``leave``, unless None, and the other keywords go to
    tqdm; with
    ``terminal_bar=False`` none, for a command whose own lines show progress there); not a
    terminal: a :class:`LineProgress` (``weights``: its steps' costs, for the time left).
    """
    stream = sys.stderr if stream is None else stream
    if disable:
        return _Null(iterable)
    if is_terminal(stream):
        if not terminal_bar:
            return _Null(iterable)
        from tqdm.auto import tqdm

        if leave is not None:
            tqdm_kwargs["leave"] = leave
        # (disable=False: a terminal of ours draws, whatever TQDM_DISABLE says for others')
        return tqdm(iterable, desc=desc, total=total, unit=unit, file=stream, disable=False,
                    **tqdm_kwargs)
    return LineProgress(iterable, total=total, desc=desc, unit=unit, stream=stream,
                        weights=weights)
