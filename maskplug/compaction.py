"""Batch compaction after the verify budget trimmed drafts.

``compact`` tells the engine, on the host, what it can know before the device
allocation: the total token count always, and the per-request split and
``cu_logits`` only in the exact regimes. ``active_cu_logits`` computes the
authoritative offsets on the device from the capacities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from ._checks import INT32_MAX, host_int, host_ints
from .errors import BudgetError
from .layout import ScheduledLayout

__all__ = ["Compaction", "active_cu_logits", "compact", "regime_of"]

Regime = Literal["full", "partial", "zero"]


class TokenTotal:
    """What a compacted batch (chain or tree) derives from its tokens per request."""

    num_tokens_per_req: npt.NDArray[np.int64]

    @property
    def num_tokens(self) -> int:
        """Total tokens after trimming (always exact, even where the split per request is not)."""
        return int(self.num_tokens_per_req.sum())


@dataclass(frozen=True)
class Compaction(TokenTotal):
    """The host view of a compacted batch.

    Attributes:
        regime: ``"full"`` (nothing trimmed), ``"zero"`` (bonus only) or
            ``"partial"``.
        num_tokens_per_req: tokens per request after trimming. In the partial
            regime without ``capacity`` only the sum is right; the split is a
            placeholder (drafts handed out front to back).
        cu_logits: logits-row offsets per request (``n + 1`` entries). Exact
            in the full and zero regimes; in the partial regime without
            ``capacity`` it is the scheduled upper bound, and the device
            offsets from :func:`active_cu_logits` are authoritative.
        exact: whether ``num_tokens_per_req`` and ``cu_logits`` are exact.
    """

    regime: Regime
    num_tokens_per_req: npt.NDArray[np.int64]
    cu_logits: npt.NDArray[np.int64]
    exact: bool


def regime_of(layout: ScheduledLayout, budget: int) -> Regime:
    """``"full"`` when nothing is trimmed, ``"zero"`` at budget 0 with drafts, else ``"partial"``.

    A batch without drafts is ``"full"``: there is nothing to trim.
    """
    total = layout.total_drafts
    if budget == total:
        return "full"
    if budget == 0:
        return "zero"
    return "partial"


def _cu(rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    cu = np.zeros(rows.shape[0] + 1, dtype=np.int64)
    np.cumsum(rows, out=cu[1:])
    return cu


def compact(layout: ScheduledLayout, budget: int | np.integer[Any] | torch.Tensor, capacity: Any = None) -> Compaction:
    """Describe the batch after a verify budget of ``budget`` drafts.

    Pass ``capacity`` (host per-request admitted drafts, e.g. from a CPU
    allocation) to make every regime exact; it must be a per-request prefix
    (``0 ≤ capacity ≤ num_drafts``) summing to ``budget``. ``budget`` may be
    an int, a numpy integer or a 0-d host tensor, checked alike.
    """
    if not isinstance(layout, ScheduledLayout):
        raise BudgetError(f"layout: expected a ScheduledLayout, got {type(layout).__name__}")
    total = layout.total_drafts
    budget = host_int("budget", budget, BudgetError, hi=total, expected="0 <= budget <= Σ num_drafts = {hi}")
    regime = regime_of(layout, budget)
    nb = layout.num_bonus
    if capacity is not None:
        cap = host_ints("capacity", capacity, BudgetError, n=layout.n)
        if cap.size and np.any(cap > layout.num_drafts):
            r = int(np.argmax((cap < 0) | (cap > layout.num_drafts)))
            raise BudgetError(
                f"capacity: expected 0 <= capacity[r] <= num_drafts[r], got capacity[{r}] = {int(cap[r])} "
                f"with num_drafts[{r}] = {int(layout.num_drafts[r])}"
            )
        if int(cap.sum()) != budget:
            raise BudgetError(f"capacity: expected a sum equal to budget {budget}, got {int(cap.sum())}")
        return Compaction(regime, layout.num_non_draft + cap, _cu(cap + nb), True)
    return compact_checked(layout, budget)


def compact_checked(layout: ScheduledLayout, budget: int) -> Compaction:
    """:func:`compact` without a capacity, for a budget already known to lie in ``[0, Σ num_drafts]``.

    For callers that chose the budget themselves (:class:`~maskplug.StepPlanner`):
    ``budget`` is a Python int and is not checked again. Every array returned
    is new.
    """
    regime = regime_of(layout, budget)
    if regime == "full":
        return Compaction(regime, layout.num_non_draft + layout.num_drafts, layout.cu_scheduled.copy(), True)
    if regime == "zero":
        zero_cu = np.arange(layout.n + 1, dtype=np.int64)
        zero_cu *= layout.num_bonus
        return Compaction(regime, layout.num_non_draft.copy(), zero_cu, True)
    # Partial: the split is decided on the device; hand drafts out front to back
    # so that at least the total is right: clip(budget - before, 0, num_drafts), with
    # the ufuncs called directly (np.clip's dispatch costs more than the work here).
    nd = layout.num_drafts
    placeholder = np.empty(layout.n, dtype=np.int64)
    if layout.n:
        placeholder[0] = budget
        np.subtract(budget, np.cumsum(nd[:-1]), out=placeholder[1:])
    np.maximum(placeholder, 0, out=placeholder)
    np.minimum(placeholder, nd, out=placeholder)
    placeholder += layout.num_non_draft
    return Compaction(regime, placeholder, layout.cu_scheduled.copy(), False)


def active_cu_logits(capacity: torch.Tensor, num_bonus: int = 1) -> torch.Tensor:
    """Authoritative logits-row offsets ``[0, cumsum(capacity + num_bonus)]`` on ``capacity``'s device.

    int32, ``n + 1`` entries; no host sync. A host (CPU) ``capacity`` is
    checked like every count: non-negative, and the offsets must fit in int32
    (:class:`BudgetError` otherwise, never a wrapped offset). The values of a
    device tensor are not read (that would be a host sync): there they are
    trusted, as :func:`~maskplug.allocate` produces them.
    """
    if (
        not isinstance(capacity, torch.Tensor)
        or capacity.ndim != 1
        or capacity.is_floating_point()
        or capacity.is_complex()
        or capacity.dtype == torch.bool
    ):
        got = f"{type(capacity).__name__} {getattr(capacity, 'dtype', '')} {tuple(getattr(capacity, 'shape', ()))}"
        raise BudgetError(f"capacity: expected a 1-D integer tensor, got {got}")
    nb = host_int("num_bonus", num_bonus, BudgetError)
    n = capacity.shape[0]
    if n * nb > INT32_MAX:
        raise BudgetError(f"num_bonus: expected offsets that fit in int32, got {n} requests × {nb} bonus rows")
    if capacity.device.type == "cpu":
        cap = host_ints("capacity", capacity, BudgetError)
        if int(cap.sum()) + n * nb > INT32_MAX:
            raise BudgetError(
                f"capacity: expected offsets that fit in int32, got a last offset of {int(cap.sum()) + n * nb}"
            )
    out = torch.zeros(n + 1, dtype=torch.int32, device=capacity.device)
    torch.cumsum(capacity.to(torch.int32) + nb, dim=0, out=out[1:])
    return out
