"""``grammar-aware``: budgets corrected with the grammar producer's draft masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sched_testkit import Case, corrected, oracle_cap, oracle_rate, steps

import maskplug as mp
from maskplug import reference
from maskplug.schedulers import GoodputScheduler, GrammarAwareScheduler

COST = mp.CostModel.linear(draft_base_ms=0.0, draft_per_req_ms=0.0, verify_base_ms=1.0, verify_per_token_ms=0.25)


def masks(request: list[int], acceptable: list[int], forced: list[list[bool]]) -> mp.DraftMasks:
    return mp.DraftMasks(np.array(request), np.array(acceptable), np.array(forced, dtype=bool))


def test_verifies_deeper_into_a_forced_span_than_dspark() -> None:
    # A confident prefix, then six positions the grammar forces to one token
    # (say the rest of a JSON key and its colon), where the drafter itself is unsure.
    lay = mp.ScheduledLayout(["req"], [8], [1])
    stale = np.array([[0.95, 0.9, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    forced = [[False, False, True, True, True, True, True, True, False]]
    view = mp.StepView(lay, COST, confidences=stale, grammar=masks([0], [8], forced))
    blind = mp.get_scheduler("dspark").budget(view)
    aware = mp.get_scheduler("grammar-aware", inner="dspark").budget(view)
    # by hand: blind survivals .95 .855 .4275 .21375 -> b=3 (3.2325 tokens / 2 ms) beats b=2 and b=4;
    # aware survivals .95 .855 .855 ... -> all 8 drafts, 1 + .95 + 7·.855 = 6.935 tokens / 3.25 ms
    assert blind.budget == 3
    assert aware.budget == 8
    assert aware.expected_tokens == pytest.approx(1 + 0.95 + 7 * 0.855)
    assert aware.cost_ms == pytest.approx(3.25)
    live = torch.tensor(stale, dtype=torch.float32)
    assert mp.allocate_step(view, live, aware.budget).tolist() == [8]
    assert mp.allocate_step(view, live, blind.budget).tolist() == [3]


def test_spends_nothing_on_drafts_the_grammar_rejects() -> None:
    # request 0: the grammar rejects its third draft; request 1 has no grammar.
    lay = mp.ScheduledLayout([10, 11], [6, 3], [1, 1])
    stale = np.full((2, 6), 0.99)
    view = mp.StepView(lay, COST, confidences=stale, grammar=masks([0], [2], [[False] * 7]))
    assert mp.get_scheduler("dspark").budget(view).budget == 9
    aware = mp.get_scheduler("grammar-aware").budget(view)
    assert aware.budget == 5
    cap = mp.allocate_step(view, torch.tensor(stale), aware.budget)
    assert cap.tolist() == [2, 3]
    # the plain allocation would have admitted rejected drafts of request 0 first (position order)
    assert mp.allocate(torch.tensor(stale), lay.num_drafts, 5).tolist() == [3, 2]
    # a grammar-blind budget still sums exactly: the accepted drafts first, then rejected ones
    assert mp.allocate_step(view, torch.tensor(stale), 6).tolist() == [3, 3]
    assert mp.allocate_step(view, torch.tensor(stale), torch.tensor(9)).tolist() == [6, 3]
    assert mp.allocate_step(view, torch.tensor(stale), torch.tensor(4)).tolist() == [2, 2]
    with pytest.raises(mp.BudgetError, match="budget"):
        mp.allocate_step(view, torch.tensor(stale), 10)


def test_wrapping_a_scheduler_without_beliefs_trims_rejected_drafts() -> None:
    lay = mp.ScheduledLayout([1, 2, 3], [4, 4, 0], [1, 1, 5])
    g = masks([1, 0], [1, 4], [[False] * 5, [False, True, True, True, False]])
    view = mp.StepView(lay, COST, grammar=g)
    assert mp.get_scheduler("verify-all").budget(view).budget == 8
    d = mp.get_scheduler("grammar-aware", inner="verify-all").budget(view)
    assert d.budget == 5
    assert np.isnan(d.expected_tokens)  # no confidences anywhere: unknown, not invented
    assert mp.get_scheduler("grammar-aware", inner="no-spec").budget(view).budget == 0
    # with confidences, the expected tokens count the grammar's certainty
    conf = np.full((3, 4), 0.5)
    d = mp.get_scheduler("grammar-aware", inner="verify-all").budget(
        mp.StepView(lay, COST, confidences=conf, grammar=g)
    )
    # request 0: 0.5, then forced 1,1,1 -> survivals .5 .5 .5 .5; request 1: .5 (only one acceptable)
    assert d.expected_tokens == pytest.approx(3 + 5 * 0.5)


def test_without_draft_masks_it_is_the_wrapped_scheduler() -> None:
    lay = mp.ScheduledLayout([1, 2], [5, 2], [1, 1])
    view = mp.StepView(lay, COST, confidences=np.array([[0.9, 0.8, 0.7, 0.6, 0.5], [0.9, 0.2, 0, 0, 0]]))
    for inner in ("dspark", "verify-all", "no-spec", "goodput"):
        assert mp.get_scheduler("grammar-aware", inner=inner).budget(view) == mp.get_scheduler(inner).budget(view)


def _beliefs(inner: object, case: Case) -> np.ndarray | None:
    if isinstance(inner, GoodputScheduler):
        return inner.beliefs(case.view)
    return case.view.confidences


@st.composite
def wrapped(draw: st.DrawFn) -> tuple[object, Case]:
    """A grammar step and a wrapped scheduler; goodput gets some random history first."""
    case = draw(steps(with_grammar=True))
    name = draw(st.sampled_from(["dspark", "goodput", "verify-all", "no-spec"]))
    inner = mp.get_scheduler(name)
    if name == "goodput":
        lay = case.view.layout
        for _ in range(draw(st.integers(0, 3))):
            v = np.array(draw(st.lists(st.integers(0, 6), min_size=lay.n, max_size=lay.n)), dtype=np.int64)
            frac = np.array(draw(st.lists(st.floats(0, 1), min_size=lay.n, max_size=lay.n)))
            inner.observe(mp.StepOutcome(lay.req_ids, v, np.floor(frac * v).astype(np.int64)))
    return inner, case


@given(wrapped())
def test_grammar_aware_never_loses_to_the_wrapped_decision(arg: tuple[object, Case]) -> None:
    """Scored with grammar-corrected survivals, its tokens per ms are >= the wrapped scheduler's own choice."""
    inner, case = arg
    view, lay, g = case.view, case.view.layout, case.view.grammar
    assert g is not None
    mine = inner.budget(view)  # type: ignore[attr-defined]
    aware = GrammarAwareScheduler(inner=inner).budget(view)  # type: ignore[arg-type]
    belief = _beliefs(inner, case)
    rows = corrected(belief, lay, g)
    e_in, c_in = oracle_rate(view, rows, mine.budget)
    e_aw, c_aw = oracle_rate(view, rows, aware.budget)
    assert e_aw / c_aw >= e_in / c_in * (1 - 1e-12)
    assert aware.expected_tokens == pytest.approx(e_aw, rel=1e-12, abs=1e-12)
    assert aware.cost_ms == pytest.approx(c_aw, rel=1e-12)

    # never budgets past what the grammar accepts, nor past the row limit
    room = 0
    grammar_of = dict(zip(g.request.tolist(), g.acceptable.tolist(), strict=True))
    for r in range(lay.n):
        room += min(int(lay.num_drafts[r]), grammar_of.get(r, int(lay.num_drafts[r])))
    assert 0 <= aware.budget <= min(room, oracle_cap(view))

    # and the device allocation, from grammar-corrected live confidences, admits no rejected draft
    live = torch.tensor(case.live)
    cap = mp.allocate_step(view, live, aware.budget).tolist()
    assert sum(cap) == aware.budget
    for r in range(lay.n):
        assert cap[r] <= grammar_of.get(r, int(lay.num_drafts[r]))
    live_rows = corrected(case.live, lay, g)
    padded = np.zeros((lay.n, case.live.shape[1]))
    limits = [0] * lay.n
    for r, row in enumerate(live_rows):
        limits[r] = min(len(row), grammar_of.get(r, len(row)))
        padded[r, : len(row)] = row
    assert cap == reference.allocate(padded, limits, aware.budget)


def test_allocate_step_validation() -> None:
    lay = mp.ScheduledLayout([1, 2], [2, 2], [1, 1])
    view = mp.StepView(lay, COST, grammar=masks([1], [1], [[False] * 3]))
    with pytest.raises(mp.BudgetError, match="step: expected a StepView"):
        mp.allocate_step("view", torch.ones((2, 2)), 1)  # type: ignore[arg-type]
    with pytest.raises(mp.BudgetError, match="confidences: expected 2 rows"):
        mp.allocate_step(view, torch.ones((3, 2)), 1)
    with pytest.raises(mp.BudgetError, match="floating"):
        mp.allocate_step(view, torch.ones((2, 2), dtype=torch.int32), 1)
    with pytest.raises(mp.BudgetError, match="budget: expected an int"):
        mp.allocate_step(view, torch.ones((2, 2)), 1.5)  # type: ignore[arg-type]
    with pytest.raises(mp.BudgetError, match="budget: expected 0 <= budget"):
        mp.allocate_step(view, torch.ones((2, 2)), -1)
    # fp16 and bf16 live confidences give the same capacities as fp32
    live = torch.tensor([[0.5, 0.25], [0.75, 0.5]])
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        for b in range(5):
            assert mp.allocate_step(view, live.to(dt), b).tolist() == mp.allocate_step(view, live, b).tolist()
