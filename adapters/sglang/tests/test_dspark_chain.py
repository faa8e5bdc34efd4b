"""SGLang's real DSpark verify chain, with SGLang's xgrammar backend and with maskplug's.

Every step runs SGLang 0.5.23's own modules, imported as they are:

``GrammarTree.from_linear_chain`` → ``build_grammar_vocab_mask`` (its
``generate_token_bitmask`` / ``traverse_tree``) → ``GrammarMask.apply`` → the
verify lengths (``schedule_verify_lens_topk`` on a budget of 0, of the
``HostConfidenceBudgetPlanner`` with a profiled cost table, random, or full)
→ ``accept_greedy`` (with ``cap_correct_len``) → ``finalize_accept_lens`` /
``build_out_tokens`` → the scheduler's ``advance_grammar_fsm``.

On random batches (requests without a grammar, with a finished grammar,
drafts the grammar refuses, stop tokens inside the chain), SGLang's xgrammar
objects and maskplug's give identical masks except the documented columns of
the non-stop control tokens, identical accept outcomes and identical kept
tokens. maskplug's own producer (:func:`maskplug_sglang.dspark.build_verify_mask`),
which fills only the rows the verify lengths keep, gives the same outcomes.
The target's logits never favour a control token (those columns are the one
named difference between the two vocabularies' masks).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import control_columns, grammar_keys
from dspark_chain import Req, advance, check_kept_rows, make_batch, make_chain, make_logits, run_verify, same_outcome
from hypothesis import event, given
from hypothesis import strategies as st
from maskplug_sglang.backend import allocate_mask
from maskplug_sglang.dspark import DSparkBudgetPlanner, fill_verify_rows
from sglang.kernels.ops.speculative.dspark.dspark_schedule import ScheduleVerifyLensTopk
from sglang.srt.environ import envs
from sglang.srt.speculative.dspark_components.dspark_planner import (
    DSparkScheduleConfig,
    HostConfidenceBudgetPlanner,
)
from sglang.srt.speculative.dspark_components.dspark_sps import SpsCostTable

import maskplug
from maskplug import CostModel

KEYS = grammar_keys()
BUDGETS = ("zero", "planner", "random", "full")
# The planner gets its (already lagged) confidences handed over, as from SGLang's relay ring,
# so it keeps no host carry of its own.
LAG = max(int(envs.SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS.get()), 1)


# -- one step of the chain ---------------------------------------------------------------------
def verify_lens_for(
    rng: np.random.Generator, mode: str, confidence: torch.Tensor, cfg: DSparkScheduleConfig
) -> tuple[int, torch.Tensor]:
    """The step's budget (0, SGLang's host planner, random or full) and SGLang's top-k verify lengths."""
    bs, gamma = confidence.shape
    if mode == "zero":
        budget = 0
    elif mode == "full":
        budget = bs * gamma
    elif mode == "random":
        budget = int(rng.integers(0, bs * gamma + 1))
    else:
        # A profiled table where steps get slower with more tokens: budgets land in between.
        probes = [1, 2, 4, 8, 16, 32, 64]
        sps = [100.0 / (1.0 + 0.15 * p) for p in probes]
        planner = HostConfidenceBudgetPlanner(
            sps_table=SpsCostTable(probes, sps, 64), cfg=cfg, model_runner=None, relay_lag_steps=LAG
        )
        gen = torch.ones(bs, dtype=torch.int64)
        budget = planner.compute_budget(
            confidence=confidence,
            generation=gen,
            current_generation=gen,
            req_pool_indices_cpu=torch.arange(bs, dtype=torch.int64),
        )
    lens = ScheduleVerifyLensTopk.execute(confidence=confidence, budget=budget, cfg=cfg)
    return budget, lens


def run_steps(backends: tuple[Any, Any], seed: int, planner_name: str | None) -> None:
    rng = np.random.default_rng(seed)
    ours_backend = backends[1]
    vocab = ours_backend.vocab
    size = vocab.vocab_size
    keep = ~control_columns(vocab)
    no_go = sorted(vocab.special_ids - set(vocab.eos_ids))
    avoid = set(vocab.special_ids) - set(vocab.eos_ids)
    bs = int(rng.integers(1, 6))
    gamma = int(rng.integers(1, 7))
    width = gamma + 1
    cfg = DSparkScheduleConfig(gamma=gamma)
    theirs_g, ours_g = make_batch(rng, backends, bs)
    theirs_reqs = [Req(f"r{i}", g) for i, g in enumerate(theirs_g)]
    ours_reqs = [Req(f"r{i}", g) for i, g in enumerate(ours_g)]
    planner = None if planner_name is None else DSparkBudgetPlanner(planner_name, gamma=gamma, cost=CostModel.linear())
    for _step in range(int(rng.integers(1, 4))):
        ids = make_chain(rng, theirs_g, size, width, avoid)
        logits = make_logits(rng, ids, size, no_go)
        confidence = torch.from_numpy(rng.uniform(0.05, 1.0, (bs, gamma)).astype(np.float32))
        dm = fill_verify_rows(ours_g, ids, allocate_mask(size, bs * width))
        if bool((np.asarray(dm.acceptable) < gamma).any()):
            event("a draft the grammar refuses (or one after a stop token)")
        plan = None
        if planner is None:
            budget, lens = verify_lens_for(rng, str(rng.choice(BUDGETS)), confidence, cfg)
        else:
            # The grammar's view of the whole chain feeds the scheduler; SGLang's top-k places its budget.
            plan = planner.plan([r.rid for r in ours_reqs], confidence, grammar=dm)
            budget, lens = plan.budget, plan.verify_lens
            check_plan(planner, plan, dm, confidence, bs, gamma)
        assert int((lens.to(torch.int64) - 1).sum()) <= budget
        theirs = run_verify(theirs_reqs, ids, logits, lens, size, maskplug_rows=False)
        ours = run_verify(ours_reqs, ids, logits, lens, size, maskplug_rows=False)
        ours_kept = run_verify(ours_reqs, ids, logits, lens, size, maskplug_rows=True)
        theirs_kept = run_verify(theirs_reqs, ids, logits, lens, size, maskplug_rows=True)
        if theirs["mask"] is None:
            assert all(m is None for m in (ours["mask"], ours_kept["mask"], theirs_kept["mask"]))
        else:
            assert torch.equal(theirs["mask"] & keep, ours["mask"] & keep), f"step {_step}: masks differ"
            check_kept_rows(ours["mask"], ours_kept["mask"], lens, width)
            check_kept_rows(theirs["mask"], theirs_kept["mask"], lens, width)
        same_outcome(theirs, ours)
        same_outcome(ours, ours_kept)
        same_outcome(theirs, theirs_kept)
        # Never accepted past the verify length.
        assert bool((ours["correct_len"] <= lens.to(ours["correct_len"].dtype) - 1).all())
        describe(theirs_g, ids, lens, ours["correct_len"], budget, gamma)
        kept_t = advance(theirs_reqs, theirs, width)
        kept_o = advance(ours_reqs, ours, width)
        assert kept_t == kept_o
        for rt, ro in zip(theirs_reqs, ours_reqs, strict=True):
            assert (rt.to_finish is None) and (ro.to_finish is None), (rt.to_finish, ro.to_finish)
            if rt.grammar is not None:
                assert rt.grammar.is_terminated() == ro.grammar.is_terminated()
        if planner is not None and plan is not None:
            planner.observe(plan, ours["correct_len"])


def describe(
    grammars: list[Any], ids: torch.Tensor, lens: torch.Tensor, correct: torch.Tensor, budget: int, gamma: int
) -> None:
    """Hypothesis statistics (``--hypothesis-show-statistics``): which situations the examples reached."""
    bs = ids.shape[0]
    event(f"budget {'0' if budget == 0 else 'full' if budget >= bs * gamma else 'ragged'}")
    if len(set(lens.tolist())) > 1:
        event("ragged verify lengths")
    if any(g is not None and g.is_terminated() for g in grammars):
        event("a finished grammar")
    if any(g is None for g in grammars):
        event("a request without grammar")
    if int(correct.max()) > 0:
        event("drafts accepted")


def check_plan(
    planner: DSparkBudgetPlanner, plan: Any, dm: maskplug.DraftMasks, confidence: torch.Tensor, bs: int, gamma: int
) -> None:
    """The scheduler's budget and SGLang's placement of it, checked against maskplug's own functions."""
    lens = plan.verify_lens.to(torch.int64)
    assert lens.shape == (bs,) and bool((lens >= 1).all()) and bool((lens <= gamma + 1).all())
    # SGLang's top-k ran on the grammar-corrected confidences with the scheduler's budget.
    again = ScheduleVerifyLensTopk.execute(confidence=plan.confidence, budget=plan.budget, cfg=planner.cfg)
    assert torch.equal(again.to(torch.int64), lens)
    acc = dict(zip(np.asarray(dm.request).tolist(), np.asarray(dm.acceptable).tolist(), strict=True))
    for i, a in acc.items():
        # A draft the grammar refuses is never given verify room (its corrected confidence is 0).
        assert int(lens[i]) - 1 <= a
        assert bool((plan.confidence[i, a:] == 0).all())
    name = getattr(planner.scheduler, "name", "")
    layout = maskplug.ScheduledLayout([f"r{i}" for i in range(bs)], [gamma] * bs, [1] * bs, num_bonus=1)
    host = confidence.to(torch.float64).numpy()
    if name == "dspark":
        assert plan.decision == maskplug.choose_budget(host, layout, planner.cost)
    if name == "grammar-aware" and getattr(planner.scheduler.inner, "name", "") == "dspark":
        assert plan.decision == maskplug.choose_budget(host, layout, planner.cost, grammar=dm)
        room = gamma * bs - sum(gamma - a for a in acc.values())
        assert plan.budget <= room
    if name == "no-spec":
        assert plan.budget == 0 and bool((lens == 1).all())


@given(seed=st.integers(0, 2**32 - 1))
def test_dspark_chain_agrees_with_sglangs_xgrammar(bpe_backends: tuple[Any, Any], seed: int) -> None:
    run_steps(bpe_backends, seed, None)


@pytest.mark.parametrize(
    "scheduler", ["dspark", "goodput", "verify-all", "no-spec", "grammar-aware:dspark", "grammar-aware:goodput"]
)
@given(seed=st.integers(0, 2**32 - 1))
def test_maskplug_scheduler_chooses_dspark_verify_lengths(
    bpe_backends: tuple[Any, Any], scheduler: str, seed: int
) -> None:
    run_steps(bpe_backends, seed, scheduler)
