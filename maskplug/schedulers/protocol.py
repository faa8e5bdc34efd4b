"""The scheduler protocol: what a scheduler sees before a step, and what it learns after.

Once per step, before the step runs, the engine builds a read-only
:class:`StepView` (the scheduled layout, the cost model, the drafter's
confidences as the host last saw them, usually two steps old, the grammar's
:class:`~maskplug.DraftMasks` when the batch has grammar requests, the logits
row limit) and calls ``scheduler.budget(view) -> BudgetDecision``. The budget
must lie in ``[0, min(Σ num_drafts, max_logits − n·num_bonus)]``. After
verification the engine calls ``scheduler.observe(StepOutcome(...))`` with,
per request id, the drafts verified and the drafts accepted, so schedulers
that learn from history can follow requests while the batch order changes.

Every argument is checked where it enters (the view, the outcome): a bad one
raises :class:`~maskplug.BudgetError` naming it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from .._checks import host_int, host_ints
from ..budget import BudgetDecision, CostModel, choose_budget, host_confidences, survival
from ..draftmasks import DraftMasks, check_draft_masks
from ..errors import BudgetError
from ..layout import ScheduledLayout

__all__ = ["Scheduler", "StepOutcome", "StepView", "check_no_config", "grammar_limits", "request_ids"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def _opt_int(name: str, v: Any) -> int | None:
    if v is None:
        return None
    return host_int(name, v, BudgetError)


def request_ids(name: str, ids: Any) -> npt.NDArray[Any]:
    """Request ids as a 1-D array, one element per id: what a :class:`~maskplug.ScheduledLayout` takes.

    Ints stay an integer array and strings a string array; anything else
    hashable (tuples, say) is an object array. A list mixing ints and
    strings is an object array too, so ``1`` and ``"1"`` stay two ids (numpy
    would make both ``"1"``). A sequence that is not 1-D, or an id that is
    not hashable, raises :class:`~maskplug.BudgetError` naming ``name``.
    """
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise BudgetError(f"{name}: expected host request ids, got a tensor on {ids.device}")
        ids = ids.detach().numpy()
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise BudgetError(f"{name}: expected a 1-D sequence of request ids, got shape {ids.shape}")
        if ids.dtype.kind in "iuUS":
            return ids
        items = ids.tolist()
    elif isinstance(ids, (str, bytes)):
        raise BudgetError(f"{name}: expected a 1-D sequence of request ids, got {type(ids).__name__} {ids!r:.80}")
    else:
        try:
            items = list(ids)
        except TypeError as exc:
            raise BudgetError(f"{name}: expected a 1-D sequence of request ids, got {type(ids).__name__}") from exc
    ints = all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in items)
    if items and (ints or all(isinstance(x, str) for x in items)):
        return np.asarray(items)
    if not items:
        return np.zeros(0, dtype=np.int64)
    for x in items:
        if isinstance(x, (list, np.ndarray, dict, set)) or not isinstance(x, Hashable):
            raise BudgetError(
                f"{name}: expected a 1-D sequence of hashable request ids, got {type(x).__name__} {x!r:.80}"
            )
    arr = np.empty(len(items), dtype=object)
    arr[:] = items
    return arr


def _unique(ids: npt.NDArray[Any]) -> bool:
    """Whether the ids are distinct (object ids by hash and equality, as a layout's dict checks them)."""
    if ids.dtype == object:
        return len(set(ids.tolist())) == ids.shape[0]
    return int(np.unique(ids).size) == ids.shape[0]


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
            conf = np.array(host_confidences(self.confidences, lay), dtype=np.float64, copy=True)
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
            object.__setattr__(self, "grammar", check_draft_masks(self.grammar, lay))

    @property
    def sampling(self) -> int:
        """Tokens emitted at budget 0: ``num_sampling``, or ``n`` when it was not given."""
        return self.layout.n if self.num_sampling is None else int(self.num_sampling)

    def best(self, confidences: Any, *, with_grammar: bool = False) -> BudgetDecision:
        """The budget :func:`~maskplug.choose_budget` picks for this step on ``confidences``.

        The step's layout, cost model, row limit and ``num_sampling`` are
        used; with ``with_grammar`` its draft masks correct the confidences
        too (rejected drafts worth 0, forced accepted ones certain).
        ``confidences`` are per-position acceptance estimates, shape
        ``(n, ≥ max num_drafts)``: the view's own or a scheduler's beliefs.
        """
        return choose_budget(
            confidences,
            self.layout,
            self.cost,
            num_sampling=self.num_sampling,
            max_logits=self.max_logits,
            grammar=self.grammar if with_grammar else None,
        )

    def score(self, budget: int, confidences: Any | None = None) -> BudgetDecision:
        """The decision for a given ``budget``: expected tokens under ``confidences`` and its step cost.

        ``confidences`` defaults to the view's; with neither, the expected
        tokens are NaN (unknown) and only the cost is meaningful.
        """
        budget = host_int("budget", budget, BudgetError, hi=self.cap)
        lay = self.layout
        c = self.cost.draft_ms(lay.n) + self.cost.verify_ms(int(lay.num_non_draft.sum()) + int(budget))
        conf = self.confidences if confidences is None else host_confidences(confidences, lay)
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
    """``g`` checked against ``lay`` (:func:`~maskplug.draftmasks.check_draft_masks`)."""
    return check_draft_masks(g, lay)


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

    Request ids are those a :class:`~maskplug.ScheduledLayout` takes (ints,
    strings, tuples or other hashable values; see :func:`request_ids`).

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
        ids = request_ids("req_ids", self.req_ids)
        n = ids.shape[0]
        arrs: dict[str, IntArray] = {}
        for name in ("verified", "accepted"):
            raw = getattr(self, name)
            if isinstance(raw, torch.Tensor):
                raw = raw.detach().cpu()
            # Counts of drafts: the same range a layout's counts have.
            arrs[name] = np.array(host_ints(name, raw, BudgetError, n=n, lo=-(2**31) if name == "accepted" else 0))
        v, acc = arrs["verified"], arrs["accepted"]
        if n and (int(acc.min()) < 0 or np.any(acc > v)):
            bad = int(np.argmax((acc < 0) | (acc > v)))
            raise BudgetError(
                f"accepted: expected 0 <= accepted <= verified, got accepted={int(acc[bad])}, "
                f"verified={int(v[bad])} for request {ids[bad]!r}"
            )
        if n > 1 and not _unique(ids):
            raise BudgetError("req_ids: expected unique request ids in one outcome")
        fin = request_ids("finished", self.finished)
        object.__setattr__(self, "req_ids", _frozen(ids))
        object.__setattr__(self, "verified", _frozen(v))
        object.__setattr__(self, "accepted", _frozen(acc))
        object.__setattr__(self, "finished", _frozen(fin))


@runtime_checkable
class Scheduler(Protocol):
    """A budget scheduler: ``budget(view) -> BudgetDecision``; ``observe(outcome)`` after each step.

    ``budget`` and ``observe`` are required. A scheduler may also offer,
    and engines read with ``getattr`` and a default:

    ``uses_grammar: bool`` (default ``False``)
        whether ``budget`` reads the step's :class:`~maskplug.DraftMasks`
        (``StepView.grammar``). An engine that sees ``True`` fills the draft
        masks before asking for the budget and allocates it with
        :func:`~maskplug.allocate_step`, since the budget counts only drafts
        the grammar accepts; with ``False`` the budget does not depend on
        the masks. Of the built-ins only ``grammar-aware`` sets it.
    ``beliefs(view) -> array | None``
        the per-position conditional acceptance estimates the scheduler
        works from (shape ``(n, ≥ max drafts)``); ``grammar-aware`` uses
        them to rescore the budget with what the grammar knows, and for a
        scheduler without beliefs can only trim drafts the grammar rejects.

    Neither is part of the ``isinstance`` check, so a scheduler written
    before them still is a :class:`Scheduler`.
    """

    def budget(self, step: StepView) -> BudgetDecision:
        """The budget for this step, in ``[0, step.cap]``."""
        ...

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from what verification accepted (may do nothing)."""
        ...


def check_no_config(name: str, config: dict[str, Any]) -> None:
    """Refuse any configuration for scheduler ``name``, which takes none (a :class:`BudgetError`)."""
    if config:
        raise BudgetError(f"{name}: unexpected configuration {sorted(config)}; this scheduler takes none")
