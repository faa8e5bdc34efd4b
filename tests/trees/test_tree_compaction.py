"""compact_tree and the unchanged mask kernels on tree mappings, against maskplug.reference, every regime."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tree_cases import TreeCase, grammar_rows, tree_cases

from maskplug import (
    BudgetError,
    DraftTree,
    LayoutError,
    ScheduledLayout,
    apply_grammar_bitmask,
    compact,
    compact_tree,
    reference,
    select_subtree,
)

BACKENDS = ["torch"]
VOCAB = 70  # three mask words, the last one partly used


def _regime_budget(case: TreeCase, regime: str, seed: int) -> int:
    total = case.tree.layout.total_drafts
    if regime == "zero":
        return 0
    if regime == "full":
        return total
    return random.Random(seed).randint(0, total)


@given(tree_cases(), st.sampled_from(["zero", "partial", "full"]), st.integers(0, 2**31))
def test_compact_tree_matches_reference(case: TreeCase, regime: str, seed: int) -> None:
    b = _regime_budget(case, regime, seed)
    keep = select_subtree(case.conf, case.tree, b, case.grammar)
    got = compact_tree(case.tree, keep)
    lay = case.tree.layout
    per_req = [keep[case.tree.cu_nodes[r] : case.tree.cu_nodes[r + 1]].tolist() for r in range(lay.n)]
    want = reference.compact_tree(case.tree, per_req)
    for name, value in want.items():
        assert getattr(got, name).tolist() == value, name
    assert got.num_tokens == int(lay.num_non_draft.sum()) + b
    assert got.regime == reference.compact(lay, b).regime
    # The same offsets the chain compaction gives for these capacities.
    assert got.cu_logits.tolist() == compact(lay, b, got.capacity).cu_logits.tolist()


def _expected_apply(case: TreeCase, rows_map, bm: np.ndarray, logits: torch.Tensor, comp, vocab: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Independent oracle: each live logits row (root, kept node, bonus) masked by the scheduled row of its position."""
    out = logits.clone()
    lay = case.tree.layout
    req, pos = rows_map.request.tolist(), rows_map.position.tolist()
    for i, (r, p) in enumerate(zip(req, pos, strict=True)):
        if r < 0:
            continue
        k = int(lay.num_drafts[r])
        if 1 <= p <= k:
            flat = int(case.tree.cu_nodes[r]) + p - 1
            if not comp.keep[flat]:
                continue
            live = int(comp.live_position[flat])
        elif p == 0:
            live = 0
        else:
            live = int(comp.capacity[r]) + p - k
        if live >= int(comp.cu_logits[r + 1] - comp.cu_logits[r]):
            continue
        row = int(comp.cu_logits[r]) + live
        for t in range(out.shape[1]):
            if t >= vocab or not reference.token_allowed(bm[i], t):
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@given(
    tree_cases(max_req=4, max_nodes=7),
    st.sampled_from(["zero", "partial", "full"]),
    st.sampled_from(["ragged", "fixed"]),
    st.integers(0, 2**31),
)
def test_apply_with_tree_mappings_matches_reference(
    backend: str, case: TreeCase, regime: str, mode: str, seed: int
) -> None:
    rng = random.Random(seed)
    lay = case.tree.layout
    b = _regime_budget(case, regime, seed)
    keep = select_subtree(case.conf, case.tree, b, case.grammar)
    comp = compact_tree(case.tree, keep)
    rows = grammar_rows(rng, lay, mode)
    sched = case.tree.mapping(rows)
    live = comp.live_mapping(sched, case.tree)
    n_rows = len(sched)
    g = torch.Generator().manual_seed(seed)
    bm = torch.randint(-(2**31), 2**31 - 1, (n_rows, 3), dtype=torch.int32, generator=g)
    total_logits = int(comp.cu_logits[-1])
    logits = torch.randn(total_logits, 72, generator=g)
    fast = logits.clone()
    apply_grammar_bitmask(fast, bm, live, comp.cu_logits, vocab_size=VOCAB, backend=backend)
    slow = logits.clone()
    reference.apply_grammar_bitmask(slow, bm, live, comp.cu_logits, vocab_size=VOCAB)
    assert torch.equal(fast, slow)
    assert torch.equal(fast, _expected_apply(case, sched, bm.numpy(), logits, comp, VOCAB))


@given(tree_cases(max_req=4, max_nodes=7, grammar=False), st.integers(0, 2**31), st.sampled_from(["ragged", "fixed"]))
def test_chain_as_tree_applies_like_the_chain(case: TreeCase, seed: int, mode: str) -> None:
    """A chain's kept subtree is a prefix: its live mapping masks exactly what the chain mapping does."""
    lay = case.tree.layout
    chain = DraftTree.chain(lay)
    b = random.Random(seed).randint(0, lay.total_drafts)
    if lay.num_bonus > 1:
        # Extra bonus rows follow the kept nodes in a tree (the last kept node's position + 1 on);
        # a trimmed chain keeps them at their scheduled positions. Both agree when nothing is trimmed.
        b = lay.total_drafts
    keep = select_subtree(case.conf, chain, b)
    comp = compact_tree(chain, keep)
    cap = reference.allocate(torch.tensor(case.conf), lay.num_drafts, b) if case.conf.size else [0] * lay.n
    assert comp.capacity.tolist() == list(cap)
    rows = grammar_rows(random.Random(seed), lay, mode)
    sched = chain.mapping(rows)
    g = torch.Generator().manual_seed(seed)
    bm = torch.randint(-(2**31), 2**31 - 1, (len(sched), 3), dtype=torch.int32, generator=g)
    logits = torch.randn(int(comp.cu_logits[-1]), 72, generator=g)
    a, c = logits.clone(), logits.clone()
    apply_grammar_bitmask(a, bm, comp.live_mapping(sched, chain), comp.cu_logits, vocab_size=VOCAB)
    apply_grammar_bitmask(c, bm, sched, compact(lay, b, comp.capacity).cu_logits, vocab_size=VOCAB)
    assert torch.equal(a, c)


def test_budget_zero_with_whole_trees_scheduled() -> None:
    lay = ScheduledLayout(["a", "b", "c"], [5, 0, 3], [1, 1, 1])
    tree = DraftTree(lay, [[-1, -1, 0, 0, 1], [], [-1, 0, -1]])
    comp = compact_tree(tree, np.zeros(8, dtype=bool))
    assert comp.regime == "zero"
    assert comp.cu_logits.tolist() == [0, 1, 2, 3]
    assert comp.kept_node.size == 0
    rows = grammar_rows(random.Random(1), lay, "ragged")
    live = comp.live_mapping(tree.mapping(rows), tree)
    # Only the root rows survive, each at its request's single logits row.
    assert sorted(
        zip(live.request[live.request >= 0].tolist(), live.position[live.request >= 0].tolist(), strict=True)
    ) == [(r, 0) for r in sorted(lay.index_of(i) for i in rows.grammar_req_ids.tolist())]


def test_kept_subtree_for_tree_attention() -> None:
    lay = ScheduledLayout(["a"], [6], [1])
    tree = DraftTree(lay, [[-1, -1, 0, 1, 2, 0]])
    keep = np.array([True, True, False, True, False, True])
    comp = compact_tree(tree, keep)
    assert comp.kept_node.tolist() == [0, 1, 3, 5]
    assert comp.kept_parent.tolist() == [-1, -1, 1, 0]
    assert comp.kept_depth.tolist() == [1, 1, 2, 2]
    assert comp.live_position.tolist() == [1, 2, -1, 3, -1, 4]
    assert comp.cu_logits.tolist() == [0, 5] and comp.regime == "partial"


def test_compact_tree_errors() -> None:
    lay = ScheduledLayout(["a"], [3], [1])
    tree = DraftTree(lay, [[-1, 0, 0]])
    with pytest.raises(BudgetError, match=r"keep: expected every kept node's parent kept, got node 2"):
        compact_tree(tree, np.array([False, False, True]))
    with pytest.raises(BudgetError, match=r"keep: expected 3 bool flags"):
        compact_tree(tree, np.array([1, 0, 1]))
    with pytest.raises(BudgetError, match=r"tree: expected a DraftTree"):
        compact_tree(lay, np.ones(3, bool))  # type: ignore[arg-type]
    comp = compact_tree(tree, np.ones(3, bool))
    other = DraftTree(ScheduledLayout(["a"], [2], [1]), [[-1, 0]])
    with pytest.raises(LayoutError, match=r"tree: expected the tree this compaction was built from"):
        comp.live_mapping(tree.mapping(grammar_rows(random.Random(0), lay, "ragged")), other)


@given(tree_cases(grammar=False), st.integers(0, 2**31))
def test_attention_mask_follows_the_kept_paths(case: TreeCase, seed: int) -> None:
    lay = case.tree.layout
    b = random.Random(seed).randint(0, lay.total_drafts)
    comp = compact_tree(case.tree, select_subtree(case.conf, case.tree, b))
    for r in range(lay.n):
        m = comp.attention_mask(r)
        a, e = int(comp.cu_kept[r]), int(comp.cu_kept[r + 1])
        par = comp.kept_parent[a:e].tolist()
        assert m.shape == (e - a + 1, e - a + 1)
        for i in range(e - a):
            seen = {0, i + 1}
            q = par[i]
            while q >= 0:
                seen.add(q + 1)
                q = par[q]
            assert set(np.flatnonzero(m[i + 1]).tolist()) == seen
        assert np.flatnonzero(m[0]).tolist() == [0]
    with pytest.raises(LayoutError, match=r"r: expected"):
        comp.attention_mask(lay.n)
