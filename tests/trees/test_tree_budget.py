"""Tree layout checks, node values, the tree budget and the kept subtree, against maskplug.reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tree_cases import TreeCase, tree_cases

from maskplug import (
    BudgetError,
    CostModel,
    DraftMasks,
    DraftTree,
    LayoutError,
    ScheduledLayout,
    TreeMasks,
    allocate,
    choose_budget,
    choose_tree_budget,
    compact_tree,
    node_values,
    reference,
    select_subtree,
)

COSTS = [
    CostModel.linear(),
    CostModel.linear(verify_base_ms=1.0, verify_per_token_ms=0.5),
    CostModel.from_curves([(0, 1.0), (64, 2.0)], [(0, 4.0), (8, 4.0), (16, 6.0), (64, 9.0)], 64, 4096, graph_limit=16),
]


def _flat(values: list[list[float]]) -> np.ndarray:
    return np.array([v for row in values for v in row], dtype=np.float64)


# ---- layout -----------------------------------------------------------------------------------


def test_parents_validated_naming_the_node() -> None:
    lay = ScheduledLayout(["a", "b"], [3, 2], [1, 1])
    with pytest.raises(LayoutError, match=r"parents\[0\]\[1\]: expected a parent index in \[-1, 1\).*got 1"):
        DraftTree(lay, [[-1, 1, 0], [-1, 0]])
    with pytest.raises(LayoutError, match=r"parents\[1\]\[0\].*got -2"):
        DraftTree(lay, [[-1, 0, 0], [-2, 0]])
    with pytest.raises(LayoutError, match=r"parents\[1\]: expected num_drafts = 2 parent indices, got 3"):
        DraftTree(lay, [[-1, 0, 0], [-1, 0, 1]])
    with pytest.raises(LayoutError, match=r"parents: expected 5 parent indices"):
        DraftTree(lay, np.array([-1, 0, 0, -1]))
    with pytest.raises(LayoutError, match=r"parents: expected integer parent indices"):
        DraftTree(lay, np.array([-1.0, 0, 0, -1, 0]))
    with pytest.raises(LayoutError, match=r"parents: expected one sequence per request \(2\)"):
        DraftTree(lay, [[-1, 0, 0]])
    with pytest.raises(LayoutError, match=r"layout: expected a ScheduledLayout"):
        DraftTree("x", [[]])  # type: ignore[arg-type]
    # A cycle is a forward (or self) reference, refused the same way.
    with pytest.raises(LayoutError, match=r"parents\[0\]\[0\].*got 0"):
        DraftTree(lay, [[0, 0, 1], [-1, 0]])


def test_tree_shape_depth_and_chains() -> None:
    lay = ScheduledLayout([7, 8, 9], [4, 3, 0], [1, 1, 1])
    t = DraftTree(lay, np.array([-1, -1, 0, 2, -1, 0, 1]))
    assert t.parents_of(0).tolist() == [-1, -1, 0, 2]
    assert t.depths_of(0).tolist() == [1, 1, 2, 3]
    assert t.depths_of(1).tolist() == [1, 2, 3]
    assert t.is_chain.tolist() == [False, True, True]
    c = DraftTree.chain(lay)
    assert c.parents.tolist() == [-1, 0, 1, 2, -1, 0, 1]
    assert c.is_chain.all()


@given(tree_cases(grammar=False), st.sampled_from(["ragged", "fixed"]), st.integers(0, 2**31))
def test_mapping_is_the_scheduled_mapping(case: TreeCase, mode: str, seed: int) -> None:
    import random

    from tree_cases import grammar_rows

    rows = grammar_rows(random.Random(seed), case.tree.layout, mode)
    m = case.tree.mapping(rows)
    ref = reference.mapping(rows, case.tree.layout)
    assert m.request.tolist() == ref.request.tolist() and m.position.tolist() == ref.position.tolist()
    nodes = case.tree.row_nodes(rows)
    for i, (r, p) in enumerate(zip(m.request.tolist(), m.position.tolist(), strict=True)):
        if r < 0:
            assert nodes[i] == -2
        else:
            assert nodes[i] == min(p, int(case.tree.layout.num_drafts[r])) - 1


# ---- node values and the budget ----------------------------------------------------------------


@given(tree_cases())
def test_node_values_match_reference(case: TreeCase) -> None:
    got = node_values(case.conf, case.tree, case.grammar)
    want = _flat(reference.tree_node_values(case.conf, case.tree, case.grammar))
    # Products run from the root down, as in the reference: bit for bit.
    assert got.tolist() == want.tolist()
    # A node is never worth more than its parent.
    cu = case.tree.cu_nodes
    par = case.tree.parents
    for i in range(got.shape[0]):
        r = int(np.searchsorted(cu, i, side="right") - 1)
        if par[i] >= 0:
            assert got[i] <= got[cu[r] + par[i]]


@given(tree_cases(), st.sampled_from(range(len(COSTS))), st.booleans(), st.integers(0, 6))
def test_choose_tree_budget_matches_reference(case: TreeCase, ci: int, limit: bool, slack: int) -> None:
    lay = case.tree.layout
    max_logits = lay.n * lay.num_bonus + slack if limit else None
    got = choose_tree_budget(case.conf, case.tree, COSTS[ci], grammar=case.grammar, max_logits=max_logits)
    want = reference.choose_tree_budget(case.conf, case.tree, COSTS[ci], grammar=case.grammar, max_logits=max_logits)
    assert got.budget == want.budget
    assert got.expected_tokens == pytest.approx(want.expected_tokens, rel=1e-12)
    assert got.cost_ms == pytest.approx(want.cost_ms, rel=1e-12)


@given(tree_cases(), st.integers(0, 60))
def test_select_subtree_matches_greedy_reference(case: TreeCase, b: int) -> None:
    total = case.tree.layout.total_drafts
    b = min(b, total)
    keep = select_subtree(case.conf, case.tree, b, case.grammar)
    want = reference.select_subtree(case.conf, case.tree, b, case.grammar)
    assert keep.tolist() == [x for row in want for x in row]
    assert int(keep.sum()) == b
    par = case.tree.parents
    cu = case.tree.cu_nodes
    for i in np.flatnonzero(keep).tolist():
        r = int(np.searchsorted(cu, i, side="right") - 1)
        assert par[i] < 0 or keep[cu[r] + par[i]]
    # Expected accepted tokens of the kept subtree: the sum of the b best node values.
    vals = node_values(case.conf, case.tree, case.grammar)
    assert float(vals[keep].sum()) == pytest.approx(float(np.sort(vals)[::-1][:b].sum()), rel=1e-12, abs=1e-15)


def _as_draft_masks(g: TreeMasks | None, lay: ScheduledLayout) -> tuple[DraftMasks | None, TreeMasks | None]:
    """Chain grammar flags as DraftMasks and as the equivalent TreeMasks (valid = the accepted prefix)."""
    if g is None:
        return None, None
    width = g.valid.shape[1]
    acc = []
    for i, r in enumerate(g.request.tolist()):
        k = int(lay.num_drafts[r])
        v = g.valid[i, :k]
        acc.append(int(np.argmin(v)) if not v.all() else k)
    cols = np.arange(width)[None, :]
    valid = cols < np.array(acc)[:, None]
    return (
        DraftMasks(g.request.copy(), np.array(acc, dtype=np.int64), g.forced.copy()),
        TreeMasks(g.request.copy(), valid, g.forced & valid),
    )


@given(tree_cases(), st.sampled_from(range(len(COSTS))), st.integers(0, 60))
def test_chain_as_tree_gives_the_chain_budget(case: TreeCase, ci: int, b: int) -> None:
    lay = case.tree.layout
    chain = DraftTree.chain(lay)
    dm, tm = _as_draft_masks(case.grammar, lay)
    got = choose_tree_budget(case.conf, chain, COSTS[ci], grammar=tm)
    want = choose_budget(case.conf, lay, COSTS[ci], grammar=dm)
    assert got == want  # bit for bit: the same survivals, sums and costs
    if dm is None and case.conf.shape[1]:
        b = min(b, lay.total_drafts)
        keep = select_subtree(case.conf, chain, b)
        cap = compact_tree(chain, keep).capacity
        live = allocate(torch.tensor(case.conf), lay.num_drafts, b)
        assert cap.tolist() == live.tolist()


def test_budget_errors_name_the_argument() -> None:
    lay = ScheduledLayout(["a"], [3], [1])
    t = DraftTree(lay, [[-1, -1, 0]])
    conf = np.full((1, 3), 0.5)
    with pytest.raises(BudgetError, match=r"confidences: expected probabilities in \[0, 1\]"):
        choose_tree_budget(np.array([[0.5, 1.5, 0.1]]), t, CostModel.linear())
    with pytest.raises(BudgetError, match=r"tree: expected a DraftTree"):
        choose_tree_budget(conf, lay, CostModel.linear())  # type: ignore[arg-type]
    with pytest.raises(BudgetError, match=r"cost: expected a CostModel"):
        choose_tree_budget(conf, t, None)  # type: ignore[arg-type]
    with pytest.raises(BudgetError, match=r"budget: expected 0 <= budget <= Σ num_drafts = 3, got 4"):
        select_subtree(conf, t, 4)
    with pytest.raises(BudgetError, match=r"max_logits: expected at least"):
        choose_tree_budget(conf, t, CostModel.linear(), max_logits=0)
    bad = TreeMasks(np.array([0]), np.array([[False, True, True]]), np.zeros((1, 3), bool))
    with pytest.raises(BudgetError, match=r"grammar.valid: expected a valid node's parent to be valid"):
        node_values(conf, t, bad)
    short = TreeMasks(np.array([0]), np.ones((1, 2), bool), np.zeros((1, 3), bool))
    with pytest.raises(BudgetError, match=r"grammar.valid: expected a bool array of shape \(1, >= 3\)"):
        choose_tree_budget(conf, t, CostModel.linear(), grammar=short)
    with pytest.raises(BudgetError, match=r"grammar.request: expected batch indices in \[0, 1\), got 3"):
        node_values(conf, t, TreeMasks(np.array([3]), np.ones((1, 3), bool), np.zeros((1, 3), bool)))
    with pytest.raises(BudgetError, match=r"grammar: expected TreeMasks"):
        node_values(conf, t, DraftMasks(np.array([0]), np.array([3]), np.zeros((1, 3), bool)))  # type: ignore[arg-type]


@given(tree_cases(), st.integers(0, 60), st.sampled_from(["float64", "float32"]), st.booleans())
def test_allocate_tree_keeps_what_select_subtree_keeps(case: TreeCase, b: int, dtype: str, tensor_budget: bool) -> None:
    from maskplug.trees import allocate_tree

    b = min(b, case.tree.layout.total_drafts)
    live = torch.tensor(case.conf, dtype=getattr(torch, dtype))
    host = live.to(torch.float64).numpy()
    got = allocate_tree(live, case.tree, torch.tensor(b) if tensor_budget else b, case.grammar)
    assert got.dtype == torch.bool
    assert got.tolist() == select_subtree(host, case.tree, b, case.grammar).tolist()


def test_allocate_tree_errors() -> None:
    from maskplug.trees import allocate_tree

    lay = ScheduledLayout(["a"], [3], [1])
    t = DraftTree(lay, [[-1, -1, 0]])
    with pytest.raises(BudgetError, match=r"confidences: expected probabilities in \[0, 1\]"):
        allocate_tree(torch.tensor([[0.5, float("nan"), 0.1]]), t, 1)
    with pytest.raises(BudgetError, match=r"confidences: expected shape \(1, >= 3\)"):
        allocate_tree(torch.zeros(1, 2), t, 1)
    with pytest.raises(BudgetError, match=r"confidences: expected a 2-D floating tensor"):
        allocate_tree(np.zeros((1, 3)), t, 1)  # type: ignore[arg-type]
    with pytest.raises(BudgetError, match=r"budget: expected 0 <= budget <= Σ num_drafts = 3, got 4"):
        allocate_tree(torch.zeros(1, 3), t, 4)


def test_cost_subclass_with_nan_or_falling_costs_is_refused() -> None:
    lay = ScheduledLayout(["a"], [3], [1])
    t = DraftTree(lay, [[-1, -1, 0]])
    conf = np.full((1, 3), 0.5)

    class NaNCost(CostModel):
        def verify_ms(self, num_tokens):  # type: ignore[no-untyped-def]
            return np.full(np.shape(num_tokens), np.nan)

    class Falling(CostModel):
        def verify_ms(self, num_tokens):  # type: ignore[no-untyped-def]
            return 10.0 - np.asarray(num_tokens, dtype=np.float64)

    base = CostModel.linear()
    with pytest.raises(BudgetError, match=r"cost: expected 4 finite step costs"):
        choose_tree_budget(conf, t, NaNCost(base._draft, base._verify))
    with pytest.raises(BudgetError, match=r"cost: expected step costs non-decreasing in the budget"):
        choose_tree_budget(conf, t, Falling(base._draft, base._verify))
