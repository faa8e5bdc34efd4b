"""A step layout reused across steps: the host path for a batch whose requests stay the same.

Between two steps of a running batch the requests usually stay the same; only
their drafts (and the stale confidences) change. :class:`StepPlanner` does
once, when the batch is formed, what depends on the requests alone (the id
index, the grammar requests' batch indices, the draft cost of the batch) and
then, per step, only what depends on the drafts:

* the :class:`~maskplug.ScheduledLayout` of the step,
* the verify budget of :func:`~maskplug.choose_budget` (or a budget given),
* the :func:`~maskplug.compact` view of the trimmed batch,
* the ragged :class:`~maskplug.RowMapping` of :meth:`~maskplug.GrammarRows.mapping`.

Each is exactly what those functions return for the same arguments; the
planner is only faster. Validation is the same too: every argument goes
through the core's own checks (:func:`maskplug.budget.host_confidences`, the
layout's count checks, :func:`~maskplug.compact`'s budget checks), so a bad
call raises the same :class:`~maskplug.MaskplugError` and returns nothing.

When the requests change (one finishes, one joins), build a new planner: that
costs what one step of the plain functions costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ._checks import host_int, host_ints
from .budget import BudgetDecision, CostModel, choose_budget, host_confidences
from .compaction import Compaction, compact
from .errors import BudgetError, LayoutError
from .layout import GrammarRows, RowMapping, ScheduledLayout

__all__ = ["Step", "StepPlanner"]

IntArray = npt.NDArray[np.int64]

# The planner fills a ScheduledLayout's fields directly (the id index is the
# part worth reusing). It does so only while the layout has exactly these
# fields; otherwise it builds each step's layout with the constructor.
_LAYOUT_FIELDS = frozenset(
    {"_ids", "_index", "_req_ids", "cu_scheduled", "num_bonus", "num_drafts", "num_non_draft", "total_drafts"}
)
_FILL_LAYOUT = frozenset(getattr(ScheduledLayout, "__slots__", ())) == _LAYOUT_FIELDS


@dataclass(frozen=True)
class Step:
    """The host view of one step, as the core functions would have built it.

    Attributes:
        layout: the step's scheduled layout.
        decision: the budget decision when confidences were given, else ``None``.
        budget: drafts verified this step.
        compaction: :func:`~maskplug.compact` of ``layout`` at ``budget``.
        mapping: the grammar row mapping (ragged, or the planner's fixed stride).
    """

    layout: ScheduledLayout
    decision: BudgetDecision | None
    budget: int
    compaction: Compaction
    mapping: RowMapping


class StepPlanner:
    """Per-step host work for a batch whose requests stay the same across steps.

    Args:
        req_ids: the batch's request ids, in batch (logits) order; unique.
        grammar_req_ids: the requests under a grammar, in the order their mask
            rows are produced (a subset of ``req_ids``; empty when none).
        num_bonus: logits rows every request gets besides its drafts.
        cost: the step cost model; needed to choose budgets from confidences.
        mode, stride: how mask rows are laid out, as for :class:`~maskplug.GrammarRows`.

    Raises:
        LayoutError: duplicate or unknown ids, a bad ``num_bonus``, ``mode`` or ``stride``.
        BudgetError: ``cost`` is not a :class:`~maskplug.CostModel`.
    """

    def __init__(
        self,
        req_ids: Sequence[Any] | npt.NDArray[Any],
        grammar_req_ids: Sequence[Any] | npt.NDArray[Any] = (),
        *,
        num_bonus: int = 1,
        cost: CostModel | None = None,
        mode: Literal["ragged", "fixed"] = "ragged",
        stride: int | None = None,
    ) -> None:
        if cost is not None and not isinstance(cost, CostModel):
            raise BudgetError(f"cost: expected a CostModel, got {type(cost).__name__}")
        # The core classes check the ids, num_bonus, mode and stride.
        n = len(req_ids)
        zeros = np.zeros(n, dtype=np.int64)
        proto = ScheduledLayout(req_ids, zeros, zeros, num_bonus)
        self._rows = GrammarRows(grammar_req_ids, mode, stride)
        self._grammar = self._rows.batch_indices(proto)
        self._grammar32 = self._grammar.astype(np.int32)
        self._proto = proto
        self._n = proto.n
        self._num_bonus = proto.num_bonus
        self._cost = cost
        # Plain cost models read consecutive sizes as a slice of their table; a
        # subclass with its own cost functions goes through choose_budget.
        plain = (
            cost is not None
            and type(cost).draft_ms is CostModel.draft_ms
            and type(cost).verify_ms is CostModel.verify_ms
        )
        self._draft_ms = float(cost._draft.span(self._n, 1)[0]) if plain and cost is not None else None
        self._uniform: dict[int, tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]] = {}

    @property
    def n(self) -> int:
        """Requests in the batch."""
        return self._n

    @property
    def grammar_rows(self) -> GrammarRows:
        """How the mask rows are laid out (the producer's order, mode and stride)."""
        return self._rows

    def layout(self, num_drafts: Any, num_non_draft: Any) -> ScheduledLayout:
        """The step's :class:`~maskplug.ScheduledLayout` (equal to building one from the planner's ids)."""
        if not _FILL_LAYOUT:
            return ScheduledLayout(self._proto._ids, num_drafts, num_non_draft, self._num_bonus)
        n = self._n
        # The layout's own count checks, so errors read exactly as the constructor's.
        nd = host_ints("num_drafts", num_drafts, LayoutError, n=n, integral_floats=True)
        nn = host_ints("num_non_draft", num_non_draft, LayoutError, n=n, integral_floats=True)
        proto = self._proto
        out = object.__new__(ScheduledLayout)
        out._ids = proto._ids
        out._index = proto._index
        out._req_ids = proto._req_ids
        out.num_drafts = nd
        out.num_non_draft = nn
        out.num_bonus = self._num_bonus
        out.total_drafts = int(nd.sum())
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(nd + self._num_bonus, out=cu[1:])
        out.cu_scheduled = cu
        return out

    def step(
        self,
        num_drafts: Any,
        num_non_draft: Any,
        confidences: Any = None,
        *,
        budget: Any = None,
        num_sampling: Any = None,
        max_logits: Any = None,
    ) -> Step:
        """Plan one step: layout, budget, compaction and mask-row mapping.

        With ``confidences`` (the stale per-draft confidences, ``(n, ≥ max
        drafts)``) the budget is :func:`~maskplug.choose_budget`'s, with
        ``num_sampling`` and ``max_logits`` as there; with ``budget`` it is that
        budget; with neither every draft is verified.

        Raises:
            LayoutError: bad draft or token counts.
            BudgetError: bad confidences, budget or limits, or no cost model
                to choose a budget with. Nothing is returned on any error.
        """
        layout = self.layout(num_drafts, num_non_draft)
        decision: BudgetDecision | None = None
        if confidences is not None:
            if budget is not None:
                raise BudgetError("budget: expected None when confidences are given (the budget is chosen from them)")
            decision = self._choose(confidences, layout, num_sampling, max_logits)
            b = decision.budget
        else:
            if num_sampling is not None or max_logits is not None:
                raise BudgetError("num_sampling, max_logits: only meaningful when confidences are given")
            b = layout.total_drafts if budget is None else budget
        comp = compact(layout, b)  # checks a given budget against the layout
        return Step(layout, decision, int(b), comp, self._mapping(layout))

    # -- budget ------------------------------------------------------------------
    def _choose(self, confidences: Any, layout: ScheduledLayout, num_sampling: Any, max_logits: Any) -> BudgetDecision:
        cost = self._cost
        if cost is None:
            raise BudgetError("cost: expected a CostModel to choose a budget from confidences (give it to StepPlanner)")
        if self._draft_ms is None:
            return choose_budget(confidences, layout, cost, num_sampling=num_sampling, max_logits=max_logits)
        # choose_budget's checks and arithmetic, in the same order: the same errors and the same floats.
        conf = host_confidences(confidences, layout)
        n = self._n
        ns = n if num_sampling is None else host_int("num_sampling", num_sampling, BudgetError)
        nd = layout.num_drafts
        total = layout.total_drafts
        cap = total
        if max_logits is not None:
            room = host_int("max_logits", max_logits, BudgetError) - n * self._num_bonus
            if room < 0:  # let the core word the error
                return choose_budget(conf, layout, cost, num_sampling=ns, max_logits=max_logits)
            cap = min(cap, room)
        k = int(nd.max()) if n else 0
        if k == 0:
            top = np.zeros(0, dtype=np.float64)
        else:
            s = np.cumprod(conf[:, :k], axis=1)
            flat = s.ravel() if total == n * k else s[np.arange(k)[None, :] < nd[:, None]]
            top = np.sort(flat)[::-1][:cap]
        est = np.empty(cap + 1, dtype=np.float64)
        est[0] = float(ns)
        np.cumsum(top, out=est[1:])
        est[1:] += float(ns)
        costs = self._draft_ms + cost._verify.span(int(layout.num_non_draft.sum()), cap + 1)
        if costs[0] <= 0:  # a plain model's costs never fall: the first is the smallest; the core words the error
            return choose_budget(conf, layout, cost, num_sampling=ns, max_logits=max_logits)
        b = int(np.argmax(est / costs))
        return BudgetDecision(budget=b, expected_tokens=float(est[b]), cost_ms=float(costs[b]))

    # -- mapping -----------------------------------------------------------------
    def _mapping(self, layout: ScheduledLayout) -> RowMapping:
        if self._rows.mode != "ragged":
            return self._rows.mapping(layout)
        g = self._grammar
        per = layout.num_drafts[g] + self._num_bonus
        if per.size and per.min() == per.max():
            rows = int(per[0]) if per.size else 0
            cached = self._uniform.get(rows)
            if cached is None:
                cached = (
                    np.repeat(self._grammar32, rows),
                    np.tile(np.arange(rows, dtype=np.int32), g.shape[0]),
                )
                self._uniform = {rows: cached}  # the last uniform shape only
            return RowMapping(cached[0].copy(), cached[1].copy())
        total = int(per.sum())
        starts = np.zeros(per.shape[0], dtype=np.int32)
        if per.shape[0] > 1:
            np.cumsum(per[:-1], out=starts[1:])
        request = np.repeat(self._grammar32, per)
        position = np.arange(total, dtype=np.int32) - np.repeat(starts, per)
        return RowMapping(request, position)
