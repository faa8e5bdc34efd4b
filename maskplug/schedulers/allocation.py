"""``allocate_step``: a step's verify budget split per request, grammar-aware, on the device.

It reads a :class:`~maskplug.StepView` (the scheduler protocol's view of the
step), so it lives with the schedulers and not in :mod:`maskplug.budget`,
which the protocol itself builds on: imports run one way, schedulers to budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..budget import _budget_arg, _check_live_values, _grammar_override, _live, allocate
from ..errors import BudgetError
from .protocol import StepView, grammar_limits

__all__ = ["allocate_step"]


def allocate_step(
    step: StepView, confidences: torch.Tensor, budget: int | np.integer[Any] | torch.Tensor
) -> torch.Tensor:
    """Per-request capacities for ``budget`` from the live ``confidences``, on their device.

    Without draft masks this is :func:`allocate`. With them, the
    live confidences are grammar-corrected (rejected drafts 0, forced
    accepted drafts 1) and drafts the grammar rejects come last: as long as
    ``budget <= Σ min(num_drafts, acceptable)`` (always so for a
    ``grammar-aware`` budget) no request is given a draft its grammar
    rejects. A larger budget, from a grammar-blind scheduler, still sums
    exactly to ``budget``: every accepted draft first, then rejected ones by
    position and request (they only cost verification work, the masks refuse
    them). No host sync; ``budget`` may be a 0-d device tensor.
    """
    if not isinstance(step, StepView):
        raise BudgetError(f"step: expected a StepView, got {type(step).__name__}")
    lay = step.layout
    _live("confidences", confidences, lay.n)
    if step.grammar is None or step.grammar.request.size == 0:
        return allocate(confidences, lay.num_drafts, budget)
    k_need = int(lay.num_drafts.max()) if lay.n else 0
    if confidences.shape[1] < k_need:
        raise BudgetError(
            f"confidences: expected at least {k_need} columns (the most drafts of any request), got {confidences.shape[1]}"
        )
    budget = _budget_arg(budget, lay.total_drafts, confidences.device)
    _check_live_values("confidences", confidences, lay.num_drafts)
    lim = grammar_limits(lay, step.grammar)
    room = int(lim.sum())
    n, k = confidences.shape
    # Host-built override: NaN keeps the live value, 0/1 replace it.
    over = _grammar_override(step.grammar, n, k)
    dev = confidences.device
    t = torch.from_numpy(over)
    if dev.type == "cuda":
        t = t.pin_memory().to(dev, non_blocking=True)  # queued, not a host sync
    t = t.to(dev, dtype=confidences.dtype)
    live = torch.where(torch.isnan(t), confidences, t)
    rest = lay.num_drafts - lim
    if isinstance(budget, torch.Tensor):
        inside: int | torch.Tensor = torch.clamp(budget, max=room)
        beyond: int | torch.Tensor = budget - inside
    else:
        inside, beyond = min(int(budget), room), max(int(budget) - room, 0)
    cap = allocate(live, lim, inside)
    if int(rest.sum()) == 0:
        return cap
    # Rejected drafts only once every accepted one is in (then `cap == lim`);
    # equal (zero) worth, so allocate's tie-break orders them by position, then request.
    extra = allocate(torch.zeros_like(live), rest, beyond)
    return cap + extra
