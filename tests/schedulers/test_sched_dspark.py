"""The ``dspark`` scheduler on the cases that define it, and the two-step confidence pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sched_testkit import CONF, oracle_rate

import maskplug as mp
from maskplug import reference

# 1 ms fixed verify cost plus 0.25 ms per token; drafting is free. With one
# decode request the step costs 1.25 + 0.25·b ms.
COST = mp.CostModel.linear(draft_base_ms=0.0, draft_per_req_ms=0.0, verify_base_ms=1.0, verify_per_token_ms=0.25)


def one_request(conf: list[float]) -> mp.StepView:
    lay = mp.ScheduledLayout(["a"], [len(conf)], [1])
    return mp.StepView(lay, COST, confidences=np.array([conf]))


def test_budget_stops_where_the_marginal_draft_stops_paying() -> None:
    # survivals .9 .81 .729 .3645 .18225; est/cost by hand:
    #   b=0 1/1.25=.8  b=1 1.9/1.5=1.267  b=2 2.71/1.75=1.549  b=3 3.439/2=1.7195  b=4 3.8035/2.25=1.690
    # the 4th draft would add .3645 tokens for .25 ms, below the 1.7195 tokens/ms the step already makes.
    d = mp.get_scheduler("dspark").budget(one_request([0.9, 0.9, 0.9, 0.5, 0.5]))
    assert d.budget == 3
    assert d.expected_tokens == pytest.approx(3.439)
    assert d.cost_ms == pytest.approx(2.0)


@given(
    st.lists(st.lists(CONF, min_size=6, max_size=6), min_size=1, max_size=5),
    st.lists(st.integers(0, 6), min_size=5, max_size=5),
    st.floats(0.0, 2.0),
    st.floats(0.1, 10.0),
)
def test_marginal_rule_on_random_steps(rows: list[list[float]], nd: list[int], per_tok: float, base: float) -> None:
    """With a linear cost, dspark takes exactly the drafts whose survival pays for its own cost."""
    n = len(rows)
    lay = mp.ScheduledLayout(list(range(n)), nd[:n], [1] * n)
    cost = mp.CostModel.linear(
        draft_base_ms=0.0, draft_per_req_ms=0.0, verify_base_ms=base, verify_per_token_ms=per_tok
    )
    view = mp.StepView(lay, cost, confidences=np.array(rows))
    d = mp.get_scheduler("dspark").budget(view)
    conf_rows = [rows[r][: nd[r]] for r in range(n)]
    best = max(e / c for e, c in (oracle_rate(view, conf_rows, b) for b in range(lay.total_drafts + 1)))
    est, c = oracle_rate(view, conf_rows, d.budget)
    assert est / c == pytest.approx(best, rel=1e-12)
    if d.budget < lay.total_drafts:
        # one more draft never raises the rate (the next survival does not pay for per_tok ms)
        e1, c1 = oracle_rate(view, conf_rows, d.budget + 1)
        assert e1 / c1 <= est / c * (1 + 1e-12)
    if d.budget > 0:
        # the last admitted draft strictly paid for itself (ties go to the smaller budget)
        e0, c0 = oracle_rate(view, conf_rows, d.budget - 1)
        assert est / c > e0 / c0 * (1 - 1e-12)


def test_budget_capped_by_max_logits() -> None:
    lay = mp.ScheduledLayout([1, 2, 3], [4, 4, 4], [1, 1, 1], num_bonus=1)
    conf = np.ones((3, 4))
    free = mp.StepView(lay, COST, confidences=conf)
    assert mp.get_scheduler("dspark").budget(free).budget == 12  # certain drafts: verify them all
    for max_logits in (3, 4, 8, 14, 15, 100):
        view = mp.StepView(lay, COST, confidences=conf, max_logits=max_logits)
        b = mp.get_scheduler("dspark").budget(view).budget
        assert b == min(12, max_logits - 3)
        assert lay.n * lay.num_bonus + b <= max_logits
    with pytest.raises(mp.BudgetError, match="max_logits"):
        mp.StepView(lay, COST, confidences=conf, max_logits=2)


def test_budget_zero_when_confidences_are_low() -> None:
    lay = mp.ScheduledLayout([1, 2, 3, 4], [5, 5, 3, 0], [1, 1, 1, 7])
    conf = np.full((4, 5), 0.05)
    d = mp.get_scheduler("dspark").budget(mp.StepView(lay, COST, confidences=conf))
    assert d.budget == 0
    assert d.expected_tokens == 4.0
    assert d.cost_ms == pytest.approx(1.0 + 0.25 * 10)


def test_dspark_needs_confidences() -> None:
    lay = mp.ScheduledLayout([1], [3], [1])
    with pytest.raises(mp.BudgetError, match="goodput"):
        mp.get_scheduler("dspark").budget(mp.StepView(lay, COST))


def test_dspark_is_grammar_blind() -> None:
    # dspark ignores draft masks: that is grammar-aware's job.
    lay = mp.ScheduledLayout([1], [4], [1])
    conf = np.full((1, 4), 0.95)
    masks = mp.DraftMasks(np.array([0]), np.array([0]), np.zeros((1, 5), dtype=bool))
    blind = mp.get_scheduler("dspark").budget(mp.StepView(lay, COST, confidences=conf))
    with_masks = mp.get_scheduler("dspark").budget(mp.StepView(lay, COST, confidences=conf, grammar=masks))
    assert blind == with_masks and blind.budget == 4


def test_two_step_staleness_budget_from_t_minus_2_allocation_from_t() -> None:
    """The budget at step t is the one the confidences recorded at t-2 call for; allocation uses step t's."""
    slots = np.array([5, 2, 7])
    lay = mp.ScheduledLayout(["x", "y", "z"], [4, 4, 4], [1, 1, 1])
    hist = mp.ConfidenceHistory(num_slots=8, max_drafts=4)
    # Three regimes that call for three different budgets; each row differs so
    # that the allocation depends on which step's confidences it reads.
    level = [0.97, 0.75, 0.2]
    shape = np.array([[1.0, 0.98, 0.96, 0.94], [0.9, 1.0, 0.95, 1.0], [1.0, 1.0, 0.9, 0.85]])

    def live(t: int) -> np.ndarray:
        return np.minimum(1.0, level[t % 3] * np.roll(shape, t, axis=0))

    budgets = {t: reference.choose_budget(live(t), lay, COST).budget for t in range(3)}
    assert len(set(budgets.values())) == 3  # the regimes are told apart by the budget
    sched = mp.get_scheduler("dspark")
    differs = 0  # steps where allocating with the stale confidences would have chosen other drafts
    hist.reset(slots)
    for t in range(9):
        stale = hist.stale(slots)
        view = mp.StepView(lay, COST, confidences=stale)
        d = sched.budget(view)
        if t < 2:
            # nothing recorded two steps ago yet: new requests read as confidence 1
            assert np.array_equal(stale, np.ones((3, 4)))
            assert d.budget == 12
        else:
            np.testing.assert_array_equal(stale, live(t - 2).astype(np.float32).astype(np.float64))
            assert d.budget == budgets[(t - 2) % 3]
            assert d.budget != budgets[(t - 1) % 3] and d.budget != budgets[t % 3]
        cur = torch.tensor(live(t), dtype=torch.float32)
        cap = mp.allocate_step(view, cur, d.budget)
        assert cap.tolist() == reference.allocate(cur, lay.num_drafts, d.budget)
        assert int(cap.sum()) == d.budget
        if t >= 2 and reference.allocate(live(t - 2), lay.num_drafts, d.budget) != cap.tolist():
            differs += 1
        hist.record(slots, cur)
    assert differs > 0
