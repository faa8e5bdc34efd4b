"""What the ``maskplug`` commands show a person: progress on stderr and plain-text tables, drawn with rich.

:class:`Progress` redraws one line in place on a terminal; elsewhere (CI
logs, pipes) it prints one line at every tenth of the work, so logs stay
short. :func:`render_table` lays out a table as plain text (no colour, no
markup), the same wherever it is printed.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterable, Sequence
from typing import Literal, TextIO

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as _RichProgress
from rich.table import Column, Table
from rich.text import Text

__all__ = ["Justify", "Progress", "render_table"]

Justify = Literal["left", "right"]


class Progress:
    """``Progress(total, label)``; call :meth:`update` with the work done, :meth:`close` at the end.

    Also a context manager that closes it, so an error leaves the terminal as it was.

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
        self.enabled = enabled
        self.done = 0
        self.note = ""
        self._last_tenth = -1
        self._bar: _RichProgress | None = None
        self._task = TaskID(0)
        self._live = False
        if not enabled:
            return
        self._console = Console(
            file=stream if stream is not None else sys.stderr, highlight=False, markup=False, emoji=False
        )
        self._live = self._console.is_terminal and not self._console.is_dumb_terminal
        self._bar = _RichProgress(
            TextColumn("{task.description}", table_column=Column(no_wrap=True)),
            BarColumn(bar_width=width),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[note]}", markup=False, table_column=Column(no_wrap=True, overflow="ellipsis")),
            console=self._console,
            auto_refresh=self._live,
            refresh_per_second=10,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task = self._bar.add_task(label, total=self.total, note="")
        if self._live:
            self._bar.start()

    def update(self, done: int, note: str = "") -> None:
        """Set the work done so far (and an optional short note)."""
        self.done = int(done)
        self.note = note
        if self._bar is None:
            return
        self._bar.update(self._task, completed=min(self.done, self.total), note=note)
        if not self._live:
            tenth = int(10 * min(self.done / self.total, 1.0))
            if tenth > self._last_tenth:
                self._last_tenth = tenth
                self._console.print(self._bar.make_tasks_table(self._bar.tasks))

    def close(self) -> None:
        """Finish the display (on a terminal the last state stays on screen); closing twice is harmless."""
        if self._bar is not None and self._live:
            self._bar.stop()
            self._live = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def render_table(
    columns: Sequence[tuple[str, Justify]],
    rows: Iterable[Sequence[str]],
) -> str:
    """A plain-text table: the header, a rule, one line per row; no trailing spaces, no final newline.

    Args:
        columns: ``(header, justify)`` per column, ``justify`` ``"left"`` or ``"right"``.
        rows: the cells of each row, already formatted, as many as ``columns``.
    """
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), header_style="")
    for header, justify in columns:
        table.add_column(Text(header), justify=justify, no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    buf = io.StringIO()
    Console(file=buf, width=10_000, color_system=None, force_terminal=False, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())
