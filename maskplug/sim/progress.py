"""A small progress display on stderr (no dependency).

On a terminal it redraws one line in place; elsewhere (CI logs, pipes) it
prints a line at every tenth of the work, so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``Progress(total, label)``; call :meth:`update` with the work done, :meth:`close` at the end.

    Args:
        total: units of work in all.
        label: what is being done (shown in front of the bar).
        stream: where to draw (default ``sys.stderr``).
        enabled: ``False`` draws nothing.
        width: bar width in characters.
    """

    def __init__(
        self, total: int, label: str = "", stream: TextIO | None = None, enabled: bool = True, width: int = 30
    ) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.done = 0
        self.start = time.perf_counter()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_tenth = -1
        self._last_draw = 0.0
        self.note = ""

    def _line(self) -> str:
        frac = min(self.done / self.total, 1.0)
        fill = round(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        elapsed = time.perf_counter() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        tail = f" {self.note}" if self.note else ""
        return f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s eta {eta:4.0f}s{tail}"

    def update(self, done: int, note: str = "") -> None:
        """Set the work done so far (and an optional short note)."""
        self.done = int(done)
        self.note = note
        if not self.enabled:
            return
        if self.tty:
            now = time.perf_counter()
            if now - self._last_draw >= 0.1 or self.done >= self.total:
                self._last_draw = now
                self.stream.write("\r\x1b[2K" + self._line())
                self.stream.flush()
        else:
            tenth = int(10 * min(self.done / self.total, 1.0))
            if tenth > self._last_tenth:
                self._last_tenth = tenth
                self.stream.write(self._line() + "\n")
                self.stream.flush()

    def close(self) -> None:
        """Finish the line."""
        if self.enabled and self.tty:
            self.stream.write("\r\x1b[2K" + self._line() + "\n")
            self.stream.flush()
