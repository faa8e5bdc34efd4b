"""Verify-budget selection: the cost model, ``choose_budget`` and ``allocate``.

The budget ``b`` is the number of drafts verified this step across the batch.
``choose_budget`` runs on the host with (possibly stale) confidences and
maximises expected emitted tokens per millisecond of step cost; ``allocate``
runs on the device with the live confidences and turns ``b`` into per-request
capacities without a host sync. (:func:`maskplug.allocate_step`, the same
for a scheduler's :class:`~maskplug.StepView` with the step's grammar, lives
in :mod:`maskplug.schedulers.allocation`: it builds on the scheduler
protocol, which builds on this module.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ._checks import check_unit_interval, host_int, host_ints
from .draftmasks import DraftMasks, check_draft_masks
from .errors import BudgetError
from .layout import ScheduledLayout

__all__ = [
    "BudgetDecision",
    "CostModel",
    "allocate",
    "choose_budget",
    "grammar_confidences",
    "host_confidences",
    "survival",
]

FloatArray = npt.NDArray[np.float64]

#: Sizes tabulated at most per cost curve (8 MiB of float64); larger sizes are evaluated on demand.
_TABLE_LIMIT = 1 << 20


def _curve(name: str, samples: Sequence[tuple[float, float]] | npt.NDArray[Any]) -> tuple[FloatArray, FloatArray]:
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu().numpy()
    try:
        raw = np.asarray(samples)
    except (TypeError, ValueError, OverflowError) as err:
        raise BudgetError(f"{name}: expected (size, ms) pairs of numbers, got {type(samples).__name__}") from err
    if raw.size and raw.dtype.kind not in "fiu":
        raise BudgetError(f"{name}: expected (size, ms) pairs of numbers, got dtype {raw.dtype}")
    arr = raw.astype(np.float64)
    if arr.ndim != 2 or arr.shape[1] != 2 or arr.shape[0] < 1:
        raise BudgetError(f"{name}: expected (size, ms) pairs, got an array of shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise BudgetError(f"{name}: expected finite, non-negative sizes and times, got {arr.tolist()}")
    order = np.argsort(arr[:, 0], kind="stable")
    x, y = arr[order, 0], arr[order, 1]
    if np.any(x[1:] == x[:-1]):
        raise BudgetError(f"{name}: expected distinct sizes, got {x.tolist()}")
    # Profiled timings are noisy; a larger batch never costs less, so make it monotone.
    return x, np.maximum.accumulate(y)


class _Curve:
    """Step cost of one phase as a function of its size (non-decreasing; see :meth:`CostModel.from_curves`)."""

    def __init__(self, x: FloatArray, y: FloatArray, graph_limit: int, table_max: int) -> None:
        self.x, self.y, self.graph_limit = x, y, graph_limit
        # The padded cost at the capture limit: no size above the limit costs less.
        self.limit_ms = float(self._padded(np.array([float(graph_limit)]))[0]) if graph_limit > 0 else 0.0
        self.table = self._eval(np.arange(min(table_max, _TABLE_LIMIT) + 1, dtype=np.float64))

    def _interpolated(self, s: FloatArray) -> FloatArray:
        x, y = self.x, self.y
        out = np.interp(s, x, y)  # flat below the first sample
        if x.shape[0] >= 2:
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
            past = s > x[-1]
            out = np.where(past, y[-1] + slope * (s - x[-1]), out)
        return out

    def _padded(self, s: FloatArray) -> FloatArray:
        # The engine pads to the next captured size, so the cost is that of the
        # smallest sample >= s (a step function); past the last sample, extrapolated.
        x, y = self.x, self.y
        idx = np.minimum(np.searchsorted(x, s, side="left"), x.shape[0] - 1)
        return np.where(s <= x[-1], y[idx], self._interpolated(s))

    def _eval(self, s: FloatArray) -> FloatArray:
        if self.graph_limit <= 0:
            return self._interpolated(s)
        # Both pieces are non-decreasing (the samples are); only where the limit
        # falls between two samples could the interpolation just above it undercut
        # the padded cost at the limit, so it is raised to that cost there.
        above = np.maximum(self._interpolated(s), self.limit_ms)
        return np.where(s <= self.graph_limit, self._padded(s), above)

    def span(self, start: int, count: int) -> FloatArray:
        """Costs of sizes ``start .. start + count - 1``: a slice of the table when it covers them."""
        if 0 <= start and start + count <= self.table.shape[0]:
            return self.table[start : start + count]
        return self._eval(np.arange(start, start + count, dtype=np.float64))

    def __call__(self, s: Any) -> Any:
        arr = np.asarray(s)
        if arr.dtype.kind in "iu" and arr.size and int(arr.min()) >= 0 and int(arr.max()) < self.table.shape[0]:
            res = self.table[arr]
        else:
            res = self._eval(arr.astype(np.float64))
        return float(res) if np.ndim(res) == 0 else res


class CostModel:
    """Step cost in milliseconds: ``draft_ms(num_reqs) + verify_ms(num_tokens)``.

    Both costs are non-decreasing in their size: a step never costs less for
    more requests or more tokens. Every model built by :meth:`from_curves` or
    :meth:`linear` is, whatever samples it is given. The budget choice relies
    on it (drafts that cannot be accepted never pay for themselves), so a
    subclass that overrides ``draft_ms`` / ``verify_ms`` must keep it:
    :func:`choose_budget` refuses a step cost that falls as the budget grows.
    """

    def __init__(self, draft: _Curve, verify: _Curve) -> None:
        self._draft = draft
        self._verify = verify

    @classmethod
    def from_curves(
        cls,
        draft_curve: Sequence[tuple[float, float]] | npt.NDArray[Any],
        verify_curve: Sequence[tuple[float, float]] | npt.NDArray[Any],
        max_reqs: int,
        max_tokens: int,
        graph_limit: int = 0,
    ) -> CostModel:
        """Build from profiled ``(size, ms)`` samples.

        Samples are made monotone (each time raised to the largest at a
        smaller size: profiled timings are noisy). Up to ``graph_limit`` the
        cost is a step function (the engine pads to captured graph sizes: a
        size costs what the smallest sample at or above it costs), above it
        linearly interpolated, and past the last sample extrapolated linearly.
        Where ``graph_limit`` falls between two samples, sizes just above it
        cost at least the padded cost at the limit, so the resulting cost is
        non-decreasing in size everywhere. Costs are tabulated up to
        ``max_reqs`` / ``max_tokens`` (at most 2**20 sizes each; larger ones
        are computed when asked) for O(1) lookups. The three sizes are ints
        in ``[0, 2**31 - 1]``, the most tokens a step can hold.
        """
        reqs = host_int("max_reqs", max_reqs, BudgetError)
        tokens = host_int("max_tokens", max_tokens, BudgetError)
        limit = host_int("graph_limit", graph_limit, BudgetError)
        dx, dy = _curve("draft_curve", draft_curve)
        vx, vy = _curve("verify_curve", verify_curve)
        return cls(_Curve(dx, dy, limit, reqs), _Curve(vx, vy, limit, tokens))

    @classmethod
    def linear(
        cls,
        draft_base_ms: float = 1.0,
        draft_per_req_ms: float = 0.01,
        verify_base_ms: float = 5.0,
        verify_per_token_ms: float = 0.02,
        max_reqs: int = 1024,
        max_tokens: int = 16384,
    ) -> CostModel:
        """A straight-line cost model, for tests and the simulator."""
        vals = {
            "draft_base_ms": draft_base_ms,
            "draft_per_req_ms": draft_per_req_ms,
            "verify_base_ms": verify_base_ms,
            "verify_per_token_ms": verify_per_token_ms,
        }
        for name, v in vals.items():
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise BudgetError(f"{name}: expected a finite number >= 0, got {type(v).__name__} {v!r}")
            if not np.isfinite(v) or v < 0:
                raise BudgetError(f"{name}: expected a finite value >= 0, got {v!r}")
        if draft_base_ms + draft_per_req_ms + verify_base_ms + verify_per_token_ms <= 0:
            raise BudgetError("CostModel.linear: expected a positive cost, got all zeros")
        return cls.from_curves(
            [(0, draft_base_ms), (1, draft_base_ms + draft_per_req_ms)],
            [(0, verify_base_ms), (1, verify_base_ms + verify_per_token_ms)],
            max_reqs,
            max_tokens,
        )

    def draft_ms(self, num_reqs: Any) -> Any:
        """Drafting cost for ``num_reqs`` requests (scalar or array)."""
        return self._draft(num_reqs)

    @property
    def tabulated(self) -> bool:
        """Whether the step costs are this class's own curves (not a subclass's ``draft_ms`` / ``verify_ms``).

        Tabulated costs are non-decreasing by construction and depend on the
        sizes alone, so callers may keep :meth:`step_costs` results for sizes
        that repeat.
        """
        cls = type(self)
        return cls.draft_ms is CostModel.draft_ms and cls.verify_ms is CostModel.verify_ms

    def step_costs(self, num_reqs: int, num_tokens: int, count: int) -> FloatArray:
        """``draft_ms(num_reqs) + verify_ms(num_tokens + b)`` for ``b = 0 .. count - 1``, a new float64 array.

        The step costs of every budget of a batch of ``num_reqs`` requests with
        ``num_tokens`` tokens besides its drafts. A subclass's own costs are
        checked (``count`` finite values, non-decreasing); every cost must be
        positive. Raises :class:`BudgetError` otherwise.
        """
        if self.tabulated:
            # Consecutive sizes: slice the tabulated curve instead of gathering from it.
            costs = self._draft.span(num_reqs, 1)[0] + self._verify.span(num_tokens, count)
            # Non-decreasing by construction: the first cost is the smallest.
            if count and costs[0] <= 0:
                raise BudgetError(f"cost: expected positive step costs, got {float(costs[0])} ms")
            return costs
        costs = np.asarray(self.draft_ms(num_reqs), dtype=np.float64) + np.asarray(
            self.verify_ms(np.arange(num_tokens, num_tokens + count)), dtype=np.float64
        )
        if costs.shape != (count,) or not np.isfinite(costs).all():
            bad = costs if costs.shape != (count,) else costs[~np.isfinite(costs)][:3]
            raise BudgetError(f"cost: expected {count} finite step costs, got {bad.tolist()}")
        # Only a subclass can break the monotone-cost contract; the curves above keep it by construction.
        falls = np.flatnonzero(np.diff(costs) < 0)
        if falls.size:
            b = int(falls[0])
            raise BudgetError(
                f"cost: expected step costs non-decreasing in the budget, got {float(costs[b])} ms at budget {b} "
                f"and {float(costs[b + 1])} ms at budget {b + 1}"
            )
        if np.any(costs <= 0):
            raise BudgetError(f"cost: expected positive step costs, got {float(costs.min())} ms")
        return costs

    def verify_ms(self, num_tokens: Any) -> Any:
        """Verification (target forward) cost for ``num_tokens`` tokens (scalar or array)."""
        return self._verify(num_tokens)


@dataclass(frozen=True)
class BudgetDecision:
    """The chosen budget, its expected emitted tokens and its step cost."""

    budget: int
    expected_tokens: float
    cost_ms: float


def host_confidences(confidences: Any, layout: ScheduledLayout, arg: str = "confidences") -> FloatArray:
    """``confidences`` as a float64 host array of shape ``(n, ≥ max num_drafts)``, checked against ``layout``.

    Accepts a numpy array, a nested sequence or a CPU tensor (a device tensor
    is refused: the host reads stale copies). Values for scheduled drafts must
    lie in ``[0, 1]``; columns past a request's drafts may hold anything. Not
    a copy when the input already is a float64 array. ``arg`` names the
    argument in the :class:`BudgetError`.
    """
    n = layout.n
    k = int(layout.num_drafts.max()) if n else 0
    return _checked_confidences(_host_float64(confidences, n, arg), n, layout.num_drafts, k, arg)


def _host_float64(confidences: Any, n: int, arg: str = "confidences") -> FloatArray:
    """The conversion of :func:`host_confidences`: a float64 host array (not yet checked), ``n`` the batch size."""
    return _host_array(confidences, n, arg).astype(np.float64, copy=False)


def _host_array(confidences: Any, n: int, arg: str = "confidences") -> npt.NDArray[Any]:
    """:func:`_host_float64` short of the last step: float arrays keep their dtype (integers become float64)."""
    if isinstance(confidences, torch.Tensor):
        if confidences.device.type != "cpu":
            raise BudgetError(f"{arg}: expected a host array (stale confidences), got a tensor on {confidences.device}")
        if confidences.is_complex() or confidences.dtype == torch.bool:
            raise BudgetError(f"{arg}: expected a float array, got dtype {confidences.dtype}")
        confidences = confidences.detach().to(torch.float64).numpy()
    if isinstance(confidences, np.ndarray):
        conf = confidences
    else:
        try:
            conf = np.asarray(confidences)
        except (TypeError, ValueError) as err:
            raise BudgetError(f"{arg}: expected a 2-D float array, got {type(confidences).__name__}") from err
    if conf.size and conf.dtype.kind not in "fiu":
        raise BudgetError(f"{arg}: expected a float array, got dtype {conf.dtype}")
    if conf.dtype.kind != "f":
        conf = conf.astype(np.float64)
    if conf.ndim == 1 and n == 0 and conf.size == 0:
        conf = conf.reshape(0, 0)
    return conf


def _checked_confidences(
    conf: FloatArray, n: int, num_drafts: npt.NDArray[np.int64], k: int, arg: str = "confidences"
) -> FloatArray:
    """The shape and value checks of :func:`host_confidences` on a float64 array, ``k`` the most drafts."""
    conf = _checked_shape(conf, n, k, arg)
    _checked_values(conf, num_drafts, k, arg)
    return conf


def _checked_shape(conf: FloatArray, n: int, k: int, arg: str = "confidences") -> FloatArray:
    """The shape checks of :func:`host_confidences`: ``(n, ≥ k)``."""
    if conf.ndim != 2 or conf.shape[0] != n:
        raise BudgetError(f"{arg}: expected shape ({n}, max_drafts), got {conf.shape}")
    if conf.shape[1] < k:
        raise BudgetError(f"{arg}: expected at least {k} columns (the most drafts of any request), got {conf.shape[1]}")
    return conf


_MIN, _MAX = np.minimum.reduce, np.maximum.reduce
_CUMPROD, _CUMSUM = np.multiply.accumulate, np.add.accumulate


def _checked_values(conf: FloatArray, num_drafts: npt.NDArray[np.int64], k: int, arg: str = "confidences") -> None:
    """The value check of :func:`host_confidences`: scheduled drafts' confidences in ``[0, 1]``, no NaN."""
    head = conf[:, :k]
    # Two reductions pass exactly when every value lies in [0, 1] (a NaN fails both); only then is
    # the full check, which ignores stale columns past a request's drafts, skipped.
    # (ufunc reductions called directly: the array methods' dispatch costs about 1 µs each at small n.)
    if head.size and not (_MIN(head, axis=None) >= 0.0 and _MAX(head, axis=None) <= 1.0):
        check_unit_interval(arg, head, BudgetError, num_drafts)


def grammar_confidences(conf: FloatArray, layout: ScheduledLayout, grammar: DraftMasks) -> FloatArray:
    """Correct per-position confidences with what the grammar knows.

    A draft the grammar rejects (and every later one) gets confidence 0; a
    draft the grammar accepts at a position that allows exactly one token gets
    confidence 1, since the target's masked distribution has no other choice.
    ``grammar`` is checked against ``layout`` as everywhere it enters
    (:func:`~maskplug.draftmasks.check_draft_masks`).
    """
    grammar = check_draft_masks(grammar, layout)
    out = np.array(conf, dtype=np.float64, copy=True)
    if out.ndim != 2 or out.shape[0] != layout.n:
        raise BudgetError(f"conf: expected shape ({layout.n}, max_drafts), got {out.shape}")
    if grammar.request.size == 0:
        return out
    over = _grammar_override(grammar, layout.n, out.shape[1])
    np.copyto(out, over, where=~np.isnan(over))
    return out


def _grammar_override(grammar: DraftMasks, n: int, k: int) -> FloatArray:
    """What the grammar says of each draft's confidence, ``(n, k)``: 0, 1, or NaN where it says nothing.

    A draft the grammar rejects (and every later one) is 0; a draft it accepts
    at a position that allows exactly one token is 1. The one statement of the
    grammar correction, for the host survivals (:func:`grammar_confidences`)
    and the live ones on the device (:func:`maskplug.allocate_step`). ``grammar`` is
    already checked against the step's layout.
    """
    over = np.full((n, k), np.nan, dtype=np.float64)
    req = grammar.request
    if req.size == 0 or k == 0:
        return over
    cols = np.arange(k)[None, :]
    acc = np.asarray(grammar.acceptable, dtype=np.int64)[:, None]
    forced = np.zeros((req.shape[0], k), dtype=bool)
    w = min(k, grammar.forced.shape[1])
    forced[:, :w] = grammar.forced[:, :w]
    rows = over[req]
    rows[forced & (cols < acc)] = 1.0
    rows[cols >= acc] = 0.0
    over[req] = rows
    return over


def survival(conf: FloatArray, num_drafts: npt.NDArray[np.int64]) -> FloatArray:
    """``s[r, k]`` = probability that drafts ``0..k`` of ``r`` are all accepted (0 past the drafts)."""
    s = np.cumprod(conf, axis=1) if conf.size else np.zeros_like(conf)
    valid = np.arange(conf.shape[1])[None, :] < num_drafts[:, None]
    return np.where(valid, s, 0.0)


#: From this many requests on, survivals are multiplied column by column (a few long vector products)
#: instead of by cumprod along each short row.
_COLUMNWISE_FROM = 64


def _sorted_survivals(
    conf: FloatArray, num_drafts: npt.NDArray[np.int64], k: int | None = None, live: Any = None
) -> FloatArray:
    """The survivals of every scheduled draft, largest first (the values :func:`survival` holds).

    ``k`` (the most drafts of any request) and ``live`` (the ``(n, k)`` mask of
    scheduled drafts, or ``None`` when every request has ``k``) are worked out
    from ``num_drafts`` unless a caller that already knows them passes them.
    """
    n = num_drafts.shape[0]
    if k is None:
        k = int(num_drafts.max()) if n else 0
        if k and int(num_drafts.min()) != k:
            live = np.arange(k)[None, :] < num_drafts[:, None]
    if k == 0:
        return np.zeros(0, dtype=np.float64)
    # Products run left to right, so stale junk past a request's drafts never
    # reaches its scheduled positions.
    if n < _COLUMNWISE_FROM:
        # In float64 whatever the input's float dtype (each value converted exactly first, as astype does).
        s = _CUMPROD(conf[:, :k], axis=1, dtype=np.float64)  # np.cumprod's own ufunc, without its dispatch
        flat = s.ravel() if live is None else s[live]
    else:
        # Column by column: the same products in the same order as cumprod along rows, laid out
        # draft-major (the order is irrelevant: they are sorted next).
        cols = np.empty((k, n), dtype=np.float64)
        cols[:] = conf[:, :k].T
        for j in range(1, k):
            np.multiply(cols[j - 1], cols[j], out=cols[j])
        flat = cols.ravel() if live is None else cols[live.T]
    # A new array either way (the products), so it is sorted in place. Only the sorted values matter
    # (their sum), so an unstable sort is fine and several times faster.
    flat.sort()
    return flat[::-1]


def choose_budget(
    confidences: Any,
    layout: ScheduledLayout,
    cost: CostModel,
    *,
    num_sampling: int | None = None,
    max_logits: int | None = None,
    grammar: DraftMasks | None = None,
) -> BudgetDecision:
    """Pick ``b`` maximising ``est(b) / cost(b)``; ties go to the smallest ``b``.

    ``est(b) = num_sampling + Σ top-b survivals`` and ``cost(b) = draft_ms(n) +
    verify_ms(Σ num_non_draft + b)``, over ``0 ≤ b ≤ min(Σ num_drafts,
    max_logits − n·num_bonus)``. ``confidences`` is a host array of shape
    ``(n, ≥ max num_drafts)``; stale values are fine, NaN or out-of-range
    values for scheduled drafts raise :class:`BudgetError`.
    """
    if not isinstance(layout, ScheduledLayout):
        raise BudgetError(f"layout: expected a ScheduledLayout, got {type(layout).__name__}")
    if not isinstance(cost, CostModel):
        raise BudgetError(f"cost: expected a CostModel, got {type(cost).__name__}")
    n = layout.n
    k = int(layout.num_drafts.max()) if n else 0
    if grammar is None:
        base = int(layout.num_non_draft.sum())
        conf = _host_array(confidences, n)
        return choose_checked(conf, layout, k, None, num_sampling, max_logits, lambda m: cost.step_costs(n, base, m))
    conf = _checked_confidences(_host_float64(confidences, n), n, layout.num_drafts, k)
    ns, cap = budget_bounds(layout, num_sampling, max_logits)
    conf = grammar_confidences(conf, layout, grammar)
    return best_budget(_sorted_survivals(conf, layout.num_drafts)[:cap], ns, layout, cost)


def choose_checked(
    conf: npt.NDArray[Any],
    layout: ScheduledLayout,
    k: int,
    live: Any,
    num_sampling: Any,
    max_logits: Any,
    step_costs: Callable[[int], FloatArray],
) -> BudgetDecision:
    """:func:`choose_budget` without grammar, from a converted ``conf`` (:func:`_host_array`, unchecked) on.

    ``k`` is the most drafts of any request, ``live`` the ``(n, k)`` mask of
    scheduled drafts (``None`` when every request has ``k``, or when unknown: it
    is then worked out if needed) and ``step_costs(m)`` the step costs of budgets
    ``0 .. m - 1`` (:meth:`CostModel.step_costs` of the layout's sizes). Checks
    and errors come in :func:`choose_budget`'s order: the shape and values of
    ``conf``, then ``num_sampling`` and ``max_logits``, then the costs.
    """
    n = layout.n
    nd = layout.num_drafts
    conf = _checked_shape(conf, n, k)
    _checked_values(conf, nd, k)
    ns, cap = budget_bounds(layout, num_sampling, max_logits)
    if live is None and k and layout.total_drafts != n * k:
        live = np.arange(k)[None, :] < nd[:, None]
    top = _sorted_survivals(conf, nd, k, live)[:cap]
    return best_of(top, ns, step_costs(cap + 1))


def budget_bounds(layout: ScheduledLayout, num_sampling: Any, max_logits: Any) -> tuple[int, int]:
    """``(num_sampling, cap)`` of a budget choice: the checked arguments and the largest budget allowed.

    ``num_sampling`` defaults to ``n``; the cap is ``Σ num_drafts``, lowered to
    ``max_logits − n·num_bonus`` when ``max_logits`` is given (below the bonus
    rows alone it raises :class:`BudgetError`). Shared by
    :func:`choose_budget` and :func:`maskplug.choose_tree_budget`.
    """
    n = layout.n
    ns = n if num_sampling is None else host_int("num_sampling", num_sampling, BudgetError)
    cap = layout.total_drafts
    if max_logits is not None:
        room = host_int("max_logits", max_logits, BudgetError) - n * layout.num_bonus
        if room < 0:
            raise BudgetError(
                f"max_logits: expected at least n*num_bonus = {n * layout.num_bonus} rows for the bonus "
                f"positions alone, got {max_logits}"
            )
        cap = min(cap, room)
    return ns, cap


def best_budget(top: FloatArray, num_sampling: int, layout: ScheduledLayout, cost: CostModel) -> BudgetDecision:
    """The budget ``b`` in ``[0, len(top)]`` maximising ``est(b) / cost(b)``; ties go to the smallest ``b``.

    ``top`` holds the values of the admissible drafts (or tree nodes), largest
    first, already cut to the cap; ``est(b) = num_sampling + Σ top[:b]`` and
    ``cost(b) = draft_ms(n) + verify_ms(Σ num_non_draft + b)``. A ``cost``
    subclass's step costs are checked (finite, non-decreasing); every cost must
    be positive. Shared by :func:`choose_budget` and
    :func:`maskplug.choose_tree_budget`.
    """
    costs = cost.step_costs(layout.n, int(layout.num_non_draft.sum()), int(top.shape[0]) + 1)
    return best_of(top, num_sampling, costs)


def best_of(top: FloatArray, num_sampling: int, costs: FloatArray) -> BudgetDecision:
    """:func:`best_budget` once the step costs of budgets ``0 .. len(top)`` are known (checked, positive)."""
    nsf = float(num_sampling)
    c0 = costs.item(0)  # .item: a Python float without a numpy scalar in between
    if top.shape[0]:
        est = _CUMSUM(top)  # est(b) for b >= 1: Σ top[:b], then num_sampling added
        est += nsf
        ratio = est / costs[1:]
        b = int(ratio.argmax())  # the first maximum: ties go to the smallest budget, 0 included below
        if ratio.item(b) > nsf / c0:
            return BudgetDecision(budget=b + 1, expected_tokens=est.item(b), cost_ms=costs.item(b + 1))
    return BudgetDecision(budget=0, expected_tokens=nsf, cost_ms=c0)


def _live(arg: str, confidences: Any, n: int | None = None) -> torch.Tensor:
    """Live confidences: a 2-D floating tensor (``n`` rows when given); values are checked by the caller."""
    if not isinstance(confidences, torch.Tensor) or confidences.ndim != 2 or not confidences.is_floating_point():
        got = f"{type(confidences).__name__} {getattr(confidences, 'dtype', '')} {tuple(getattr(confidences, 'shape', ()))}"
        raise BudgetError(f"{arg}: expected a 2-D floating tensor (n, max_drafts), got {got}")
    if n is not None and confidences.shape[0] != n:
        raise BudgetError(f"{arg}: expected {n} rows (one per request), got {confidences.shape[0]}")
    return confidences


def _check_live_values(arg: str, confidences: torch.Tensor, num_drafts: npt.NDArray[np.int64]) -> None:
    """On the host, refuse NaN or values outside [0, 1] for scheduled drafts (a device tensor is not read)."""
    if confidences.device.type != "cpu" or confidences.numel() == 0:
        return
    k = int(num_drafts.max()) if num_drafts.size else 0
    head = confidences[:, :k].detach()
    if head.dtype != torch.float32 and head.dtype != torch.float64:
        head = head.float()
    check_unit_interval(arg, head.numpy(), BudgetError, num_drafts)


def _int_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _device_count_tensor(arg: str, value: torch.Tensor, shape: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    """A device-resident count tensor: dtype, shape and device checked; its values are not read (no host sync)."""
    if value.device != dev:
        raise BudgetError(f"{arg}: expected a host value or a tensor on {dev}, got a tensor on {value.device}")
    if tuple(value.shape) != shape or not _int_dtype(value.dtype):
        what = "a 0-d integer tensor" if not shape else f"an integer tensor of shape {shape}"
        raise BudgetError(f"{arg}: expected {what}, got {value.dtype} {tuple(value.shape)}")
    return value


def _budget_arg(budget: Any, hi: int | None, dev: torch.device) -> int | torch.Tensor:
    """``budget`` as a checked host int in ``[0, hi]``, or a device 0-d integer tensor (values not read)."""
    if isinstance(budget, torch.Tensor) and budget.device.type != "cpu":
        return _device_count_tensor("budget", budget, (), dev)
    if hi is None:
        return host_int("budget", budget, BudgetError)
    return host_int("budget", budget, BudgetError, hi=hi, expected="0 <= budget <= Σ num_drafts = {hi}")


def allocate(
    confidences: torch.Tensor, num_drafts: torch.Tensor | Any, budget: int | np.integer[Any] | torch.Tensor
) -> torch.Tensor:
    """Per-request capacities from the live confidences: the global top-``budget`` survivals.

    Ties are broken by position, then request, so the result is deterministic
    and always a prefix of each request's drafts. Runs on the device of
    ``confidences`` with no host sync (``budget`` may be a 0-d device tensor).
    Returns int32 capacities of shape ``(n,)``.

    Host arguments (lists, numpy arrays, CPU tensors, 0-d tensors, ints) are
    checked the same way in every form: ``num_drafts`` holds ``n`` counts in
    ``[0, max_drafts]``, ``budget`` lies in ``[0, Σ num_drafts]`` and, on the
    CPU, the confidences of scheduled drafts lie in ``[0, 1]``, else
    :class:`BudgetError`. Values of device tensors are not read (that would
    be a host sync); the result still never exceeds a request's drafts, a
    NaN confidence counts as 0 and others are clamped into ``[0, 1]``.
    """
    _live("confidences", confidences)
    dev = confidences.device
    n, k = confidences.shape
    if isinstance(num_drafts, torch.Tensor) and num_drafts.device.type != "cpu":
        nd = _device_count_tensor("num_drafts", num_drafts, (n,), dev).to(torch.int64)
        return _top_budget(confidences, nd, _budget_arg(budget, None, dev), unchecked=True)
    nd_host = host_ints("num_drafts", num_drafts, BudgetError, n=n, hi=k)
    b = _budget_arg(budget, int(nd_host.sum()), dev)
    _check_live_values("confidences", confidences, nd_host)
    if dev.type == "cpu" and not isinstance(b, torch.Tensor):
        return _top_budget_host(confidences, nd_host, b)
    return _top_budget(confidences, torch.tensor(nd_host, device=dev), b, unchecked=dev.type != "cpu")


def _top_budget_host(confidences: torch.Tensor, nd: npt.NDArray[np.int64], b: int) -> torch.Tensor:
    """:func:`_top_budget` on checked host values, in numpy: the same survivals, order and ties.

    An engine core plans on the host, where each torch op costs a few
    microseconds of dispatch: at 16 requests this is several times faster than
    the device path's dozen ops. ``b`` lies in ``[0, Σ nd]`` and ``nd`` in
    ``[0, k]`` (checked), so the ``b`` largest survivals are all scheduled drafts.
    """
    n, k = confidences.shape
    if n == 0 or k == 0 or b == 0:
        return torch.zeros(n, dtype=torch.int32)
    c = confidences.detach().to(torch.float64).numpy()
    s = _CUMPROD(c, axis=1)  # the same left-to-right products as torch.cumprod
    valid = np.arange(k)[None, :] < nd[:, None]
    # Position-major, as on the device: a stable ascending sort of the negated survivals is the
    # stable descending sort there (ties by position, then request); -1 (no draft) sorts last.
    flat = np.where(valid, s, -1.0).T.ravel()
    np.negative(flat, out=flat)
    chosen = np.argsort(flat, kind="stable")[:b]
    return torch.from_numpy(np.bincount(chosen % n, minlength=n).astype(np.int32))


def _top_budget(confidences: torch.Tensor, nd: torch.Tensor, b: int | torch.Tensor, *, unchecked: bool) -> torch.Tensor:
    """The capacities of :func:`allocate` once its arguments are checked, on the confidences' device.

    ``unchecked``: the values were not read on the host (a device tensor), so
    they are kept in range here: confidences clamped into ``[0, 1]`` with NaN
    as 0. Whatever the values, a request never gets more than
    ``min(num_drafts, max_drafts)`` drafts and a negative budget or count
    selects nothing.
    """
    n, k = confidences.shape
    dev = confidences.device
    if n == 0 or k == 0:
        return torch.zeros(n, dtype=torch.int32, device=dev)
    c = confidences.to(torch.float64)
    if unchecked:
        c = torch.nan_to_num(c.clamp(0.0, 1.0), nan=0.0)
    s = torch.cumprod(c, dim=1)
    pos = torch.arange(k, device=dev)
    valid = pos[None, :] < nd[:, None]
    s = torch.where(valid, s, torch.full_like(s, -1.0))  # never picked before a real draft
    # Flatten position-major so a stable descending sort breaks ties by
    # position first, then by request.
    flat = s.t().reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=dev)
    # A position past a request's drafts is never chosen, whatever the budget.
    chosen = (rank < b).view(k, n) & valid.t()
    return chosen.sum(dim=0, dtype=torch.int32)
