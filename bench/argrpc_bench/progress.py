"""Progress on stderr: a redrawn bar on a terminal, plain lines otherwise.

stdout is left to the results (tables, paths) so ``argrpc-bench ... > out.txt`` captures
only those. A log file or CI console gets one line per step instead of a bar, because
carriage-return redraws turn into megabytes of noise there.
"""
from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, TextIO

ProgressFn = Callable[[str, float], None]

_BAR_WIDTH = 24
_MIN_REDRAW_S = 0.1  # redraw a terminal bar at most 10 times a second


class Progress:
    """Overall progress over ``total_steps`` runs, each reporting its own 0..1 fraction.

    ``step(title)`` returns the callback to hand to ``runner.run`` for the next run; the
    runner calls it with ``(label, fraction_of_this_run)``.
    """

    def __init__(self, total_steps: int, stream: TextIO | None = None,
                 tty: bool | None = None) -> None:
        self.total = max(1, total_steps)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.index = -1
        self.title = ""
        self._last_label = ""
        self._last_draw = 0.0
        self._started = time.monotonic()
        self._line_len = 0

    def step(self, title: str) -> ProgressFn:
        self.index = min(self.index + 1, self.total - 1)
        self.title = title
        self._last_label = ""
        self.update("", 0.0)
        return self.update

    def update(self, label: str, fraction: float) -> None:
        fraction = min(1.0, max(0.0, float(fraction)))
        overall = (self.index + fraction) / self.total
        text = f"{self.title}: {label}" if label else self.title
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw < _MIN_REDRAW_S and fraction < 1.0 \
                    and label == self._last_label:
                return
            self._last_draw = now
            self._last_label = label
            filled = int(round(overall * _BAR_WIDTH))
            bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
            elapsed = now - self._started
            line = f"[{bar}] {overall * 100:3.0f}% {elapsed:5.0f}s  {text}"
            # a line wider than the terminal wraps, and "\r" then redraws only its tail
            width = shutil.get_terminal_size((100, 24)).columns - 1
            line = line[:max(20, width)]
            pad = max(0, self._line_len - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._line_len = len(line)
            self.stream.flush()
        elif label != self._last_label or (label == "" and fraction == 0.0):
            # one line per new label: the fraction alone changing is not news in a log
            self._last_label = label
            self.stream.write(f"[{overall * 100:3.0f}%] {text}\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        """A line that must not be overwritten by the bar (warnings, skipped transports)."""
        if self.tty and self._line_len:
            self.stream.write("\r" + " " * self._line_len + "\r")
            self._line_len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._line_len:
            self.stream.write("\n")
            self._line_len = 0
        self.stream.flush()
