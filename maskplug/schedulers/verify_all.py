"""``verify-all``: fixed-width speculation, every scheduled draft that fits the row limit."""

from __future__ import annotations

from ..budget import BudgetDecision
from ._stateless import StatelessScheduler
from .protocol import StepView

__all__ = ["VerifyAllScheduler"]


class VerifyAllScheduler(StatelessScheduler):
    """Fixed-width speculation: verify every scheduled draft (as many as the row limit allows)."""

    name = "verify-all"

    def budget(self, step: StepView) -> BudgetDecision:
        """``step.cap``; expected tokens from the view's confidences when it has them (NaN otherwise)."""
        return step.score(step.cap)
