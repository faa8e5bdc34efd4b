"""A step layout reused across steps: the host path for a batch whose requests stay the same.

Between two steps of a running batch the requests usually stay the same; only
their drafts (and the stale confidences) change. :class:`StepPlanner` does
once, when the batch is formed, what depends on the requests alone (the id
index, the grammar requests' batch indices) and then, per step, only what
depends on the counts:

* the :class:`~maskplug.ScheduledLayout` of the step,
* the verify budget of :func:`~maskplug.choose_budget` (or a budget given),
* the :func:`~maskplug.compact` view of the trimmed batch,
* the :class:`~maskplug.RowMapping` of :meth:`~maskplug.GrammarRows.mapping`.

The planner is a cache around the core, not a second implementation: each
part is computed by the same core function the plain path calls (the layout's
count checks, :func:`maskplug.budget.host_confidences`' checks, the sorted
survivals, :meth:`~maskplug.CostModel.step_costs`, compaction and the mapping),
only with what repeats kept: the ids and grammar indices for the planner's
life, and what follows from the draft counts and the token counts, each kept
while it repeats the last step's (compared by value, so buffers refilled in
place are fine). So each result is exactly what those functions return for the
same arguments, and a bad call raises the same :class:`~maskplug.MaskplugError`
and returns nothing.

When the requests change (one finishes, one joins), build a new planner: that
costs what one step of the plain functions costs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from ._checks import INT32_MAX
from .budget import BudgetDecision, CostModel, _host_array, choose_checked
from .compaction import Compaction, compact, compact_checked
from .errors import BudgetError
from .layout import GrammarRows, RowMapping, ScheduledLayout, _as_counts

__all__ = ["Step", "StepPlanner"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Below this many requests a step's counts are checked, summed and accumulated as Python ints (one
# tolist) instead of by numpy reductions: at n = 8 a numpy reduction costs about 1.5 µs against about
# 0.1 µs for min/max/sum over a list; at n = 64 both are about 2 µs.
_PYTHON_BELOW = 48


# Below this many grammar requests ragged mappings are picked from row tables with one mask
# (GrammarRows._mapping_at): 9 µs against 28 µs for the repeats at 8 requests, 22 against 26 at 256,
# 68 against 62 at 1024 (one loaded run).
_TABLES_BELOW = 512


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


class _Drafts:
    """What follows from one step's checked draft counts; kept while they repeat.

    Arrays here are never handed out (``mapping`` excepted: a checked mapping is
    read-only): every step gets its own copies.
    """

    __slots__ = ("cu", "k", "key", "mapping", "nd", "rows", "total")

    def __init__(self, key: tuple[str, bytes] | None, nd: IntArray, total: int, k: int, cu: IntArray) -> None:
        self.key = key
        self.nd = nd
        self.total = total
        self.k = k
        self.cu = cu
        self.mapping: RowMapping | None = None
        # Which rows each request has (StepPlanner._rows_mask); worked out on first use.
        self.rows: npt.NDArray[np.bool_] | None = None


def _listed(ids: Any) -> Any:
    """Ids as given when they can be measured; an iterator read once into a list (anything else left as is)."""
    if isinstance(ids, (Sequence, np.ndarray)) or hasattr(ids, "__len__"):
        return ids
    try:
        return list(ids)
    except TypeError:
        return ids  # not iterable: the core class words the error


def _counts(name: str, values: Any, n: int, fast: bool) -> tuple[IntArray, int, int, list[int] | None]:
    """``(counts, sum, max, listed)``: the layout's count check of ``values``, the counts an int64 array of their own.

    ``fast``: ``values`` is a 1-D integer numpy array of ``n`` entries (its
    key was taken), so only the range is left to check; any failure, and every
    other form, goes through the layout's own check, which words the error.
    ``listed``: the counts as a list, when the check made one (small batches).
    """
    if fast and n:
        out = values.astype(np.int64)  # a copy: the caller's buffer may be refilled
        if n < _PYTHON_BELOW:
            listed = values.tolist()
            lo, hi = min(listed), max(listed)
            if 0 <= lo and hi <= INT32_MAX:
                return out, sum(listed), hi, listed
        else:
            lo, hi = int(out.min()), int(out.max())  # a uint64 too big for int64 wraps below 0 here
            if 0 <= lo and hi <= INT32_MAX:
                return out, int(out.sum()), hi, None
    out = _as_counts(name, values, n)
    return out, int(out.sum()), int(out.max()) if n else 0, None


def _offsets(nd: IntArray, num_bonus: int, listed: list[int] | None) -> IntArray:
    """``[0, cumsum(nd + num_bonus)]`` as a new int64 array: the layout's ``cu_scheduled``."""
    n = nd.shape[0]
    if n < _PYTHON_BELOW:
        rows = map(num_bonus.__add__, nd.tolist() if listed is None else listed)
        return np.array(list(accumulate(rows, initial=0)), dtype=np.int64)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nd + num_bonus, out=cu[1:])
    return cu


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

    Draft counts and token counts are each kept while they repeat the previous
    step's (integer numpy arrays of the same dtype and values, the common case
    between steps); their values are compared, never their identity, so an
    engine may refill the same buffers in place, and counts that change every
    step (an n-gram drafter's) only redo what follows from them. Every layout
    and compaction a step returns holds arrays of its own; the mapping's are
    read-only. A planner keeps that one step of memory, so it belongs to one
    thread at a time.
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
        self._needs = int(self._grammar.max()) + 1 if self._grammar.size else 0
        self._proto = proto
        self._n = proto.n
        self._num_bonus = proto.num_bonus
        self._cost = cost
        self._drafts: _Drafts | None = None
        self._tokens: tuple[tuple[str, bytes] | None, IntArray, int] | None = None
        self._tables: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] | None = None
        self._shifted = np.arange(16, dtype=np.int64) - self._num_bonus
        # Step costs of a tabulated model for one token base: (base, costs of budgets 0 .. len - 1).
        self._costs: tuple[int, FloatArray] | None = None

    @property
    def n(self) -> int:
        """Requests in the batch."""
        return self._n

    @property
    def grammar_rows(self) -> GrammarRows:
        """How the mask rows are laid out (the producer's order, mode and stride)."""
        return self._rows

    # -- layout ------------------------------------------------------------------
    def _layout(self, num_drafts: Any, num_non_draft: Any) -> tuple[ScheduledLayout, _Drafts, int]:
        """The step's layout, and what follows from its draft counts and its token sum (each kept while it repeats).

        Only 1-D integer numpy arrays of ``n`` counts are compared with the last
        step's (by dtype and value); their range is the only check left to do. Any
        failure, and every other form, goes through the layout's own checks, which
        word the error. Draft counts first, as the constructor checks them. (The
        helpers are written out here: at 8 requests each call costs about as much
        as the numpy work it would wrap.)
        """
        n = self._n
        d = self._drafts
        fast = type(num_drafts) is np.ndarray and num_drafts.dtype.kind in "iu" and num_drafts.shape == (n,)
        key = (num_drafts.dtype.str, num_drafts.tobytes()) if fast else None
        if d is None or key is None or d.key != key:
            nd, total, k, listed = _counts("num_drafts", num_drafts, n, fast)
            d = self._drafts = _Drafts(key, nd, total, k, _offsets(nd, self._num_bonus, listed))
        t = self._tokens
        fast = type(num_non_draft) is np.ndarray and num_non_draft.dtype.kind in "iu" and num_non_draft.shape == (n,)
        key = (num_non_draft.dtype.str, num_non_draft.tobytes()) if fast else None
        if t is None or key is None or t[0] != key:
            nn, base, _, _ = _counts("num_non_draft", num_non_draft, n, fast)
            t = self._tokens = (key, nn, base)
        # Copies: the layout is the caller's, the kept arrays are not.
        layout = self._proto._with_counts(d.nd.copy(), t[1].copy(), d.total, d.cu.copy())
        return layout, d, t[2]

    def layout(self, num_drafts: Any, num_non_draft: Any) -> ScheduledLayout:
        """The step's :class:`~maskplug.ScheduledLayout` (equal to building one from the planner's ids)."""
        return self._layout(num_drafts, num_non_draft)[0]

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
        layout, d, base = self._layout(num_drafts, num_non_draft)
        decision: BudgetDecision | None = None
        if confidences is not None:
            decision = self._choose(confidences, layout, d, base, num_sampling, max_logits)
            b = decision.budget
            comp = compact_checked(layout, b)
        elif budget is not None:
            comp = compact(layout, budget)  # the core checks a given budget
            b = int(budget)
        else:
            b = d.total
            comp = compact_checked(layout, b)
        mapping = d.mapping
        if mapping is None:
            mapping = d.mapping = self._rows._mapping_at(
                layout,
                self._grammar,
                self._grammar32,
                self._row_tables(d),
                self._needs,
                d.total + self._n * self._num_bonus,
            )
        return Step(layout, decision, b, comp, mapping)

    def _rows_mask(self, d: _Drafts) -> npt.NDArray[np.bool_]:
        """``mask[r, p] = p < num_drafts[r] + num_bonus``, ``(n, k + num_bonus)``: which rows each request has.

        One comparison gives both what the mapping picks and, past the bonus
        columns, which survivals are scheduled drafts.
        """
        m = d.rows
        if m is None:
            w = d.k + self._num_bonus
            shifted = self._shifted
            if shifted.shape[0] < w:
                shifted = self._shifted = np.arange(max(w, 2 * shifted.shape[0]), dtype=np.int64) - self._num_bonus
            m = d.rows = shifted[None, :w] < d.nd[:, None]
        return m

    def _row_tables(
        self, d: _Drafts
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.bool_]] | None:
        """The row tables and mask for :meth:`GrammarRows._mapping_at` (tables kept, rebuilt wider)."""
        g = self._grammar32.shape[0]
        if g >= _TABLES_BELOW or self._rows.mode != "ragged":
            return None
        mask = self._rows_mask(d)
        w = mask.shape[1]
        t = self._tables
        if t is None or t[1].shape[1] < w:
            w = max(w, 8)
            pos = np.empty((g, w), dtype=np.int32)
            pos[:] = np.arange(w, dtype=np.int32)
            req = np.empty((g, w), dtype=np.int32)
            req[:] = self._grammar32[:, None]
            t = self._tables = (req, pos)
        return t[0], t[1], mask

    # -- budget ------------------------------------------------------------------
    def _choose(
        self, confidences: Any, layout: ScheduledLayout, d: _Drafts, base: int, num_sampling: Any, max_logits: Any
    ) -> BudgetDecision:
        """:func:`~maskplug.choose_budget` (without grammar), its checks in its order, with the counts known."""
        cost = self._cost
        if cost is None:
            raise BudgetError("cost: expected a CostModel to choose a budget from confidences (give it to StepPlanner)")
        # Which survivals are scheduled drafts: the rows mask past its bonus columns (None: all).
        live = None if d.total == self._n * d.k else self._rows_mask(d)[:, self._num_bonus :]
        return choose_checked(
            _host_array(confidences, self._n),
            layout,
            d.k,
            live,
            num_sampling,
            max_logits,
            lambda m: self._step_costs(cost, base, m),
        )

    def _step_costs(self, cost: CostModel, base: int, count: int) -> FloatArray:
        """``cost.step_costs(n, base, count)``; for a tabulated model, a slice of the longest kept for ``base``.

        The slice holds the same sums of the same table entries as a call for
        ``count`` sizes would make.
        """
        if not cost.tabulated:
            return cost.step_costs(self._n, base, count)
        c = self._costs
        if c is None or c[0] != base or c[1].shape[0] < count:
            c = self._costs = (base, cost.step_costs(self._n, base, count))
        return c[1][:count]
