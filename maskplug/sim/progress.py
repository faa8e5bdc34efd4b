"""The progress display of the simulator's commands: :class:`maskplug.console.Progress` (re-exported)."""

from __future__ import annotations

from ..console import Progress

__all__ = ["Progress"]
