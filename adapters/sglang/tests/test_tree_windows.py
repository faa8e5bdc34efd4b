"""EAGLE draft-tree windows through maskplug's tree API, node by node against SGLang's own ``traverse_tree``.

Each example: a batch of SGLang windows (random draft trees with branches,
drafts the grammar allows, refuses, stop tokens, requests without a grammar,
ids past the vocabulary), filled once by :func:`maskplug_sglang.trees.fill_draft_trees`
and per request by SGLang's ``traverse_tree`` (``sglang.srt.speculative.spec_utils``,
imported as is) on our grammar objects and on SGLang's xgrammar objects. The
rows must agree bit for bit; the per-node validity must be what SGLang's
traversal accepted; the grammars must end where they started.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import test_spec_window as windows
import torch
from conftest import compile_pair, control_columns, grammar_keys
from hypothesis import given
from hypothesis import strategies as st
from maskplug_sglang.backend import MaskplugGrammar, allocate_mask
from maskplug_sglang.trees import fill_draft_trees, window_tree
from sglang.srt.speculative.spec_utils import traverse_tree

from maskplug import CostModel, LayoutError, choose_tree_budget, node_values, select_subtree

KEYS = grammar_keys()


def _accepted_by_traversal(
    nt: torch.Tensor, ns: torch.Tensor, toks: torch.Tensor, rows: torch.Tensor, eos: set[int], size: int
) -> list[bool]:
    """Which nodes SGLang's traversal accepted, read off its own rows: each node's bit in its parent's row."""
    w = toks.shape[0]
    acc = [False] * w
    acc[0] = True
    stack = [0]
    while stack:
        q = stack.pop()
        c = int(nt[q])
        while c != -1:
            t = int(toks[c])
            par_ok = acc[q] and (q == 0 or int(toks[q]) not in eos)
            acc[c] = par_ok and t < size and bool((int(rows[q][t >> 5]) >> (t & 31)) & 1)
            stack.append(c)
            c = int(ns[c])
    return acc


def _batch(bpe_backends: tuple[Any, Any], rng: np.random.Generator) -> tuple[Any, ...]:
    size = bpe_backends[1].vocab.vocab_size
    eos = bpe_backends[1].vocab.eos_ids[0]
    avoid = set(bpe_backends[1].vocab.special_ids) - {eos}
    batch, width = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    theirs_l: list[Any] = []
    ours_l: list[MaskplugGrammar | None] = []
    nt = np.full((batch, width), -1, dtype=np.int64)
    ns = np.full((batch, width), -1, dtype=np.int64)
    tk = np.zeros((batch, width), dtype=np.int64)
    for i in range(batch):
        theirs, ours = compile_pair(bpe_backends, KEYS[int(rng.integers(0, len(KEYS)))])
        a, b, c = windows._random_tree(rng, theirs, size, width, float(rng.choice([0.0, 0.2, 0.5])), avoid)
        nt[i], ns[i], tk[i] = a.numpy(), b.numpy(), c.numpy()
        if width > 1 and rng.random() < 0.15:
            tk[i, int(rng.integers(1, width))] = size + 3  # an id past the vocabulary (padded model vocabularies)
        if rng.random() < 0.2:
            theirs, ours = None, None
        theirs_l.append(theirs)
        ours_l.append(ours)
    return size, eos, batch, width, theirs_l, ours_l, nt, ns, tk


@pytest.mark.parametrize("strategy", ["auto", "walk"])
@given(seed=st.integers(0, 2**32 - 1))
def test_tree_windows_match_sglangs_traversal(bpe_backends: tuple[Any, Any], strategy: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    size, eos, batch, width, theirs_l, ours_l, nt, ns, tk = _batch(bpe_backends, rng)
    want = allocate_mask(size, batch * width)
    want_theirs = allocate_mask(size, batch * width)
    probes = []
    for i in range(batch):
        if ours_l[i] is None:
            continue
        span = slice(i * width, (i + 1) * width)
        args = (torch.from_numpy(nt[i]), torch.from_numpy(ns[i]), torch.from_numpy(tk[i]))
        traverse_tree(*args, ours_l[i], want[span], vocab_size=size)
        traverse_tree(*args, theirs_l[i], want_theirs[span], vocab_size=size)
        one = allocate_mask(size, 1)
        ours_l[i].fill_vocab_mask(one, 0)  # type: ignore[union-attr]
        probes.append((i, one))
    got = allocate_mask(size, batch * width)
    res = fill_draft_trees(ours_l, tk, nt, ns, got, vocab_size=size, strategy=strategy)
    assert torch.equal(got, want)
    keep = ~control_columns(bpe_backends[1].vocab)
    assert torch.equal(got & keep, want_theirs & keep)
    # Node by node: valid exactly where SGLang's traversal accepted the draft.
    for i in range(batch):
        if ours_l[i] is None:
            assert not res.valid[i].any()
            continue
        rows = want[i * width : (i + 1) * width]
        acc = _accepted_by_traversal(
            torch.from_numpy(nt[i]), torch.from_numpy(ns[i]), torch.from_numpy(tk[i]), rows, {eos}, size
        )
        assert res.valid[i].tolist() == acc
    # The grammars are where they started.
    for i, one in probes:
        again = allocate_mask(size, 1)
        ours_l[i].fill_vocab_mask(again, 0)  # type: ignore[union-attr]
        assert torch.equal(one, again)
    # The tree feeds the tree budget: refused nodes are worth nothing, kept subtrees are closed under parents.
    if res.tree.layout.total_drafts:
        conf = np.full((res.tree.n, int(res.tree.layout.num_drafts.max())), 0.7)
        vals = node_values(conf, res.tree, res.masks)
        for g in range(res.tree.n):
            a, b = int(res.tree.cu_nodes[g]), int(res.tree.cu_nodes[g + 1])
            assert (vals[a:b][~res.masks.valid[g, : b - a]] == 0).all()
        d = choose_tree_budget(conf, res.tree, CostModel.linear(), grammar=res.masks)
        kept = select_subtree(conf, res.tree, d.budget, res.masks)
        assert int(kept.sum()) == d.budget


def test_window_tree_orders_parents_first_and_checks_links() -> None:
    # Node 3 is linked before node 1 (children listed out of index order).
    nt = [3, -1, -1, 2]
    ns = [-1, -1, -1, 1]
    nodes, parents = window_tree(nt, ns, [0, 5, 6, 7])
    assert nodes.tolist() == [3, 2, 1]
    assert parents.tolist() == [-1, 0, -1]
    nodes, parents = window_tree(nt, ns, [0, 5, 6, 99], vocab_size=50)
    assert nodes.tolist() == [1] and parents.tolist() == [-1]
    with pytest.raises(LayoutError, match=r"retrieve_next_token: expected links forming a tree"):
        window_tree([1, 0], [-1, -1], [0, 1])


def test_bad_shapes_write_nothing(bpe_backends: tuple[Any, Any]) -> None:
    _, ours = compile_pair(bpe_backends, KEYS[0])
    size = ours.vocab.vocab_size
    mask = allocate_mask(size, 4)
    before = mask.clone()
    tk = np.zeros((2, 2), dtype=np.int64)
    with pytest.raises(LayoutError, match=r"grammars: expected one entry per request \(2\)"):
        fill_draft_trees([ours], tk, tk - 1, tk - 1, mask)
    with pytest.raises(LayoutError, match=r"retrieve_next_token, retrieve_next_sibling: expected the shape"):
        fill_draft_trees([ours, None], tk, np.zeros((2, 3), np.int64), tk, mask)
    with pytest.raises(LayoutError, match=r"vocab_mask: expected at least batch × W = 4 rows"):
        fill_draft_trees([ours, None], tk, tk - 1, tk - 1, mask[:3])
    with pytest.raises(LayoutError, match=r"links forming a tree"):
        fill_draft_trees([ours, None], tk, np.array([[1, 0], [-1, -1]]), tk - 1, mask)
    assert torch.equal(mask, before)
