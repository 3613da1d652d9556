"""Progress of long work on stderr: a line rewritten in place while the work runs
(``[bench kv] 12.4 s``, or ``[demo] model 3/8 MiB ...`` with a bar when the total is known),
then one final line. Shown only when stderr is a terminal or ``--progress`` asks for it;
without a terminal each update is its own line (at most one every ``interval`` seconds), so a
log file stays readable.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Ticker", "add_progress_option", "wanted"]


def add_progress_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress on stderr (default: only when stderr is a terminal)")


def wanted(flag: bool | None, stream: TextIO | None = None) -> bool:
    """``--progress`` / ``--no-progress`` if given, else whether ``stream`` is a terminal."""
    out = stream if stream is not None else sys.stderr
    return bool(flag) if flag is not None else out.isatty()


def _bar(done: float, total: float, width: int = 24) -> str:
    part = min(max(done / total, 0.0), 1.0) if total > 0 else 0.0
    full = int(part * width)
    return "[" + "#" * full + "." * (width - full) + f"] {part * 100:5.1f}%"


class Ticker:
    """A context manager showing ``label``, the elapsed time and, when ``measure`` returns
    ``(done, total)``, a bar and the rate; updated from a daemon thread every ``interval``
    seconds while the block runs (the work itself is not touched)."""

    def __init__(self, label: str, *, enabled: bool, unit: str = "MiB", scale: float = 1 << 20,
                 measure: Callable[[], tuple[float, float]] | None = None,
                 interval: float = 0.5, stream: TextIO | None = None) -> None:
        self.label = label
        self.enabled = enabled
        self.unit = unit
        self.scale = scale
        self.measure = measure
        self.interval = interval
        self.stream = stream if stream is not None else sys.stderr
        self._tty = self.stream.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0

    def line(self) -> str:
        elapsed = time.monotonic() - self._start
        text = f"{self.label} {elapsed:.1f} s"
        if self.measure is not None:
            done, total = self.measure()
            rate = done / self.scale / elapsed if elapsed > 0 else 0.0
            text += (f" {_bar(done, total)} {done / self.scale:.1f}/{total / self.scale:.1f} "
                     f"{self.unit}, {rate:.1f} {self.unit}/s")
        return text

    def _show(self, final: bool = False) -> None:
        text = self.line() + (" (done)" if final else "")
        if self._tty:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._show()

    def __enter__(self) -> "Ticker":
        self._start = time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="kvsp-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._show(final=True)
