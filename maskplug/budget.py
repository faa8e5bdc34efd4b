"""Verify-budget selection: the cost model, ``choose_budget``, ``allocate`` and ``allocate_step``.

The budget ``b`` is the number of drafts verified this step across the batch.
``choose_budget`` runs on the host with (possibly stale) confidences and
maximises expected emitted tokens per millisecond of step cost; ``allocate``
runs on the device with the live confidences and turns ``b`` into per-request
capacities without a host sync. ``allocate_step`` does the same for a
scheduler's :class:`~maskplug.schedulers.StepView`, keeping drafts the
step's grammar rejects out of the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from .draftmasks import DraftMasks
from .errors import BudgetError
from .layout import ScheduledLayout

if TYPE_CHECKING:
    from .schedulers.protocol import StepView

__all__ = [
    "BudgetDecision",
    "CostModel",
    "allocate",
    "allocate_step",
    "choose_budget",
    "grammar_confidences",
    "host_confidences",
    "survival",
]

FloatArray = npt.NDArray[np.float64]


def _curve(name: str, samples: Sequence[tuple[float, float]] | npt.NDArray[Any]) -> tuple[FloatArray, FloatArray]:
    arr = np.asarray(samples, dtype=np.float64)
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
        self.table = self._eval(np.arange(table_max + 1, dtype=np.float64))

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
        ``max_reqs`` / ``max_tokens`` for O(1) lookups.
        """
        for name, v in (("max_reqs", max_reqs), ("max_tokens", max_tokens), ("graph_limit", graph_limit)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise BudgetError(f"{name}: expected an int >= 0, got {v!r}")
        dx, dy = _curve("draft_curve", draft_curve)
        vx, vy = _curve("verify_curve", verify_curve)
        return cls(_Curve(dx, dy, int(graph_limit), int(max_reqs)), _Curve(vx, vy, int(graph_limit), int(max_tokens)))

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
    if isinstance(confidences, torch.Tensor):
        if confidences.device.type != "cpu":
            raise BudgetError(f"{arg}: expected a host array (stale confidences), got a tensor on {confidences.device}")
        confidences = confidences.detach().to(torch.float64).numpy()
    conf = np.asarray(confidences, dtype=np.float64) if not isinstance(confidences, np.ndarray) else confidences
    if conf.dtype.kind not in "fiu":
        raise BudgetError(f"{arg}: expected a float array, got dtype {conf.dtype}")
    conf = conf.astype(np.float64, copy=False)
    if conf.ndim == 1 and layout.n == 0 and conf.size == 0:
        conf = conf.reshape(0, 0)
    if conf.ndim != 2 or conf.shape[0] != layout.n:
        raise BudgetError(f"{arg}: expected shape ({layout.n}, max_drafts), got {conf.shape}")
    k = int(layout.num_drafts.max()) if layout.n else 0
    if conf.shape[1] < k:
        raise BudgetError(f"{arg}: expected at least {k} columns (the most drafts of any request), got {conf.shape[1]}")
    head = conf[:, :k]
    # One pass over the columns that can matter (NaN fails both comparisons);
    # only if it fails, look at which entries belong to scheduled drafts, since
    # stale columns past a request's drafts may hold anything.
    if not np.all((head >= 0.0) & (head <= 1.0)):
        valid = np.arange(k)[None, :] < layout.num_drafts[:, None]
        bad = ~((head >= 0.0) & (head <= 1.0)) & valid
        if np.any(bad):
            raise BudgetError(f"{arg}: expected probabilities in [0, 1] for scheduled drafts, got {head[bad][0]}")
    return conf


def grammar_confidences(conf: FloatArray, layout: ScheduledLayout, grammar: DraftMasks) -> FloatArray:
    """Correct per-position confidences with what the grammar knows.

    A draft the grammar rejects (and every later one) gets confidence 0; a
    draft the grammar accepts at a position that allows exactly one token gets
    confidence 1, since the target's masked distribution has no other choice.
    """
    out = np.array(conf, dtype=np.float64, copy=True)
    req = np.asarray(grammar.request, dtype=np.int64)
    if req.size == 0:
        return out
    if req.min() < 0 or req.max() >= layout.n:
        raise BudgetError(f"grammar.request: expected batch indices in [0, {layout.n}), got {req.tolist()}")
    acc = np.asarray(grammar.acceptable, dtype=np.int64)
    k = out.shape[1]
    cols = np.arange(k)[None, :]
    rejected = cols >= acc[:, None]
    forced = np.zeros((req.shape[0], k), dtype=bool)
    f = np.asarray(grammar.forced, dtype=bool)
    w = min(k, f.shape[1]) if f.ndim == 2 else 0
    forced[:, :w] = f[:, :w]
    rows = out[req]
    rows = np.where(forced & ~rejected, 1.0, rows)
    rows = np.where(rejected, 0.0, rows)
    out[req] = rows
    return out


def survival(conf: FloatArray, num_drafts: npt.NDArray[np.int64]) -> FloatArray:
    """``s[r, k]`` = probability that drafts ``0..k`` of ``r`` are all accepted (0 past the drafts)."""
    s = np.cumprod(conf, axis=1) if conf.size else np.zeros_like(conf)
    valid = np.arange(conf.shape[1])[None, :] < num_drafts[:, None]
    return np.where(valid, s, 0.0)


def _sorted_survivals(conf: FloatArray, num_drafts: npt.NDArray[np.int64]) -> FloatArray:
    """The survivals of every scheduled draft, largest first (the values :func:`survival` holds)."""
    k = int(num_drafts.max()) if num_drafts.size else 0
    if k == 0:
        return np.zeros(0, dtype=np.float64)
    # Products run left to right, so stale junk past a request's drafts never
    # reaches its scheduled positions.
    s = np.cumprod(conf[:, :k], axis=1)
    flat = s.ravel() if int(num_drafts.min()) == k else s[np.arange(k)[None, :] < num_drafts[:, None]]
    # Only the sorted values matter (their sum), so an unstable sort is fine and several times faster.
    return np.sort(flat)[::-1]


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
    conf = host_confidences(confidences, layout)
    n = layout.n
    if num_sampling is None:
        num_sampling = n
    elif isinstance(num_sampling, bool) or not isinstance(num_sampling, (int, np.integer)) or num_sampling < 0:
        raise BudgetError(f"num_sampling: expected an int >= 0, got {num_sampling!r}")
    cap = layout.total_drafts
    if max_logits is not None:
        if isinstance(max_logits, bool) or not isinstance(max_logits, (int, np.integer)):
            raise BudgetError(f"max_logits: expected an int, got {max_logits!r}")
        room = int(max_logits) - n * layout.num_bonus
        if room < 0:
            raise BudgetError(
                f"max_logits: expected at least n*num_bonus = {n * layout.num_bonus} rows for the bonus "
                f"positions alone, got {max_logits}"
            )
        cap = min(cap, room)
    if grammar is not None:
        conf = grammar_confidences(conf, layout, grammar)
    top = _sorted_survivals(conf, layout.num_drafts)[:cap]
    est = np.empty(cap + 1, dtype=np.float64)
    est[0] = float(num_sampling)
    np.cumsum(top, out=est[1:])
    est[1:] += float(num_sampling)
    base = int(layout.num_non_draft.sum())
    if type(cost).draft_ms is CostModel.draft_ms and type(cost).verify_ms is CostModel.verify_ms:
        # Consecutive sizes: slice the tabulated curve instead of gathering from it.
        costs = cost._draft.span(n, 1)[0] + cost._verify.span(base, cap + 1)
    else:  # a subclass with its own cost functions
        costs = np.asarray(cost.draft_ms(n), dtype=np.float64) + np.asarray(
            cost.verify_ms(np.arange(base, base + cap + 1)), dtype=np.float64
        )
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
    ratio = est / costs
    b = int(np.argmax(ratio))  # first maximum: ties go to the smallest budget
    return BudgetDecision(budget=b, expected_tokens=float(est[b]), cost_ms=float(costs[b]))


def allocate(confidences: torch.Tensor, num_drafts: torch.Tensor | Any, budget: int | torch.Tensor) -> torch.Tensor:
    """Per-request capacities from the live confidences: the global top-``budget`` survivals.

    Ties are broken by position, then request, so the result is deterministic
    and always a prefix of each request's drafts. Runs on the device of
    ``confidences`` with no host sync (``budget`` may be a 0-d device tensor).
    Returns int32 capacities of shape ``(n,)``.
    """
    if not isinstance(confidences, torch.Tensor) or confidences.ndim != 2 or not confidences.is_floating_point():
        got = f"{type(confidences).__name__} {getattr(confidences, 'shape', '')} {getattr(confidences, 'dtype', '')}"
        raise BudgetError(f"confidences: expected a 2-D floating tensor (n, max_drafts), got {got}")
    dev = confidences.device
    n, k = confidences.shape
    if not isinstance(num_drafts, torch.Tensor):
        nd_host = np.asarray(num_drafts)
        if nd_host.ndim != 1 or nd_host.shape[0] != n or (nd_host.size and nd_host.dtype.kind not in "iu"):
            raise BudgetError(f"num_drafts: expected {n} integer counts, got {nd_host.dtype} {nd_host.shape}")
        if nd_host.size and (nd_host.min() < 0 or nd_host.max() > k):
            raise BudgetError(f"num_drafts: expected counts in [0, {k}], got {nd_host.tolist()}")
        if isinstance(budget, (int, np.integer)) and not isinstance(budget, bool):
            if not 0 <= int(budget) <= int(nd_host.sum()):
                raise BudgetError(f"budget: expected 0 <= budget <= Σ num_drafts = {int(nd_host.sum())}, got {budget}")
        nd = torch.as_tensor(nd_host.astype(np.int64), device=dev)
    else:
        if num_drafts.shape != (n,) or num_drafts.is_floating_point():
            raise BudgetError(
                f"num_drafts: expected an integer tensor of shape ({n},), got {num_drafts.dtype} {tuple(num_drafts.shape)}"
            )
        if num_drafts.device != dev:
            raise BudgetError(f"num_drafts: expected device {dev}, got {num_drafts.device}")
        nd = num_drafts.to(torch.int64)
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer, torch.Tensor)):
        raise BudgetError(f"budget: expected an int or a 0-d tensor, got {budget!r}")
    if isinstance(budget, (int, np.integer)) and budget < 0:
        raise BudgetError(f"budget: expected >= 0, got {budget}")
    if n == 0 or k == 0:
        return torch.zeros(n, dtype=torch.int32, device=dev)
    s = torch.cumprod(confidences.to(torch.float64), dim=1)
    pos = torch.arange(k, device=dev)
    valid = pos[None, :] < nd[:, None]
    s = torch.where(valid, s, torch.full_like(s, -1.0))  # never picked before a real draft
    # Flatten position-major so a stable descending sort breaks ties by
    # position first, then by request.
    flat = s.t().reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=dev)
    chosen = (rank < budget).view(k, n)
    return chosen.sum(dim=0, dtype=torch.int32)


def allocate_step(step: StepView, confidences: torch.Tensor, budget: int | torch.Tensor) -> torch.Tensor:
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
    # The step view is built on this module's cost model and checks, so its
    # module is imported here, at the first call, rather than at the top.
    from .schedulers.protocol import StepView, grammar_limits

    if not isinstance(step, StepView):
        raise BudgetError(f"step: expected a StepView, got {type(step).__name__}")
    lay = step.layout
    if not isinstance(confidences, torch.Tensor) or confidences.ndim != 2 or not confidences.is_floating_point():
        got = f"{type(confidences).__name__} {getattr(confidences, 'dtype', '')} {tuple(getattr(confidences, 'shape', ()))}"
        raise BudgetError(f"confidences: expected a 2-D floating tensor (n, max_drafts), got {got}")
    if confidences.shape[0] != lay.n:
        raise BudgetError(f"confidences: expected {lay.n} rows (one per request), got {confidences.shape[0]}")
    if step.grammar is None or np.asarray(step.grammar.request).size == 0:
        return allocate(confidences, lay.num_drafts, budget)
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer, torch.Tensor)):
        raise BudgetError(f"budget: expected an int or a 0-d tensor, got {budget!r}")
    if isinstance(budget, (int, np.integer)) and not 0 <= budget <= lay.total_drafts:
        raise BudgetError(f"budget: expected 0 <= budget <= Σ num_drafts = {lay.total_drafts}, got {budget}")
    lim = grammar_limits(lay, step.grammar)
    room = int(lim.sum())
    n, k = confidences.shape
    # Host-built override: NaN keeps the live value, 0/1 replace it.
    over = np.full((n, k), np.nan, dtype=np.float32)
    if k:
        g = step.grammar
        req = np.asarray(g.request, dtype=np.int64)
        cols = np.arange(k)[None, :]
        acc = np.asarray(g.acceptable, dtype=np.int64)[:, None]
        f = np.zeros((req.shape[0], k), dtype=bool)
        w = min(k, g.forced.shape[1])
        f[:, :w] = g.forced[:, :w]
        rows = over[req]
        rows[f & (cols < acc)] = 1.0
        rows[cols >= acc] = 0.0
        over[req] = rows
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
