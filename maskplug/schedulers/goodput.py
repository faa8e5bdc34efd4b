"""``goodput``: budgets for drafters without a confidence head, learned from acceptance history."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._checks import host_int
from ..budget import BudgetDecision
from ..errors import BudgetError
from .protocol import StepOutcome, StepView, request_ids

__all__ = ["GoodputScheduler"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: Draft positions tracked per request: a size check instead of an absurd allocation.
MAX_POSITIONS = 1 << 16


def _positions(name: str, k: int) -> int:
    if k > MAX_POSITIONS:
        raise BudgetError(f"{name}: expected at most {MAX_POSITIONS} draft positions per request, got {k}")
    return k


class _IdTable:
    """Request id → row of a state array.

    Integer and string ids are vectorised (sorted ids + searchsorted);
    other hashable ids (tuples, as layouts take them) go through a dict.
    One kind of id per table: numpy would silently compare ``1`` with
    ``"1"``, so a table of int ids refuses str ids and the other way round.
    Freed rows are handed out again.
    """

    def __init__(self) -> None:
        self.keys: npt.NDArray[Any] = np.zeros(0, dtype=np.int64)
        self.rows: IntArray = np.zeros(0, dtype=np.int64)
        self.index: dict[Any, int] = {}  # the "object" kind's table
        self.free: IntArray = np.zeros(0, dtype=np.int64)
        self.size = 0  # rows ever handed out
        self.kind: str | None = None  # "int", "str" or "object"

    @staticmethod
    def _kind(ids: npt.NDArray[Any]) -> str:
        k = ids.dtype.kind
        return "int" if k in "iu" else "str" if k in "US" else "object"

    def lookup(self, ids: npt.NDArray[Any]) -> IntArray:
        """Row of each id, -1 when unknown (ids of another kind are never known)."""
        out = np.full(ids.shape[0], -1, dtype=np.int64)
        if ids.size == 0 or self._kind(ids) != self.kind:
            return out
        if self.kind == "object":
            get = self.index.get
            return np.fromiter((get(x, -1) for x in ids.tolist()), dtype=np.int64, count=ids.shape[0])
        if self.keys.size == 0:
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
        if self.kind == "object":
            self.index.update(zip(ids.tolist(), rows.tolist(), strict=True))
            return rows
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
            if self.kind == "object":
                for x in ids.tolist():
                    self.index.pop(x, None)
            else:
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

    A new request's first observations weigh more than ``alpha``: its
    estimate at a position is the running mean of its observations with the
    prior counted as ``prior_weight`` observations (after one accepted draft
    from a prior of 0.5, 0.75; after one rejected, 0.25), until that mean's
    step ``1 / (prior_weight + n + 1)`` falls to ``alpha`` and the average
    turns exponential. Requests live a few dozen steps, so with a fixed
    ``alpha = 0.1`` a request whose drafts are always accepted would spend most
    of its life near the prior (0.83 after ten steps from 0.5), and so would
    one whose drafts always fail. The population average (below) starts the
    same way, one step's mean counting as one observation.
    ``prior_weight=None`` keeps the plain exponential averages from the first
    observation.

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
    uses_grammar = False

    def __init__(
        self,
        alpha: float = 0.1,
        prior: float = 0.5,
        population_alpha: float = 0.05,
        prior_weight: float | None = 1.0,
    ) -> None:
        if prior_weight is not None and (
            isinstance(prior_weight, bool)
            or not isinstance(prior_weight, (int, float, np.floating))
            or not np.isfinite(prior_weight)
            or prior_weight < 0
        ):
            raise BudgetError(f"prior_weight: expected a finite number >= 0 or None, got {prior_weight!r}")
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
        self.prior_weight = None if prior_weight is None else float(prior_weight)
        self._ids = _IdTable()
        self._est = np.zeros((0, 0), dtype=np.float64)
        # Observations per request and position, for the running mean's step (shape of ``_est``).
        self._seen = np.zeros((0, 0), dtype=np.float64)
        self._population = np.zeros(0, dtype=np.float64)
        self._population_seen = np.zeros(0, dtype=np.float64)  # steps that observed each position

    def _widen(self, rows: int, cols: int) -> None:
        r0, c0 = self._est.shape
        if cols > c0:
            pop = np.full(cols, self.prior)
            pop[:c0] = self._population
            self._population = pop
            pop_seen = np.zeros(cols)
            pop_seen[:c0] = self._population_seen
            self._population_seen = pop_seen
            est = np.empty((r0, cols))
            est[:, :c0] = self._est
            est[:, c0:] = self.prior  # never observed at these positions: the prior
            self._est = est
            seen = np.zeros((r0, cols))
            seen[:, :c0] = self._seen
            self._seen = seen
        r0, c0 = self._est.shape
        if rows > r0:
            size = max(rows, 2 * r0, 16)
            est = np.empty((size, c0))
            est[:r0] = self._est
            self._est = est
            seen = np.zeros((size, c0))
            seen[:r0] = self._seen
            self._seen = seen

    def population(self, num_positions: int) -> FloatArray:
        """The prior a new request gets, per position (a copy)."""
        num_positions = _positions("num_positions", host_int("num_positions", num_positions, BudgetError))
        self._widen(0, num_positions)
        return self._population[:num_positions].copy()

    def estimates(self, req_ids: Sequence[Any] | npt.NDArray[Any], num_positions: int) -> FloatArray:
        """Current per-position acceptance estimates of ``req_ids`` (new ids get the population prior)."""
        ids = request_ids("req_ids", req_ids)
        num_positions = _positions("num_positions", host_int("num_positions", num_positions, BudgetError))
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
        return step.best(self.beliefs(step))

    def observe(self, outcome: StepOutcome) -> None:
        """Fold one step's acceptances into the per-request and population averages."""
        if not isinstance(outcome, StepOutcome):
            raise BudgetError(f"outcome: expected a StepOutcome, got {type(outcome).__name__}")
        ids, v, acc = outcome.req_ids, outcome.verified, outcome.accepted
        k = _positions("verified", int(v.max()) if v.size else 0)
        if ids.size:
            rows = self._ids.lookup(ids)
            new = rows < 0
            if np.any(new):
                self._widen(0, k)
                fresh = self._ids.add(ids[new])
                self._widen(int(fresh.max()) + 1, k)
                self._est[fresh] = self._population
                self._seen[fresh] = 0.0
                rows[new] = fresh
            self._widen(0, k)
            if k:
                pos = np.arange(k)[None, :]
                seen = (pos < v[:, None]) & (pos <= acc[:, None])
                hit = (pos < acc[:, None]).astype(np.float64)
                cur = self._est[rows, :k]
                if self.prior_weight is None:
                    rate: float | FloatArray = self.alpha
                else:
                    n_seen = self._seen[rows, :k]
                    rate = np.maximum(self.alpha, 1.0 / (self.prior_weight + n_seen + 1.0))
                    self._seen[rows, :k] = n_seen + seen
                self._est[rows, :k] = np.where(seen, cur + rate * (hit - cur), cur)
                count = seen.sum(axis=0)
                obs = count > 0
                mean = np.divide((hit * seen).sum(axis=0), count, out=np.zeros(k), where=obs)
                pop = self._population[:k]
                if self.prior_weight is None:
                    prate: float | FloatArray = self.population_alpha
                else:
                    n_pop = self._population_seen[:k]
                    prate = np.maximum(self.population_alpha, 1.0 / (self.prior_weight + n_pop + 1.0))
                    self._population_seen[:k] = n_pop + obs
                self._population[:k] = np.where(obs, pop + prate * (mean - pop), pop)
        if outcome.finished.size:
            self._ids.remove(outcome.finished)
