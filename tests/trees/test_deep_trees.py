"""Deep draft trees: depths, node values and the kept subtree of 32,000-node chains and paths.

Depth and node values once took one vectorised pass per tree level over
every node (quadratic in depth). The results here are compared with a
node-by-node computation (a node's depth is its parent's plus one, its value
its parent's times its confidence), itself checked against
:mod:`maskplug.reference` on small trees; values bit for bit.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_cases import tree_cases

from maskplug import DraftTree, ScheduledLayout, compact_tree, node_values, reference, select_subtree

DEEP = 32_000


def _sequential(tree: DraftTree, conf: np.ndarray) -> tuple[list[int], list[float]]:
    """Depth and value of every node, flat in batch order, one node at a time (parents come first)."""
    depth: list[int] = []
    value: list[float] = []
    for r in range(tree.n):
        a = int(tree.cu_nodes[r])
        for j, p in enumerate(tree.parents_of(r).tolist()):
            c = float(conf[r, j])
            if p < 0:
                depth.append(1)
                value.append(c)
            else:
                depth.append(depth[a + p] + 1)
                value.append(value[a + p] * c)
    return depth, value


@given(tree_cases(max_nodes=12, grammar=False))
def test_the_node_by_node_computation_is_the_reference(case) -> None:  # type: ignore[no-untyped-def]
    depth, value = _sequential(case.tree, case.conf)
    assert value == [v for row in reference.tree_node_values(case.conf, case.tree) for v in row]
    assert depth == [len(p) for r in range(case.tree.n) for p in _paths(case.tree.parents_of(r).tolist())]
    assert case.tree.depth.tolist() == depth
    assert node_values(case.conf, case.tree).tolist() == value


def _paths(parents: list[int]) -> list[list[int]]:
    out = []
    for j in range(len(parents)):
        path, q = [], j
        while q >= 0:
            path.append(q)
            q = parents[q]
        out.append(path)
    return out


def _deep_cases() -> dict[str, list[list[int]]]:
    rng = random.Random(7)
    caterpillar = [-1]
    for j in range(1, DEEP):  # a long spine with a leaf off every tenth node
        caterpillar.append(j - 1 if j % 10 else max(j - 2, -1))
    return {
        "chain": [list(range(-1, DEEP - 1))],
        "two roots then a chain": [[-1, -1, *range(1, DEEP - 1)]],
        "caterpillar": [caterpillar],
        "chain beside a star": [list(range(-1, DEEP - 1)), [-1] * 500],
        "random jumps back": [[-1] + [j - 1 if rng.random() < 0.98 else rng.randrange(-1, j) for j in range(1, DEEP)]],
    }


@pytest.mark.parametrize("name", list(_deep_cases()))
def test_deep_trees_match_the_node_by_node_computation(name: str) -> None:
    parents = _deep_cases()[name]
    nd = [len(p) for p in parents]
    lay = ScheduledLayout([f"r{i}" for i in range(len(nd))], nd, [1] * len(nd))
    tree = DraftTree(lay, parents)
    rng = np.random.default_rng(3)
    # Close to 1, so values along 32,000 nodes stay well away from underflow.
    conf = 1.0 - rng.random((len(nd), max(nd))) * 1e-5
    depth, value = _sequential(tree, conf)
    assert tree.depth.tolist() == depth
    assert tree.is_chain.tolist() == [p == list(range(-1, len(p) - 1)) for p in parents]
    got = node_values(conf, tree)
    assert got.tolist() == value  # bit for bit
    # The kept subtree of a deep tree: every kept node's parent kept, the best values kept.
    b = DEEP // 3
    keep = select_subtree(conf, tree, b)
    assert int(keep.sum()) == b
    up = tree.up
    assert not np.any(keep & (up >= 0) & ~keep[np.maximum(up, 0)])
    assert float(np.min(got[keep])) >= float(np.max(got[~keep]))
    comp = compact_tree(tree, keep)
    assert comp.kept_depth.tolist() == [d for d, k in zip(depth, keep.tolist(), strict=True) if k]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3), k=st.integers(0, 400), branch=st.floats(0, 1))
def test_random_deep_and_wide_trees(seed: int, n: int, k: int, branch: float) -> None:
    """Chains with a few branches (few runs, many levels) and bushy trees (many runs, few levels)."""
    rng = random.Random(seed)
    parents = [[j - 1 if rng.random() >= branch else rng.randrange(-1, j) for j in range(k)] for _ in range(n)]
    lay = ScheduledLayout([f"r{i}" for i in range(n)], [k] * n, [1] * n)
    tree = DraftTree(lay, parents)
    conf = np.asarray([[rng.random() for _ in range(k)] for _ in range(n)]).reshape(n, k)
    depth, value = _sequential(tree, conf)
    assert tree.depth.tolist() == depth
    assert node_values(conf, tree).tolist() == value
