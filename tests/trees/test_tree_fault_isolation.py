"""One bad request never fails the batch of draft trees: fill_tree_masks with injected faults, every provider.

Random batches of draft trees (every registered provider mixed in one
batch, any shape, chains, stars, with and without bonus rows, ragged and
fixed rows, matchers mid-text or terminated) get faults injected into some
requests: node ids outside the vocabulary or negative, and matchers whose
``fill``, ``accept``, ``is_terminated``, ``rollback`` or engine tree walk
raises at a chosen call, once or from then on (a sticky error state). The
faulty matchers are the wrappers of the chain tests
(``tests/grammars/test_fault_isolation.py``): without batch operations,
with their provider's failing batch and chain operations (the chain
shortcut), and with the engine's native tree walk where the provider has
one. Each result is compared with the same batch without the failed
requests, on the providers' own matchers: every other request's rows and
flags are bit-identical, a failed request's rows are the stop-only row with
no node valid or forced, ``failed`` holds exactly the requests at fault, and
the tree budget values those requests' nodes at 0.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tree_cases import random_parents

from maskplug import (
    BudgetError,
    CostModel,
    DraftTree,
    GrammarError,
    GrammarRows,
    ScheduledLayout,
    TreeMasks,
    choose_tree_budget,
    fill_tree_masks,
    node_values,
    select_subtree,
)
from maskplug.grammar import Matcher
from maskplug.grammar.rows import stop_row
from maskplug.grammar_trees import native_tree_walker
from maskplug.trees import check_tree_masks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grammars"))
from grammar_testkit import PROVIDERS, random_walk, state_of
from test_fault_isolation import (
    ENGINES,
    FAULT_OPS,
    REGEXES,
    BrokenEngine,
    Fault,
    Faulty,
    FaultyOps,
    assert_failures_reported,
    grammar,
    vocab,
)
from test_tree_grammar import _tree_tokens

pytestmark = pytest.mark.skipif(not PROVIDERS, reason="no grammar provider is installed")

STRATEGIES = ["auto", "native", "walk"]
WRAPS = ["none", "single", "ops", "native"]
MAX_NODES = 6
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _TickingWalk:
    """An engine object whose tree walk asks the request's :class:`Fault` first (op ``"traverse"``)."""

    def __init__(self, fault: Fault, walk: Any) -> None:
        self._fault = fault
        self._walk = walk

    def traverse_draft_tree(self, *args: Any) -> Any:
        self._fault.tick("traverse")
        return self._walk(*args)


class NativeFaulty(Faulty):
    """:class:`Faulty` with the wrapped matcher's native tree walk (where its engine has one), faulty too."""

    @property
    def raw(self) -> Any:
        walk = native_tree_walker(self.inner)
        return None if walk is None else _TickingWalk(self.fault, walk)


@dataclass
class TreeBatch:
    tree: DraftTree
    grammar: list[int]  # batch index of each grammar request, in rows order
    mode: str
    stride: int | None
    inner: list[Matcher]  # the providers' matchers
    given: list[Matcher]  # what fill_tree_masks gets (wrapped or not)
    faults: list[Fault | None]
    tokens: list[list[int]]
    bad_ids: set[int]  # grammar requests with a bad node id
    wrap: str
    providers: list[str]  # each grammar request's provider

    def rows(self, keep: Sequence[int]) -> GrammarRows:
        ids = [f"r{self.grammar[g]}" for g in keep]
        return GrammarRows(ids, mode="fixed", stride=self.stride) if self.mode == "fixed" else GrammarRows(ids)


def make_tree_batch(seed: int, wrap: str) -> TreeBatch:
    """A random batch of draft trees; ``wrap``: "none" (bad ids only), "single", "ops" or "native" wrappers."""
    rng = random.Random(seed)
    v = vocab()
    n = rng.randint(1, 5)
    nb = rng.choice([1, 1, 2, 0])
    nd = [rng.randint(0, MAX_NODES) for _ in range(n)]
    all_chains = rng.random() < 0.35  # then "auto" takes the chain shortcut (with a bonus row)
    shapes = ["chain" if all_chains else rng.choice(["any", "any", "chain", "star"]) for _ in range(n)]
    parents = [random_parents(rng, k, s) for k, s in zip(nd, shapes, strict=True)]
    layout = ScheduledLayout([f"r{i}" for i in range(n)], nd, [1] * n, num_bonus=nb)
    tree = DraftTree(layout, parents)
    order = [i for i in range(n) if rng.random() < 0.85] or [0]
    rng.shuffle(order)
    mode = rng.choice(["ragged", "fixed"])
    stride = max(nd[i] for i in order) + nb + rng.randint(0, 2) if mode == "fixed" else None
    stride = max(stride, 1) if stride is not None else None
    ops_of: dict[int, FaultyOps] = {}
    inner: list[Matcher] = []
    handed: list[Matcher] = []
    faults: list[Fault | None] = []
    tokens: list[list[int]] = []
    bad_ids: set[int] = set()
    ops_names = (*FAULT_OPS, "traverse", "traverse") if wrap == "native" else FAULT_OPS
    providers: list[str] = []
    for g, i in enumerate(order):
        providers.append(rng.choice(PROVIDERS))
        m = grammar(providers[-1], rng.choice(REGEXES)).matcher()
        for t in random_walk(m, v, rng, rng.randint(0, 2), stop=rng.random() < 0.15):
            assert m.accept(t)
        toks = _tree_tokens(m, v, rng, parents[i])
        k = nd[i]
        if k and rng.random() < 0.15:
            toks[rng.randrange(k)] = rng.choice([-1, -(2**40), v.vocab_size, v.vocab_size + rng.randrange(1000)])
            bad_ids.add(g)
        inner.append(m)
        tokens.append(toks)
        fault: Fault | None = None
        if wrap == "none":
            handed.append(m)
        else:
            fault = Fault()
            if rng.random() < 0.45:
                fault = Fault(rng.choice(ops_names), rng.randint(1, 3), sticky=wrap == "ops" or rng.random() < 0.5)
            if wrap == "native":
                handed.append(NativeFaulty(m, fault, None))
            else:
                ops: FaultyOps | None = None
                if wrap == "ops":
                    base = m.batch_ops  # type: ignore[attr-defined]
                    ops = ops_of.setdefault(id(base), FaultyOps(base, partial=rng.random() < 0.5))
                handed.append(Faulty(m, fault, ops))
        faults.append(fault)
    return TreeBatch(tree, order, mode, stride, inner, handed, faults, tokens, bad_ids, wrap, providers)


def _flat(b: TreeBatch, tokens: Sequence[Sequence[int]], keep: Sequence[int]) -> np.ndarray:
    """Every scheduled node's id in batch order (requests without a grammar here: id 5)."""
    lay = b.tree.layout
    by_req = {b.grammar[g]: tokens[g] for g in keep}
    return np.array([t for r in range(lay.n) for t in by_req.get(r, [5] * int(lay.num_drafts[r]))], dtype=np.int64)


def row_starts(rows: GrammarRows, layout: ScheduledLayout) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(rows.rows_per_request(layout))]).astype(np.int64)


def check_tree_isolated(b: TreeBatch, strategy: str, flat: bool) -> TreeMasks:
    v = vocab()
    lay = b.tree.layout
    g_count = len(b.grammar)
    probes = [[t for t in toks if 0 <= t < v.vocab_size] + [0] for toks in b.tokens]
    before = [state_of(m, v, p) for m, p in zip(b.inner, probes, strict=True)]
    rows = b.rows(range(g_count))
    total = rows.num_rows(lay)
    bm = torch.randint(-(2**31), 2**31 - 1, (total + 2, v.mask_words), dtype=torch.int32)
    tail = bm[total:].clone()
    arg: Any = _flat(b, b.tokens, range(g_count)) if flat else b.tokens
    out = fill_tree_masks(b.given, arg, bm, rows, b.tree, strategy=strategy, threads=2)
    assert torch.equal(bm[total:], tail), "a row past the batch was written"

    expect = assert_failures_reported(out, b, "tokens")
    # What fill_tree_masks hands out passes the budget's own check, failures included.
    checked = check_tree_masks(out, b.tree)
    assert dict(checked.failed) == dict(out.failed)

    # Failed requests: stop-only rows (node and bonus rows), no node valid or forced.
    starts = row_starts(rows, lay)
    stop = stop_row(v)
    for g in expect:
        need = int(lay.num_drafts[b.grammar[g]]) + lay.num_bonus
        for p in range(need):
            assert torch.equal(bm[starts[g] + p], stop), (g, p)
        assert not out.valid[g].any() and not out.forced[g].any()
        assert bool((bm[starts[g] + need : starts[g + 1]] == -1).all())  # unused fixed rows: all-allowed
    # Every matcher that did not fail (or failed and was rolled back) is where it started.
    for g, m in enumerate(b.inner):
        f = b.faults[g]
        dropped = g in expect and "should be dropped" in str(out.failed[b.grammar[g]])
        if not dropped:
            assert state_of(m, v, probes[g]) == before[g], g
        else:
            assert f is not None and f.fired and (f.sticky or f.op == "rollback")

    # The same batch without the failed requests, on the providers' own matchers.
    keep = [g for g in range(g_count) if g not in expect]
    ref_rows = b.rows(keep)
    ref_bm = v.new_bitmask(ref_rows.num_rows(lay))
    ref_arg: Any = _flat(b, b.tokens, keep) if flat else [b.tokens[g] for g in keep]
    ref = fill_tree_masks([b.inner[g] for g in keep], ref_arg, ref_bm, ref_rows, b.tree, strategy=strategy)
    assert not ref.failed
    ref_starts = row_starts(ref_rows, lay)
    for j, g in enumerate(keep):
        n_rows = int(ref_starts[j + 1] - ref_starts[j])
        assert torch.equal(bm[starts[g] : starts[g] + n_rows], ref_bm[ref_starts[j] : ref_starts[j + 1]]), g
        k = int(lay.num_drafts[b.grammar[g]])
        assert out.valid[g, :k].tolist() == ref.valid[j, :k].tolist()
        assert out.forced[g, :k].tolist() == ref.forced[j, :k].tolist()
        assert not out.valid[g, k:].any() and not out.forced[g, k:].any()
    assert [state_of(b.inner[g], v, probes[g]) for g in keep] == [before[g] for g in keep]

    # The tree budget: a failed request's nodes are worth 0, every other node as without the failures.
    conf = np.random.default_rng(len(b.grammar)).random((lay.n, max(int(lay.num_drafts.max(initial=0)), 1)))
    got_v, ref_v = node_values(conf, b.tree, out), node_values(conf, b.tree, ref)
    cu = b.tree.cu_nodes
    for g in expect:
        r = b.grammar[g]
        assert not got_v[int(cu[r]) : int(cu[r + 1])].any()
    failed_nodes = np.zeros(lay.total_drafts, dtype=bool)
    for g in expect:
        r = b.grammar[g]
        failed_nodes[int(cu[r]) : int(cu[r + 1])] = True
    np.testing.assert_array_equal(got_v[~failed_nodes], ref_v[~failed_nodes])
    cost = CostModel.linear(1.0, 0.02, 5.0, 0.05)
    budget = choose_tree_budget(conf, b.tree, cost, grammar=out).budget
    kept = select_subtree(conf, b.tree, budget, grammar=out)
    positive = int((got_v > 0).sum())
    assert not (kept & failed_nodes).any() or int(budget) > positive
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), wrap=st.sampled_from(WRAPS), flat=st.booleans())
def test_one_bad_request_never_fails_the_batch_of_trees(strategy: str, seed: int, wrap: str, flat: bool) -> None:
    check_tree_isolated(make_tree_batch(seed, wrap), strategy, flat)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_kind_of_tree_fault_is_reached(strategy: str) -> None:
    """The random batches do exercise each fault on each path and provider: fixed seeds until each has failed a request."""
    want = {"bad-id", "dropped", "single:fill", "single:accept", "single:rollback"}
    want |= {f"provider:{p}" for p in PROVIDERS}
    if strategy == "auto":
        want |= {"ops:fill", "ops:accept", "ops:is_terminated"}  # the chain shortcut's batch operations
    if strategy != "walk" and "xgrammar" in PROVIDERS:
        want |= {"native:traverse", "native:is_terminated"}
    seen: set[str] = set()
    for seed in range(600):
        wrap = WRAPS[seed % len(WRAPS)]
        b = make_tree_batch(seed, wrap)
        out = check_tree_isolated(b, strategy, flat=False)
        seen |= {"bad-id" for g in b.bad_ids if b.grammar[g] in out.failed}
        seen |= {f"{wrap}:{f.op}" for f in b.faults if f is not None and f.fired}
        seen |= {"dropped" for e in out.failed.values() if "should be dropped" in str(e)}
        seen |= {f"provider:{b.providers[g]}" for g in range(len(b.grammar)) if b.grammar[g] in out.failed}
        if want <= seen:
            return
    pytest.fail(f"faults never reached: {sorted(want - seen)}")


# ---------------------------------------------------------------- a fault inside a provider's own engine


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", ["any", "chain"])
@pytest.mark.parametrize("provider", [p for p in PROVIDERS if p in ENGINES])
def test_a_fault_inside_a_providers_engine_fails_its_tree_alone(provider: str, shape: str, strategy: str) -> None:
    """The providers' own matchers (native tree walk, depth-first walk, chain shortcut) over a broken engine."""
    v = vocab()
    rng = random.Random(11)
    ms = [grammar(provider, REGEXES[0]).matcher() for _ in range(4)]
    parents = [random_parents(rng, 5, shape) for _ in range(4)]
    if shape == "any":
        parents = [[-1, -1, 0, 1, 0] for _ in range(4)]  # a real tree: the chain shortcut does not apply
    tokens = [_tree_tokens(m, v, rng, p) for m, p in zip(ms, parents, strict=True)]
    probes = [[*t, 0] for t in tokens]
    before = [state_of(m, v, p) for m, p in zip(ms, probes, strict=True)]
    attr, calls = ENGINES[provider]
    setattr(ms[2], attr, BrokenEngine(getattr(ms[2], attr), calls))
    if hasattr(ms[2], "_mask_ok"):
        ms[2]._mask_ok = False  # type: ignore[attr-defined]  # no mask at hand: the engine is asked
    ids = ["a", "b", "c", "d"]
    layout = ScheduledLayout(ids, [5] * 4, [1] * 4)
    tree = DraftTree(layout, parents)
    bm = torch.randint(-(2**31), 2**31 - 1, (24, v.mask_words), dtype=torch.int32)
    out = fill_tree_masks(ms, tokens, bm, GrammarRows(ids), tree, strategy=strategy)
    assert list(out.failed) == [2]
    err = out.failed[2]
    assert str(err).startswith("matchers[2]: the matcher raised ") and err.__cause__ is not None
    assert bool((bm[12:18] == stop_row(v)).all()) and not out.valid[2].any() and not out.forced[2].any()
    keep = [0, 1, 3]
    ref_bm = v.new_bitmask(18)
    ref = fill_tree_masks(
        [ms[g] for g in keep], [tokens[g] for g in keep], ref_bm, GrammarRows(["a", "b", "d"]), tree, strategy=strategy
    )
    assert torch.equal(bm[0:12], ref_bm[0:12]) and torch.equal(bm[18:24], ref_bm[12:18])
    assert out.valid[keep].tolist() == ref.valid.tolist() and out.forced[keep].tolist() == ref.forced.tolist()
    assert [state_of(ms[g], v, probes[g]) for g in keep] == [before[g] for g in keep]


def test_a_tree_walk_that_cannot_roll_back_says_the_matcher_should_be_dropped() -> None:
    """A sticky error at the first roll back: the request fails, the error says its matcher is lost."""
    v = vocab()
    provider = next((p for p in PROVIDERS if p != "xgrammar"), PROVIDERS[0])
    rng = random.Random(4)
    ms = [grammar(provider, REGEXES[1]).matcher() for _ in range(2)]
    parents = [-1, 0, 0]
    tokens = [_tree_tokens(m, v, rng, parents) for m in ms]
    walk = random_walk(ms[0], v, rng, 1, stop=False)
    tokens[0][0] = walk[0]  # the first node is accepted, so leaving it rolls back
    wrapped = [Faulty(ms[0], Fault("rollback", 1, sticky=True), None), ms[1]]
    layout = ScheduledLayout(["a", "b"], [3, 3], [1, 1])
    bm = v.new_bitmask(8)
    out = fill_tree_masks(wrapped, tokens, bm, GrammarRows(["a", "b"]), DraftTree(layout, [parents] * 2))
    assert list(out.failed) == [0]
    text = str(out.failed[0])
    assert text.startswith("matchers[0]: the matcher raised EngineFault in its rollback(1) leaving node ")
    assert "should be dropped" in text
    assert bool((bm[0:4] == stop_row(v)).all())


# ---------------------------------------------------------------- TreeMasks.failed where tree masks are checked


def test_tree_masks_failed_is_checked_and_carried() -> None:
    layout = ScheduledLayout(["a", "b", "c"], [2, 3, 1], [1, 1, 1])
    tree = DraftTree(layout, [[-1, 0], [-1, -1, 1], [-1]])
    valid = np.array([[False, False, False], [True, True, False]])
    base = (np.array([2, 0]), valid, np.zeros((2, 3), dtype=bool))
    assert TreeMasks(*base).failed == {} and check_tree_masks(TreeMasks(*base), tree).failed == {}
    err = GrammarError("tokens[0][0]: expected a token id in [0, 7), got 9")
    checked = check_tree_masks(TreeMasks(*base, failed={np.int64(2): err}), tree)
    assert dict(checked.failed) == {2: err} and all(type(k) is int for k in checked.failed)
    with pytest.raises(TypeError):
        checked.failed[0] = err  # type: ignore[index]  # read-only
    bad_cases: list[tuple[Any, str]] = [
        ([2], r"^grammar\.failed: expected a mapping"),
        ({1: err}, r"^grammar\.failed: expected batch indices of grammar\.request"),
        ({True: err}, r"^grammar\.failed: expected batch indices"),
        ({2: "lost"}, r"^grammar\.failed: expected a GrammarError for request 2"),
        ({0: err}, r"^grammar\.valid: expected no valid node in failed request 0, got 2"),
    ]
    for bad, why in bad_cases:
        with pytest.raises(BudgetError, match=why):
            check_tree_masks(TreeMasks(*base, failed=bad), tree)
    # The budget reads tree masks through the same check.
    with pytest.raises(BudgetError, match=r"^grammar\.valid: expected no valid node in failed request 0"):
        node_values(np.full((3, 3), 0.5), tree, TreeMasks(*base, failed={0: err}))
