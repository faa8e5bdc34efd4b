"""``dspark``: confidence-scheduled budgets from the drafter's (stale) confidences."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..budget import BudgetDecision
from ..errors import BudgetError
from .protocol import StepOutcome, StepView, check_no_config

__all__ = ["DSparkScheduler"]


class DSparkScheduler:
    """Confidence-scheduled budgets: ``choose_budget`` on the view's (stale) confidences.

    The budget maximises expected emitted tokens per millisecond. Needs a
    confidence head; grammar-blind (wrap it in ``grammar-aware`` for that).
    """

    name = "dspark"
    uses_grammar = False

    def __init__(self, **config: Any) -> None:
        check_no_config("dspark", config)

    def beliefs(self, step: StepView) -> npt.NDArray[np.float64]:
        """The drafter's confidences from the view (required)."""
        if step.confidences is None:
            raise BudgetError(
                "confidences: expected the drafter's confidences for the 'dspark' scheduler, got None; "
                "use 'goodput' for drafters without a confidence head"
            )
        return step.confidences

    def budget(self, step: StepView) -> BudgetDecision:
        """``argmax_b est(b) / cost(b)`` with the stale confidences (grammar-blind)."""
        return step.best(self.beliefs(step))

    def observe(self, outcome: StepOutcome) -> None:
        """Nothing to learn: the confidence head already reflects the history."""
