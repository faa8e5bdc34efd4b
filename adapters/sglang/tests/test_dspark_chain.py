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

import functools
import types
from typing import Any

import numpy as np
import pytest
import torch
from conftest import allowed_ids, compile_pair, control_columns, grammar_keys
from hypothesis import event, given
from hypothesis import strategies as st
from maskplug_sglang.backend import MaskplugGrammar, allocate_mask
from maskplug_sglang.dspark import DSparkBudgetPlanner, build_verify_mask, fill_verify_rows
from sglang.kernels.ops.speculative.dspark.dspark_accept import AcceptGreedy, FinalizeAcceptLens
from sglang.kernels.ops.speculative.dspark.dspark_schedule import ScheduleVerifyLensTopk
from sglang.kernels.ops.speculative.dspark.dspark_verify_window import BuildOutTokens
from sglang.srt.environ import envs
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.speculative.dspark_components.dspark_planner import (
    DSparkScheduleConfig,
    HostConfidenceBudgetPlanner,
)
from sglang.srt.speculative.dspark_components.dspark_sps import SpsCostTable
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

import maskplug
from maskplug import CostModel

KEYS = grammar_keys()
BUDGETS = ("zero", "planner", "random", "full")
# The planner gets its (already lagged) confidences handed over, as from SGLang's relay ring,
# so it keeps no host carry of its own.
LAG = max(int(envs.SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS.get()), 1)


# -- the parts of SGLang's request/batch objects the verify chain reads -------------------
class Req:
    """The fields of SGLang's ``Req`` that the grammar steps read and write."""

    def __init__(self, rid: str, grammar: Any) -> None:
        self.rid = rid
        self.grammar = grammar
        self.is_retracted = False
        self.to_finish: Any = None

    def finished(self) -> bool:
        return False


class DecodeMode:
    def is_decode(self) -> bool:
        return True

    def is_extend(self) -> bool:
        return False


def decode_batch(reqs: list[Req]) -> Any:
    return types.SimpleNamespace(
        reqs=reqs, has_grammar=any(r.grammar is not None for r in reqs), forward_mode=DecodeMode()
    )


def result_processor() -> Any:
    """SGLang's batch-result processor methods on a bare object (the grammar steps use nothing else)."""
    proc = types.SimpleNamespace()
    proc._accept_grammar_tokens = functools.partial(SchedulerBatchResultProcessor._accept_grammar_tokens, proc)
    return proc


# -- random batches ---------------------------------------------------------------------------
def _allowed(g: Any, size: int, avoid: set[int]) -> np.ndarray:
    one = g.allocate_vocab_mask(size, 1, "cpu")
    g.fill_vocab_mask(one, 0)
    return np.array([t for t in allowed_ids(one[0], size) if t not in avoid], dtype=np.int64)


def make_batch(rng: np.random.Generator, backends: tuple[Any, Any], bs: int) -> tuple[list[Any], list[Any]]:
    """One grammar pair per request (or None), some advanced a little, some finished."""
    ours_backend = backends[1]
    size = ours_backend.vocab.vocab_size
    eos = ours_backend.vocab.eos_ids[0]
    avoid = set(ours_backend.vocab.special_ids)
    theirs_l: list[Any] = []
    ours_l: list[Any] = []
    for _ in range(bs):
        if rng.random() < 0.15:
            theirs_l.append(None)
            ours_l.append(None)
            continue
        theirs, ours = compile_pair(backends, KEYS[int(rng.integers(0, len(KEYS)))])
        assert isinstance(ours, MaskplugGrammar)
        finish = rng.random() < 0.15
        for _ in range(int(rng.integers(0, 4)) if not finish else 40):
            ok = _allowed(theirs, size, avoid)
            one = theirs.allocate_vocab_mask(size, 1, "cpu")
            theirs.fill_vocab_mask(one, 0)
            if finish and (int(one[0][eos >> 5]) >> (eos & 31)) & 1:
                theirs.accept_token(eos)
                ours.accept_token(eos)
                break
            if not ok.size:
                break
            t = int(rng.choice(ok))
            theirs.accept_token(t)
            ours.accept_token(t)
        assert theirs.is_terminated() == ours.is_terminated()
        theirs_l.append(theirs)
        ours_l.append(ours)
    return theirs_l, ours_l


def make_chain(rng: np.random.Generator, oracles: list[Any], size: int, width: int, avoid: set[int]) -> torch.Tensor:
    """``(bs, W)`` verify ids: a committed token, then drafts the grammar allows or (sometimes) refuses."""
    ids = np.zeros((len(oracles), width), dtype=np.int64)
    pool = np.array([t for t in range(size) if t not in avoid], dtype=np.int64)
    for i, g in enumerate(oracles):
        ids[i, 0] = int(rng.choice(pool))
        bad = float(rng.choice([0.0, 0.15, 0.5]))
        taken = 0
        for k in range(1, width):
            ok = np.zeros(0, dtype=np.int64) if g is None or g.is_terminated() else _allowed(g, size, avoid)
            if ok.size and rng.random() >= bad and taken == k - 1:
                t = int(rng.choice(ok))
                g.accept_token(t)
                taken += 1
            else:
                t = int(rng.choice(pool))
            ids[i, k] = t
        if g is not None and taken:
            g.rollback(taken)
    return torch.from_numpy(ids)


def make_logits(rng: np.random.Generator, ids: torch.Tensor, size: int, no_go: list[int]) -> torch.Tensor:
    """Target logits ``(bs*W, size)``: row ``k`` often prefers draft ``k+1``; control tokens never win."""
    bs, width = ids.shape
    logits = torch.from_numpy(rng.standard_normal((bs * width, size)).astype(np.float32))
    agree = float(rng.choice([0.5, 0.9, 1.0]))
    for i in range(bs):
        for k in range(width - 1):
            if rng.random() < agree:
                logits[i * width + k, int(ids[i, k + 1])] += 20.0
    if no_go:
        logits[:, no_go] = -1e4
    return logits


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


def run_verify(
    reqs: list[Req], ids: torch.Tensor, logits: torch.Tensor, lens: torch.Tensor, size: int, *, maskplug_rows: bool
) -> dict[str, Any]:
    """Mask, apply, accept and finalize one step; the grammars are not advanced."""
    bs, width = ids.shape
    sampling_info = types.SimpleNamespace(vocab_size=size, grammar_mask="stale")
    tree = GrammarTree.from_linear_chain(ids)
    if maskplug_rows:
        gm = build_verify_mask(
            reqs=reqs, tree=tree, sampling_info=sampling_info, device="cpu", barrier=None, verify_lens=lens
        )
    else:
        gm = build_grammar_vocab_mask(reqs=reqs, tree=tree, sampling_info=sampling_info, device="cpu", barrier=None)
    masked = logits.clone()
    if gm is not None:
        assert sampling_info.grammar_mask is None  # SGLang's convention: the extend stage's mask is dropped
        gm.apply(masked)
    correct_len, bonus, trim = AcceptGreedy.execute(
        candidates=ids, target_logits=masked, verify_num_draft_tokens=width, cutoff_verify_lens=lens
    )
    fin = FinalizeAcceptLens.execute(
        correct_len=correct_len, cap_trim_lens=trim, prefix_lens=torch.full((bs,), 10, dtype=torch.int64)
    )
    out = BuildOutTokens.execute(
        draft_tokens=ids[:, 1:], correct_len=correct_len, bonus=bonus, verify_num_draft_tokens=width, gamma=width - 1
    )
    return {
        "mask": None if gm is None else gm.vocab_mask,
        "correct_len": correct_len,
        "bonus": bonus,
        "commit_lens": fin.commit_lens,
        "out": out,
    }


def advance(reqs: list[Req], step: dict[str, Any], width: int) -> list[Any] | None:
    """SGLang's grammar barrier: ``advance_grammar_fsm`` over what the step committed."""
    result = GenerationBatchResult(
        next_token_ids=step["out"].reshape(-1),
        accept_lens=step["commit_lens"],
        speculative_num_draft_tokens=width,
    )
    batch = decode_batch(reqs)
    SchedulerBatchResultProcessor.advance_grammar_fsm(result_processor(), result, batch)
    assert result.grammar_advanced == batch.has_grammar
    return list(result.grammar_retained_tokens) if batch.has_grammar else None


def same_outcome(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in ("correct_len", "bonus", "commit_lens", "out"):
        assert torch.equal(a[k], b[k]), f"{k}: {a[k].tolist()} != {b[k].tolist()}"


def check_kept_rows(full: torch.Tensor, kept: torch.Tensor, lens: torch.Tensor, width: int) -> None:
    """maskplug's rows equal the full chain's where kept; rows past each verify length were not computed."""
    for i, n in enumerate(lens.tolist()):
        block = slice(i * width, i * width + n)
        assert torch.equal(kept[block], full[block]), f"request {i}: kept rows differ"
        assert bool((kept[i * width + n : (i + 1) * width] == -1).all()), f"request {i}: rows past {n} filled"


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
