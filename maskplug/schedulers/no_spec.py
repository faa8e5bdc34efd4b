"""``no-spec``: no speculation, always budget 0 (bonus token only)."""

from __future__ import annotations

from ..budget import BudgetDecision
from ._stateless import StatelessScheduler
from .protocol import StepView

__all__ = ["NoSpecScheduler"]


class NoSpecScheduler(StatelessScheduler):
    """No speculation: always budget 0, every request emits its bonus token only."""

    name = "no-spec"

    def budget(self, step: StepView) -> BudgetDecision:
        """Always 0."""
        return step.score(0)
