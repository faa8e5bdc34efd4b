"""Budget schedulers: who decides how many drafts a step verifies.

A scheduler is chosen by name, :func:`get_scheduler` (``MASKPLUG_SCHEDULER``
picks the default), and registered through the ``maskplug_register_schedulers``
hook, the built-ins below exactly like an outside plugin's.

The protocol
------------
Once per step, before the step runs, the engine builds a read-only
:class:`StepView` (the scheduled layout, the cost model, the drafter's
confidences as the host last saw them, usually two steps old, the grammar's
:class:`~maskplug.DraftMasks` when the batch has grammar requests, the logits
row limit) and calls ``scheduler.budget(view) -> BudgetDecision``. The budget
must lie in ``[0, min(Σ num_drafts, max_logits − n·num_bonus)]``. After
verification the engine calls ``scheduler.observe(StepOutcome(...))`` with,
per request id, the drafts verified and the drafts accepted, so schedulers
that learn from history can follow requests while the batch order changes.

A scheduler may also offer ``beliefs(view) -> array | None``: its per-position
conditional acceptance estimates for the step (shape ``(n, ≥ max drafts)``).
``grammar-aware`` uses them to rescore the budget with what the grammar knows;
for a scheduler without beliefs it can only trim drafts the grammar rejects.

The built-ins
-------------
``dspark``
    ``choose_budget`` on the view's (stale) confidences: the budget maximising
    expected emitted tokens per millisecond. Needs a confidence head.
``verify-all``
    fixed-width speculation: every scheduled draft that fits the row limit.
``no-spec``
    always budget 0 (bonus token only).
``goodput``
    for drafters without a confidence head: per request and position, an
    exponentially weighted average of past acceptance (see
    :class:`GoodputScheduler` for the prior of new requests), then the same
    argmax as ``dspark``.
``grammar-aware``
    wraps any scheduler (``get_scheduler("grammar-aware", inner="goodput")``):
    drafts the grammar rejects, and all after them, are worth nothing;
    accepted drafts at positions the grammar forces to one token are certain.

The allocation (which drafts of which request make up the budget) runs on
the device with the live confidences: :func:`allocate_step` does it and, on
a step with draft masks, never admits a draft the grammar rejected.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from .budget import (
    BudgetDecision,
    CostModel,
    _host_confidences,
    allocate,
    choose_budget,
    grammar_confidences,
    survival,
)
from .draftmasks import DraftMasks
from .errors import BudgetError, PluginError
from .hookspecs import hookimpl
from .layout import ScheduledLayout

__all__ = [
    "DEFAULT_SCHEDULER",
    "DSparkScheduler",
    "GoodputScheduler",
    "GrammarAwareScheduler",
    "NoSpecScheduler",
    "Scheduler",
    "StepOutcome",
    "StepView",
    "VerifyAllScheduler",
    "allocate_step",
    "get_scheduler",
    "grammar_limits",
    "schedulers",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: The scheduler :func:`get_scheduler` returns when neither a name nor ``MASKPLUG_SCHEDULER`` is given.
DEFAULT_SCHEDULER = "dspark"


def _opt_int(name: str, v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise BudgetError(f"{name}: expected an int >= 0 or None, got {v!r}")
    return int(v)


def _frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    v = a.view()
    v.flags.writeable = False
    return v


@dataclass(frozen=True)
class StepView:
    """What a scheduler may look at for one step (read-only; arrays are not writeable).

    Attributes:
        layout: the scheduled layout of the step.
        cost: the engine's step cost model.
        confidences: host per-position conditional acceptance confidences,
            shape ``(n, ≥ max num_drafts)``, usually two steps old; ``None``
            when the drafter has no confidence head.
        grammar: the grammar producer's :class:`DraftMasks` for this step's
            grammar requests, or ``None``.
        max_logits: the most logits rows the engine can take this step
            (bonus rows included), or ``None`` for no limit.
        num_sampling: tokens the step emits even at budget 0 (default: ``n``).
    """

    layout: ScheduledLayout
    cost: CostModel
    confidences: FloatArray | None = None
    grammar: DraftMasks | None = None
    max_logits: int | None = None
    num_sampling: int | None = None
    #: The largest admissible budget, ``min(Σ num_drafts, max_logits − n·num_bonus)``.
    cap: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, ScheduledLayout):
            raise BudgetError(f"layout: expected a ScheduledLayout, got {type(self.layout).__name__}")
        if not isinstance(self.cost, CostModel):
            raise BudgetError(f"cost: expected a CostModel, got {type(self.cost).__name__}")
        lay = self.layout
        if self.confidences is not None:
            # A private copy: never alias (or freeze) the engine's own buffer.
            conf = np.array(_host_confidences(self.confidences, lay), dtype=np.float64, copy=True)
            object.__setattr__(self, "confidences", _frozen(conf))
        max_logits = _opt_int("max_logits", self.max_logits)
        object.__setattr__(self, "max_logits", max_logits)
        object.__setattr__(self, "num_sampling", _opt_int("num_sampling", self.num_sampling))
        cap = lay.total_drafts
        if max_logits is not None:
            room = max_logits - lay.n * lay.num_bonus
            if room < 0:
                raise BudgetError(
                    f"max_logits: expected at least n*num_bonus = {lay.n * lay.num_bonus} rows for the bonus "
                    f"positions alone, got {max_logits}"
                )
            cap = min(cap, room)
        object.__setattr__(self, "cap", cap)
        if self.grammar is not None:
            object.__setattr__(self, "grammar", _check_grammar(self.grammar, lay))

    @property
    def sampling(self) -> int:
        """Tokens emitted at budget 0: ``num_sampling``, or ``n`` when it was not given."""
        return self.layout.n if self.num_sampling is None else int(self.num_sampling)

    def score(self, budget: int, confidences: Any | None = None) -> BudgetDecision:
        """The decision for a given ``budget``: expected tokens under ``confidences`` and its step cost.

        ``confidences`` defaults to the view's; with neither, the expected
        tokens are NaN (unknown) and only the cost is meaningful.
        """
        if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or not 0 <= budget <= self.cap:
            raise BudgetError(f"budget: expected an int in [0, {self.cap}], got {budget!r}")
        lay = self.layout
        c = self.cost.draft_ms(lay.n) + self.cost.verify_ms(int(lay.num_non_draft.sum()) + int(budget))
        conf = self.confidences if confidences is None else _host_confidences(confidences, lay)
        if budget == 0:
            est = float(self.sampling)  # exact whatever the confidences
        elif conf is None:
            est = float("nan")
        else:
            s = survival(np.asarray(conf, dtype=np.float64), lay.num_drafts)
            # the sum of the top-b survivals (ties are equal values: any sort gives the same sum)
            top = np.sort(s.ravel())[::-1][: int(budget)]
            est = float(self.sampling + top.sum())
        return BudgetDecision(budget=int(budget), expected_tokens=est, cost_ms=float(c))


def _check_grammar(g: Any, lay: ScheduledLayout) -> DraftMasks:
    if not isinstance(g, DraftMasks):
        raise BudgetError(f"grammar: expected DraftMasks or None, got {type(g).__name__}")
    req = np.asarray(g.request)
    acc = np.asarray(g.acceptable)
    forced = np.asarray(g.forced)
    if req.ndim != 1 or (req.size and req.dtype.kind not in "iu"):
        raise BudgetError(f"grammar.request: expected a 1-D integer array, got {req.dtype} {req.shape}")
    if req.size and (int(req.min()) < 0 or int(req.max()) >= lay.n):
        raise BudgetError(f"grammar.request: expected batch indices in [0, {lay.n}), got {req.tolist()}")
    if req.size > 1 and np.unique(req).size != req.size:
        raise BudgetError(f"grammar.request: expected unique batch indices, got {req.tolist()}")
    if acc.shape != req.shape or (acc.size and acc.dtype.kind not in "iu"):
        raise BudgetError(f"grammar.acceptable: expected {req.shape[0]} integer counts, got {acc.dtype} {acc.shape}")
    nd = lay.num_drafts[req.astype(np.int64)] if req.size else np.zeros(0, dtype=np.int64)
    if acc.size and (int(acc.min()) < 0 or np.any(acc > nd)):
        raise BudgetError(
            f"grammar.acceptable: expected counts in [0, num_drafts] per grammar request {nd.tolist()}, got {acc.tolist()}"
        )
    if forced.ndim != 2 or forced.shape[0] != req.shape[0] or (forced.size and forced.dtype.kind != "b"):
        raise BudgetError(
            f"grammar.forced: expected a bool array of shape ({req.shape[0]}, rows), got {forced.dtype} {forced.shape}"
        )
    return DraftMasks(
        request=_frozen(req.astype(np.int64)),
        acceptable=_frozen(acc.astype(np.int64)),
        forced=_frozen(forced.astype(bool)),
    )


def grammar_limits(layout: ScheduledLayout, grammar: DraftMasks | None) -> IntArray:
    """Per request, the drafts the budget may spend on: ``num_drafts``, cut to ``acceptable`` for grammar requests."""
    lim = layout.num_drafts.copy()
    if grammar is not None and np.asarray(grammar.request).size:
        req = np.asarray(grammar.request, dtype=np.int64)
        lim[req] = np.minimum(lim[req], np.asarray(grammar.acceptable, dtype=np.int64))
    return lim


@dataclass(frozen=True)
class StepOutcome:
    """What verification found, per request id (any order, any subset of the batch).

    Attributes:
        req_ids: the requests that were verified.
        verified: drafts verified per request (its capacity this step).
        accepted: drafts accepted per request, ``0 <= accepted <= verified``.
        finished: ids of requests that finished; history about them may be dropped.
    """

    req_ids: npt.NDArray[Any]
    verified: IntArray
    accepted: IntArray
    finished: npt.NDArray[Any] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __post_init__(self) -> None:
        ids = np.asarray(self.req_ids)
        if ids.ndim != 1:
            raise BudgetError(f"req_ids: expected a 1-D sequence of request ids, got shape {ids.shape}")
        n = ids.shape[0]
        arrs: dict[str, IntArray] = {}
        for name in ("verified", "accepted"):
            raw = getattr(self, name)
            if isinstance(raw, torch.Tensor):
                raw = raw.detach().cpu().numpy()
            a = np.asarray(raw)
            if a.shape != (n,) or (a.size and a.dtype.kind not in "iu"):
                raise BudgetError(f"{name}: expected {n} integer counts (one per req id), got {a.dtype} {a.shape}")
            arrs[name] = a.astype(np.int64)
        v, acc = arrs["verified"], arrs["accepted"]
        if n and (int(acc.min()) < 0 or np.any(acc > v)):
            bad = int(np.argmax((acc < 0) | (acc > v)))
            raise BudgetError(
                f"accepted: expected 0 <= accepted <= verified, got accepted={int(acc[bad])}, "
                f"verified={int(v[bad])} for request {ids[bad]!r}"
            )
        if n > 1 and np.unique(ids).size != n:
            raise BudgetError("req_ids: expected unique request ids in one outcome")
        fin = np.asarray(self.finished)
        if fin.ndim != 1:
            raise BudgetError(f"finished: expected a 1-D sequence of request ids, got shape {fin.shape}")
        object.__setattr__(self, "req_ids", _frozen(ids))
        object.__setattr__(self, "verified", _frozen(v))
        object.__setattr__(self, "accepted", _frozen(acc))
        object.__setattr__(self, "finished", _frozen(fin))


@runtime_checkable
class Scheduler(Protocol):
    """A budget scheduler: ``budget(view) -> BudgetDecision``; ``observe(outcome)`` after each step."""

    def budget(self, step: StepView) -> BudgetDecision:
        """The budget for this step, in ``[0, step.cap]``."""
        ...

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from what verification accepted (may do nothing)."""
        ...


def _no_config(name: str, config: dict[str, Any]) -> None:
    if config:
        raise BudgetError(f"{name}: unexpected configuration {sorted(config)}; this scheduler takes none")


class DSparkScheduler:
    """Confidence-scheduled budgets: ``choose_budget`` on the view's (stale) confidences."""

    name = "dspark"

    def __init__(self, **config: Any) -> None:
        _no_config("dspark", config)

    def beliefs(self, step: StepView) -> FloatArray:
        """The drafter's confidences from the view (required)."""
        if step.confidences is None:
            raise BudgetError(
                "confidences: expected the drafter's confidences for the 'dspark' scheduler, got None; "
                "use 'goodput' for drafters without a confidence head"
            )
        return step.confidences

    def budget(self, step: StepView) -> BudgetDecision:
        """``argmax_b est(b) / cost(b)`` with the stale confidences (grammar-blind)."""
        return choose_budget(
            self.beliefs(step),
            step.layout,
            step.cost,
            num_sampling=step.num_sampling,
            max_logits=step.max_logits,
        )

    def observe(self, outcome: StepOutcome) -> None:
        """Nothing to learn: the confidence head already reflects the history."""


class VerifyAllScheduler:
    """Fixed-width speculation: verify every scheduled draft (as many as the row limit allows)."""

    name = "verify-all"

    def __init__(self, **config: Any) -> None:
        _no_config("verify-all", config)

    def budget(self, step: StepView) -> BudgetDecision:
        """``step.cap``; expected tokens from the view's confidences when it has them (NaN otherwise)."""
        return step.score(step.cap)

    def observe(self, outcome: StepOutcome) -> None:
        """Nothing to learn."""


class NoSpecScheduler:
    """No speculation: always budget 0, every request emits its bonus token only."""

    name = "no-spec"

    def __init__(self, **config: Any) -> None:
        _no_config("no-spec", config)

    def budget(self, step: StepView) -> BudgetDecision:
        """Always 0."""
        return step.score(0)

    def observe(self, outcome: StepOutcome) -> None:
        """Nothing to learn."""


class _IdTable:
    """Request id → row of a state array, vectorised (sorted ids + searchsorted, free-list of rows)."""

    def __init__(self) -> None:
        self.keys: npt.NDArray[Any] = np.zeros(0, dtype=np.int64)
        self.rows: IntArray = np.zeros(0, dtype=np.int64)
        self.free: IntArray = np.zeros(0, dtype=np.int64)
        self.size = 0  # rows ever handed out
        self.kind: str | None = None  # "int" or "str": numpy would silently compare 1 with "1"

    @staticmethod
    def _kind(ids: npt.NDArray[Any]) -> str:
        kind = "int" if ids.dtype.kind in "iu" else "str" if ids.dtype.kind in "US" else None
        if kind is None:
            raise BudgetError(f"req_ids: expected integer or string request ids, got dtype {ids.dtype}")
        return kind

    def lookup(self, ids: npt.NDArray[Any]) -> IntArray:
        """Row of each id, -1 when unknown (ids of the other kind are never known)."""
        out = np.full(ids.shape[0], -1, dtype=np.int64)
        if ids.size == 0 or self.keys.size == 0 or self._kind(ids) != self.kind:
            return out
        try:
            pos = np.searchsorted(self.keys, ids)
        except TypeError as exc:
            raise BudgetError(
                f"req_ids: ids of type {ids.dtype} cannot be compared with earlier ids ({self.keys.dtype})"
            ) from exc
        pos = np.minimum(pos, self.keys.shape[0] - 1)
        hit = np.asarray(self.keys[pos] == ids, dtype=bool)
        out[hit] = self.rows[pos[hit]]
        return out

    def add(self, ids: npt.NDArray[Any]) -> IntArray:
        """Rows for ids that are not in the table yet (unique ids)."""
        if ids.size:
            kind = self._kind(ids)
            if self.kind is None:
                self.kind = kind
            elif kind != self.kind:
                raise BudgetError(
                    f"req_ids: expected {self.kind} ids like the earlier ones, got {kind} ids ({ids.dtype})"
                )
        k = ids.shape[0]
        reuse = self.free[:k]
        self.free = self.free[k:]
        fresh = np.arange(self.size, self.size + (k - reuse.shape[0]), dtype=np.int64)
        self.size += fresh.shape[0]
        rows = np.concatenate([reuse, fresh])
        keys = np.concatenate([self.keys, ids]) if self.keys.size else ids.copy()
        try:
            order = np.argsort(keys, kind="stable")
        except TypeError as exc:
            raise BudgetError(f"req_ids: ids of type {ids.dtype} cannot be mixed with earlier ids") from exc
        self.keys = keys[order]
        self.rows = np.concatenate([self.rows, rows])[order]
        return rows

    def remove(self, ids: npt.NDArray[Any]) -> IntArray:
        """Forget ids (unknown ones are ignored); returns the freed rows."""
        rows = self.lookup(ids)
        gone = rows[rows >= 0]
        if gone.size:
            keep = ~np.isin(self.rows, gone)
            self.keys, self.rows = self.keys[keep], self.rows[keep]
            self.free = np.concatenate([self.free, gone])
        return gone


class GoodputScheduler:
    """Budgets for drafters without a confidence head, learned from acceptance history.

    For every request and draft position ``p`` it keeps ``a[p]``, an
    exponentially weighted average (weight ``alpha`` on the newest
    observation) of whether draft ``p`` was accepted *given that drafts
    ``0..p-1`` were*: the same conditional meaning as a confidence head's
    output. A verified step with ``accepted = k`` of ``verified = c`` drafts
    observes a 1 at positions ``0..k-1``, a 0 at position ``k`` when ``k < c``,
    and nothing further on.

    Prior for new requests: the population estimate per position, an
    average over every observation of every request (weight
    ``population_alpha`` on each step's mean), which itself starts at ``prior`` (default 0.5, a
    neutral guess) and stays there until a position is first observed. So a
    request that joins a batch whose drafts are rarely accepted starts
    pessimistic, and one that joins a well-drafting batch starts optimistic.

    The budget is then ``argmax_b est(b) / cost(b)`` exactly as ``dspark``
    computes it, on these estimates. Positions that are never verified keep
    their estimate, so a scheduler that reaches budget 0 stays there until
    the engine shows it outcomes again.
    """

    name = "goodput"

    def __init__(self, alpha: float = 0.1, prior: float = 0.5, population_alpha: float = 0.05) -> None:
        for nm, v, lo_open in (
            ("alpha", alpha, True),
            ("prior", prior, False),
            ("population_alpha", population_alpha, True),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not np.isfinite(v):
                raise BudgetError(f"{nm}: expected a number, got {v!r}")
            if not (0 < v <= 1 if lo_open else 0 <= v <= 1):
                raise BudgetError(f"{nm}: expected a value in {'(0, 1]' if lo_open else '[0, 1]'}, got {v!r}")
        self.alpha = float(alpha)
        self.prior = float(prior)
        self.population_alpha = float(population_alpha)
        self._ids = _IdTable()
        self._est = np.zeros((0, 0), dtype=np.float64)
        self._population = np.zeros(0, dtype=np.float64)

    def _widen(self, rows: int, cols: int) -> None:
        r0, c0 = self._est.shape
        if cols > c0:
            pop = np.full(cols, self.prior)
            pop[:c0] = self._population
            self._population = pop
            est = np.empty((r0, cols))
            est[:, :c0] = self._est
            est[:, c0:] = self.prior  # never observed at these positions: the prior
            self._est = est
        r0, c0 = self._est.shape
        if rows > r0:
            est = np.empty((max(rows, 2 * r0, 16), c0))
            est[:r0] = self._est
            self._est = est

    def population(self, num_positions: int) -> FloatArray:
        """The prior a new request gets, per position (a copy)."""
        self._widen(0, num_positions)
        return self._population[:num_positions].copy()

    def estimates(self, req_ids: Sequence[Any] | npt.NDArray[Any], num_positions: int) -> FloatArray:
        """Current per-position acceptance estimates of ``req_ids`` (new ids get the population prior)."""
        ids = np.asarray(req_ids)
        if ids.ndim != 1:
            raise BudgetError(f"req_ids: expected a 1-D sequence of request ids, got shape {ids.shape}")
        self._widen(0, num_positions)
        rows = self._ids.lookup(ids)
        out = np.broadcast_to(self._population[:num_positions], (ids.shape[0], num_positions)).copy()
        known = rows >= 0
        out[known] = self._est[rows[known], :num_positions]
        return out

    def beliefs(self, step: StepView) -> FloatArray:
        """The estimates for the requests of ``step``, ``(n, max num_drafts)``."""
        lay = step.layout
        k = int(lay.num_drafts.max()) if lay.n else 0
        return self.estimates(lay.req_ids, k)

    def budget(self, step: StepView) -> BudgetDecision:
        """``choose_budget`` on the history-based estimates (the view's confidences are not used)."""
        return choose_budget(
            self.beliefs(step),
            step.layout,
            step.cost,
            num_sampling=step.num_sampling,
            max_logits=step.max_logits,
        )

    def observe(self, outcome: StepOutcome) -> None:
        """Fold one step's acceptances into the per-request and population averages."""
        if not isinstance(outcome, StepOutcome):
            raise BudgetError(f"outcome: expected a StepOutcome, got {type(outcome).__name__}")
        ids, v, acc = outcome.req_ids, outcome.verified, outcome.accepted
        k = int(v.max()) if v.size else 0
        if ids.size:
            rows = self._ids.lookup(ids)
            new = rows < 0
            if np.any(new):
                self._widen(0, k)
                fresh = self._ids.add(ids[new])
                self._widen(int(fresh.max()) + 1, k)
                self._est[fresh] = self._population
                rows[new] = fresh
            self._widen(0, k)
            if k:
                pos = np.arange(k)[None, :]
                seen = (pos < v[:, None]) & (pos <= acc[:, None])
                hit = (pos < acc[:, None]).astype(np.float64)
                cur = self._est[rows, :k]
                self._est[rows, :k] = np.where(seen, cur + self.alpha * (hit - cur), cur)
                count = seen.sum(axis=0)
                obs = count > 0
                mean = np.divide((hit * seen).sum(axis=0), count, out=np.zeros(k), where=obs)
                pop = self._population[:k]
                self._population[:k] = np.where(obs, pop + self.population_alpha * (mean - pop), pop)
        if outcome.finished.size:
            self._ids.remove(outcome.finished)


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
        return grammar_confidences(_host_confidences(conf, step.layout, "beliefs"), step.layout, step.grammar)

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
        # choose_budget with the grammar hints; past the accepted drafts every
        # survival is 0, so the argmax (smallest on ties) never spends there.
        return choose_budget(
            conf,
            step.layout,
            step.cost,
            num_sampling=step.num_sampling,
            max_logits=step.max_logits,
            grammar=step.grammar,
        )

    def observe(self, outcome: StepOutcome) -> None:
        """Passed on to the wrapped scheduler."""
        self.inner.observe(outcome)


def allocate_step(step: StepView, confidences: torch.Tensor, budget: int | torch.Tensor) -> torch.Tensor:
    """Per-request capacities for ``budget`` from the live ``confidences``, on their device.

    Without draft masks this is :func:`maskplug.allocate`. With them, the
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


_BUILTINS: dict[str, type] = {
    "dspark": DSparkScheduler,
    "verify-all": VerifyAllScheduler,
    "no-spec": NoSpecScheduler,
    "goodput": GoodputScheduler,
    "grammar-aware": GrammarAwareScheduler,
}


@hookimpl
def maskplug_register_schedulers(register):  # type: ignore[no-untyped-def]
    """Register the built-in schedulers (through the same hook as outside plugins)."""
    for name, cls in _BUILTINS.items():
        register(name, cls)


def schedulers() -> list[str]:
    """Names of the registered schedulers."""
    from .plugins import get_registry

    return sorted(get_registry().schedulers)


def get_scheduler(name: str | None = None, **config: Any) -> Scheduler:
    """A new scheduler ``name`` built with ``config``.

    ``name=None`` takes ``MASKPLUG_SCHEDULER`` from the environment, or
    ``"dspark"``. An unknown name raises :class:`PluginError` listing the
    registered ones; a configuration the scheduler refuses raises
    :class:`BudgetError`.
    """
    from .plugins import get_registry

    if name is None:
        name = os.environ.get("MASKPLUG_SCHEDULER") or DEFAULT_SCHEDULER
        source = "MASKPLUG_SCHEDULER"
    else:
        source = "name"
    factories = get_registry().schedulers
    if not isinstance(name, str) or name not in factories:
        raise PluginError(f"{source}: expected one of the registered schedulers {sorted(factories)}, got {name!r}")
    try:
        sched = factories[name](**config)
    except TypeError as exc:
        raise BudgetError(f"config: scheduler {name!r} refused {sorted(config)}: {exc}") from exc
    for attr in ("budget", "observe"):
        if not callable(getattr(sched, attr, None)):
            raise PluginError(
                f"scheduler {name!r}: expected an object with a callable {attr!r}, got {type(sched).__name__}"
            )
    return sched


class _SchedulersModule(types.ModuleType):
    """This module, callable: ``maskplug.schedulers()`` lists the registered names.

    The package exports both the module and the listing function under the
    one name ``schedulers``; making the module callable keeps
    ``import maskplug.schedulers`` and ``maskplug.schedulers()`` both working.
    """

    def __call__(self) -> list[str]:
        return schedulers()


sys.modules[__name__].__class__ = _SchedulersModule
