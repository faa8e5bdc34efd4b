"""One bad request never fails the batch: fill_draft_masks and commit_many with injected faults.

Random batches (every registered provider mixed in one batch, random
layouts, chain lengths 0..K, reasoning gates, matchers mid-text or
terminated) get faults injected into some requests: draft ids outside the
vocabulary or negative, and matchers whose ``fill``, ``accept``,
``is_terminated`` or ``rollback`` raises at a chosen call, once or from then
on (a sticky error state). Faulty matchers reach the walks three ways: as
the providers' own matchers (only bad ids then), wrapped without batch
operations (the request-by-request walk), and wrapped together with their
provider's batch and chain operations, which then raise for every request
of the call (and scribble over the rows they were given first).

Each result is compared with the same batch without the failed requests:
every other request's rows and fields are bit-identical, each failed
request's rows are the stop-only row, and ``failed`` holds exactly the
requests whose draft ids were bad or whose matcher raised.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

import numpy as np
import pytest
import torch
from grammar_testkit import PROVIDERS, disallowed_token, random_walk, small_vocab, state_of
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from maskplug import (
    BudgetError,
    CommitResult,
    DraftMasks,
    GrammarError,
    GrammarRows,
    GrammarSpec,
    ScheduledLayout,
    commit,
    commit_many,
    fill_draft_masks,
    grammar_provider,
)
from maskplug.draftmasks import check_draft_masks
from maskplug.grammar import ChainOps, Matcher, Vocab
from maskplug.grammar.rows import stop_row

pytestmark = pytest.mark.skipif(not PROVIDERS, reason="no grammar provider is installed")

STRATEGIES = ["auto", "chains", "batch", "threads", "serial"]
REGEXES = (r"[a-z]{1,6}( [0-9]{1,2}){0,2}", r"(yes|no|maybe)", r"\{\"[a-c]{1,3}\": [0-9]{1,3}\}")
MAX_DRAFTS = 4
# Modest: every example runs two fills; the file stays well under a minute on one core.
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@lru_cache(maxsize=1)
def vocab() -> Vocab:
    return small_vocab(extra=5)


@cache
def grammar(provider: str, regex: str) -> Any:
    return grammar_provider(provider, vocab()).compile(GrammarSpec("regex", regex))


class EngineFault(RuntimeError):
    """What an injected fault raises."""


@dataclass
class Fault:
    """When a wrapped matcher raises: at the ``at``-th call of ``op``, and with ``sticky`` at every call after."""

    op: str = "none"
    at: int = 1
    sticky: bool = False
    fired: bool = False
    calls: Counter[str] = field(default_factory=Counter)

    def tick(self, op: str) -> None:
        if self.fired and self.sticky:
            raise EngineFault(f"{op}: the engine is in an error state")
        self.calls[op] += 1
        if op == self.op and self.calls[op] == self.at:
            self.fired = True
            raise EngineFault(f"{op}: injected failure at call {self.at}")


class Faulty:
    """A matcher that wraps a provider's matcher and raises as its :class:`Fault` says."""

    def __init__(self, inner: Matcher, fault: Fault, ops: FaultyOps | None) -> None:
        self.inner = inner
        self.fault = fault
        self.vocab = getattr(inner, "vocab", None)
        self.batch_ops = ops
        self.releases_gil = bool(getattr(inner, "releases_gil", False))

    def accept(self, token: int) -> bool:
        self.fault.tick("accept")
        return self.inner.accept(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        self.fault.tick("fill")
        return self.inner.fill(bitmask, row)

    def rollback(self, n: int) -> None:
        self.fault.tick("rollback")
        self.inner.rollback(n)

    def is_terminated(self) -> bool:
        self.fault.tick("is_terminated")
        return self.inner.is_terminated()

    def validate(self, tokens: Sequence[int]) -> int:
        return self.inner.validate(tokens)

    def reset(self) -> None:
        self.inner.reset()

    def fork(self) -> Matcher:
        return self.inner.fork()

    @property
    def num_accepted(self) -> int | None:
        return getattr(self.inner, "num_accepted", None)


def assert_failures_reported(out: Any, b: Any, arg: str) -> set[int]:
    """``out.failed`` names exactly the batch's faulty requests, each with the error its fault calls for.

    ``b`` is a generated batch (``faults``, ``bad_ids``, ``grammar``); ``arg`` is the producer's name for
    the token argument (``drafts``, ``tokens``). Returns the faulty requests' grammar indices.
    """
    fired = {g for g, f in enumerate(b.faults) if f is not None and f.fired}
    expect: set[int] = b.bad_ids | fired
    assert set(out.failed) == {b.grammar[g] for g in expect}
    assert out.request.tolist() == b.grammar
    for g in expect:
        err = out.failed[b.grammar[g]]
        assert isinstance(err, GrammarError)
        if g in b.bad_ids:
            assert str(err).startswith(f"{arg}[{g}]["), str(err)
            assert "expected a token id in [0, " in str(err)
            f = b.faults[g]
            assert f is None or not f.calls, "a request with a bad token id was walked"
        else:
            assert str(err).startswith(f"matchers[{g}]: "), str(err)
            assert isinstance(err.__cause__, EngineFault), repr(err.__cause__)
    return expect


def _scribble(bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """What a native call that died half way leaves behind: garbage in the rows it was given."""
    for r in rows:
        bitmask[int(r)] = 0x5A5A5A5A


class FaultyOps:
    """A provider's batch and chain operations over :class:`Faulty` matchers.

    Each call first asks every wrapper it was given (one tick each); when one
    raises, the whole call raises for all of them: ``fill`` and
    ``fill_chains`` after writing garbage into their rows, ``accept`` and
    ``rollback`` before anything moves, or with ``partial`` after moving the
    matchers before the failing one that keep a count of what they accepted
    (``num_accepted``), which fill_draft_masks reads to put them back (as a
    loop over the matchers that stops at the first exception would).
    """

    def __init__(self, inner: Any, partial: bool = False) -> None:
        self.inner = inner
        self.partial = partial
        self.fills_forced = bool(getattr(inner, "fills_forced", False))

    def _counted(self, matchers: Sequence[Matcher], values: Sequence[int]) -> tuple[list[Matcher], list[int]]:
        """The inner matchers that keep a count (and their values), for a partial move before raising."""
        pairs = [(m.inner, int(x)) for m, x in zip(matchers, values, strict=True)]  # type: ignore[attr-defined]
        keep = [(m, x) for m, x in pairs if getattr(m, "num_accepted", None) is not None] if self.partial else []
        return [m for m, _ in keep], [x for _, x in keep]

    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        try:
            for m in matchers:
                m.fault.tick("fill")  # type: ignore[attr-defined]
        except EngineFault:
            _scribble(bitmask, rows)
            raise
        self.inner.fill([m.inner for m in matchers], bitmask, rows)  # type: ignore[attr-defined]

    def accept(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> list[bool]:
        done = 0
        try:
            for m in matchers:
                m.fault.tick("accept")  # type: ignore[attr-defined]
                done += 1
        except EngineFault:
            moved, toks = self._counted(matchers[:done], tokens[:done])
            if moved:
                self.inner.accept(moved, toks)
            raise
        return list(self.inner.accept([m.inner for m in matchers], tokens))  # type: ignore[attr-defined]

    def rollback(self, matchers: Sequence[Matcher], counts: Sequence[int]) -> None:
        done = 0
        try:
            for m, k in zip(matchers, counts, strict=True):
                if int(k):
                    m.fault.tick("rollback")  # type: ignore[attr-defined]
                done += 1
        except EngineFault:
            moved, ks = self._counted(matchers[:done], counts[:done])
            if moved:
                self.inner.rollback(moved, ks)
            raise
        self.inner.rollback([m.inner for m in matchers], counts)  # type: ignore[attr-defined]

    def fill_chains(
        self,
        matchers: Sequence[Matcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
        drafts: Sequence[Sequence[int]],
        threads: int | None = None,
        forced: Any = None,
    ) -> list[int]:
        try:
            for m, d in zip(matchers, drafts, strict=True):
                m.fault.tick("fill")  # type: ignore[attr-defined]
                if len(d):
                    m.fault.tick("accept")  # type: ignore[attr-defined]
        except EngineFault:
            _scribble(bitmask, [r + p for r, d in zip(rows, drafts, strict=True) for p in range(len(d) + 1)])
            raise
        inner = [m.inner for m in matchers]  # type: ignore[attr-defined]
        if self.fills_forced:
            return list(self.inner.fill_chains(inner, bitmask, rows, drafts, threads=threads, forced=forced))
        return list(self.inner.fill_chains(inner, bitmask, rows, drafts, threads=threads))


# ---------------------------------------------------------------- random batches with faults


@dataclass
class Batch:
    layout: ScheduledLayout
    grammar: list[int]  # batch index of each grammar request, in rows order
    mode: str
    stride: int | None
    inner: list[Matcher]  # the providers' matchers
    given: list[Matcher]  # what fill_draft_masks gets (wrapped or not)
    faults: list[Fault | None]
    drafts: list[list[int]]
    gates: list[int]
    bad_ids: set[int]  # grammar requests with a bad draft id

    def rows(self, keep: Sequence[int]) -> GrammarRows:
        ids = [f"r{self.grammar[g]}" for g in keep]
        return GrammarRows(ids, mode="fixed", stride=self.stride) if self.mode == "fixed" else GrammarRows(ids)


FAULT_OPS = ("fill", "accept", "is_terminated", "rollback")


def make_batch(seed: int, wrap: str) -> Batch:
    """A random batch; ``wrap``: "none" (bad ids only), "single" (wrappers, no batch ops) or "ops"."""
    rng = random.Random(seed)
    v = vocab()
    n = rng.randint(1, 6)
    nb = rng.choice([1, 1, 2])
    num_drafts = [rng.randint(0, MAX_DRAFTS) for _ in range(n)]
    layout = ScheduledLayout([f"r{i}" for i in range(n)], num_drafts, [1] * n, num_bonus=nb)
    order = [i for i in range(n) if rng.random() < 0.85] or [0]
    rng.shuffle(order)
    mode = rng.choice(["ragged", "fixed"])
    stride = max(num_drafts[i] for i in order) + nb + rng.randint(0, 2) if mode == "fixed" else None
    ops_of: dict[int, FaultyOps] = {}
    inner: list[Matcher] = []
    handed: list[Matcher] = []
    faults: list[Fault | None] = []
    drafts: list[list[int]] = []
    gates: list[int] = []
    bad_ids: set[int] = set()
    for g, i in enumerate(order):
        m = grammar(rng.choice(PROVIDERS), rng.choice(REGEXES)).matcher()
        for t in random_walk(m, v, rng, rng.randint(0, 2), stop=rng.random() < 0.15):
            assert m.accept(t)
        k = num_drafts[i]
        walk = random_walk(m, v, rng, k, stop=rng.random() < 0.4 and not m.is_terminated())
        walk += [rng.randrange(len(v.tokens)) for _ in range(k - len(walk))]
        if k and rng.random() < 0.3 and not m.is_terminated():
            walk[0] = disallowed_token(m, v, rng)
        if k and rng.random() < 0.15:
            p = rng.randrange(k)
            walk[p] = rng.choice([-1, -(2**40), v.vocab_size, v.vocab_size + rng.randrange(1000)])
            bad_ids.add(g)
        gates.append(rng.choice([0, 0, 0, rng.randint(0, k + nb + 1)]))
        inner.append(m)
        drafts.append(walk)
        fault: Fault | None = None
        if wrap == "none":
            handed.append(m)
        else:
            ops: FaultyOps | None = None
            if wrap == "ops":
                base = m.batch_ops  # type: ignore[attr-defined]
                ops = ops_of.setdefault(id(base), FaultyOps(base, partial=rng.random() < 0.5))
            fault = Fault()
            if rng.random() < 0.4:
                # Through batch operations a fault stays: the request is walked again after the batch call.
                fault = Fault(rng.choice(FAULT_OPS), rng.randint(1, 3), sticky=wrap == "ops" or rng.random() < 0.5)
            handed.append(Faulty(m, fault, ops))
        faults.append(fault)
    return Batch(layout, order, mode, stride, inner, handed, faults, drafts, gates, bad_ids)


def row_starts(rows: GrammarRows, layout: ScheduledLayout) -> np.ndarray:
    per = rows.rows_per_request(layout)
    return np.concatenate([[0], np.cumsum(per)]).astype(np.int64)


def check_isolated(b: Batch, strategy: str, wait: bool, flat: bool) -> DraftMasks:
    v = vocab()
    g_count = len(b.grammar)
    probes = [[*d, 0] for d in b.drafts]
    before = [state_of(m, v, [t for t in p if 0 <= t < v.vocab_size]) for m, p in zip(b.inner, probes, strict=True)]
    rows = b.rows(range(g_count))
    total = rows.num_rows(b.layout)
    bm = torch.randint(-(2**31), 2**31 - 1, (total + 2, v.mask_words), dtype=torch.int32)
    tail = bm[total:].clone()
    if flat:
        # One flat array of every scheduled draft in batch order (requests without a grammar: random ids).
        by_req = {b.grammar[g]: d for g, d in enumerate(b.drafts)}
        arg: Any = np.array(
            [t for i in range(b.layout.n) for t in by_req.get(i, [5] * int(b.layout.num_drafts[i]))], dtype=np.int64
        )
    else:
        arg = b.drafts
    res = fill_draft_masks(b.given, arg, bm, rows, b.layout, active_from=b.gates, strategy=strategy, wait=wait)
    out = res if isinstance(res, DraftMasks) else res.result(60)
    assert torch.equal(bm[total:], tail), "a row past the batch was written"

    expect = assert_failures_reported(out, b, "drafts")
    # Failed requests: stop-only rows, nothing acceptable, nothing forced.
    starts = row_starts(rows, b.layout)
    stop = stop_row(v)
    for g in expect:
        need = int(b.layout.num_drafts[b.grammar[g]]) + b.layout.num_bonus
        for p in range(need):
            assert torch.equal(bm[starts[g] + p], stop), (g, p)
        assert int(out.acceptable[g]) == 0 and not out.forced[g].any()
        # Unused rows of a fixed stride stay all-allowed.
        assert bool((bm[starts[g] + need : starts[g + 1]] == -1).all())
    # Every matcher that did not fail (or failed and was rolled back) is where it started.
    for g, m in enumerate(b.inner):
        f = b.faults[g]
        dropped = g in expect and "should be dropped" in str(out.failed[b.grammar[g]])
        if not dropped:
            assert state_of(m, v, [t for t in probes[g] if 0 <= t < v.vocab_size]) == before[g], g
        elif f is not None:
            assert f.fired and (f.sticky or f.op == "rollback")

    # The same batch without the failed requests, on the providers' own matchers.
    keep = [g for g in range(g_count) if g not in expect]
    ref_rows = b.rows(keep)
    ref_bm = v.new_bitmask(ref_rows.num_rows(b.layout))
    ref = fill_draft_masks(
        [b.inner[g] for g in keep],
        [b.drafts[g] for g in keep],
        ref_bm,
        ref_rows,
        b.layout,
        active_from=[b.gates[g] for g in keep],
        strategy=strategy,
    )
    assert not ref.failed
    ref_starts = row_starts(ref_rows, b.layout)
    for j, g in enumerate(keep):
        n_rows = int(ref_starts[j + 1] - ref_starts[j])
        assert torch.equal(bm[starts[g] : starts[g] + n_rows], ref_bm[ref_starts[j] : ref_starts[j + 1]]), g
        assert int(out.acceptable[g]) == int(ref.acceptable[j])
        width = min(out.forced.shape[1], ref.forced.shape[1])
        assert out.forced[g, :width].tolist() == ref.forced[j, :width].tolist()
        assert not out.forced[g, width:].any() and not ref.forced[j, width:].any()
    return out


@pytest.mark.parametrize("wait", [True, False], ids=["wait", "job"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), wrap=st.sampled_from(["none", "single", "ops", "ops"]), flat=st.booleans())
def test_one_bad_request_never_fails_the_batch(strategy: str, wait: bool, seed: int, wrap: str, flat: bool) -> None:
    check_isolated(make_batch(seed, wrap), strategy, wait, flat)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_kind_of_fault_is_reached(strategy: str) -> None:
    """The random batches do exercise each fault: fixed seeds until every kind has failed a request."""
    seen: set[str] = set()
    for seed in range(400):
        wrap = ["none", "single", "ops"][seed % 3]
        b = make_batch(seed, wrap)
        out = check_isolated(b, strategy, wait=True, flat=False)
        seen |= {"bad-id" for g in b.bad_ids if b.grammar[g] in out.failed}
        seen |= {f"{wrap}:{f.op}" for f in b.faults if f is not None and f.fired}
        seen |= {"dropped" for e in out.failed.values() if "should be dropped" in str(e)}
        want = {"bad-id", "dropped", "single:fill", "single:accept", "single:rollback", "ops:fill", "ops:accept"}
        if strategy in ("batch",):
            want.add("ops:rollback")
        if strategy in ("auto", "chains"):
            want.add("ops:is_terminated")
        if want <= seen:
            return
    pytest.fail(f"faults never reached: {sorted(want - seen)}")


def test_a_batch_chain_call_that_raises_is_redone_one_request_at_a_time() -> None:
    """All requests of a failing chain call are walked again; only the one at fault fails."""
    v = vocab()
    provider = PROVIDERS[0]
    ms = [grammar(provider, REGEXES[0]).matcher() for _ in range(4)]
    rng = random.Random(5)
    drafts = [random_walk(m, v, rng, 3, stop=False) for m in ms]
    drafts = [d + [5] * (3 - len(d)) for d in drafts]
    ops = FaultyOps(ms[0].batch_ops)  # type: ignore[attr-defined]
    assert isinstance(ops, ChainOps)
    faults = [Fault(), Fault("fill", 1, sticky=True), Fault(), Fault()]
    wrapped = [Faulty(m, f, ops) for m, f in zip(ms, faults, strict=True)]
    ids = ["a", "b", "c", "d"]
    layout = ScheduledLayout(ids, [3] * 4, [1] * 4)
    bm = v.new_bitmask(16)
    out = fill_draft_masks(wrapped, drafts, bm, GrammarRows(ids), layout, strategy="chains")
    assert list(out.failed) == [1]
    assert "should be dropped" not in str(out.failed[1])  # nothing was accepted: nothing to roll back
    # The chain call raised at request 1 (after request 0's tick); every healthy request was walked again.
    assert faults[1].calls["fill"] == 1 and faults[0].calls["fill"] >= 2
    assert faults[2].calls["fill"] >= 1 and faults[3].calls["fill"] >= 1
    ref_bm = v.new_bitmask(12)
    keep = [0, 2, 3]
    fill_draft_masks([ms[g] for g in keep], [drafts[g] for g in keep], ref_bm, GrammarRows(["a", "c", "d"]), layout)
    assert torch.equal(bm[0:4], ref_bm[0:4]) and torch.equal(bm[8:16], ref_bm[4:12])
    assert bool((bm[4:8] == stop_row(v)).all())


# ---------------------------------------------------------------- a fault inside a provider's own engine

# Where each provider keeps its engine object, and the engine calls that break.
ENGINES = {
    # xgrammar's batch calls take the native handle.
    "xgrammar": ("raw", ("fill_next_token_bitmask", "accept_token", "traverse_draft_tree", "_handle")),
    "llguidance": ("engine", ("unsafe_compute_mask_ptr", "consume_token", "compute_mask")),
    "outlines-core": ("_guide", ("get_state", "write_mask_into", "advance")),
}


class BrokenEngine:
    """An engine object whose listed attributes raise when used; everything else goes to the real one."""

    def __init__(self, real: Any, broken: Sequence[str]) -> None:
        self._real = real
        self._broken = frozenset(broken)

    def __getattr__(self, name: str) -> Any:
        if name in self._broken:
            raise EngineFault(f"{name}: the engine is broken")
        return getattr(self._real, name)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("provider", [p for p in PROVIDERS if p in ENGINES])
def test_a_fault_inside_a_providers_engine_fails_its_request_alone(provider: str, strategy: str) -> None:
    """The providers' own batch and chain operations meet an engine that raises: only its request fails."""
    v = vocab()
    rng = random.Random(3)
    ms = [grammar(provider, REGEXES[0]).matcher() for _ in range(4)]
    drafts = [random_walk(m, v, rng, 3, stop=False) for m in ms]
    drafts = [d + [5] * (3 - len(d)) for d in drafts]
    probes = [[*d, 0] for d in drafts]
    before = [state_of(m, v, p) for m, p in zip(ms, probes, strict=True)]
    attr, calls = ENGINES[provider]
    setattr(ms[2], attr, BrokenEngine(getattr(ms[2], attr), calls))
    if hasattr(ms[2], "_mask_ok"):
        ms[2]._mask_ok = False  # type: ignore[attr-defined]  # no mask at hand: the engine is asked
    ids = ["a", "b", "c", "d"]
    layout = ScheduledLayout(ids, [3] * 4, [1] * 4)
    bm = torch.randint(-(2**31), 2**31 - 1, (16, v.mask_words), dtype=torch.int32)
    out = fill_draft_masks(ms, drafts, bm, GrammarRows(ids), layout, strategy=strategy)
    assert list(out.failed) == [2]
    err = out.failed[2]
    assert str(err).startswith("matchers[2]: the matcher raised ") and err.__cause__ is not None
    assert bool((bm[8:12] == stop_row(v)).all()) and int(out.acceptable[2]) == 0 and not out.forced[2].any()
    keep = [0, 1, 3]
    ref_bm = v.new_bitmask(12)
    ref = fill_draft_masks(
        [ms[g] for g in keep], [drafts[g] for g in keep], ref_bm, GrammarRows(["a", "b", "d"]), layout
    )
    assert torch.equal(bm[0:8], ref_bm[0:8]) and torch.equal(bm[12:16], ref_bm[8:12])
    assert out.acceptable[keep].tolist() == ref.acceptable.tolist()
    assert out.forced[keep].tolist() == ref.forced.tolist()
    assert [state_of(ms[g], v, probes[g]) for g in keep] == [before[g] for g in keep]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_failed_matcher_stands_in_for_a_grammar_already_failed(strategy: str) -> None:
    """The SDK's FailedMatcher: its request gets the stop-only rows and is reported; the others are untouched."""
    from maskplug.grammar.sdk import FailedMatcher

    v = vocab()
    rng = random.Random(11)
    ms: list[Any] = [grammar(PROVIDERS[0], REGEXES[0]).matcher() for _ in range(3)]
    drafts = [random_walk(m, v, rng, 3, stop=False) for m in ms]
    drafts = [d + [5] * (3 - len(d)) for d in drafts]
    ms[1] = FailedMatcher(v, GrammarError("matchers[1]: the engine broke"))
    with pytest.raises(GrammarError, match="failed earlier: matchers\\[1\\]: the engine broke"):
        ms[1].accept(0)
    assert not ms[1].is_terminated()
    ids = ["a", "b", "c"]
    layout = ScheduledLayout(ids, [3] * 3, [1] * 3)
    bm = torch.randint(-(2**31), 2**31 - 1, (12, v.mask_words), dtype=torch.int32)
    out = fill_draft_masks(ms, drafts, bm, GrammarRows(ids), layout, strategy=strategy)
    assert list(out.failed) == [1] and "the grammar failed earlier" in str(out.failed[1])
    assert bool((bm[4:8] == stop_row(v)).all()) and int(out.acceptable[1]) == 0
    ref_bm = v.new_bitmask(8)
    fill_draft_masks([ms[0], ms[2]], [drafts[0], drafts[2]], ref_bm, GrammarRows(["a", "c"]), layout)
    assert torch.equal(bm[0:4], ref_bm[0:4]) and torch.equal(bm[8:12], ref_bm[4:8])


# ---------------------------------------------------------------- commit and commit_many


def test_commit_turns_an_engine_exception_into_a_grammar_error() -> None:
    v = vocab()
    for provider in PROVIDERS:
        m = grammar(provider, REGEXES[0]).matcher()
        toks = random_walk(m, v, random.Random(2), 3, stop=False)
        assert len(toks) >= 2
        before = state_of(m, v, toks)
        # The second accept raises: the first token is rolled back, the cause is chained.
        w = Faulty(m, Fault("accept", 2), None)
        with pytest.raises(GrammarError, match=r"^matcher: the matcher raised EngineFault") as info:
            commit(w, toks)
        assert isinstance(info.value.__cause__, EngineFault)
        assert "were rolled back" in str(info.value)
        assert state_of(m, v, toks) == before
        # Sticky: the rollback fails too, and the error says the matcher should be dropped.
        w = Faulty(m, Fault("accept", 2, sticky=True), None)
        with pytest.raises(GrammarError, match="should be dropped"):
            commit(w, toks)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
@example(seed=16384)  # a request whose history already ends with its stop token: nothing more to commit
def test_commit_many_fails_only_the_bad_requests(seed: int) -> None:
    rng = random.Random(seed)
    v = vocab()
    n = rng.randint(1, 6)
    inner: list[Matcher] = []
    given_: list[Matcher] = []
    faults: list[Fault] = []
    tokens: list[Any] = []
    bad: set[int] = set()
    for i in range(n):
        m = grammar(rng.choice(PROVIDERS), rng.choice(REGEXES)).matcher()
        for t in random_walk(m, v, rng, rng.randint(0, 2), stop=rng.random() < 0.1):
            assert m.accept(t)
        toks = random_walk(m, v, rng, rng.randint(0, 4), stop=rng.random() < 0.3)
        if rng.random() < 0.3:
            toks.append(rng.randrange(len(v.tokens)))  # perhaps one the grammar refuses
        if toks and rng.random() < 0.2:
            toks[rng.randrange(len(toks))] = rng.choice([-1, v.vocab_size])
            bad.add(i)
        f = Fault()
        if rng.random() < 0.4:
            f = Fault(rng.choice(["accept", "is_terminated"]), rng.randint(1, 3), sticky=rng.random() < 0.5)
        inner.append(m)
        given_.append(Faulty(m, f, None) if rng.random() < 0.8 else m)
        faults.append(f if isinstance(given_[-1], Faulty) else Fault())
        tokens.append(np.asarray(toks, dtype=np.int64) if rng.random() < 0.3 else toks)
    probes = [[t for t in tokens[i] if 0 <= int(t) < v.vocab_size] + [0] for i in range(n)]
    before = [state_of(m, v, p) for m, p in zip(inner, probes, strict=True)]
    twins = [m.fork() for m in inner]
    res = commit_many(given_, tokens)
    assert isinstance(res, CommitResult)
    fired = {i for i, f in enumerate(faults) if f.fired}
    assert set(res.failed) == bad | fired
    for i in range(n):
        if i in bad:
            assert str(res.failed[i]).startswith(f"tokens_per_request[{i}]["), str(res.failed[i])
            assert not faults[i].calls and res.taken[i] == 0
            assert state_of(inner[i], v, probes[i]) == before[i]
        elif i in fired:
            err = res.failed[i]
            assert str(err).startswith(f"matchers[{i}]: ") and isinstance(err.__cause__, EngineFault)
            assert res.taken[i] == 0
            if "should be dropped" not in str(err):
                assert state_of(inner[i], v, probes[i]) == before[i]
        else:
            # Exactly as a single commit of the same tokens on a twin.
            assert res.taken[i] == commit(twins[i], tokens[i])
            assert state_of(inner[i], v, probes[i]) == state_of(twins[i], v, probes[i])


@pytest.mark.parametrize(
    ("args", "arg"),
    [
        (lambda ms: (ms, [[1]]), "tokens_per_request"),
        (lambda ms: (ms, None), "tokens_per_request"),
        (lambda ms: ([ms[0], None], [[1], [1]]), "matchers[1]"),
        (lambda ms: ([ms[0], ms[0]], [[1], [1]]), "matchers[1]"),
        (lambda ms: (ms, [[1], [0.5]]), "tokens_per_request[1]"),
        (lambda ms: (ms, [[1], [[1]]]), "tokens_per_request[1]"),
        (lambda ms: (None, [[1], [1]]), "matchers"),
    ],
    ids=["too-few", "none", "not-a-matcher", "twice", "float", "2d", "matchers-none"],
)
def test_commit_many_structural_errors_raise_before_any_matcher_moves(args: Any, arg: str) -> None:
    v = vocab()
    ms = [grammar(p, REGEXES[0]).matcher() for p in PROVIDERS[:1] * 2]
    toks = random_walk(ms[0], v, random.Random(1), 2, stop=False)
    before = [state_of(m, v, toks) for m in ms]
    a, b = args(ms)
    with pytest.raises(GrammarError) as info:
        commit_many(a, b)
    assert str(info.value).startswith(f"{arg}: "), str(info.value)
    assert [state_of(m, v, toks) for m in ms] == before


# ---------------------------------------------------------------- DraftMasks.failed where DraftMasks are checked


def test_draft_masks_failed_is_checked_and_carried_where_grammar_information_enters() -> None:
    layout = ScheduledLayout(["a", "b", "c"], [2, 3, 1], [1, 1, 1])
    base = (np.array([2, 0]), np.array([1, 0]), np.zeros((2, 4), dtype=bool))
    assert DraftMasks(*base).failed == {} and check_draft_masks(DraftMasks(*base), layout).failed == {}
    err = GrammarError("drafts[1][0]: expected a token id in [0, 7), got 9")
    checked = check_draft_masks(DraftMasks(*base, failed={np.int64(0): err}), layout)
    assert dict(checked.failed) == {0: err} and all(type(k) is int for k in checked.failed)
    with pytest.raises(TypeError):
        checked.failed[2] = err  # type: ignore[index]  # read-only
    for bad, why in (([0], "a mapping"), ({1: err}, "batch indices of grammar.request"), ({True: err}, "batch")):
        with pytest.raises(BudgetError, match=rf"^grammar\.failed: expected {why}"):
            check_draft_masks(DraftMasks(*base, failed=bad), layout)  # type: ignore[arg-type]
