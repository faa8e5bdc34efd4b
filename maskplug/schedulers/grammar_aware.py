"""``grammar-aware``: any scheduler's budget, corrected with the step's draft masks."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..budget import BudgetDecision, grammar_confidences, host_confidences
from ..errors import BudgetError
from .protocol import Scheduler, StepOutcome, StepView, grammar_limits
from .registry import DEFAULT_SCHEDULER, get_scheduler

__all__ = ["GrammarAwareScheduler"]

FloatArray = npt.NDArray[np.float64]


class GrammarAwareScheduler:
    """Wraps a scheduler and corrects its budget with the step's :class:`DraftMasks`.

    With the wrapped scheduler's per-position beliefs (``dspark``'s
    confidences, ``goodput``'s estimates) it rechooses the budget on
    grammar-corrected survivals: a draft the grammar rejects, and every later
    one, is worth 0; an accepted draft at a position the grammar forces to a
    single token is certain (conditional confidence 1). Since the wrapped
    decision is one of the candidates, the result never has fewer expected
    tokens per millisecond under the corrected survivals. A wrapped scheduler
    without beliefs (``verify-all``, ``no-spec``) keeps its budget, cut to the
    drafts the grammar accepts. Without draft masks it defers to the wrapped
    scheduler unchanged.

    Args:
        inner: the wrapped scheduler's name, or a scheduler object.
        **inner_config: configuration for the wrapped scheduler (with a name).
    """

    name = "grammar-aware"
    uses_grammar = True

    def __init__(self, inner: str | Scheduler = DEFAULT_SCHEDULER, **inner_config: Any) -> None:
        if isinstance(inner, str):
            self.inner: Scheduler = get_scheduler(inner, **inner_config)
        elif isinstance(inner, Scheduler):
            if inner_config:
                raise BudgetError(f"inner_config: expected none with a scheduler object, got {sorted(inner_config)}")
            self.inner = inner
        else:
            raise BudgetError(f"inner: expected a scheduler name or object, got {type(inner).__name__}")

    def beliefs(self, step: StepView) -> FloatArray | None:
        """The wrapped scheduler's beliefs, grammar-corrected when the step has draft masks."""
        fn = getattr(self.inner, "beliefs", None)
        if fn is None:
            return None
        conf = fn(step)
        if conf is None or step.grammar is None:
            return conf
        return grammar_confidences(host_confidences(conf, step.layout, "beliefs"), step.layout, step.grammar)

    def budget(self, step: StepView) -> BudgetDecision:
        """The wrapped decision, rescored (or trimmed) with the grammar."""
        if step.grammar is None:
            return self.inner.budget(step)
        fn = getattr(self.inner, "beliefs", None)
        conf = fn(step) if fn is not None else None
        if conf is None:
            inner = self.inner.budget(step)
            room = int(grammar_limits(step.layout, step.grammar).sum())
            seen = (
                None if step.confidences is None else grammar_confidences(step.confidences, step.layout, step.grammar)
            )
            return step.score(min(inner.budget, room, step.cap), seen)
        # Past the accepted drafts every survival is 0 and step costs never
        # fall as the budget grows, so the argmax (smallest on ties) never spends there.
        return step.best(conf, with_grammar=True)

    def observe(self, outcome: StepOutcome) -> None:
        """Passed on to the wrapped scheduler."""
        self.inner.observe(outcome)
