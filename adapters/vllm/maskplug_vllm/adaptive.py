"""Adaptive verification inside vLLM 0.32's engine, driven by a maskplug scheduler.

With ``MASKPLUG_VLLM=1`` and ``MASKPLUG_VLLM_SCHEDULER=<name>`` (any
registered scheduler, ``grammar-aware:<inner>`` for the grammar-aware wrapper
of another one), every engine step runs like this. Every decision is made once,
in the process that schedules the step (vLLM's engine core); the workers, one
or many, in that process or others, at any tensor-parallel rank, only apply it.

1. **Engine core, scheduling.** vLLM's scheduler schedules the step as usual,
   drafts included, and the grammar rows for every scheduled draft are
   produced right away (maskplug's producer, :func:`maskplug.fill_draft_masks`),
   together with the step's :class:`~maskplug.DraftMasks`. The step's
   :class:`~maskplug.ScheduledLayout` is built from the scheduled drafts and
   the maskplug scheduler picks the budget from a :class:`~maskplug.StepView`
   (cost model, draft masks, and the drafter's confidences as recorded two
   steps earlier when the drafter has them; no logits-row limit; every
   scheduled request counts as emitting a token at budget 0). The budget is
   split per request with :func:`maskplug.allocate_step` (on the live
   confidences where there are some) and the compacted step is attached to
   vLLM's scheduler output as plain data (:data:`VERIFY_STEP_ATTR`), which
   vLLM serialises to every worker with the rest of the output.
2. **Workers.** Before the model runner builds its inputs it swaps in a copy
   of the scheduler output holding only the kept drafts
   (:func:`compacted_output`), so input ids, positions, attention and
   spec-decode metadata and rejection sampling agree with each other. The
   grammar rows, which reach the workers as vLLM's own grammar output does,
   are applied through the mapping built from the **scheduled** layout with
   the **active** row offsets (:func:`maskplug_vllm.worker.apply_scatter`), so
   the rows of trimmed drafts write nothing. A model drafter records its
   probability of each proposed token and returns it with the draft ids
   (:mod:`maskplug_vllm.confidences`).
3. **Engine core, the outcome.** When the sampled tokens come back, the
   outcome (drafts verified and accepted per request id, finished requests)
   goes to the scheduler's ``observe``, the counters of :func:`step_stats`
   and the ``maskplug_*`` Prometheus series move (:mod:`maskplug_vllm.metrics`)
   and the ``maskplug_step_end`` hook fires once.

vLLM's own scheduler keeps the scheduler output it made, so trimmed drafts
count as rejected drafts there: computed tokens and KV blocks roll back
through vLLM's ordinary rejection path. The only per-request state is the
maskplug scheduler's own, which is told about finished requests.

The attributes replaced (besides those of :mod:`maskplug_vllm.patches`):

==========================================================  ============================================
attribute                                                   what it does in addition
==========================================================  ============================================
``vllm.v1.core.sched.scheduler.Scheduler.schedule``         rows, draft masks, budget, compacted step (*)
``Scheduler.get_grammar_bitmask``                           hands back those rows (*)
``Scheduler.update_from_output``                            reports the outcome, counts, fires the hook
``Scheduler.make_spec_decoding_stats``                      counts a ``verify-all`` step's drafts (**)
``Scheduler.update_draft_token_ids``                        keeps the drafter's confidences (*)
``GPUModelRunner.execute_model`` (CPU runner's too)         runs the compacted step
``GPUModelRunner.take_draft_token_ids``                     returns the drafter's confidences too
``SpecDecodeBaseProposer.propose`` / ``._greedy_sample``    record the draft model's probabilities
``vllm.engine.arg_utils.EngineArgs.create_engine_config``   refuses what cannot work (:func:`check_config`)
==========================================================  ============================================

(*) Only for a scheduler that plans: under the built-in ``verify-all`` vLLM's
own methods run there (it plans nothing and learns nothing; its steps are
only counted, in ``update_from_output``).

(**) vLLM's ``update_from_output`` calls it for every request with drafts and
sampled tokens, whether it keeps statistics or not: without
``maskplug_step_end`` listeners a ``verify-all`` step's drafts and accepted
drafts are added there, as vLLM's loop goes (a count of its own between
forward passes cost about 10 µs per step at one request).

Executors: vLLM's in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
and its engine-core process (``LLM(...)``'s default, the OpenAI server),
``UniProcExecutor`` and ``MultiprocExecutor``, tensor parallelism.
Refused when the engine config is created, in the process the user started
(:func:`check_config`): no speculative decoding, asynchronous scheduling,
pipeline parallelism, and a scheduler that needs confidences (``dspark``)
with a drafter that has none. Only vLLM 0.32.0 is supported.

Cost model: ``MASKPLUG_VLLM_COST=<path>`` names a JSON file (see
:func:`load_cost_model`, written by ``python -m maskplug_vllm.calibrate``);
without it :func:`default_cost_model` is used.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence, Sized
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from maskplug import (
    BudgetError,
    CostModel,
    DraftMasks,
    PluginError,
    ScheduledLayout,
    Scheduler,
    StepOutcome,
    StepView,
    allocate_step,
    compact,
    get_registry,
    get_scheduler,
)
from maskplug.engines.sdk import VerifyAllScheduler, parse_scheduler_spec, wraps

from . import confidences, metrics, patches
from .calibrate import check_overhead, with_overheads
from .confidences import CONFIDENCES_ATTR, DraftConfidences
from .host import draft_counts
from .metrics import StepMetrics
from .scheduler import DRAFT_MASKS_ATTR, WANT_DRAFT_MASKS_ATTR
from .worker import SCHEDULED_SPEC_ATTR

__all__ = [
    "ADAPTIVE_VLLM_VERSIONS",
    "CONFIDENCE_METHODS",
    "COST_ENV",
    "SCHEDULED_SPEC_ATTR",
    "SCHEDULER_ENV",
    "VERIFY_STEP_ATTR",
    "adaptive_installed",
    "check_config",
    "compacted_output",
    "current_scheduler",
    "default_cost_model",
    "install_adaptive",
    "load_cost_model",
    "make_scheduler",
    "reset_step_stats",
    "set_cost_model",
    "set_scheduler",
    "step_stats",
]

SCHEDULER_ENV = "MASKPLUG_VLLM_SCHEDULER"
"""Name of the maskplug scheduler that picks each step's verify budget; unset: vLLM verifies every draft."""

COST_ENV = "MASKPLUG_VLLM_COST"
"""Path of a JSON cost file (see :func:`load_cost_model`); unset: :func:`default_cost_model`."""

ADAPTIVE_VLLM_VERSIONS: tuple[str, ...] = ("0.32.0",)
"""vLLM releases whose scheduler and model runner the adaptive patches were written against and tested with."""


VERIFY_STEP_ATTR = "maskplug_verify_step"
"""Attribute of a scheduler output whose drafts maskplug's budget trimmed: the compacted step, as plain data.

A dict with ``budget``, ``num_scheduled_tokens``, ``total_num_scheduled_tokens``
and ``scheduled_spec_decode_tokens`` (the kept drafts), decided once in the
engine core and serialised with the scheduler output to every worker and rank
(see :func:`compacted_output`). Absent when the step verifies every draft.
"""

_DRAFT_MASKS_ON_OUTPUT = "maskplug_draft_masks"

#: The fallback cost model's parameters (milliseconds): a fixed cost per forward pass plus a
#: small cost per verified token, for when no cost file is given. It makes every draft with
#: a fair chance of acceptance worth verifying; a calibrated file reflects the real engine.
DEFAULT_COST = {"verify_base_ms": 10.0, "verify_per_token_ms": 0.05, "draft_base_ms": 0.0, "draft_per_req_ms": 0.0}

_MAX_REQS = 1024
_NO_IDS: npt.NDArray[np.str_] = np.zeros(0, dtype=str)
_MAX_TOKENS = 16384


# -- cost model ---------------------------------------------------------------------------------


def _pairs(path: str, key: str, value: Any) -> list[tuple[float, float]]:
    if not isinstance(value, list) or not value:
        raise BudgetError(f"{COST_ENV} ({path}): {key!r}: expected a non-empty list of [size, ms] pairs, got {value!r}")
    out = []
    for item in value:
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in item)
        ):
            raise BudgetError(f"{COST_ENV} ({path}): {key!r}: expected [size, ms] number pairs, got {item!r}")
        out.append((float(item[0]), float(item[1])))
    return out


def load_cost_model(
    path: str | os.PathLike[str], *, max_reqs: int = _MAX_REQS, max_tokens: int = _MAX_TOKENS
) -> CostModel:
    """Read a cost file and build the :class:`maskplug.CostModel` it describes.

    The file is a JSON object::

        {"verify": [[num_tokens, ms], ...],     # required: forward-pass time per scheduled token count
         "draft": [[num_requests, ms], ...],    # optional: drafting time per request count (default: free)
         "graph_limit": 0,                      # optional: padded (captured-graph) sizes up to this count
         "step_overhead_ms": 0.0,               # optional: whole-step cost beyond the forward, per step
         "token_overhead_ms": 0.0}              # optional: and per token (python -m maskplug_vllm.calibrate)

    Other keys (e.g. what was measured, on which machine) are ignored. The
    curves go to :meth:`maskplug.CostModel.from_curves`, which makes them
    monotone, interpolates between samples and extrapolates past the last.

    Raises:
        BudgetError: a missing file, bad JSON or a bad curve, naming the file.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise BudgetError(f"{COST_ENV}: expected a readable JSON cost file, got {str(p)!r} ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise BudgetError(f"{COST_ENV} ({p}): expected JSON, got a parse error: {exc}") from exc
    if not isinstance(data, dict):
        raise BudgetError(f"{COST_ENV} ({p}): expected a JSON object with a 'verify' curve, got {type(data).__name__}")
    if "verify" not in data:
        raise BudgetError(
            f"{COST_ENV} ({p}): expected a 'verify' curve of [num_tokens, ms] pairs, got keys {sorted(data)}"
        )
    verify = _pairs(str(p), "verify", data["verify"])
    draft = _pairs(str(p), "draft", data["draft"]) if data.get("draft") is not None else [(0.0, 0.0)]
    graph_limit = data.get("graph_limit", 0)
    if isinstance(graph_limit, bool) or not isinstance(graph_limit, int) or graph_limit < 0:
        raise BudgetError(f"{COST_ENV} ({p}): 'graph_limit': expected an int >= 0, got {graph_limit!r}")
    if max(ms for _, ms in verify) <= 0:
        raise BudgetError(f"{COST_ENV} ({p}): 'verify': expected some positive time, got {verify}")
    try:
        step_ms = check_overhead("step_overhead_ms", data.get("step_overhead_ms", 0.0))
        token_ms = check_overhead("token_overhead_ms", data.get("token_overhead_ms", 0.0))
        draft, verify = with_overheads(draft, verify, step_ms, token_ms)
        return CostModel.from_curves(draft, verify, max_reqs, max_tokens, graph_limit=graph_limit)
    except BudgetError as exc:
        raise BudgetError(f"{COST_ENV} ({p}): {exc}") from exc


def default_cost_model() -> CostModel:
    """The cost model used without ``MASKPLUG_VLLM_COST``: :data:`DEFAULT_COST` as a straight line."""
    return CostModel.linear(**DEFAULT_COST, max_reqs=_MAX_REQS, max_tokens=_MAX_TOKENS)


def _cost_from_env() -> CostModel:
    path = os.environ.get(COST_ENV, "").strip()
    return load_cost_model(path) if path else default_cost_model()


# -- schedulers -----------------------------------------------------------------------------------


def make_scheduler(name: str) -> Scheduler:
    """A new scheduler from a ``MASKPLUG_VLLM_SCHEDULER`` value: a registered name, or ``grammar-aware:<inner>``.

    The spelling is maskplug's one scheduler-spec parser's
    (:func:`maskplug.schedulers.parse_scheduler_spec`); errors name the variable.
    """
    if not isinstance(name, str) or not name.strip():
        raise PluginError(f"{SCHEDULER_ENV}: expected a scheduler name, got {name!r}")
    spec = parse_scheduler_spec(name, SCHEDULER_ENV)
    return get_scheduler(spec.name, **spec.config)


# -- per-step bookkeeping -------------------------------------------------------------------------


class _Plan:
    """One step as planned in the engine core, before the forward pass.

    ``layout`` and ``capacity`` are built on first use for a ``verify-all``
    step (:meth:`all_drafts`): its outcome needs only the scheduler output's
    own dicts, and at one request the arrays cost more than the rest of the
    plan.
    """

    __slots__ = (
        "_capacity",
        "_layout",
        "_nst",
        "_spec",
        "budget",
        "finished",
        "num_grammar",
        "probe",
        "regime",
        "structured",
    )

    def __init__(
        self,
        layout: ScheduledLayout | None,
        budget: int,
        capacity: npt.NDArray[np.int64] | None,
        regime: str,
        structured: bool,
        num_grammar: int,
        finished: list[str],
    ) -> None:
        self._layout = layout
        self.budget = budget
        self._capacity = capacity
        self.regime = regime
        self.structured = structured
        self.num_grammar = num_grammar
        self.finished = finished
        self._nst: Mapping[str, int] | None = None
        self._spec: Mapping[str, Sequence[int]] | None = None
        #: Batch index → the first draft the budget trimmed, for requests that lost some (see ``finish``).
        self.probe: dict[int, int] | None = None

    @classmethod
    def all_drafts(
        cls,
        nst: Mapping[str, int],
        spec: Mapping[str, Sequence[int]],
        total: int,
        structured: bool,
        num_grammar: int,
        finished: list[str],
    ) -> _Plan:
        """A step that verifies every scheduled draft (``nst``/``spec``: the scheduler output's dicts)."""
        plan = cls(None, total, None, "full", structured, num_grammar, finished)
        plan._nst = nst
        plan._spec = spec
        return plan

    @property
    def layout(self) -> ScheduledLayout:
        if self._layout is None:
            assert self._nst is not None and self._spec is not None
            ids = list(self._nst)
            nd = draft_counts(ids, self._spec)
            nn = np.fromiter(self._nst.values(), dtype=np.int64, count=len(ids)) - nd
            self._layout = ScheduledLayout(ids, nd, nn)
        return self._layout

    @property
    def num_requests(self) -> int:
        return len(self._nst) if self._layout is None and self._nst is not None else self.layout.n

    @property
    def capacity(self) -> npt.NDArray[np.int64]:
        if self._capacity is None:
            self._capacity = self.layout.num_drafts.copy()
        return self._capacity


#: Where each counter sits in :attr:`_Controller.counts` (the metrics file's order, :data:`metrics.FIELDS`).
_STEPS, _FULL, _PARTIAL, _ZERO, _SCHEDULED, _VERIFIED, _ACCEPTED, _EMITTED, _STRUCTURED, _BUDGET = range(10)
_REGIME_AT = {"full": _FULL, "partial": _PARTIAL, "zero": _ZERO}
assert metrics.FIELDS[_FULL] == "regime_full" and metrics.FIELDS[_BUDGET] == "budget" and len(metrics.FIELDS) == 10


def _stats_of(c: Sequence[int]) -> dict[str, Any]:
    """The counters of :func:`step_stats` from :attr:`_Controller.counts`."""
    return {
        "steps": c[_STEPS],
        "regimes": {"full": c[_FULL], "partial": c[_PARTIAL], "zero": c[_ZERO]},
        "drafts_scheduled": c[_SCHEDULED],
        "drafts_verified": c[_VERIFIED],
        "drafts_accepted": c[_ACCEPTED],
        "tokens_emitted": c[_EMITTED],
        "structured_steps": c[_STRUCTURED],
    }


def _new_stats() -> dict[str, Any]:
    return {
        "steps": 0,
        "regimes": {"full": 0, "partial": 0, "zero": 0},
        "drafts_scheduled": 0,
        "drafts_verified": 0,
        "drafts_accepted": 0,
        "tokens_emitted": 0,
        "structured_steps": 0,
    }


def _verify_step(so: Any, layout: ScheduledLayout, capacity: npt.NDArray[np.int64], comp: Any) -> dict[str, Any]:
    """The compacted step as plain data: what :data:`VERIFY_STEP_ATTR` carries to every worker."""
    ids = layout.req_ids.tolist()
    spec: Mapping[str, list[int]] = so.scheduled_spec_decode_tokens
    return {
        "budget": int(capacity.sum()),
        "num_scheduled_tokens": {r: int(t) for r, t in zip(ids, comp.num_tokens_per_req.tolist(), strict=True)},
        "total_num_scheduled_tokens": int(comp.num_tokens),
        "scheduled_spec_decode_tokens": {
            r: list(spec[r][:c]) for r, c in zip(ids, capacity.tolist(), strict=True) if c > 0
        },
    }


def compacted_output(scheduler_output: Any) -> Any:
    """The scheduler output a model runner runs: the compacted copy when the engine core trimmed the step.

    Workers decide nothing: the engine core attached the kept drafts and token
    counts (:data:`VERIFY_STEP_ATTR`, plain data that vLLM serialises with the
    rest of the scheduler output, identical on every rank). The copy carries
    the drafts as scheduled (:data:`~maskplug_vllm.worker.SCHEDULED_SPEC_ATTR`)
    for the mask apply; vLLM's object is never changed (under the in-process
    executor the engine core reads it again). Without the attribute the
    output itself is returned.
    """
    step = getattr(scheduler_output, VERIFY_STEP_ATTR, None)
    if step is None:
        return scheduler_output
    trimmed = dataclasses.replace(
        scheduler_output,
        num_scheduled_tokens=step["num_scheduled_tokens"],
        total_num_scheduled_tokens=step["total_num_scheduled_tokens"],
        scheduled_spec_decode_tokens=step["scheduled_spec_decode_tokens"],
    )
    # dataclasses.replace copies fields only: the step data itself stays behind on vLLM's object.
    setattr(trimmed, SCHEDULED_SPEC_ATTR, scheduler_output.scheduled_spec_decode_tokens)
    return trimmed


class _Controller:
    """The engine core's state of adaptive verification: the scheduler, the cost model, the counters.

    It lives in the process that schedules (vLLM's engine core); the model
    runners only apply what it decided (:func:`compacted_output`).
    """

    def __init__(self, scheduler: Scheduler, name: str, cost: CostModel) -> None:
        self.scheduler = scheduler  # also sets verifies_all
        self.name = name
        self.cost = cost
        #: The step counters in the metrics file's order (:data:`metrics.FIELDS`), added to by the
        #: engine core's thread alone, on every step; :attr:`stats` reads them as a dict.
        self.counts: list[int] = [0] * len(metrics.FIELDS)
        #: ``counts[_STEPS]`` when the counters were last written to the metrics file (:meth:`publish`).
        self.published = 0
        #: True while vLLM's ``update_from_output`` runs for a ``verify-all`` step that is counted as it
        #: goes: vLLM's loop hands each request's drafts and accepted drafts to
        #: ``make_spec_decoding_stats``, whose wrapper adds them to :attr:`counts`.
        self.counting = False
        #: Whether a grammar request with drafts has been seen in the step being counted that way.
        self.structured_seen = False
        self.confidences = DraftConfidences()
        self.metrics: StepMetrics | None = None
        self.offsets: dict[str, int] = {}
        self.lock = threading.Lock()
        hooks = get_registry().step_end_hooks()
        #: pluggy's live list of ``maskplug_step_end`` hooks (truthy while anyone listens), or where
        #: pluggy keeps no such list a stand-in that asks the registry each time.
        self.hooks: Sized = hooks if hooks is not None else _AskRegistry()

    @property
    def stats(self) -> dict[str, Any]:
        """The counters as :func:`step_stats` gives them (a new dict, without ``scheduler``)."""
        return _stats_of(list(self.counts))

    @property
    def unpublished(self) -> int:
        """Steps counted since the metrics file was last written."""
        return self.counts[_STEPS] - self.published

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler that picks the budgets; setting it also sets :attr:`verifies_all`."""
        return self._scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        #: Whether the scheduler is the built-in ``verify-all`` (exactly it, not a subclass). With no
        #: logits-row limit, as here, it verifies every draft and learns nothing, so its steps are
        #: neither planned nor given an outcome, only counted (``update_from_output``). A plain
        #: attribute: the patched engine-core methods read it on every step.
        self.verifies_all = type(scheduler) is VerifyAllScheduler

    # Step 1, in the engine core: right after vLLM scheduled the step.
    def plan(self, so: Any, grammar_output: Any = None) -> _Plan:
        """Choose the step's budget and split; attach the compacted step to ``so`` when drafts are trimmed.

        ``so`` keeps every field vLLM gave it (its scheduler reads them again
        in ``update_from_output``); only :data:`VERIFY_STEP_ATTR` is added.
        """
        nst: Mapping[str, int] = so.num_scheduled_tokens
        spec: Mapping[str, list[int]] = so.scheduled_spec_decode_tokens
        if self.verifies_all:
            return self._plan_all(so, nst, spec, grammar_output)
        ids = list(nst)
        nd = draft_counts(ids, spec)
        nn = np.fromiter(nst.values(), dtype=np.int64, count=len(ids)) - nd
        layout = ScheduledLayout(ids, nd, nn)
        gids: list[str] = list(grammar_output.structured_output_request_ids) if grammar_output is not None else []
        finished = list(so.finished_req_ids)
        self.confidences.forget(finished)
        total = layout.total_drafts
        if total == 0:
            return _Plan(layout, 0, np.zeros(layout.n, dtype=np.int64), "full", False, len(gids), finished)
        structured = bool(gids) and bool(np.any(nd[layout.indices_of(gids)] > 0))
        dm = _draft_masks_for(layout, grammar_output)
        stale, live = self.confidences.for_step(ids, spec)
        view = StepView(layout, self.cost, grammar=dm, confidences=stale)
        decision = self.scheduler.budget(view)
        b = decision.budget
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= int(b) <= view.cap:
            raise BudgetError(f"scheduler {self.name!r}: expected a budget in [0, {view.cap}], got {b!r}")
        b = int(b)
        if b == total:
            # Nothing trimmed: every request keeps all its drafts (the only split that sums to the
            # total), and vLLM's own scheduler output runs unchanged.
            return _Plan(layout, b, nd.copy(), "full", structured, len(gids), finished)
        capacity = self._split(view, b, live)
        comp = compact(layout, b, capacity)
        setattr(so, VERIFY_STEP_ATTR, _verify_step(so, layout, capacity, comp))
        plan = _Plan(layout, b, capacity, comp.regime, structured, len(gids), finished)
        # Read now: vLLM trims and replaces a request's draft list in place on later steps.
        plan.probe = {i: int(spec[ids[i]][c]) for i, c in enumerate(capacity.tolist()) if c < nd[i]}
        return plan

    def _plan_all(self, so: Any, nst: Mapping[str, int], spec: Mapping[str, list[int]], grammar_output: Any) -> _Plan:
        """:meth:`plan` for the built-in ``verify-all``: every draft kept, nothing attached, no arrays.

        The same plan as the general path's (its layout and capacities are
        built if something asks for them); what a step costs here is the
        scheduler output's dicts read once.
        """
        finished = list(so.finished_req_ids) if so.finished_req_ids else []
        if finished:
            self.confidences.forget(finished)
        total = 0
        for r, d in spec.items():
            if d and r in nst:
                total += len(d)
        gids: Sequence[str] = grammar_output.structured_output_request_ids if grammar_output is not None else ()
        structured = False
        if total:
            get = spec.get
            structured = any(get(g) for g in gids)
        return _Plan.all_drafts(nst, spec, total, structured, len(gids), finished)

    def _split(self, view: StepView, budget: int, live: npt.NDArray[np.float64] | None) -> npt.NDArray[np.int64]:
        """Per-request capacities for ``budget``.

        The drafter's live confidences where it has them (the budget read the
        stale ones, as on an engine that cannot wait for them), else the
        scheduler's beliefs, else by position.
        """
        lay = view.layout
        if budget == 0:
            return np.zeros(lay.n, dtype=np.int64)  # the only split of nothing
        if lay.n == 1:
            # One request gets the whole budget whatever its confidences or grammar (every split
            # sums to the budget): the allocation's device ops are half of a one-request plan.
            return np.array([budget], dtype=np.int64)
        k = int(lay.num_drafts.max())
        beliefs = live
        if beliefs is None:
            fn = getattr(self.scheduler, "beliefs", None)
            if fn is not None:
                beliefs = fn(view)
        if beliefs is None:
            # No per-position estimates: every draft equally likely, so drafts go out by
            # position (first drafts of every request first), then by batch order.
            conf = torch.ones((lay.n, k), dtype=torch.float64)
        else:
            conf = torch.from_numpy(np.ascontiguousarray(np.asarray(beliefs, dtype=np.float64)[:, :k]))
        return allocate_step(view, conf, budget).numpy().astype(np.int64)

    def forget(self, finished: Any) -> None:
        """Tell the scheduler about finished requests on a step that runs nothing."""
        if finished:
            self.confidences.forget(finished)
            empty = np.zeros(0, dtype=np.int64)
            self.scheduler.observe(
                StepOutcome(
                    req_ids=np.zeros(0, dtype=str),
                    verified=empty,
                    accepted=empty,
                    finished=np.asarray(list(finished), dtype=str),
                )
            )

    def idle_step(self, finished: Any) -> None:
        """A step that ran nothing: pass its finished requests on and count the steps that waited.

        vLLM's last step of a batch may only announce finished requests; an
        engine that falls idle has published everything.
        """
        if finished:
            self.forget(finished)
        if self.counts[_STEPS] != self.published:
            self.publish()

    # Step 3, in the engine core: the sampled tokens came back from the workers.
    def finish(self, plan: _Plan, output: Any) -> None:
        sampled = getattr(output, "sampled_token_ids", None) or []
        index: Mapping[str, int] = getattr(output, "req_id_to_index", None) or {}
        num_sampled = len(sampled)
        get = index.get
        nst = plan._nst
        if nst is not None and self.verifies_all:
            # Nothing to tell the scheduler; only the counters need the accepted drafts, read off
            # the scheduler output's own dicts (every request verified all its drafts).
            spec = plan._spec
            assert spec is not None
            num_emitted = num_accepted = 0
            for r in nst:
                j = get(r)
                if j is None or j >= num_sampled:
                    continue
                e = len(sampled[j])
                num_emitted += e
                if e > 1:
                    d = spec.get(r)
                    if d:
                        num_accepted += min(e - 1, len(d))
            self._count(plan, num_emitted, num_accepted, None)
            return
        lay = plan.layout
        ids = lay.req_ids.tolist()
        emitted_list = []
        for r in ids:
            j = get(r)
            emitted_list.append(len(sampled[j]) if j is not None and j < num_sampled else 0)
        num_emitted = sum(emitted_list)
        if self.verifies_all:
            caps = plan.capacity.tolist()
            num_accepted = sum(min(e - 1, c) for e, c in zip(emitted_list, caps, strict=True) if e > 0 and c > 0)
        else:
            emitted = np.array(emitted_list, dtype=np.int64)
            # Only requests that had drafts scheduled say anything about acceptance.
            sel = np.flatnonzero((emitted > 0) & (lay.num_drafts > 0))
            verified = plan.capacity[sel]
            accepted = np.minimum(np.maximum(emitted[sel] - 1, 0), verified)
            num_accepted = int(accepted.sum())
            if plan.probe:
                verified, accepted = _probed(plan.probe, sel, verified, accepted, ids, sampled, get)
            outcome = StepOutcome(
                req_ids=lay.req_ids[sel] if sel.size else _NO_IDS,
                verified=verified,
                accepted=accepted,
                finished=np.asarray(plan.finished, dtype=str) if plan.finished else _NO_IDS,
            )
            self.scheduler.observe(outcome)
        self._count(plan, num_emitted, num_accepted, lay.total_drafts)

    def finish_all(self, requests: Mapping[str, Any], so: Any, output: Any, gids: Sequence[str] | None = None) -> None:
        """Count a ``verify-all`` step that was not planned, from vLLM's scheduler and runner outputs.

        What :meth:`plan` and :meth:`finish` would count for it (every draft
        verified, the regime ``full``), read off the step's outputs: the
        built-in ``verify-all`` learns nothing, so the engine core keeps no
        plan between the two calls (the requests that finished are forgotten
        here too). ``gids`` are the step's grammar requests when its grammar
        output is at hand, else they are found in ``requests``, the
        scheduler's own map, as vLLM finds them (only those with drafts
        unless ``maskplug_step_end`` listeners want their number). The engine
        core counts a step this way when listeners want its record; without
        them, as vLLM's ``update_from_output`` goes (the same counts:
        ``make_spec_decoding_stats`` here).
        """
        nst: Mapping[str, int] = so.num_scheduled_tokens
        spec: Mapping[str, Sequence[int]] = so.scheduled_spec_decode_tokens
        sampled = getattr(output, "sampled_token_ids", None) or []
        index: Mapping[str, int] = getattr(output, "req_id_to_index", None) or {}
        drafts_of = spec.get
        n = len(nst)
        if len(sampled) == n == len(index) and index.keys() == nst.keys() and spec.keys() <= nst.keys():
            # vLLM's usual step: one sampled list per scheduled request (its runner's batch rows),
            # drafts only for scheduled requests. Counted in C-level passes, no loop per request: a
            # request emits its accepted drafts and one token more (vLLM's rejection sampler, whose
            # acceptance vLLM's own counters read the same way), a prefill chunk nothing.
            lens = list(map(len, sampled))
            num_emitted = sum(lens)
            num_accepted = num_emitted - n + lens.count(0)
            total = sum(map(len, spec.values()))
        else:
            # Requests the runner no longer holds, or rows that are not the scheduled requests':
            # each scheduled request read on its own.
            get = index.get
            num_sampled = len(sampled)
            total = num_emitted = num_accepted = 0
            for r in nst:
                d = drafts_of(r)
                nd = len(d) if d else 0
                total += nd
                j = get(r)
                if j is None or j >= num_sampled:
                    continue
                e = len(sampled[j])
                num_emitted += e
                if e > 1 and nd:
                    num_accepted += min(e - 1, nd)
        structured = False
        num_grammar = 0
        if gids is not None:
            num_grammar = len(gids)
            structured = bool(total) and any(map(drafts_of, gids))
        elif getattr(so, "has_structured_output_requests", True):
            # The requests vLLM's get_grammar_bitmask produces rows for: every one for the listeners'
            # record (its number), else only whether one with drafts is among them (a loop over the
            # requests with drafts that stops at the first).
            if self.hooks:
                for r in nst:
                    req = requests.get(r)
                    if req is not None and req.use_structured_output and not req.is_prefill_chunk:
                        num_grammar += 1
                        if total and drafts_of(r):
                            structured = True
            elif total:
                for r, d in spec.items():
                    if (
                        d
                        and (req := requests.get(r)) is not None
                        and req.use_structured_output
                        and not req.is_prefill_chunk
                    ):
                        structured = True
                        break
        finished = so.finished_req_ids
        if finished:
            self.confidences.forget(list(finished))
        self._tally(total, total, num_emitted, num_accepted, structured, "full", n, num_grammar, len(finished or ()))

    def _count(self, plan: _Plan, num_emitted: int, num_accepted: int, scheduled: int | None) -> None:
        """Add a finished step to the counters and metrics, and tell ``maskplug_step_end`` listeners."""
        self._tally(
            plan.budget if scheduled is None else scheduled,  # None: a verify-all step, every draft verified
            plan.budget,
            num_emitted,
            num_accepted,
            plan.structured,
            plan.regime,
            plan.num_requests,
            plan.num_grammar,
            len(plan.finished),
        )

    def _tally(
        self,
        scheduled: int,
        budget: int,
        num_emitted: int,
        num_accepted: int,
        structured: bool,
        regime: str,
        num_requests: int,
        num_grammar: int,
        num_finished: int,
    ) -> None:
        """:meth:`_count` of a step given by its figures (a verify-all step has no plan to read them from).

        The figures are added to :attr:`counts`; without ``maskplug_step_end``
        listeners the metrics file is written (:meth:`publish`) every
        :data:`FOLD_EVERY` steps, at the end of a step in which a request
        finished (before its output leaves the engine core), when the engine
        runs an empty step, and by :func:`step_stats` in the engine's process.
        Writing the file on every step cost 4–5 µs more per step at one
        request in the engine (``benchmarks/RESULTS.md``), where the code
        runs cold between model steps.
        """
        c = self.counts
        c[_STEPS] += 1
        c[_SCHEDULED] += scheduled
        c[_VERIFIED] += budget
        c[_ACCEPTED] += num_accepted
        c[_EMITTED] += num_emitted
        c[_BUDGET] = budget
        if structured:
            c[_REGIME_AT[regime]] += 1
            c[_STRUCTURED] += 1
        if not self.hooks:
            if c[_STEPS] - self.published >= FOLD_EVERY:
                self.publish()
            return
        step = self.publish()  # every step counted and published: the record carries its own step number
        get_registry().step_end(
            {
                "step": step - 1,
                "scheduler": self.name,
                "num_requests": num_requests,
                "num_grammar_requests": num_grammar,
                "scheduled_drafts": scheduled,
                "budget": budget,
                "regime": regime,
                "structured": structured,
                "accepted": num_accepted,
                "emitted": num_emitted,
                "finished": num_finished,
            }
        )

    def publish(self) -> int:
        """Write :attr:`counts` to the metrics file (when there is one); returns the steps counted.

        Called on the engine core's thread: the counters of every step so far
        become readable by other processes (the OpenAI server's Prometheus
        collector, :func:`step_stats` there).
        """
        c = self.counts
        if self.metrics is not None:
            self.metrics.write(c)
        steps = self.published = c[_STEPS]
        return steps


class _AskRegistry:
    """:attr:`_Controller.hooks` where pluggy keeps no live list of its hooks: as long as the registry says."""

    def __len__(self) -> int:
        return int(get_registry().step_end_listened())


def _probed(
    probe: Mapping[int, int],
    sel: npt.NDArray[np.intp],
    verified: npt.NDArray[np.int64],
    accepted: npt.NDArray[np.int64],
    ids: list[str],
    sampled: Sequence[Sequence[int]],
    index: Callable[[str], int | None],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The outcome with each request's first trimmed draft judged by the token the step emitted.

    A request whose verified drafts were all accepted emits one more token,
    sampled by the target at exactly the position of its first trimmed
    draft: the draft would have been accepted iff it equals that token.
    Under greedy decoding that is what verification would have found; for a
    drafter that proposes a single token per position (n-gram) it also holds
    in distribution under sampling (acceptance probability ``p(draft)``, the
    chance that the sampled token is the draft). Without it a request whose
    budget reached 0 would never be observed again, and one that started
    from a pessimistic prior (a batch of rejected drafts around a request
    whose drafts are good) would never be verified at all. For a draft model
    under sampling it is conservative (acceptance ``min(1, p / q) >= p``).
    """
    verified = verified.copy()
    accepted = accepted.copy()
    for k, i in enumerate(sel.tolist()):
        draft = probe.get(i)
        if draft is None or accepted[k] != verified[k]:
            continue  # nothing trimmed, or a verified draft was rejected: the emitted token is not at the probe
        j = index(ids[i])
        assert j is not None  # `sel` holds only requests that emitted tokens
        verified[k] += 1
        if sampled[j][-1] == draft:
            accepted[k] += 1
    return verified, accepted


def _draft_masks_for(layout: ScheduledLayout, grammar_output: Any) -> DraftMasks | None:
    """The producer's draft masks re-indexed into the step layout (``None`` without them)."""
    if grammar_output is None:
        return None
    dm = getattr(grammar_output, _DRAFT_MASKS_ON_OUTPUT, None)
    if dm is None:
        return None
    gidx = layout.indices_of(list(grammar_output.structured_output_request_ids), "structured_output_request_ids")
    req = np.asarray(dm.request, dtype=np.int64)
    return DraftMasks(
        request=gidx[req] if req.size else np.zeros(0, dtype=np.int64),
        acceptable=np.asarray(dm.acceptable, dtype=np.int64),
        forced=np.asarray(dm.forced, dtype=bool),
    )


_controller: _Controller | None = None
_install_lock = threading.Lock()
#: The engine core's wrappers that only a planning scheduler uses, ``(owner, attribute) -> wrapper``:
#: under ``verify-all`` they would only return what vLLM's own method returns (it plans nothing, has
#: no rows made ahead to hand back and takes no confidences), so vLLM's own method is in place
#: instead (:func:`_planning_wrappers`).
_PLANNING_ONLY: dict[tuple[Any, str], Any] = {}


def _planning_wrappers(on: bool) -> None:
    """Put the planning-only wrappers in place (``on``) or vLLM's own methods (``verify-all``).

    At one request in flight each wrapper's call between forward passes costs
    microseconds, for nothing under ``verify-all``. An attribute that holds
    neither (something else wrapped it since) is left as it is.
    """
    for (owner, attr), wrapper in _PLANNING_ONLY.items():
        own = patches.original(owner, attr)
        now = getattr(owner, attr)
        want = wrapper if on else own
        if now is not want and (now is wrapper or now is own):
            setattr(owner, attr, want)


# -- the patches ----------------------------------------------------------------------------------

#: Planned steps awaiting their outcome, per scheduler: ``id(scheduler_output)`` → the output (kept
#: alive so the id stays its own), its grammar output and the plan, made in ``schedule``
#: (``get_grammar_bitmask`` hands its rows back).
_STEPS_ATTR = "_maskplug_steps"

_MAX_PENDING = 16

#: The most steps the engine core counts before writing its counters to the metrics file
#: (:meth:`_Controller.publish`): Prometheus and :func:`step_stats` in other processes lag the engine
#: by at most this many steps while requests run; every step up to a request's end is published
#: before its output leaves the engine core, and an engine that falls idle has published everything.
FOLD_EVERY = 16


def _open_metrics(sched: Any, name: str) -> StepMetrics:
    par = getattr(getattr(sched, "vllm_config", None), "parallel_config", None)
    engine = int(getattr(par, "data_parallel_rank", 0) or 0)
    return StepMetrics(metrics.ensure_metrics_dir(), engine, name)


def _pending(sched: Any) -> dict[int, tuple[Any, Any, _Plan | None]]:
    steps = getattr(sched, _STEPS_ATTR, None)
    if steps is None:
        steps = {}
        setattr(sched, _STEPS_ATTR, steps)
    return steps


def _make_schedule(orig: Callable[..., Any], orig_grammar: Callable[..., Any]) -> Callable[..., Any]:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        so = orig(self, *args, **kwargs)
        ctl = _controller
        if ctl is None or ctl.verifies_all:
            # verify-all: nothing to plan. The rows are produced where vLLM asks for them
            # (get_grammar_bitmask, after the step is sent: with a multiprocess executor while the
            # workers run the model), and update_from_output counts the step from vLLM's own outputs.
            # Produced here instead the rows delayed the step by their cost, and the matchers were
            # cold when the emitted tokens reached them after the forward pass (at 16 requests in the
            # engine 64 µs more host work per step; at one request no difference beyond the noise).
            return so
        if ctl.metrics is None:
            ctl.metrics = _open_metrics(self, ctl.name)
        if so.total_num_scheduled_tokens == 0:
            # Nothing runs (the engine loops while a request waits, e.g. for its grammar): no rows, no plan.
            ctl.idle_step(so.finished_req_ids)
            return so
        pending = _pending(self)
        if len(pending) >= _MAX_PENDING:
            # Outcomes come back in order, a step or two later (more only if vLLM dropped one): the oldest go.
            for key in list(pending)[: len(pending) - _MAX_PENDING + 1]:
                del pending[key]
        # The rows for every scheduled draft, produced now (vLLM would produce the same rows while
        # the model runs): the budget needs the step's draft masks before the step is sent.
        manager = self.structured_output_manager
        setattr(manager, DRAFT_MASKS_ATTR, None)
        setattr(manager, WANT_DRAFT_MASKS_ATTR, True)
        try:
            grammar_output = orig_grammar(self, so)
        finally:
            setattr(manager, WANT_DRAFT_MASKS_ATTR, False)
        produced = getattr(manager, DRAFT_MASKS_ATTR, None)
        setattr(manager, DRAFT_MASKS_ATTR, None)
        attached = False
        if grammar_output is not None and produced is not None:
            gids, dm = produced
            if list(gids) == list(grammar_output.structured_output_request_ids):
                setattr(grammar_output, _DRAFT_MASKS_ON_OUTPUT, dm)
                attached = True
        plan = ctl.plan(so, grammar_output)
        if attached:
            # The draft masks stay in this process: workers get vLLM's own grammar output.
            delattr(grammar_output, _DRAFT_MASKS_ON_OUTPUT)
        pending[id(so)] = (so, grammar_output, plan)
        return so

    return wraps(orig)(schedule)


def _make_get_grammar_bitmask(orig: Callable[..., Any]) -> Callable[..., Any]:
    def get_grammar_bitmask(self: Any, scheduler_output: Any) -> Any:
        pending = getattr(self, _STEPS_ATTR, None)
        if pending:
            entry = pending.get(id(scheduler_output))
            if entry is not None and entry[0] is scheduler_output:
                return entry[1]
        return orig(self, scheduler_output)

    return wraps(orig)(get_grammar_bitmask)


#: The parameters of vLLM's ``Scheduler.make_spec_decoding_stats`` that its wrapper takes (checked at install).
SPEC_STATS_PARAMS = (
    "self",
    "spec_decoding_stats",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_invalid_spec_tokens",
    "request_id",
)


def _make_make_spec_decoding_stats(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``Scheduler.make_spec_decoding_stats``: the count of a ``verify-all`` step as vLLM's loop goes.

    vLLM's ``update_from_output`` calls it for every request with drafts and
    sampled tokens, with the request's drafts and accepted drafts, whether
    vLLM keeps statistics or not. Refused (:class:`~maskplug.PluginError`)
    when its parameters are not :data:`SPEC_STATS_PARAMS`.
    """
    got = tuple(inspect.signature(orig).parameters)
    if got != SPEC_STATS_PARAMS:
        raise PluginError(
            "vllm.v1.core.sched.scheduler.Scheduler.make_spec_decoding_stats: expected the parameters "
            f"{', '.join(SPEC_STATS_PARAMS)}, got {', '.join(got)}"
        )

    def make_spec_decoding_stats(
        self: Any,
        spec_decoding_stats: Any,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        num_invalid_spec_tokens: Any,
        request_id: str,
    ) -> Any:
        ctl = _controller
        if ctl is not None and ctl.counting:
            # A verify-all step counted as vLLM's update_from_output goes (see there): every
            # scheduled draft verified; vLLM's accepted drafts, read before it trims a stopping
            # request's tokens; the request is still in the scheduler's map here.
            c = ctl.counts
            c[_SCHEDULED] += num_draft_tokens
            c[_VERIFIED] += num_draft_tokens
            c[_ACCEPTED] += num_accepted_tokens
            if (
                not ctl.structured_seen
                and (req := self.requests.get(request_id)) is not None
                and req.use_structured_output
                and not req.is_prefill_chunk
            ):
                ctl.structured_seen = True
        if not self.log_stats:
            return None  # what vLLM's method returns then, without its call
        return orig(
            self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id
        )

    return wraps(orig)(make_spec_decoding_stats)


def _make_update_from_output(orig: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        ctl = _controller
        if ctl is None:
            return orig(self, scheduler_output, model_runner_output)
        if not scheduler_output.total_num_scheduled_tokens:
            # vLLM's engine loop also calls this for steps that scheduled nothing: while a request
            # waits, e.g. for its grammar, the loop spins (tens of steps per request at one request
            # in flight). A planning engine handled them in schedule; a verify-all one does here, and
            # only when there is something to do: a finished request to forget or steps to publish
            # (after which nothing is left to publish when a request ends in a step that ran nothing).
            if ctl.verifies_all and (scheduler_output.finished_req_ids or ctl.counts[_STEPS] != ctl.published):
                if ctl.metrics is None:
                    ctl.metrics = _open_metrics(self, ctl.name)
                ctl.idle_step(scheduler_output.finished_req_ids)
            return orig(self, scheduler_output, model_runner_output)
        if ctl.metrics is None:
            ctl.metrics = _open_metrics(self, ctl.name)
        pending = getattr(self, _STEPS_ATTR, None)
        entry = pending.pop(id(scheduler_output), None) if pending else None
        if entry is not None and entry[0] is scheduler_output:
            ctl.finish(entry[2], model_runner_output)
        else:
            # A step that was not planned: verify-all's (even if the scheduler changed since it was
            # scheduled), every draft verified. Its grammar requests are read off the scheduler's
            # map, as vLLM's get_grammar_bitmask reads them (nothing changes them in between: the
            # engine core's loop runs the step's three calls one after the other, asynchronous
            # scheduling being refused).
            sampled = getattr(model_runner_output, "sampled_token_ids", None)
            if sampled is None or ctl.hooks:
                ctl.finish_all(self.requests, scheduler_output, model_runner_output)
            else:
                # Without listeners the step is counted as vLLM's method goes: its loop hands every
                # request's drafts and accepted drafts to make_spec_decoding_stats (a call vLLM
                # makes whether it keeps statistics or not), whose wrapper adds them. Counted here
                # on its own between forward passes, a step cost about 10 µs at one request.
                c = ctl.counts
                c[_EMITTED] += sum(map(len, sampled))  # before vLLM trims a stopping request's list
                drafts = c[_SCHEDULED]
                if scheduler_output.finished_req_ids:
                    ctl.confidences.forget(list(scheduler_output.finished_req_ids))
                ctl.counting = True
                try:
                    out = orig(self, scheduler_output, model_runner_output)
                finally:
                    ctl.counting = False
                c[_STEPS] += 1
                c[_BUDGET] = c[_SCHEDULED] - drafts
                if ctl.structured_seen:
                    ctl.structured_seen = False
                    c[_FULL] += 1
                    c[_STRUCTURED] += 1
                if c[_STEPS] - ctl.published >= FOLD_EVERY or getattr(self, "finished_req_ids", True):
                    ctl.publish()  # as below, and every FOLD_EVERY steps
                return out
        out = orig(self, scheduler_output, model_runner_output)
        if ctl.counts[_STEPS] != ctl.published and getattr(self, "finished_req_ids", True):
            # A request ended in this step: its steps are published before its output leaves the
            # engine core (a client that reads the metrics after its answer sees them).
            ctl.publish()
        return out

    return wraps(orig)(update_from_output)


def _make_update_draft_token_ids(orig: Callable[..., Any]) -> Callable[..., Any]:
    def update_draft_token_ids(self: Any, draft_token_ids: Any) -> Any:
        ctl = _controller
        conf = getattr(draft_token_ids, CONFIDENCES_ATTR, None)
        if ctl is not None and conf is not None:
            ctl.confidences.record(list(draft_token_ids.req_ids), conf)
        return orig(self, draft_token_ids)

    return wraps(orig)(update_draft_token_ids)


def _make_execute_model(orig: Callable[..., Any]) -> Callable[..., Any]:
    def execute_model(self: Any, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        return orig(self, compacted_output(scheduler_output), intermediate_tensors)

    return wraps(orig)(execute_model)


def install_adaptive(scheduler: str | Scheduler | None = None, cost: CostModel | None = None) -> None:
    """Install the adaptive-verification patches (after :func:`maskplug_vllm.install`) and pick the scheduler.

    ``scheduler`` defaults to ``MASKPLUG_VLLM_SCHEDULER`` and ``cost`` to
    ``MASKPLUG_VLLM_COST`` (else :func:`default_cost_model`). Idempotent: a
    second call only changes what is given.

    Raises:
        PluginError: vLLM is not a release these patches support, the
            structured-output patches are not installed, or the scheduler is unknown.
    """
    global _controller
    version = patches.vllm_version()
    if version not in ADAPTIVE_VLLM_VERSIONS:
        raise PluginError(
            f"{SCHEDULER_ENV}: maskplug's adaptive verification patches vLLM's scheduler and model runner and "
            f"was tested with vLLM {', '.join(ADAPTIVE_VLLM_VERSIONS)}, got {version}; unset {SCHEDULER_ENV} "
            "to keep vLLM's own verification"
        )
    if not patches.installed():
        raise PluginError(
            f"{SCHEDULER_ENV}: expected maskplug's structured-output patches to be installed first "
            "(MASKPLUG_VLLM=1), got none; the budget needs maskplug's rows and mask apply"
        )
    if scheduler is None and _controller is None:
        scheduler = os.environ.get(SCHEDULER_ENV, "").strip() or None
        if scheduler is None:
            raise PluginError(f"{SCHEDULER_ENV}: expected a scheduler name, got nothing")
    with _install_lock:
        sched_mod = importlib.import_module("vllm.v1.core.sched.scheduler")
        runner_mod = importlib.import_module("vllm.v1.worker.gpu_model_runner")
        proposer_mod = importlib.import_module("vllm.v1.spec_decode.llm_base_proposer")
        args_mod = importlib.import_module("vllm.engine.arg_utils")
        cls = sched_mod.Scheduler
        runner = runner_mod.GPUModelRunner
        proposer = proposer_mod.SpecDecodeBaseProposer
        orig_grammar = patches.original(cls, "get_grammar_bitmask")
        # The engine core: decide (schedule), hand back the rows, learn the outcome, take confidences.
        planning_only = {
            "schedule": _make_schedule(patches.original(cls, "schedule"), orig_grammar),
            "get_grammar_bitmask": _make_get_grammar_bitmask(orig_grammar),
            "update_draft_token_ids": _make_update_draft_token_ids(patches.original(cls, "update_draft_token_ids")),
        }
        for attr, wrapper in planning_only.items():
            if not patches._patches.replaced(cls, attr):
                patches._replace(cls, attr, wrapper)
                _PLANNING_ONLY[(cls, attr)] = wrapper
        patches._replace(
            cls, "update_from_output", _make_update_from_output(patches.original(cls, "update_from_output"))
        )
        patches._replace(
            cls,
            "make_spec_decoding_stats",
            _make_make_spec_decoding_stats(patches.original(cls, "make_spec_decoding_stats")),
        )
        # The workers: apply the compacted step; a model drafter records its confidences.
        patches._replace(runner, "execute_model", _make_execute_model(patches.original(runner, "execute_model")))
        patches._replace(
            runner,
            "take_draft_token_ids",
            confidences.make_take_draft_token_ids(patches.original(runner, "take_draft_token_ids")),
        )
        patches._replace(proposer, "propose", confidences.make_propose(patches.original(proposer, "propose")))
        patches._replace(
            proposer, "_greedy_sample", confidences.make_greedy_sample(patches.original(proposer, "_greedy_sample"))
        )
        # The process the user started: refuse what cannot work before any engine process starts.
        patches._replace(
            args_mod.EngineArgs,
            "create_engine_config",
            _make_create_engine_config(patches.original(args_mod.EngineArgs, "create_engine_config")),
        )
        metrics.ensure_metrics_dir()
        metrics.register_collector()
        if _controller is None:
            assert scheduler is not None
            sched, name = _resolve(scheduler)
            _controller = _Controller(sched, name, cost if cost is not None else _cost_from_env())
            _planning_wrappers(not _controller.verifies_all)
            return
    if scheduler is not None:
        set_scheduler(scheduler)
    if cost is not None:
        set_cost_model(cost)


# -- start-up checks ------------------------------------------------------------------------------

#: Speculative methods whose drafter hands maskplug its confidences (see :mod:`maskplug_vllm.confidences`).
CONFIDENCE_METHODS = ("draft_model",)


def _needs_confidences(scheduler: Scheduler) -> bool:
    """Whether ``scheduler`` refuses a step without the drafter's confidences (probed on a one-draft step)."""
    view = StepView(ScheduledLayout(["probe"], [1], [1]), default_cost_model())
    try:
        scheduler.budget(view)
    except BudgetError as exc:
        return "confidences" in str(exc)
    return False


def check_config(vllm_config: Any, scheduler: str | None = None) -> None:
    """Refuse, with a :class:`~maskplug.PluginError` naming the setting, an engine config adaptive verification cannot serve.

    Called where the engine config is created (``EngineArgs.create_engine_config``),
    so the refusal reaches the process the user started, before any engine
    process exists. ``scheduler`` defaults to the running one's name.

    Refused: no speculative decoding (nothing to budget), asynchronous
    scheduling (the drafts of a step are not known when it is scheduled),
    pipeline parallelism (steps overlap in vLLM's batch queue), and a
    scheduler that needs confidences with a drafter that has none.
    """
    name = scheduler if scheduler is not None else (_controller.name if _controller is not None else "")
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not getattr(spec, "num_speculative_tokens", 0):
        raise PluginError(
            f"{SCHEDULER_ENV}={name}: maskplug's adaptive verification chooses how many drafts to verify, got an "
            "engine without speculative decoding; pass --speculative-config (e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 3}\') or unset ' + SCHEDULER_ENV
        )
    sched_cfg = getattr(vllm_config, "scheduler_config", None)
    if getattr(sched_cfg, "async_scheduling", False):
        raise PluginError(
            f"{SCHEDULER_ENV}={name}: maskplug's adaptive verification needs synchronous scheduling (the budget "
            "is chosen from the drafts a step schedules), got async_scheduling=True; start the engine with "
            f"--no-async-scheduling (async_scheduling=False) or unset {SCHEDULER_ENV}"
        )
    par = getattr(vllm_config, "parallel_config", None)
    pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
    if pp != 1:
        raise PluginError(
            f"{SCHEDULER_ENV}={name}: maskplug's adaptive verification supports tensor parallelism but not "
            f"pipeline parallelism, got pipeline_parallel_size={pp}; use --tensor-parallel-size for several "
            f"devices, or unset {SCHEDULER_ENV}"
        )
    method = str(getattr(spec, "method", ""))
    # A fresh instance for the probe, so the running scheduler's history is not touched.
    try:
        sched: Scheduler | None = make_scheduler(name) if name else None
    except PluginError:
        sched = _controller.scheduler if _controller is not None else None
    if sched is not None and method not in CONFIDENCE_METHODS and _needs_confidences(sched):
        raise PluginError(
            f"{SCHEDULER_ENV}={name}: this scheduler reads the drafter's confidences, got the {method!r} drafter, "
            f"which has none; use a drafter with confidences ({', '.join(CONFIDENCE_METHODS)}) or a scheduler "
            "that learns from outcomes (goodput, grammar-aware:goodput)"
        )


def _make_create_engine_config(orig: Callable[..., Any]) -> Callable[..., Any]:
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = orig(self, *args, **kwargs)
        if _controller is not None:
            check_config(config)
        return config

    return wraps(orig)(create_engine_config)


def adaptive_installed() -> bool:
    """Whether maskplug's schedulers drive verification in this process."""
    return _controller is not None and patches.installed()


def _resolve(scheduler: str | Scheduler) -> tuple[Scheduler, str]:
    if isinstance(scheduler, str):
        return make_scheduler(scheduler), scheduler.strip()
    if isinstance(scheduler, Scheduler):
        return scheduler, str(getattr(scheduler, "name", type(scheduler).__name__))
    raise PluginError(f"scheduler: expected a scheduler name or object, got {type(scheduler).__name__}")


def _require() -> _Controller:
    if _controller is None:
        raise PluginError(
            f"{SCHEDULER_ENV}: adaptive verification is not installed in this process (set MASKPLUG_VLLM=1 and "
            f"{SCHEDULER_ENV}=<name> before the engine starts)"
        )
    return _controller


def _require_local_engine(ctl: _Controller, what: str) -> None:
    """Refuse to change what only an engine core in another process would use (it would change nothing)."""
    if ctl.metrics is None and metrics.read_metrics():
        raise PluginError(
            f"{what}: the engine core runs in another process (vLLM's default multiprocessing), so a change "
            f"here would not reach it; set {SCHEDULER_ENV} / {COST_ENV} before the engine starts, or run the "
            "engine core in this process with VLLM_ENABLE_V1_MULTIPROCESSING=0"
        )


def set_scheduler(scheduler: str | Scheduler) -> None:
    """Switch the scheduler of the running engine (between ``LLM.generate`` calls); its history starts empty."""
    ctl = _require()
    _require_local_engine(ctl, "set_scheduler")
    sched, name = _resolve(scheduler)
    with ctl.lock:
        ctl.scheduler, ctl.name = sched, name
        if ctl.metrics is not None:
            ctl.metrics.set_scheduler(name)
        _planning_wrappers(not ctl.verifies_all)


def set_cost_model(cost: CostModel) -> None:
    """Replace the cost model the scheduler is shown."""
    if not isinstance(cost, CostModel):
        raise BudgetError(f"cost: expected a CostModel, got {type(cost).__name__}")
    ctl = _require()
    _require_local_engine(ctl, "set_cost_model")
    with ctl.lock:
        ctl.cost = cost


def current_scheduler() -> Scheduler:
    """The scheduler that picks the budgets now."""
    return _require().scheduler


def step_stats() -> dict[str, Any]:
    """Counters of the engine steps since start (or :func:`reset_step_stats`).

    Keys: ``steps`` (engine steps that ran the model), ``regimes`` (``full``,
    ``partial``, ``zero``: steps with drafts scheduled for at least one
    structured-output request, by :func:`maskplug.compaction.regime_of`),
    ``drafts_scheduled`` (drafts vLLM scheduled), ``drafts_verified`` (kept by
    the budget), ``drafts_accepted``, ``tokens_emitted`` (sampled tokens),
    ``structured_steps`` (the steps counted in ``regimes``), ``scheduler``.

    In the process that schedules (the in-process engine core) these are its
    own counters. In a process whose engine core runs elsewhere (``LLM(...)``
    with vLLM's default engine-core process) they are read from the engine
    cores' counter files (:mod:`maskplug_vllm.metrics`), summed over engines;
    while requests run those files may lag the engine by up to
    :data:`FOLD_EVERY` steps (they are complete once the engine is idle).
    Empty counters, and ``scheduler`` ``None``, when adaptive verification is off.
    """
    ctl = _controller
    if ctl is None:
        out = _new_stats()
        out["scheduler"] = None
        return out
    with ctl.lock:
        if ctl.metrics is None:
            if engines := metrics.read_metrics():
                return _from_files(engines, ctl.offsets, ctl.name)
        elif ctl.counts[_STEPS] != ctl.published:
            ctl.publish()  # the engine's own process: its file says what the counters say
        out = ctl.stats
        out["scheduler"] = ctl.name
    return out


_FLAT = ("steps", "drafts_scheduled", "drafts_verified", "drafts_accepted", "tokens_emitted", "structured_steps")


def _from_files(engines: Mapping[str, Mapping[str, Any]], offsets: Mapping[str, int], name: str) -> dict[str, Any]:
    out = _new_stats()
    for v in engines.values():
        for key in _FLAT:
            out[key] += int(v[key])
        for regime in ("full", "partial", "zero"):
            out["regimes"][regime] += int(v[f"regime_{regime}"])
    for key in _FLAT:
        out[key] -= offsets.get(key, 0)
    for regime in ("full", "partial", "zero"):
        out["regimes"][regime] -= offsets.get(f"regime_{regime}", 0)
    names = {str(v.get("scheduler", "")) for v in engines.values()} - {""}
    out["scheduler"] = names.pop() if len(names) == 1 else name
    return out


def reset_step_stats() -> None:
    """Zero the counters of :func:`step_stats`."""
    ctl = _controller
    if ctl is None:
        return
    with ctl.lock:
        ctl.counts[:] = [0] * len(ctl.counts)
        if ctl.metrics is not None:
            ctl.publish()
        ctl.published = 0
        if ctl.metrics is None and (engines := metrics.read_metrics()):
            # The engine cores' files keep counting; from now on they are read from here.
            now = _from_files(engines, {}, ctl.name)
            ctl.offsets = {key: now[key] for key in _FLAT}
            ctl.offsets.update({f"regime_{r}": now["regimes"][r] for r in ("full", "partial", "zero")})


def _uninstall_adaptive() -> None:
    """Forget the scheduler (the patches themselves go with :func:`maskplug_vllm.uninstall`)."""
    global _controller
    _controller = None
    _PLANNING_ONLY.clear()
