"""fill_tree_masks against the per-node replay oracle (maskplug.reference.tree_mask_rows), every provider."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_cases import grammar_rows, random_parents

from maskplug import (
    DraftTree,
    GrammarError,
    GrammarRows,
    GrammarSpec,
    LayoutError,
    ScheduledLayout,
    fill_draft_masks,
    fill_tree_masks,
    grammar_providers,
    reference,
)
from maskplug.grammar import Matcher
from maskplug.grammar.protocols import TreeOps
from maskplug.grammar_trees import native_tree_walker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grammars"))
from grammar_testkit import REGEXES, compiled, random_walk, state_of, vocab

PROVIDERS = grammar_providers()
pytestmark = pytest.mark.skipif(not PROVIDERS, reason="no grammar provider is installed")


def _tree_tokens(m, v, rng: random.Random, parents: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """Node tokens: mostly grammar-valid continuations of the parent's path, some invalid, some stop tokens."""
    toks: list[int] = []
    paths: list[list[int]] = []
    for p in parents:
        path = [] if p < 0 else [*paths[p], p]
        prefix = [toks[q] for q in path]
        took = 0
        for t in prefix:
            if m.is_terminated() or not m.accept(t):
                break
            took += 1
        live = took == len(prefix) and not m.is_terminated()
        walk = random_walk(m, v, rng, 1, stop=rng.random() < 0.2) if live else []
        if took:
            m.rollback(took)
        if walk and rng.random() < 0.85:
            toks.append(walk[0])
        else:
            toks.append(rng.randrange(len(v.tokens)))
        paths.append(path)
    return toks


def _case(
    provider: str, rng: random.Random, mode: str, shape: str = "any", bonus: tuple[int, ...] = (1, 1, 2, 0)
) -> tuple[Any, DraftTree, Any, list[Any], list[Any]]:
    v = vocab("spm")
    n = rng.randint(1, 4)
    nb = rng.choice(bonus)
    nd = [rng.randint(0, 7) for _ in range(n)]
    parents = [random_parents(rng, k, shape if shape != "mixed" else rng.choice(["any", "chain"])) for k in nd]
    layout = ScheduledLayout([f"r{i}" for i in range(n)], nd, [1] * n, num_bonus=nb)
    tree = DraftTree(layout, parents)
    rows = grammar_rows(rng, layout, mode)
    matchers, tokens = [], []
    for rid in rows.grammar_req_ids.tolist():
        r = layout.index_of(rid)
        m = compiled(provider, "spm", GrammarSpec("regex", rng.choice(REGEXES))).matcher()
        for t in random_walk(m, v, rng, rng.randint(0, 2), stop=False):
            assert m.accept(t)
        matchers.append(m)
        tokens.append(_tree_tokens(m, v, rng, parents[r]))
    return v, tree, rows, matchers, tokens


def _check(v, tree, rows, matchers, tokens, strategy: str, flat: bool = False) -> None:  # type: ignore[no-untyped-def]
    lay = tree.layout
    probes = [[*t, 0] for t in tokens]
    before = [state_of(m, v, p) for m, p in zip(matchers, probes, strict=True)]
    total = rows.num_rows(lay)
    bm = torch.randint(-(2**31), 2**31 - 1, (total + 1, v.mask_words), dtype=torch.int32)
    tail = bm[total:].clone()
    arg: Any = tokens
    if flat:  # every scheduled node in batch order (requests without a grammar: any ids)
        arr = np.zeros(lay.total_drafts, dtype=np.int64)
        for g, rid in enumerate(rows.grammar_req_ids.tolist()):
            r = lay.index_of(rid)
            arr[tree.cu_nodes[r] : tree.cu_nodes[r + 1]] = tokens[g]
        arg = arr
    got = fill_tree_masks(matchers, arg, bm, rows, tree, strategy=strategy, threads=2)
    assert [state_of(m, v, p) for m, p in zip(matchers, probes, strict=True)] == before
    assert torch.equal(bm[total:], tail)
    m_ = tree.mapping(rows)
    full = np.full(v.mask_words, -1, dtype=np.int32)
    for g, rid in enumerate(rows.grammar_req_ids.tolist()):
        r = lay.index_of(rid)
        k = int(lay.num_drafts[r])
        par = tree.parents_of(r).tolist()
        ref_rows, valid, forced = reference.tree_mask_rows(
            matchers[g], v.mask_words, v.eos_ids, tokens[g], par, lay.num_bonus
        )
        mine = np.flatnonzero(m_.request == r)
        assert got.request[g] == r
        for i, row in zip(mine.tolist(), ref_rows, strict=False):
            np.testing.assert_array_equal(bm[i].numpy(), row, err_msg=f"request {r} row {m_.position[i]}")
        for i in mine[len(ref_rows) :].tolist():
            raise AssertionError(f"unexpected row {i}")
        assert got.valid[g, :k].tolist() == valid
        assert got.forced[g, :k].tolist() == forced
        assert not got.valid[g, k:].any() and not got.forced[g, k:].any()
    unused = np.flatnonzero(m_.request < 0)
    for i in unused.tolist():
        np.testing.assert_array_equal(bm[i].numpy(), full)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("mode", ["ragged", "fixed"])
@pytest.mark.parametrize("strategy", ["auto", "native", "walk"])
def test_tree_rows_match_the_replay_oracle(provider: str, mode: str, strategy: str) -> None:
    rng = random.Random(hash((provider, mode, strategy)) & 0xFFFF)
    for _ in range(6):
        _check(*_case(provider, rng, mode, rng.choice(["any", "mixed", "star"])), strategy)


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(PROVIDERS or ["none"]), st.integers(0, 2**31), st.sampled_from(["ragged", "fixed"]))
def test_tree_rows_property(provider: str, seed: int, mode: str) -> None:
    rng = random.Random(seed)
    _check(*_case(provider, rng, mode), rng.choice(["auto", "native", "walk"]), flat=rng.random() < 0.5)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_chain_as_tree_gives_the_chain_rows(provider: str) -> None:
    rng = random.Random(7)
    for mode in ("ragged", "fixed"):
        for _ in range(4):
            # fill_draft_masks' chain operations need a bonus row (they fill the row after the last draft).
            v, tree, rows, matchers, tokens = _case(provider, rng, mode, "chain", bonus=(1, 2))
            total = rows.num_rows(tree.layout)
            a = torch.zeros((total, v.mask_words), dtype=torch.int32)
            dm = fill_draft_masks(matchers, tokens, a, rows, tree.layout)
            for strategy in ("auto", "native", "walk"):
                b = torch.ones((total, v.mask_words), dtype=torch.int32)
                tm = fill_tree_masks(matchers, tokens, b, rows, tree, strategy=strategy)
                assert torch.equal(a, b), strategy
                k = tm.valid.shape[1]
                assert tm.num_valid.tolist() == dm.acceptable.tolist()
                cols = np.arange(k)[None, :]
                assert tm.forced.tolist() == (dm.forced[:, :k] & (cols < dm.acceptable[:, None])).tolist()


def test_native_walk_is_used_where_the_engine_has_one() -> None:
    if "xgrammar" not in PROVIDERS:
        pytest.skip("xgrammar is not installed")
    m = compiled("xgrammar", "spm", GrammarSpec("regex", REGEXES[0])).matcher()
    assert native_tree_walker(m) is not None
    for other in ("llguidance", "outlines-core"):
        if other in PROVIDERS:
            assert native_tree_walker(compiled(other, "spm", GrammarSpec("regex", REGEXES[0])).matcher()) is None


class _TreeWalkingOps:
    """Batch operations that declare :class:`TreeOps`; ``fill_tree`` walks the links with the matcher protocol.

    It writes a row for the nodes it reaches only (others keep what they held),
    as the protocol allows, and counts its calls.
    """

    def __init__(self) -> None:
        self.calls = 0

    def fill(self, matchers: Any, bitmask: torch.Tensor, rows: Any) -> None:
        for m, r in zip(matchers, rows, strict=True):
            m.fill(bitmask, r)

    def accept(self, matchers: Any, tokens: Any) -> list[bool]:
        return [m.accept(int(t)) for m, t in zip(matchers, tokens, strict=True)]

    def rollback(self, matchers: Any, counts: Any) -> None:
        for m, n in zip(matchers, counts, strict=True):
            if n:
                m.rollback(n)

    def fill_tree(
        self, matcher: Any, next_child: torch.Tensor, next_sibling: torch.Tensor, tokens: torch.Tensor, bitmask: Any
    ) -> None:
        self.calls += 1

        def visit(j: int) -> None:
            matcher.fill(bitmask, j)
            c = int(next_child[j])
            while c >= 0:
                if matcher.accept(int(tokens[c])):
                    if not matcher.is_terminated():
                        visit(c)
                    matcher.rollback(1)
                c = int(next_sibling[c])

        visit(0)


class _WithTreeOps:
    """A provider's matcher offered with :class:`_TreeWalkingOps` as its batch operations."""

    def __init__(self, inner: Matcher, ops: _TreeWalkingOps) -> None:
        self.inner = inner
        self.vocab = getattr(inner, "vocab", None)
        self.batch_ops = ops

    def accept(self, token: int) -> bool:
        return self.inner.accept(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        return self.inner.fill(bitmask, row)

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def validate(self, tokens: Any) -> int:
        return self.inner.validate(tokens)

    def reset(self) -> None:
        self.inner.reset()

    def fork(self) -> Matcher:
        return self.inner.fork()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("strategy", ["auto", "native", "walk"])
def test_declared_tree_ops_are_the_native_walk(provider: str, strategy: str) -> None:
    """Batch operations that are a TreeOps walk their requests' trees, with the replay oracle's rows."""
    ops = _TreeWalkingOps()
    assert isinstance(ops, TreeOps)
    rng = random.Random(hash((provider, strategy, "tree-ops")) & 0xFFFF)
    walked = 0
    for _ in range(6):
        v, tree, rows, matchers, tokens = _case(provider, rng, "ragged", rng.choice(["any", "star"]))
        wrapped = [_WithTreeOps(m, ops) for m in matchers]
        assert all(native_tree_walker(m) is not None for m in wrapped)
        before = ops.calls
        _check(v, tree, rows, wrapped, tokens, strategy)
        # One engine walk per live request with nodes, unless the depth-first walk was asked for.
        idx = rows.batch_indices(tree.layout)
        live = sum(1 for g, m in enumerate(matchers) if tree.layout.num_drafts[idx[g]] and not m.is_terminated())
        chain = strategy == "auto" and tree.layout.num_bonus >= 1 and bool(tree.is_chain[idx].all())
        expect = 0 if strategy == "walk" or chain else live
        assert ops.calls - before == expect
        walked += ops.calls - before
    assert walked or strategy == "walk" or not PROVIDERS


@pytest.mark.parametrize("provider", PROVIDERS)
def test_bad_input_touches_nothing(provider: str) -> None:
    v = vocab("spm")
    lay = ScheduledLayout(["a", "b"], [3, 2], [1, 1])
    tree = DraftTree(lay, [[-1, -1, 0], [-1, 0]])
    rows = GrammarRows(["b", "a"])
    m = [compiled(provider, "spm", GrammarSpec("regex", REGEXES[0])).matcher() for _ in range(2)]
    before = [state_of(x, v, [5, 6]) for x in m]
    bm = torch.full((rows.num_rows(lay), v.mask_words), 7, dtype=torch.int32)
    keep = bm.clone()
    cases = [
        ((m[:1], [[1, 2], [1, 2, 3]], bm, rows, tree), LayoutError, r"matchers: expected 2"),
        ((m, [[1, 2], [1, 2]], bm, rows, tree), LayoutError, r"tokens\[1\]: expected num_drafts = 3"),
        ((m, [[1, 2], [1, 2, 3]], bm[:2], rows, tree), GrammarError, r"row: expected a row in \[0, 2\), got 6"),
        ((m, [[1, 2], [1, 2, 3]], bm, rows, lay), LayoutError, r"tree: expected a DraftTree"),
        ((m, [[1, 2], [1, 2, 3]], bm, "rows", tree), LayoutError, r"rows: expected a GrammarRows"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fill_tree_masks(*args)  # type: ignore[arg-type]
        assert torch.equal(bm, keep)
        assert [state_of(x, v, [5, 6]) for x in m] == before
    with pytest.raises(LayoutError, match=r"strategy: expected one of"):
        fill_tree_masks(m, [[1, 2], [1, 2, 3]], bm, rows, tree, strategy="fast")
    # A node id outside the vocabulary fails only its request (request "a", batch index 0), untouched.
    got = fill_tree_masks(m, [[1, 2], [1, 2, v.vocab_size]], bm, rows, tree)
    assert list(got.failed) == [0]
    assert str(got.failed[0]).startswith(f"tokens[1][2]: expected a token id in [0, {v.vocab_size}), got ")
    assert state_of(m[1], v, [5, 6]) == before[1]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("strategy", ["auto", "native", "walk"])
def test_terminated_matcher_rows(provider: str, strategy: str) -> None:
    """A grammar that already ended: the root row allows only the stop tokens and no node is valid."""
    v = vocab("spm")
    m = compiled(provider, "spm", GrammarSpec("regex", r"(yes|no|maybe)")).matcher()
    walk = random_walk(m, v, random.Random(3), 8, stop=True)
    for t in walk:
        assert m.accept(t)
    assert m.is_terminated()
    eos = v.eos_ids[0]
    lay = ScheduledLayout(["a"], [4], [1])
    tree = DraftTree(lay, [[-1, -1, 0, 2]])
    rows = GrammarRows(["a"])
    tokens = [[eos, 5, 6, 7]]
    bm = torch.zeros((5, v.mask_words), dtype=torch.int32)
    got = fill_tree_masks([m], tokens, bm, rows, tree, strategy=strategy)
    ref_rows, valid, forced = reference.tree_mask_rows(m, v.mask_words, v.eos_ids, tokens[0], [-1, -1, 0, 2], 1)
    for i, row in enumerate(ref_rows):
        np.testing.assert_array_equal(bm[i].numpy(), row)
    assert got.valid[0].tolist() == valid == [False] * 4
    assert got.forced[0].tolist() == forced
    assert m.is_terminated()
