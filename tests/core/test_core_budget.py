"""Budget selection, allocation and the cost model: worked examples with known answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import maskplug as mp
from maskplug import reference
from maskplug.kernels.torch_backend import TorchBackend


def _layout(num_drafts: list[int], num_non_draft: list[int] | None = None, num_bonus: int = 1) -> mp.ScheduledLayout:
    n = len(num_drafts)
    return mp.ScheduledLayout(list(range(n)), num_drafts, num_non_draft or [1] * n, num_bonus=num_bonus)


def _flat_cost(ms: float = 10.0) -> mp.CostModel:
    """Every step costs the same: more verified drafts are free."""
    return mp.CostModel.from_curves([(1, 1.0)], [(1, ms)], 64, 4096)


# --------------------------------------------------------------------------- choose_budget


def test_marginal_draft_stops_paying_at_a_cost_jump() -> None:
    # Four requests, four drafts each, 4 non-draft tokens. The target runs in
    # captured CUDA graphs of 8 and 16 tokens: up to 8 tokens cost 10 ms, 9..16
    # cost 24 ms. Verifying the first draft of each request fills the 8-token
    # graph; the fifth draft would push the step into the 16-token graph.
    layout = _layout([4, 4, 4, 4])
    cost = mp.CostModel.from_curves([(1, 0.0), (64, 0.0)], [(8, 10.0), (16, 24.0)], 64, 64, graph_limit=16)
    conf = np.full((4, 4), 0.9)
    d = mp.choose_budget(conf, layout, cost)
    assert d.budget == 4
    assert d.cost_ms == pytest.approx(10.0)
    assert d.expected_tokens == pytest.approx(4 + 4 * 0.9)
    assert d == reference.choose_budget(conf, layout, cost)
    # The best budget past the jump (all 12 drafts that fit in 16 tokens)
    # yields more tokens but fewer per millisecond.
    best_past = (4 + 4 * (0.9 + 0.81 + 0.729)) / 24.0
    assert d.expected_tokens / d.cost_ms > best_past
    # Without the jump the same confidences buy every draft.
    d_flat = mp.choose_budget(conf, layout, _flat_cost())
    assert d_flat.budget == 16


def test_max_logits_caps_the_budget() -> None:
    layout = _layout([4, 4, 4, 4])
    conf = np.full((4, 4), 0.9)
    assert mp.choose_budget(conf, layout, _flat_cost()).budget == 16
    # 4 bonus rows plus at most 5 drafts.
    d = mp.choose_budget(conf, layout, _flat_cost(), max_logits=9)
    assert d.budget == 5
    assert mp.choose_budget(conf, layout, _flat_cost(), max_logits=4).budget == 0
    with pytest.raises(mp.BudgetError, match="max_logits"):
        mp.choose_budget(conf, layout, _flat_cost(), max_logits=3)


def test_ties_go_to_the_smallest_budget() -> None:
    layout = _layout([3, 2])
    # Only the first draft of request 0 can be accepted; later drafts add
    # nothing and cost nothing, so b = 1, 2, ... 5 all tie: b = 1 wins.
    conf = np.array([[1.0, 0.0, 0.0], [0.0, 0.7, 0.7]])
    d = mp.choose_budget(conf, layout, _flat_cost())
    assert d.budget == 1
    assert d.expected_tokens == pytest.approx(3.0)
    # All-zero confidences: every budget ties with b = 0.
    assert mp.choose_budget(np.zeros((2, 3)), layout, _flat_cost()).budget == 0


def test_num_sampling_enters_the_estimate() -> None:
    layout = _layout([2, 2])
    conf = np.full((2, 2), 0.5)
    d = mp.choose_budget(conf, layout, _flat_cost(), num_sampling=7)
    assert d.budget == 4
    assert d.expected_tokens == pytest.approx(7 + 2 * 0.5 + 2 * 0.25)


def test_stale_confidences_are_accepted() -> None:
    """Confidences from an older step: wider than needed, junk past each request's drafts."""
    layout = _layout([2, 0, 3])
    fresh = np.array([[0.8, 0.4, 0.0], [0.0, 0.0, 0.0], [0.9, 0.9, 0.2]])
    stale = np.full((3, 6), np.nan)
    stale[0, :2] = fresh[0, :2]
    stale[2, :3] = fresh[2, :3]
    stale[1, :] = [7.0, -1.0, np.inf, np.nan, 2.0, 0.5]  # request 1 has no drafts this step
    cost = mp.CostModel.linear()
    want = mp.choose_budget(fresh, layout, cost)
    assert mp.choose_budget(stale, layout, cost) == want
    assert mp.choose_budget(torch.from_numpy(stale), layout, cost) == want
    assert mp.choose_budget(stale.tolist(), layout, cost) == want


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1.5, -0.01])
def test_bad_confidences_raise(bad: float) -> None:
    layout = _layout([2, 2])
    conf = np.full((2, 2), 0.5)
    conf[1, 1] = bad
    with pytest.raises(mp.BudgetError, match="confidences"):
        mp.choose_budget(conf, layout, mp.CostModel.linear())


def test_grammar_hints_zero_rejected_drafts_and_force_single_tokens() -> None:
    layout = _layout([3, 3])
    conf = np.full((2, 3), 0.5)
    hints = mp.DraftMasks(
        request=np.array([1, 0]),
        acceptable=np.array([3, 1]),  # request 0: the grammar rejects its second draft
        forced=np.array([[True, True, False, False], [False, False, False, False]]),
    )
    d = mp.choose_budget(conf, layout, _flat_cost(), grammar=hints)
    # Request 1's first two drafts are forced (survival 1, 1, 0.5); request 0
    # keeps only its first draft (0.5). Free verification takes all four
    # useful drafts and stops: the rest have survival 0 and ties go low.
    assert d.budget == 4
    assert d.expected_tokens == pytest.approx(2 + 1 + 1 + 0.5 + 0.5)
    assert d == reference.choose_budget(conf, layout, _flat_cost(), grammar=hints)


def test_choose_budget_empty_batch() -> None:
    layout = _layout([])
    d = mp.choose_budget(np.zeros((0, 0)), layout, mp.CostModel.linear())
    assert d.budget == 0 and d.expected_tokens == 0.0


# --------------------------------------------------------------------------- allocate


def test_allocate_breaks_ties_by_position_then_request() -> None:
    conf = torch.ones(3, 2)
    nd = torch.tensor([2, 2, 2])
    # All survivals are 1: position 0 of every request first, then position 1 of request 0.
    assert mp.allocate(conf, nd, 4).tolist() == [2, 1, 1]
    assert mp.allocate(conf, nd, 2).tolist() == [1, 1, 0]
    assert mp.allocate(conf, nd, torch.tensor(5)).tolist() == [2, 2, 1]
    assert mp.allocate(conf, nd, 0).tolist() == [0, 0, 0]


def test_allocate_follows_survival_not_confidence() -> None:
    # Request 0's second draft has confidence 1 but survival 0.3; request 1's
    # first draft (0.5) is ahead of it.
    conf = torch.tensor([[0.3, 1.0], [0.5, 0.1]])
    assert mp.allocate(conf, [2, 2], 1).tolist() == [0, 1]
    assert mp.allocate(conf, [2, 2], 2).tolist() == [1, 1]
    assert mp.allocate(conf, [2, 2], 3).tolist() == [2, 1]


def test_allocate_ignores_columns_past_the_drafts() -> None:
    conf = torch.tensor([[0.2, 0.9, 0.9], [1.0, 1.0, 1.0]])
    assert mp.allocate(conf, [1, 3], 2).tolist() == [0, 2]
    assert mp.allocate(conf, [1, 3], 4).tolist() == [1, 3]


def test_device_paths_never_read_device_data_on_the_host() -> None:
    """On the 'meta' device any host read (.item(), .tolist(), bool()) raises, so these run sync-free."""
    meta = torch.device("meta")
    conf = torch.empty(5, 4, device=meta)
    nd = torch.empty(5, dtype=torch.int64, device=meta)
    cap = mp.allocate(conf, nd, torch.empty((), dtype=torch.int64, device=meta))
    assert cap.device == meta and cap.shape == (5,) and cap.dtype == torch.int32
    cu = mp.active_cu_logits(cap, 1)
    assert cu.device == meta and cu.shape == (6,)
    logits = torch.empty(25, 300, device=meta)
    rows = torch.empty(25, dtype=torch.int32, device=meta)
    TorchBackend()._apply_device(logits, torch.empty(25, 10, dtype=torch.int32, device=meta), rows, rows, cu, 300, True)
    with pytest.raises(RuntimeError, match="meta"):  # the premise: a host read on meta fails
        cap.sum().item()


def test_active_cu_logits() -> None:
    cap = torch.tensor([0, 3, 1], dtype=torch.int64)
    assert mp.active_cu_logits(cap, 1).tolist() == [0, 1, 5, 7]
    assert mp.active_cu_logits(cap, 0).tolist() == [0, 0, 3, 4]
    assert mp.active_cu_logits(cap, 2).dtype == torch.int32


# --------------------------------------------------------------------------- cost model


def test_from_curves_is_made_monotone() -> None:
    cost = mp.CostModel.from_curves([(1, 1.0)], [(4, 5.0), (8, 3.0), (16, 6.0)], 8, 32)
    # The noisy 8-token sample (3 ms) is raised to the 4-token cost.
    assert cost.verify_ms(8) == pytest.approx(5.0)
    assert cost.verify_ms(12) == pytest.approx(5.5)
    ys = cost.verify_ms(np.arange(0, 33))
    assert np.all(np.diff(ys) >= 0)


def test_from_curves_step_function_up_to_graph_limit() -> None:
    samples = [(1, 2.0), (2, 2.5), (4, 3.0), (8, 4.0), (16, 6.0), (64, 12.0)]
    cost = mp.CostModel.from_curves([(1, 1.0)], samples, 8, 128, graph_limit=16)
    # Up to the limit a size costs what the next captured size costs.
    assert [cost.verify_ms(s) for s in (1, 2, 3, 4, 5, 8, 9, 16)] == [2.0, 2.5, 3.0, 3.0, 4.0, 4.0, 6.0, 6.0]
    # Above it, linear interpolation between samples.
    assert cost.verify_ms(40) == pytest.approx(9.0)
    # Past the last sample, linear extrapolation with the last segment's slope.
    assert cost.verify_ms(112) == pytest.approx(18.0)
    # Beyond the tabulated range the same formula applies.
    assert cost.verify_ms(1000) == pytest.approx(12.0 + (1000 - 64) * 6.0 / 48)
    # Arrays and scalars agree.
    sizes = np.array([3, 9, 40, 112, 1000])
    np.testing.assert_allclose(cost.verify_ms(sizes), [cost.verify_ms(int(s)) for s in sizes])


def test_from_curves_without_graphs_interpolates_everywhere() -> None:
    cost = mp.CostModel.from_curves([(1, 1.0), (9, 5.0)], [(16, 10.0), (32, 20.0)], 16, 64)
    assert cost.verify_ms(24) == pytest.approx(15.0)
    assert cost.verify_ms(8) == pytest.approx(10.0)  # flat below the first sample
    assert cost.verify_ms(48) == pytest.approx(30.0)
    assert cost.draft_ms(5) == pytest.approx(3.0)
    assert cost.draft_ms(17) == pytest.approx(9.0)  # past the table (16) and the samples
    # Unsorted samples mean the same curve.
    again = mp.CostModel.from_curves([(9, 5.0), (1, 1.0)], [(32, 20.0), (16, 10.0)], 16, 64)
    assert [again.verify_ms(s) for s in (8, 24, 48)] == [cost.verify_ms(s) for s in (8, 24, 48)]


def test_linear_cost_model() -> None:
    cost = mp.CostModel.linear(draft_base_ms=2, draft_per_req_ms=0.5, verify_base_ms=4, verify_per_token_ms=0.25)
    assert cost.draft_ms(8) == pytest.approx(6.0)
    assert cost.verify_ms(100) == pytest.approx(29.0)
    assert cost.verify_ms(100_000) == pytest.approx(4 + 25_000)
