"""Random draft trees for the tree tests (hypothesis strategies and plain builders)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from maskplug import DraftTree, GrammarRows, ScheduledLayout, TreeMasks


@dataclass
class TreeCase:
    tree: DraftTree
    parents: list[list[int]]
    conf: np.ndarray
    grammar: TreeMasks | None


def random_parents(rng: random.Random, k: int, shape: str = "any") -> list[int]:
    """``k`` parent indices, parents first: a chain, a star, or any tree."""
    if shape == "chain":
        return [j - 1 for j in range(k)]
    if shape == "star":
        return [-1] * k
    return [rng.randint(-1, j - 1) for j in range(k)]


def random_grammar(rng: random.Random, tree: DraftTree, conf_ties: bool = False) -> TreeMasks:
    """Per-node flags that respect the tree: a node is valid only under a valid parent."""
    lay = tree.layout
    grammar = [r for r in range(lay.n) if rng.random() < 0.7]
    rng.shuffle(grammar)
    width = max([int(lay.num_drafts[r]) for r in grammar] or [0]) + rng.randint(0, 2)
    valid = np.zeros((len(grammar), width), dtype=bool)
    forced = np.zeros((len(grammar), width), dtype=bool)
    for g, r in enumerate(grammar):
        par = tree.parents_of(r).tolist()
        for j, p in enumerate(par):
            valid[g, j] = (p < 0 or valid[g, p]) and rng.random() < 0.85
            forced[g, j] = valid[g, j] and rng.random() < 0.25
    return TreeMasks(np.array(grammar, dtype=np.int64), valid, forced)


@st.composite
def tree_cases(draw: st.DrawFn, max_req: int = 5, max_nodes: int = 9, grammar: bool = True) -> TreeCase:
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    n = draw(st.integers(0, max_req))
    nb = draw(st.sampled_from([1, 1, 1, 0, 2]))
    shapes = [draw(st.sampled_from(["any", "any", "chain", "star"])) for _ in range(n)]
    nd = [draw(st.integers(0, max_nodes)) for _ in range(n)]
    parents = [random_parents(rng, k, s) for k, s in zip(nd, shapes, strict=True)]
    layout = ScheduledLayout([f"q{i}" for i in range(n)], nd, [1] * n, num_bonus=nb)
    tree = DraftTree(layout, parents)
    width = max(nd or [0]) + rng.randint(0, 2)
    # Coarse values make ties (between nodes, requests and depths) common.
    coarse = draw(st.booleans())
    conf = np.array(
        [[rng.choice([0.0, 0.5, 1.0, 0.25]) if coarse else rng.random() for _ in range(width)] for _ in range(n)],
        dtype=np.float64,
    ).reshape(n, width)
    g = random_grammar(rng, tree) if grammar and draw(st.booleans()) else None
    return TreeCase(tree, parents, conf, g)


def grammar_rows(rng: random.Random, layout: ScheduledLayout, mode: str) -> GrammarRows:
    """Some requests (random order) with a grammar, ragged or fixed."""
    ids = layout.req_ids.tolist()
    chosen = [i for i in ids if rng.random() < 0.8]
    rng.shuffle(chosen)
    if mode == "fixed":
        need = max([int(layout.num_drafts[layout.index_of(i)]) for i in chosen] or [0]) + layout.num_bonus
        return GrammarRows(chosen, mode="fixed", stride=max(need, 1) + rng.randint(0, 2))
    return GrammarRows(chosen)
