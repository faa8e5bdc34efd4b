"""``no-spec``: no speculation, always budget 0 (bonus token only)."""

from __future__ import annotations

from typing import Any

from ..budget import BudgetDecision
from .protocol import StepOutcome, StepView, check_no_config

__all__ = ["NoSpecScheduler"]


class NoSpecScheduler:
    """No speculation: always budget 0, every request emits its bonus token only."""

    name = "no-spec"
    uses_grammar = False

    def __init__(self, **config: Any) -> None:
        check_no_config("no-spec", config)

    def budget(self, step: StepView) -> BudgetDecision:
        """Always 0."""
        return step.score(0)

    def observe(self, outcome: StepOutcome) -> None:
        """Nothing to learn."""
