"""``verify-all``: fixed-width speculation, every scheduled draft that fits the row limit."""

from __future__ import annotations

from typing import Any

from ..budget import BudgetDecision
from .protocol import StepOutcome, StepView, check_no_config

__all__ = ["VerifyAllScheduler"]


class VerifyAllScheduler:
    """Fixed-width speculation: verify every scheduled draft (as many as the row limit allows)."""

    name = "verify-all"
    uses_grammar = False

    def __init__(self, **config: Any) -> None:
        check_no_config("verify-all", config)

    def budget(self, step: StepView) -> BudgetDecision:
        """``step.cap``; expected tokens from the view's confidences when it has them (NaN otherwise)."""
        return step.score(step.cap)

    def observe(self, outcome: StepOutcome) -> None:
        """Nothing to learn."""
