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

from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from ._checks import host_int, host_ints
from .budget import BudgetDecision, CostModel, choose_budget, host_confidences
from .compaction import Compaction, compact, regime_of
from .errors import BudgetError, LayoutError
from .layout import GrammarRows, RowMapping, ScheduledLayout

__all__ = ["Step", "StepPlanner"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# The planner fills a ScheduledLayout's fields directly (the id index is the
# part worth reusing). It does so only while the layout has exactly these
# fields; otherwise it builds each step's layout with the constructor.
_LAYOUT_FIELDS = frozenset(
    {"_ids", "_index", "_req_ids", "cu_scheduled", "num_bonus", "num_drafts", "num_non_draft", "total_drafts"}
)
_FILL_LAYOUT = frozenset(getattr(ScheduledLayout, "__slots__", ())) == _LAYOUT_FIELDS

# From this many requests on, survivals are multiplied column by column (a few
# long vector products) instead of by cumprod along each short row.
_COLUMNWISE_FROM = 64


class Step(NamedTuple):
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


class _Counts:
    """What follows from one step's (already checked) draft and token counts; kept while they repeat.

    Arrays here are never handed out: every step gets its own copies.
    """

    __slots__ = (
        "base",
        "before",
        "cu",
        "full_tokens",
        "k",
        "key",
        "live",
        "mapping",
        "n",
        "total",
        "zero_cu",
    )

    def __init__(self, nd: IntArray, nn: IntArray, num_bonus: int, key: tuple[str, bytes, str, bytes] | None) -> None:
        n = nd.shape[0]
        self.key = key
        self.n = n
        self.total = int(nd.sum())
        self.base = int(nn.sum())
        self.k = int(nd.max()) if n else 0
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(nd + num_bonus, out=cu[1:])
        self.cu = cu
        before = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(nd[:-1], out=before[1:])
        self.before = before
        self.full_tokens = nn + nd
        self.zero_cu = np.arange(n + 1, dtype=np.int64) * num_bonus
        # Which entries of the (n, k) survivals are scheduled drafts; None when all are.
        self.live = None if self.total == n * self.k else np.arange(self.k)[None, :] < nd[:, None]
        self.mapping: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] | None = None


def _listed(ids: Any) -> Any:
    """Ids as given when they can be measured; an iterator read once into a list (anything else left as is)."""
    if isinstance(ids, (Sequence, np.ndarray)) or hasattr(ids, "__len__"):
        return ids
    try:
        return list(ids)
    except TypeError:
        return ids  # not iterable: the core class words the error


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

    Steps whose draft and token counts repeat the previous step's (integer
    arrays of the same dtype and values, the common case between steps) reuse
    what follows from them; their values are compared, never their identity,
    so an engine may refill the same buffers in place. A planner keeps that
    one step of memory, so it belongs to one thread at a time.
    """

    def __init__(
        self,
        req_ids: Iterable[Any] | npt.NDArray[Any],
        grammar_req_ids: Iterable[Any] | npt.NDArray[Any] = (),
        *,
        num_bonus: int = 1,
        cost: CostModel | None = None,
        mode: Literal["ragged", "fixed"] = "ragged",
        stride: int | None = None,
    ) -> None:
        if cost is not None and not isinstance(cost, CostModel):
            raise BudgetError(f"cost: expected a CostModel, got {type(cost).__name__}")
        # The core classes check the ids, num_bonus, mode and stride.
        ids, grammar_ids = _listed(req_ids), _listed(grammar_req_ids)
        try:
            n = len(ids)
        except TypeError:
            n = 0  # not a sequence: ScheduledLayout refuses it below
        zeros = np.zeros(n, dtype=np.int64)
        proto = ScheduledLayout(ids, zeros, zeros, num_bonus)
        self._rows = GrammarRows(grammar_ids, mode, stride)
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
        self._last: _Counts | None = None
        self._costs: tuple[int, int, FloatArray] | None = None

    @property
    def n(self) -> int:
        """Requests in the batch."""
        return self._n

    @property
    def grammar_rows(self) -> GrammarRows:
        """How the mask rows are laid out (the producer's order, mode and stride)."""
        return self._rows

    # -- layout ------------------------------------------------------------------
    def _counts(self, num_drafts: Any, num_non_draft: Any) -> tuple[IntArray, IntArray, _Counts]:
        """The step's checked counts and what follows from them (reused when they repeat the last step's)."""
        n = self._n
        last = self._last
        key: tuple[str, bytes, str, bytes] | None = None
        if (
            type(num_drafts) is np.ndarray
            and type(num_non_draft) is np.ndarray
            and num_drafts.dtype.kind in "iu"
            and num_non_draft.dtype.kind in "iu"
            and num_drafts.shape == (n,)
            and num_non_draft.shape == (n,)
        ):
            key = (num_drafts.dtype.str, num_drafts.tobytes(), num_non_draft.dtype.str, num_non_draft.tobytes())
            if last is not None and last.key == key:
                # The same values, of the same dtype, as counts that passed the layout's checks: valid,
                # and what followed from them still holds. As int64, as the checks hand them on.
                return num_drafts.astype(np.int64, copy=False), num_non_draft.astype(np.int64, copy=False), last
        # The layout's own count checks, so errors read exactly as the constructor's.
        nd = host_ints("num_drafts", num_drafts, LayoutError, n=n, integral_floats=True)
        nn = host_ints("num_non_draft", num_non_draft, LayoutError, n=n, integral_floats=True)
        counts = _Counts(nd, nn, self._num_bonus, key)
        self._last = counts
        return nd, nn, counts

    def _layout(self, nd: IntArray, nn: IntArray, counts: _Counts) -> ScheduledLayout:
        proto = self._proto
        out = object.__new__(ScheduledLayout)
        out._ids = proto._ids
        out._index = proto._index
        out._req_ids = proto._req_ids
        out.num_drafts = nd
        out.num_non_draft = nn
        out.num_bonus = self._num_bonus
        out.total_drafts = counts.total
        out.cu_scheduled = counts.cu.copy()
        return out

    def layout(self, num_drafts: Any, num_non_draft: Any) -> ScheduledLayout:
        """The step's :class:`~maskplug.ScheduledLayout` (equal to building one from the planner's ids)."""
        if not _FILL_LAYOUT:
            return ScheduledLayout(self._proto._ids, num_drafts, num_non_draft, self._num_bonus)
        return self._layout(*self._counts(num_drafts, num_non_draft))

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
        if confidences is not None and budget is not None:
            raise BudgetError("budget: expected None when confidences are given (the budget is chosen from them)")
        if confidences is None and (num_sampling is not None or max_logits is not None):
            raise BudgetError("num_sampling, max_logits: only meaningful when confidences are given")
        if not _FILL_LAYOUT:
            layout = ScheduledLayout(self._proto._ids, num_drafts, num_non_draft, self._num_bonus)
            counts = _Counts(layout.num_drafts, layout.num_non_draft, self._num_bonus, None)
        else:
            nd, nn, counts = self._counts(num_drafts, num_non_draft)
            layout = self._layout(nd, nn, counts)
        decision: BudgetDecision | None = None
        if confidences is not None:
            decision = self._choose(confidences, layout, counts, num_sampling, max_logits)
            b = decision.budget
            comp = self._compact(layout, counts, b)
        elif budget is not None:
            comp = compact(layout, budget)  # the core checks a given budget
            b = int(budget)
        else:
            b = counts.total
            comp = self._compact(layout, counts, b)
        return Step(layout, decision, b, comp, self._mapping(layout, counts))

    # -- budget ------------------------------------------------------------------
    def _choose(
        self, confidences: Any, layout: ScheduledLayout, counts: _Counts, num_sampling: Any, max_logits: Any
    ) -> BudgetDecision:
        cost = self._cost
        if cost is None:
            raise BudgetError("cost: expected a CostModel to choose a budget from confidences (give it to StepPlanner)")
        if self._draft_ms is None:
            return choose_budget(confidences, layout, cost, num_sampling=num_sampling, max_logits=max_logits)
        # choose_budget's checks and arithmetic, in the same order: the same errors and the same floats.
        conf = host_confidences(confidences, layout)
        n = self._n
        ns = n if num_sampling is None else host_int("num_sampling", num_sampling, BudgetError)
        cap = counts.total
        if max_logits is not None:
            room = host_int("max_logits", max_logits, BudgetError) - n * self._num_bonus
            if room < 0:  # let the core word the error
                return choose_budget(conf, layout, cost, num_sampling=ns, max_logits=max_logits)
            cap = min(cap, room)
        k = counts.k
        est = np.empty(cap + 1, dtype=np.float64)
        est[0] = float(ns)
        if k and cap:
            if n < _COLUMNWISE_FROM:
                surv = conf[:, :k].cumprod(axis=1)
                flat = surv.ravel() if counts.live is None else surv[counts.live]
            else:
                # Column by column: the same products in the same order as cumprod along rows,
                # laid out draft-major (the order is irrelevant: they are sorted next).
                cols = np.empty((k, n), dtype=np.float64)
                cols[:] = conf[:, :k].T
                for j in range(1, k):
                    np.multiply(cols[j - 1], cols[j], out=cols[j])
                flat = cols.ravel() if counts.live is None else cols[counts.live.T]
            # Largest first: sorting the negated survivals keeps them contiguous for the running sum.
            # Negating is exact and rounding is symmetric in sign, so ns - (sum of negated) is
            # bit for bit ns + (sum of the survivals), the core's est.
            neg = np.negative(flat)  # a new array: sorted in place
            neg.sort()
            neg[:cap].cumsum(out=est[1:])
            np.subtract(est[0], est[1:], out=est[1:])
        else:
            est[1:] = est[0]  # no survivals: cap is 0
        costs = self._step_costs(counts.base, cap)
        if costs[0] <= 0:  # a plain model's costs never fall: the first is the smallest; the core words the error
            return choose_budget(conf, layout, cost, num_sampling=ns, max_logits=max_logits)
        b = int((est / costs).argmax())
        return BudgetDecision(budget=b, expected_tokens=float(est[b]), cost_ms=float(costs[b]))

    def _step_costs(self, base: int, cap: int) -> FloatArray:
        """``draft_ms(n) + verify_ms(base .. base + cap)`` (kept while base and cap repeat)."""
        c = self._costs
        if c is not None and c[0] == base and c[1] == cap:
            return c[2]
        assert self._cost is not None and self._draft_ms is not None
        costs = self._draft_ms + self._cost._verify.span(base, cap + 1)
        self._costs = (base, cap, costs)
        return costs

    # -- compaction and mapping ----------------------------------------------------
    def _compact(self, layout: ScheduledLayout, counts: _Counts, b: int) -> Compaction:
        """:func:`~maskplug.compact` at a budget known to be valid (chosen, or every draft)."""
        regime = regime_of(layout, b)
        if regime == "full":
            return Compaction(regime, counts.full_tokens.copy(), counts.cu.copy(), True)
        if regime == "zero":
            return Compaction(regime, layout.num_non_draft.copy(), counts.zero_cu.copy(), True)
        # compact's placeholder split, clip(b - before, 0, num_drafts), with the ufuncs called directly.
        placeholder = np.subtract(b, counts.before)
        np.maximum(placeholder, 0, out=placeholder)
        np.minimum(placeholder, layout.num_drafts, out=placeholder)
        placeholder += layout.num_non_draft
        return Compaction(regime, placeholder, counts.cu.copy(), False)

    def _mapping(self, layout: ScheduledLayout, counts: _Counts) -> RowMapping:
        if self._rows.mode != "ragged":
            return self._rows.mapping(layout)
        m = counts.mapping
        if m is None:
            g = self._grammar
            per = layout.num_drafts[g] + self._num_bonus
            total = int(per.sum())
            starts = np.zeros(per.shape[0], dtype=np.int32)
            if per.shape[0] > 1:
                np.cumsum(per[:-1], out=starts[1:])
            request = np.repeat(self._grammar32, per)
            position = np.arange(total, dtype=np.int32) - np.repeat(starts, per)
            m = counts.mapping = (request, position)
        return RowMapping(m[0].copy(), m[1].copy())
