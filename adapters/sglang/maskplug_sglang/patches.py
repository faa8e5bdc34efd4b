"""Narrow, version-checked patches of SGLang 0.5.23's DSpark decode step.

SGLang has a registry for grammar backends (which :mod:`maskplug_sglang.plugin`
uses) but none for the DSpark verify planner or its grammar-mask producer, so
maskplug's budget and mask rows enter the step by replacing exactly these
attributes, and nothing else:

==========================================================================  ===============================================
attribute                                                                   replaced by
==========================================================================  ===============================================
``DSparkWorkerV2._forward_decode``                                          the same step, with maskplug's step record
                                                                            open (its outcome queued for the scheduler)
``DraftBlockProposer.propose``                                              the same, noting the step's verify chain
``DSparkVerifyPlanner.resolve_verify_token_budget``                         the budget of a maskplug scheduler
``DSparkVerifyPlanner.schedule_layout``                                     SGLang's own, on grammar-corrected confidences
``dspark_worker_v2.build_grammar_vocab_mask``                               :func:`maskplug_sglang.dspark.build_verify_mask`
                                                                            (only the rows the verify layout keeps)
==========================================================================  ===============================================

SGLang's top-k (``schedule_verify_lens_topk``), its verify layout, its accept
kernels and its grammar barrier run unchanged. Every replacement falls back to
SGLang's own behaviour outside a DSpark decode step, in static verify mode
(no budget to choose), without a confidence head, and with data-parallel
attention's gathered graph tiers (where every rank must use the budget chosen
before the step).

:func:`install` checks the SGLang version first and refuses any release
other than the tested ones (:data:`TESTED_SGLANG`); :func:`uninstall` puts
SGLang's functions back.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from maskplug import DraftMasks
from maskplug.engines.sdk import PatchSet

from .dspark import (
    DSparkBudgetPlanner,
    VerifyPlan,
    blank_rows_past,
    build_verify_mask,
    check_sglang_version,
    cost_from_sps_table,
    fill_verify_rows,
)
from .plugin import TESTED_SGLANG

__all__ = [
    "ENABLE_ENV",
    "TESTED_SGLANG",
    "DecodeStep",
    "current_step",
    "enabled_by_env",
    "flush_observations",
    "install",
    "installed",
    "uninstall",
]

ENABLE_ENV = "MASKPLUG_SGLANG_DSPARK"
"""Set to ``1`` to install the DSpark patches in every SGLang process (through the plugin entry point)."""

logger = logging.getLogger(__name__)

_patches = PatchSet("sglang", f"SGLang {', '.join(TESTED_SGLANG)}")
_lock = _patches.lock
_local = threading.local()

WORKER = "sglang.srt.speculative.dspark_components.dspark_worker_v2"
PLANNER = "sglang.srt.speculative.dspark_components.dspark_planner"
DRAFT = "sglang.srt.speculative.dspark_components.dspark_draft"


@dataclass
class DecodeStep:
    """What maskplug records during one DSpark decode step (one per worker thread)."""

    reqs: list[Any]
    barrier: Callable[[], None] | None
    vocab_size: int | None
    verify_ids: torch.Tensor | None = None
    plan: VerifyPlan | None = None
    planner: DSparkBudgetPlanner | None = None
    grammar: DraftMasks | None = None
    rows: torch.Tensor | None = None
    verify_lens: torch.Tensor | None = None


def current_step() -> DecodeStep | None:
    """The DSpark decode step running on this thread, if any."""
    return getattr(_local, "step", None)


_replace = _patches.replace


def original(owner: Any, attr: str) -> Any:
    """SGLang's own implementation of a patched attribute (the current one when not patched)."""
    return _patches.original(owner, attr)


def installed() -> bool:
    """Whether the patches are in place in this process."""
    return _patches.installed()


# -- the replacements ----------------------------------------------------------------------
def make_forward_decode(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``DSparkWorkerV2._forward_decode`` with maskplug's step record open around it."""
    sig = inspect.signature(orig)

    def _forward_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(self, *args, **kwargs)
        batch = bound.arguments.get("batch")
        mode = getattr(batch, "forward_mode", None)
        if batch is None or (mode is not None and mode.is_idle()) or current_step() is not None:
            return orig(self, *args, **kwargs)
        info = getattr(batch, "sampling_info", None)
        step = DecodeStep(
            reqs=list(getattr(batch, "reqs", [])),
            barrier=bound.arguments.get("grammar_barrier"),
            vocab_size=getattr(info, "vocab_size", None),
        )
        _local.step = step
        try:
            result = orig(self, *args, **kwargs)
        finally:
            _local.step = None
        observe_step(step, result)
        return result

    _forward_decode.__wrapped__ = orig  # type: ignore[attr-defined]
    _forward_decode.__doc__ = orig.__doc__
    return _forward_decode


def observe_step(step: DecodeStep, result: Any) -> None:
    """Queue what verification accepted for the step's scheduler (``accept_lens - 1`` per request).

    The scheduler is told at the start of the next planned step
    (:func:`flush_observations`): reading ``accept_lens`` here would wait for
    the device and break SGLang's overlap of host and device work; by the
    next step the previous outcome is on its way to the host anyway.
    """
    if step.plan is None or step.planner is None:
        return
    lens = getattr(result, "accept_lens", None)
    if lens is None:
        return
    step.planner._maskplug_pending = (step.plan, lens)  # type: ignore[attr-defined]


def flush_observations(planner: DSparkBudgetPlanner) -> None:
    """Hand a planner's queued outcome (if any) to its scheduler."""
    pending = getattr(planner, "_maskplug_pending", None)
    if pending is None:
        return
    planner._maskplug_pending = None  # type: ignore[attr-defined]
    plan, lens = pending
    accepted = torch.as_tensor(lens).detach().to("cpu", torch.int64) - 1
    accepted = torch.minimum(accepted.clamp(min=0), plan.verify_lens.detach().cpu().to(torch.int64) - 1)
    ids = set(plan.req_ids)
    # Requests of the step before that left the batch have finished (or were retracted).
    gone = [r for r in getattr(planner, "_maskplug_last_ids", set()) if r not in ids]
    planner.observe(plan, accepted.numpy(), finished=gone)
    planner._maskplug_last_ids = ids  # type: ignore[attr-defined]


def make_propose(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``DraftBlockProposer.propose``, noting the step's verify chain ``[anchor | drafts]``."""

    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        proposal = orig(self, *args, **kwargs)
        step = current_step()
        if step is not None:
            ids = getattr(proposal, "verify_ids", None)
            if ids is None:
                ids = torch.cat([proposal.draft_block_ids[:, :1], proposal.draft_block.draft_tokens], dim=1)
            step.verify_ids = ids
        return proposal

    propose.__wrapped__ = orig  # type: ignore[attr-defined]
    propose.__doc__ = orig.__doc__
    return propose


def planner_for(verify_planner: Any) -> DSparkBudgetPlanner:
    """The maskplug planner of one SGLang ``DSparkVerifyPlanner`` (built on first use).

    The scheduler is ``MASKPLUG_SCHEDULER`` (``grammar-aware:X`` wraps ``X``);
    the cost model is SGLang's profiled DSpark cost table.
    """
    mine = getattr(verify_planner, "_maskplug_planner", None)
    if mine is None:
        cfg = verify_planner._schedule_cfg
        budget_planner = verify_planner._budget_planner
        width = int(verify_planner.verify_num_draft_tokens)
        max_reqs = 4096
        cost = cost_from_sps_table(budget_planner.sps_table, max_reqs, max_reqs * width)
        mine = DSparkBudgetPlanner(None, gamma=int(cfg.gamma), cost=cost, max_verify_len=int(cfg.max_verify_len))
        verify_planner._maskplug_planner = mine
    return mine


def make_resolve_budget(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``DSparkVerifyPlanner.resolve_verify_token_budget``: a maskplug scheduler's budget."""

    def resolve_verify_token_budget(
        self: Any, *, draft_input: Any, confidence: Any, prefix_lens: Any, req_pool_indices: Any
    ) -> Any:
        step = current_step()
        if (
            step is None
            or step.verify_ids is None
            or confidence is None
            or not self.schedules_verify_budget
            or getattr(self, "_dp_tier_gather_enabled", False)
        ):
            return orig(
                self,
                draft_input=draft_input,
                confidence=confidence,
                prefix_lens=prefix_lens,
                req_pool_indices=req_pool_indices,
            )
        planner = planner_for(self)
        flush_observations(planner)
        step.planner = planner
        grammars = [getattr(r, "grammar", None) for r in step.reqs]
        live = [g for g in grammars if g is not None and not g.is_terminated()]
        if planner.reads_grammar and live and step.vocab_size is not None:
            # The scheduler reads the grammar's view of the chain: walk it now (the
            # previous batch's tokens first), keeping the rows for the mask.
            if step.barrier is not None:
                step.barrier()
            ids = step.verify_ids.detach().to("cpu", torch.int64)
            bs, width = int(ids.shape[0]), int(ids.shape[1])
            rows = live[0].allocate_vocab_mask(vocab_size=step.vocab_size, batch_size=bs * width, device="cpu")
            step.grammar = fill_verify_rows(grammars, ids, rows)
            step.rows = rows
            if step.grammar.failed:
                from .backend import abort_failed_requests

                # Only those requests end (with their error); their drafts are worth nothing to the budget.
                abort_failed_requests(step.reqs)
        req_ids = [getattr(r, "rid", i) for i, r in enumerate(step.reqs)]
        step.plan = planner.plan(req_ids, confidence.float(), grammar=step.grammar)
        draft_input.verify_token_budget = step.plan.budget
        return step.plan.budget

    resolve_verify_token_budget.__wrapped__ = orig  # type: ignore[attr-defined]
    return resolve_verify_token_budget


def make_schedule_layout(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``DSparkVerifyPlanner.schedule_layout``: SGLang's own, fed the plan's corrected confidences."""

    def schedule_layout(self: Any, *, confidence: Any = None, **kwargs: Any) -> Any:
        step = current_step()
        if step is not None and step.plan is not None and confidence is not None:
            confidence = step.plan.confidence.to(device=confidence.device, dtype=confidence.dtype)
        layout = orig(self, confidence=confidence, **kwargs)
        if step is not None:
            if layout is None:
                step.verify_lens = None
            else:
                cpu = getattr(layout, "verify_lens_cpu", None)
                lens = layout.verify_lens if cpu is None else torch.tensor(cpu, dtype=torch.int32)
                step.verify_lens = lens.detach().cpu()
        return layout

    schedule_layout.__wrapped__ = orig  # type: ignore[attr-defined]
    return schedule_layout


def make_build_mask(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``build_grammar_vocab_mask`` as the DSpark worker calls it: only the kept rows."""

    def build_grammar_vocab_mask(*, reqs: Any, tree: Any, sampling_info: Any, device: Any, barrier: Any) -> Any:
        step = current_step()
        if step is None:
            return orig(reqs=reqs, tree=tree, sampling_info=sampling_info, device=device, barrier=barrier)
        lens = step.verify_lens
        if step.rows is not None:
            # Walked for the scheduler already: no grammar work left, only the cut.
            from sglang.srt.constrained.base_grammar_backend import GrammarMask

            if barrier is not None:
                barrier()
            ids = tree.resolve()[2]
            mask = step.rows
            if lens is not None:
                blank_rows_past(mask, lens, int(ids.shape[1]))
            first = next(g for g in (getattr(r, "grammar", None) for r in reqs) if g is not None)
            sampling_info.grammar_mask = None
            return GrammarMask(first, mask.to(device, non_blocking=True))
        return build_verify_mask(
            reqs=reqs, tree=tree, sampling_info=sampling_info, device=device, barrier=barrier, verify_lens=lens
        )

    build_grammar_vocab_mask.__wrapped__ = orig  # type: ignore[attr-defined]
    return build_grammar_vocab_mask


# -- install / uninstall ------------------------------------------------------------------------
def install() -> None:
    """Check the SGLang version, then install the DSpark patches (idempotent).

    Raises:
        PluginError: SGLang is not a tested release, or its DSpark modules lack
            an attribute the patches replace.
    """
    check_sglang_version()
    with _lock:
        worker = importlib.import_module(WORKER)
        planner = importlib.import_module(PLANNER)
        draft = importlib.import_module(DRAFT)
        _replace(
            worker.DSparkWorkerV2,
            "_forward_decode",
            make_forward_decode(original(worker.DSparkWorkerV2, "_forward_decode")),
        )
        _replace(draft.DraftBlockProposer, "propose", make_propose(original(draft.DraftBlockProposer, "propose")))
        vp = planner.DSparkVerifyPlanner
        _replace(vp, "resolve_verify_token_budget", make_resolve_budget(original(vp, "resolve_verify_token_budget")))
        _replace(vp, "schedule_layout", make_schedule_layout(original(vp, "schedule_layout")))
        _replace(worker, "build_grammar_vocab_mask", make_build_mask(original(worker, "build_grammar_vocab_mask")))


def uninstall() -> None:
    """Put SGLang's own implementations back."""
    _patches.uninstall()


def enabled_by_env() -> bool:
    """Whether :data:`ENABLE_ENV` asks for the patches."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
