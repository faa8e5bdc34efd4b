"""Step cost curves are non-decreasing, and the schedulers never buy drafts that are worth nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sched_testkit import cost_models, oracle_rate

import maskplug as mp
from maskplug import reference

# A profiled verify curve with a graph-capture limit between its two samples:
# up to the limit every size pads to the 100-token graph (3 ms); just above it
# the interpolation from the 1-token sample would give about 1.2 ms.
VERIFY = [(1, 1.0), (100, 3.0)]
DRAFT = [(1, 1.0)]


def _gap_model() -> mp.CostModel:
    return mp.CostModel.from_curves(DRAFT, VERIFY, max_reqs=8, max_tokens=128, graph_limit=10)


def test_a_graph_limit_between_samples_keeps_the_cost_non_decreasing() -> None:
    cost = _gap_model()
    got = [float(cost.verify_ms(s)) for s in range(0, 14)]
    assert got == [1.0, 1.0] + [3.0] * 12  # 11, 12, 13 tokens cost the padded 3 ms, not about 1.2 ms
    # from the next sample on, the interpolation is back above the padded cost
    assert float(cost.verify_ms(100)) == 3.0
    assert float(cost.verify_ms(128)) == pytest.approx(3.0 + 28 * 2.0 / 99)
    assert float(cost.verify_ms(1000)) == pytest.approx(3.0 + 900 * 2.0 / 99)  # past the table, same formula
    ys = cost.verify_ms(np.arange(0, 300))
    assert np.all(np.diff(ys) >= 0)


def test_every_draft_refused_by_the_grammar_gives_budget_zero_on_that_curve() -> None:
    """The fixed case a property once found: grammar-aware:dspark spent 5 drafts the grammar refused."""
    cost = _gap_model()
    lay = mp.ScheduledLayout([0], [5], [6])  # 6 tokens before any draft: budgets 0..5 span sizes 6..11
    refused = mp.DraftMasks(np.array([0]), np.array([0]), np.zeros((1, 6), dtype=bool))
    view = mp.StepView(lay, cost, confidences=np.full((1, 5), 0.9), grammar=refused)
    aware = mp.get_scheduler("grammar-aware", inner="dspark").budget(view)
    assert aware.budget == 0
    assert aware.expected_tokens == 1.0
    assert aware.cost_ms == pytest.approx(1.0 + 3.0)
    # and it is the oracle's choice with the grammar-corrected (all zero) confidences
    assert aware == reference.choose_budget(np.zeros((1, 5)), lay, cost)
    # the grammar-blind wrapped decision is unchanged by the fix: 5 confident drafts for the same 3 ms
    assert mp.get_scheduler("dspark").budget(view).budget == 5


@given(cost_models(), st.integers(0, 300))
def test_every_cost_model_is_non_decreasing(cost: mp.CostModel, start: int) -> None:
    sizes = np.arange(start, start + 300)
    for fn in (cost.draft_ms, cost.verify_ms):
        ys = np.asarray(fn(sizes))
        assert np.all(np.diff(ys) >= 0)
        # scalars (tabulated or not) agree with the array form
        assert [float(fn(int(s))) for s in sizes[::37]] == ys[::37].tolist()


@st.composite
def gap_curves(draw: st.DrawFn) -> mp.CostModel:
    """Profiled curves whose capture limit may fall anywhere, between samples included."""
    sizes = sorted(set(draw(st.lists(st.integers(0, 64), min_size=1, max_size=5))))
    vy = draw(st.lists(st.floats(0.1, 20.0), min_size=len(sizes), max_size=len(sizes)))  # unsorted: noisy samples
    return mp.CostModel.from_curves(
        [(1, draw(st.floats(0.0, 2.0)))],
        list(zip(sizes, vy, strict=True)),
        max_reqs=8,
        max_tokens=draw(st.integers(0, 96)),  # sizes past the table use the same formula
        graph_limit=draw(st.integers(0, 70)),
    )


@given(
    gap_curves(),
    st.lists(st.integers(0, 6), min_size=1, max_size=4),
    st.lists(st.integers(1, 20), min_size=4, max_size=4),
    st.data(),
)
def test_drafts_worth_nothing_are_never_verified(
    cost: mp.CostModel, nd: list[int], non_draft: list[int], data: st.DataObject
) -> None:
    """With every draft refused (or of zero confidence) each scheduler that optimises picks budget 0."""
    n = len(nd)
    lay = mp.ScheduledLayout(list(range(n)), nd, non_draft[:n])
    k = max(nd)
    conf = np.array(data.draw(st.lists(st.floats(0.0, 1.0), min_size=n * k, max_size=n * k))).reshape(n, k)
    refused = mp.DraftMasks(np.arange(n), np.zeros(n, dtype=np.int64), np.zeros((n, k + 1), dtype=bool))
    view = mp.StepView(lay, cost, confidences=conf, grammar=refused)
    for inner in ("dspark", "goodput", "verify-all"):
        d = mp.get_scheduler("grammar-aware", inner=inner).budget(view)
        assert d.budget == 0
    zero = mp.StepView(lay, cost, confidences=np.zeros((n, k)))
    assert mp.get_scheduler("dspark").budget(zero).budget == 0
    # the rate the scheduler reports is the oracle's at that budget
    est, ms = oracle_rate(zero, [[0.0] * d for d in nd], 0)
    assert mp.get_scheduler("dspark").budget(zero) == mp.BudgetDecision(0, est, ms)


class _Falling(mp.CostModel):
    """A cost model whose verify cost drops after 4 tokens (not a valid step cost)."""

    def __init__(self) -> None:  # no curves: both costs are its own
        pass

    def draft_ms(self, num_reqs: Any) -> Any:
        return 0.5

    def verify_ms(self, num_tokens: Any) -> Any:
        t = np.asarray(num_tokens)
        return np.where(t <= 4, 5.0, 1.0)


def test_a_subclass_with_a_falling_cost_is_refused() -> None:
    lay = mp.ScheduledLayout(["a"], [6], [1])
    with pytest.raises(
        mp.BudgetError, match=r"cost: expected step costs non-decreasing.*got 5.5 ms at budget 3 and 1.5 ms at budget 4"
    ):
        mp.choose_budget(np.full((1, 6), 0.5), lay, _Falling())
    view = mp.StepView(lay, _Falling(), confidences=np.full((1, 6), 0.5))
    with pytest.raises(mp.BudgetError, match="non-decreasing"):
        mp.get_scheduler("dspark").budget(view)
