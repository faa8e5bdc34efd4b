"""Adaptive verification inside vLLM 0.32's engine, driven by a maskplug scheduler.

With ``MASKPLUG_VLLM=1`` and ``MASKPLUG_VLLM_SCHEDULER=<name>`` (any
registered scheduler, ``grammar-aware:<inner>`` for the grammar-aware wrapper
of another one), every engine step runs like this:

1. vLLM's scheduler schedules the step as usual, drafts included, and the
   grammar rows for every scheduled draft are produced right away (maskplug's
   producer, :func:`maskplug.fill_draft_masks`), together with the step's
   :class:`~maskplug.DraftMasks`. Both travel to the model runner on the
   scheduler output.
2. In the model runner, before it builds its inputs, the step's
   :class:`~maskplug.ScheduledLayout` is built from the scheduled drafts and
   the maskplug scheduler picks the budget from a :class:`~maskplug.StepView`
   (cost model, draft masks; n-gram drafting has no confidence head, so
   schedulers such as ``goodput`` learn from outcomes; no logits-row limit;
   every scheduled request counts as emitting a token at budget 0, a prefill
   chunk that does not finish its prompt included). The budget is split
   per request with :func:`maskplug.allocate_step` and the step is compacted:
   the runner gets a copy of the scheduler output that schedules only the
   kept drafts, so input ids, positions, attention and spec-decode metadata
   and rejection sampling agree with each other.
3. The grammar rows are applied through the mapping built from the
   **scheduled** layout with the **active** row offsets
   (:func:`maskplug_vllm.worker.apply_scatter`), so the rows of trimmed
   drafts write nothing.
4. After sampling, the outcome (drafts verified and accepted per request id,
   finished requests) goes to the scheduler's ``observe``, the counters of
   :func:`step_stats` move and the ``maskplug_step_end`` hook fires once.

vLLM's own scheduler keeps the scheduler output it made, so trimmed drafts
count as rejected drafts there: computed tokens and KV blocks roll back
through vLLM's ordinary rejection path. The only per-request state is the
maskplug scheduler's own, which is told about finished requests.

The attributes replaced (besides those of :mod:`maskplug_vllm.patches`):

=====================================================  =================================================
attribute                                              what it does in addition
=====================================================  =================================================
``vllm.v1.core.sched.scheduler.Scheduler.schedule``    produces the step's rows and draft masks at once
``Scheduler.get_grammar_bitmask``                      hands back those rows
``GPUModelRunner.execute_model`` (CPU runner's too)    plans and compacts the step before the inputs
``GPUModelRunner.sample_tokens``                       reports the outcome, counts, fires the hook
=====================================================  =================================================

The scheduler and the model runner must share a process: vLLM's in-process
engine core with one worker (``UniProcExecutor``, the CPU build's default),
with or without ``VLLM_ENABLE_V1_MULTIPROCESSING`` (the counters live in the
engine-core process). Asynchronous scheduling, pipeline or tensor
parallelism are refused. Only vLLM 0.32.0 is supported.

Cost model: ``MASKPLUG_VLLM_COST=<path>`` names a JSON file (see
:func:`load_cost_model`, written by ``python -m maskplug_vllm.calibrate``);
without it :func:`default_cost_model` is used.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import threading
from collections.abc import Callable, Mapping
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

from . import patches
from .host import draft_counts
from .scheduler import DRAFT_MASKS_ATTR
from .worker import SCHEDULED_SPEC_ATTR

__all__ = [
    "ADAPTIVE_VLLM_VERSIONS",
    "COST_ENV",
    "SCHEDULED_SPEC_ATTR",
    "SCHEDULER_ENV",
    "adaptive_installed",
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


_GRAMMAR_ATTR = "maskplug_grammar_output"
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
         "graph_limit": 0}                      # optional: padded (captured-graph) sizes up to this count

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
    """A new scheduler from a ``MASKPLUG_VLLM_SCHEDULER`` value: a registered name, or ``grammar-aware:<inner>``."""
    if not isinstance(name, str) or not name.strip():
        raise PluginError(f"{SCHEDULER_ENV}: expected a scheduler name, got {name!r}")
    name = name.strip()
    if ":" in name:
        outer, inner = (part.strip() for part in name.split(":", 1))
        if outer != "grammar-aware" or not inner:
            raise PluginError(
                f"{SCHEDULER_ENV}: expected a registered scheduler name or 'grammar-aware:<inner>', got {name!r}"
            )
        get_scheduler(inner)  # an unknown inner name fails here, naming the registered ones
        return get_scheduler("grammar-aware", inner=inner)
    return get_scheduler(name)


# -- per-step bookkeeping -------------------------------------------------------------------------


@dataclasses.dataclass
class _Plan:
    """One step as planned before the forward pass."""

    layout: ScheduledLayout
    budget: int
    capacity: npt.NDArray[np.int64]
    regime: str
    structured: bool
    num_grammar: int
    finished: list[str]


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


class _Controller:
    """The process-wide state of adaptive verification: the scheduler, the cost model, the counters."""

    def __init__(self, scheduler: Scheduler, name: str, cost: CostModel) -> None:
        self.scheduler = scheduler
        self.name = name
        self.cost = cost
        self.stats = _new_stats()
        self.pending: _Plan | None = None
        self.lock = threading.Lock()
        self.checked = False

    # Step 2: before the runner builds its inputs.
    def plan(self, runner: Any, so: Any) -> tuple[Any, _Plan]:
        if not self.checked:
            _check_runner(runner)
            self.checked = True
        nst: Mapping[str, int] = so.num_scheduled_tokens
        spec: Mapping[str, list[int]] = so.scheduled_spec_decode_tokens
        ids = list(nst)
        nd = draft_counts(ids, spec)
        nn = np.fromiter(nst.values(), dtype=np.int64, count=len(ids)) - nd
        layout = ScheduledLayout(ids, nd, nn)
        grammar_output = getattr(so, _GRAMMAR_ATTR, None)
        gids: list[str] = list(grammar_output.structured_output_request_ids) if grammar_output is not None else []
        dm = _draft_masks_for(layout, grammar_output)
        finished = list(so.finished_req_ids)
        total = layout.total_drafts
        structured = bool(gids) and bool(np.any(nd[layout.indices_of(gids)] > 0))
        if total == 0:
            plan = _Plan(layout, 0, np.zeros(layout.n, dtype=np.int64), "full", False, len(gids), finished)
            return so, plan
        view = StepView(layout, self.cost, grammar=dm)
        decision = self.scheduler.budget(view)
        b = decision.budget
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= int(b) <= view.cap:
            raise BudgetError(f"scheduler {self.name!r}: expected a budget in [0, {view.cap}], got {b!r}")
        b = int(b)
        if b == total:
            # Nothing trimmed: every request keeps all its drafts (the only split that sums to the
            # total), and vLLM's own scheduler output runs unchanged.
            plan = _Plan(layout, b, nd.copy(), "full", structured, len(gids), finished)
            return so, plan
        capacity = self._split(view, b)
        comp = compact(layout, b, capacity)
        plan = _Plan(layout, b, capacity, comp.regime, structured, len(gids), finished)
        kept = {r: list(spec[r][:c]) for r, c in zip(ids, capacity.tolist(), strict=True) if c > 0}
        num_tokens = {r: int(t) for r, t in zip(ids, comp.num_tokens_per_req.tolist(), strict=True)}
        trimmed = dataclasses.replace(
            so,
            num_scheduled_tokens=num_tokens,
            total_num_scheduled_tokens=comp.num_tokens,
            scheduled_spec_decode_tokens=kept,
        )
        setattr(trimmed, SCHEDULED_SPEC_ATTR, spec)
        return trimmed, plan

    def _split(self, view: StepView, budget: int) -> npt.NDArray[np.int64]:
        """Per-request capacities for ``budget``: the scheduler's beliefs where it has them, else by position."""
        lay = view.layout
        if budget == 0:
            return np.zeros(lay.n, dtype=np.int64)  # the only split of nothing
        k = int(lay.num_drafts.max())
        beliefs = None
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
            empty = np.zeros(0, dtype=np.int64)
            self.scheduler.observe(
                StepOutcome(
                    req_ids=np.zeros(0, dtype=str),
                    verified=empty,
                    accepted=empty,
                    finished=np.asarray(list(finished), dtype=str),
                )
            )

    # Step 4: after sampling.
    def finish(self, plan: _Plan, output: Any) -> None:
        sampled = getattr(output, "sampled_token_ids", None) or []
        index: Mapping[str, int] = getattr(output, "req_id_to_index", None) or {}
        lay = plan.layout
        ids = lay.req_ids.tolist()
        num_sampled = len(sampled)
        get = index.get
        emitted_list = []
        for r in ids:
            j = get(r)
            emitted_list.append(len(sampled[j]) if j is not None and j < num_sampled else 0)
        emitted = np.array(emitted_list, dtype=np.int64)
        # Only requests that had drafts scheduled say anything about acceptance.
        sel = np.flatnonzero((emitted > 0) & (lay.num_drafts > 0))
        accepted = np.minimum(np.maximum(emitted[sel] - 1, 0), plan.capacity[sel])
        outcome = StepOutcome(
            req_ids=lay.req_ids[sel] if sel.size else _NO_IDS,
            verified=plan.capacity[sel],
            accepted=accepted,
            finished=np.asarray(plan.finished, dtype=str) if plan.finished else _NO_IDS,
        )
        self.scheduler.observe(outcome)
        num_accepted = int(accepted.sum())
        with self.lock:
            st = self.stats
            step = st["steps"]
            st["steps"] += 1
            st["drafts_scheduled"] += lay.total_drafts
            st["drafts_verified"] += plan.budget
            st["drafts_accepted"] += num_accepted
            st["tokens_emitted"] += int(emitted.sum())
            if plan.structured:
                st["structured_steps"] += 1
                st["regimes"][plan.regime] += 1
        get_registry().step_end(
            {
                "step": step,
                "scheduler": self.name,
                "num_requests": lay.n,
                "num_grammar_requests": plan.num_grammar,
                "scheduled_drafts": lay.total_drafts,
                "budget": plan.budget,
                "regime": plan.regime,
                "structured": plan.structured,
                "accepted": num_accepted,
                "emitted": int(emitted.sum()),
                "finished": len(plan.finished),
            }
        )


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


def _check_runner(runner: Any) -> None:
    if getattr(runner, "use_async_scheduling", False):
        raise PluginError(
            f"{SCHEDULER_ENV}: maskplug's adaptive verification needs synchronous scheduling, got async "
            "scheduling; start the engine with async_scheduling=False or unset the variable"
        )
    world = getattr(getattr(runner, "parallel_config", None), "world_size", 1)
    if world != 1:
        raise PluginError(
            f"{SCHEDULER_ENV}: maskplug's adaptive verification runs the scheduler and the model runner in one "
            f"process, got a parallel world of {world} workers; unset the variable"
        )


_controller: _Controller | None = None
_install_lock = threading.Lock()


# -- the patches ----------------------------------------------------------------------------------


def _make_schedule(orig: Callable[..., Any], orig_grammar: Callable[..., Any]) -> Callable[..., Any]:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        so = orig(self, *args, **kwargs)
        if _controller is None:
            return so
        # The rows for every scheduled draft, produced now (vLLM would produce the same rows while
        # the model runs): the model runner needs the step's draft masks before it builds its inputs.
        manager = self.structured_output_manager
        setattr(manager, DRAFT_MASKS_ATTR, None)
        grammar_output = orig_grammar(self, so)
        produced = getattr(manager, DRAFT_MASKS_ATTR, None)
        setattr(manager, DRAFT_MASKS_ATTR, None)
        if grammar_output is not None and produced is not None:
            gids, dm = produced
            if list(gids) == list(grammar_output.structured_output_request_ids):
                setattr(grammar_output, _DRAFT_MASKS_ON_OUTPUT, dm)
        setattr(so, _GRAMMAR_ATTR, grammar_output)
        return so

    schedule.__doc__ = orig.__doc__
    schedule.__wrapped__ = orig  # type: ignore[attr-defined]
    return schedule


def _make_get_grammar_bitmask(orig: Callable[..., Any]) -> Callable[..., Any]:
    def get_grammar_bitmask(self: Any, scheduler_output: Any) -> Any:
        if hasattr(scheduler_output, _GRAMMAR_ATTR):
            return getattr(scheduler_output, _GRAMMAR_ATTR)
        return orig(self, scheduler_output)

    get_grammar_bitmask.__doc__ = orig.__doc__
    get_grammar_bitmask.__wrapped__ = orig  # type: ignore[attr-defined]
    return get_grammar_bitmask


def _make_execute_model(orig: Callable[..., Any]) -> Callable[..., Any]:
    def execute_model(self: Any, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        ctl = _controller
        if ctl is None:
            return orig(self, scheduler_output, intermediate_tensors)
        if scheduler_output.total_num_scheduled_tokens == 0:
            # vLLM's last step of a batch may only announce finished requests: pass them on.
            ctl.forget(scheduler_output.finished_req_ids)
            return orig(self, scheduler_output, intermediate_tensors)
        ctl.pending = None
        run_output, plan = ctl.plan(self, scheduler_output)
        result = orig(self, run_output, intermediate_tensors)
        if result is None:
            ctl.pending = plan  # sampled by sample_tokens
        elif hasattr(result, "sampled_token_ids"):
            ctl.finish(plan, result)
        return result

    execute_model.__doc__ = orig.__doc__
    execute_model.__wrapped__ = orig  # type: ignore[attr-defined]
    return execute_model


def _make_sample_tokens(orig: Callable[..., Any]) -> Callable[..., Any]:
    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        result = orig(self, grammar_output)
        ctl = _controller
        if ctl is not None and ctl.pending is not None:
            plan, ctl.pending = ctl.pending, None
            ctl.finish(plan, result)
        return result

    sample_tokens.__doc__ = orig.__doc__
    sample_tokens.__wrapped__ = orig  # type: ignore[attr-defined]
    return sample_tokens


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
        cls = sched_mod.Scheduler
        runner = runner_mod.GPUModelRunner
        orig_grammar = patches.original(cls, "get_grammar_bitmask")
        patches._replace(cls, "schedule", _make_schedule(patches.original(cls, "schedule"), orig_grammar))
        patches._replace(cls, "get_grammar_bitmask", _make_get_grammar_bitmask(orig_grammar))
        patches._replace(runner, "execute_model", _make_execute_model(patches.original(runner, "execute_model")))
        patches._replace(runner, "sample_tokens", _make_sample_tokens(patches.original(runner, "sample_tokens")))
        if _controller is None:
            assert scheduler is not None
            sched, name = _resolve(scheduler)
            _controller = _Controller(sched, name, cost if cost is not None else _cost_from_env())
            return
    if scheduler is not None:
        set_scheduler(scheduler)
    if cost is not None:
        set_cost_model(cost)


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


def set_scheduler(scheduler: str | Scheduler) -> None:
    """Switch the scheduler of the running engine (between ``LLM.generate`` calls); its history starts empty."""
    ctl = _require()
    sched, name = _resolve(scheduler)
    with ctl.lock:
        ctl.scheduler, ctl.name = sched, name


def set_cost_model(cost: CostModel) -> None:
    """Replace the cost model the scheduler is shown."""
    if not isinstance(cost, CostModel):
        raise BudgetError(f"cost: expected a CostModel, got {type(cost).__name__}")
    ctl = _require()
    with ctl.lock:
        ctl.cost = cost


def current_scheduler() -> Scheduler:
    """The scheduler that picks the budgets now."""
    return _require().scheduler


def step_stats() -> dict[str, Any]:
    """Counters of this process's engine steps since start (or :func:`reset_step_stats`).

    Keys: ``steps`` (engine steps that ran the model), ``regimes`` (``full``,
    ``partial``, ``zero``: steps with drafts scheduled for at least one
    structured-output request, by :func:`maskplug.compaction.regime_of`),
    ``drafts_scheduled`` (drafts vLLM scheduled), ``drafts_verified`` (kept by
    the budget), ``drafts_accepted``, ``tokens_emitted`` (sampled tokens),
    ``structured_steps`` (the steps counted in ``regimes``), ``scheduler``.
    Empty counters, and ``scheduler`` ``None``, when adaptive verification is off.
    """
    ctl = _controller
    if ctl is None:
        out = _new_stats()
        out["scheduler"] = None
        return out
    with ctl.lock:
        out = {k: dict(v) if isinstance(v, dict) else v for k, v in ctl.stats.items()}
        out["scheduler"] = ctl.name
    return out


def reset_step_stats() -> None:
    """Zero the counters of :func:`step_stats`."""
    ctl = _controller
    if ctl is not None:
        with ctl.lock:
            ctl.stats = _new_stats()


def _uninstall_adaptive() -> None:
    """Forget the scheduler (the patches themselves go with :func:`maskplug_vllm.uninstall`)."""
    global _controller
    _controller = None
