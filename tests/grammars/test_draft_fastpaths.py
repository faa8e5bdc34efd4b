"""The fast draft-row paths: chain operations, position-major batches, the outlines-core mask cache.

``fill_draft_masks``'s default strategy now hands whole draft chains to each
provider (``fill_chains``); the position-major batch path stays reachable
with ``strategy="batch"``. Both are checked here against the slow per-row
oracle (same helper as ``test_grammar_draft``), and the outlines-core mask
cache against fills straight from the engine.
"""

from __future__ import annotations

import random
from functools import lru_cache

import numpy as np
import pytest
import torch
from grammar_testkit import PROVIDERS, REGEXES, allowed_ids, random_walk, state_of, vocab
from hypothesis import given
from hypothesis import strategies as st
from test_grammar_draft import _check, _make_case

from maskplug import GrammarError, GrammarRows, GrammarSpec, ScheduledLayout, fill_draft_masks, grammar_provider
from maskplug.grammar import ChainOps

pytestmark = pytest.mark.skipif(not PROVIDERS, reason="no grammar provider is installed")


@pytest.mark.parametrize("provider", PROVIDERS)
@given(
    seed=st.integers(0, 2**32 - 1),
    mode=st.sampled_from(["ragged", "fixed"]),
    flat=st.booleans(),
    strategy=st.sampled_from(["chains", "batch"]),
)
def test_chain_and_batch_paths_match_reference(provider: str, seed: int, mode: str, flat: bool, strategy: str) -> None:
    rng = random.Random(seed)
    case = _make_case(provider, "spm", rng, rng.randint(1, 5), 5, mode)
    _check(*case, flat=flat, strategy=strategy)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("threads", [1, 2])
def test_chains_on_the_131k_vocab_any_pool_size(provider: str, threads: int) -> None:
    rng = random.Random(77 + threads)
    v, layout, rows, grammar, matchers, drafts, gates = _make_case(provider, "tekken", rng, 12, 7, "ragged")
    _check(v, layout, rows, grammar, matchers, drafts, gates, flat=False, strategy="chains")
    # The same batch twice with different pool sizes writes the same rows.
    total = rows.num_rows(layout)
    a, b = v.new_bitmask(total), v.new_bitmask(total)
    out_a = fill_draft_masks(matchers, drafts, a, rows, layout, active_from=gates, strategy="chains", threads=threads)
    out_b = fill_draft_masks(matchers, drafts, b, rows, layout, active_from=gates, strategy="serial")
    assert torch.equal(a, b)
    np.testing.assert_array_equal(out_a.acceptable, out_b.acceptable)
    np.testing.assert_array_equal(out_a.forced, out_b.forced)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_fill_chains_refuses_terminated_matchers_and_leaves_them_untouched(provider: str) -> None:
    v = vocab("spm")
    c = grammar_provider(provider, v).compile(GrammarSpec("choice", ["yes", "no"]))
    m = c.matcher()
    ops = getattr(m, "batch_ops", None)
    if not isinstance(ops, ChainOps):
        pytest.skip(f"{provider} has no chain operation")
    text = random_walk(m, v, random.Random(3), 10, stop=True)
    for t in text:
        assert m.accept(t)
    assert m.is_terminated()
    bm = v.new_bitmask(4)
    before = bm.clone()
    with pytest.raises(GrammarError, match="matchers"):
        ops.fill_chains([m], bm, [0], [[int(v.eos_ids[0])]], threads=1)
    assert m.is_terminated() and torch.equal(bm, before)
    # fill_draft_masks sends terminated matchers down the generic walk instead.
    layout = ScheduledLayout(["a"], [1], [1])
    rows = GrammarRows(["a"])
    out = fill_draft_masks([m], [[int(v.eos_ids[0])]], bm, rows, layout)
    assert out.acceptable[0] == 0
    assert set(allowed_ids(bm[0], v.vocab_size).tolist()) == set(v.eos_ids)


# ---------------------------------------------------------------- outlines-core mask cache


def _outlines_or_skip() -> type:
    if "outlines-core" not in PROVIDERS:
        pytest.skip("outlines-core provider is not installed")
    from maskplug_outlines import OutlinesProvider

    return OutlinesProvider


@lru_cache(maxsize=8)
def _outlines_provider(capacity_rows: int):  # type: ignore[no-untyped-def]
    """One provider per cache size, kept across examples (compiling an index per example would dominate)."""
    v = vocab("spm")
    return _outlines_or_skip()(v, mask_cache_bytes=capacity_rows * v.mask_words * 4)


def _engine_row(m, v) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The row straight from the engine, bypassing the cache."""
    out = np.zeros(v.mask_words, dtype=np.int32)
    m._write_engine_row(out)
    return out


@given(seed=st.integers(0, 2**32 - 1), capacity_rows=st.sampled_from([1, 2, 3, 64]))
def test_outlines_cached_fills_equal_engine_fills(seed: int, capacity_rows: int) -> None:
    """Along random walks, every cached fill (hits, misses, cache generations turning over) equals the engine's."""
    _outlines_or_skip()
    v = vocab("spm")
    rng = random.Random(seed)
    cached = _outlines_provider(capacity_rows)
    plain = _outlines_provider(0)
    spec = GrammarSpec("regex", rng.choice(REGEXES))
    mc, mp = cached.compile(spec).matcher(), plain.compile(spec).matcher()
    assert mc.grammar.masks.capacity == capacity_rows and mp.grammar.masks.capacity == 0
    walk = random_walk(mp, v, rng, rng.randint(1, 12), stop=True)
    b1, b2 = v.new_bitmask(1), v.new_bitmask(1)
    for t in [*walk, None]:
        for _ in range(2):  # the second fill of a state is a hit
            r1, r2 = mc.fill(b1, 0), mp.fill(b2, 0)
            assert r1 == r2
            assert torch.equal(b1, b2)
            if not mc.is_terminated():
                np.testing.assert_array_equal(b1[0].numpy(), _engine_row(mc, v))
        if t is None:
            break
        assert mc.accept(t) and mp.accept(t)
    assert len(mc.grammar.masks) <= capacity_rows


def test_outlines_chains_with_a_tiny_cache_match_the_uncached_provider() -> None:
    """Cache misses inside a chain (the guide is moved there and back) and generation changes mid-call."""
    provider_cls = _outlines_or_skip()
    v = vocab("tekken")
    n, k = 10, 7
    outs = []
    for cap in (0, 2):
        prov = provider_cls(v, mask_cache_bytes=cap * v.mask_words * 4)
        rng_c = random.Random(5)
        ms, drafts = [], []
        for i in range(n):
            m = prov.compile(GrammarSpec("regex", REGEXES[i % len(REGEXES)])).matcher()
            d = random_walk(m, v, rng_c, k, stop=False)
            if i % 3 == 0 and d:
                d[rng_c.randrange(len(d))] = 5000 + i
            d += [rng_c.randrange(1000, len(v.tokens)) for _ in range(k - len(d))]
            ms.append(m)
            drafts.append(d)
        layout = ScheduledLayout(list(range(n)), [k] * n, [1] * n)
        rows = GrammarRows(list(range(n)))
        bm = v.new_bitmask(rows.num_rows(layout))
        probes = [[*d, 0] for d in drafts]
        before = [state_of(m, v, p) for m, p in zip(ms, probes, strict=True)]
        out = fill_draft_masks(ms, drafts, bm, rows, layout, strategy="chains")
        assert [state_of(m, v, p) for m, p in zip(ms, probes, strict=True)] == before
        outs.append((bm, out))
    (b0, o0), (b1, o1) = outs
    assert torch.equal(b0, b1)
    np.testing.assert_array_equal(o0.acceptable, o1.acceptable)
    np.testing.assert_array_equal(o0.forced, o1.forced)


def test_outlines_bad_cache_size_is_a_grammar_error() -> None:
    provider_cls = _outlines_or_skip()
    with pytest.raises(GrammarError, match="mask_cache_bytes"):
        provider_cls(vocab("spm"), mask_cache_bytes=-1)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_fill_chains_checks_the_buffer_before_writing(provider: str) -> None:
    v = vocab("spm")
    m = grammar_provider(provider, v).compile(GrammarSpec("regex", REGEXES[0])).matcher()
    ops = getattr(m, "batch_ops", None)
    if not isinstance(ops, ChainOps):
        pytest.skip(f"{provider} has no chain operation")
    drafts = [random_walk(m, v, random.Random(9), 3, stop=False)]
    probe = [*drafts[0], 0]
    before = state_of(m, v, probe)
    short = torch.zeros((len(drafts[0]), v.mask_words), dtype=torch.int32)  # one row too few
    narrow = torch.zeros((8, v.mask_words - 1), dtype=torch.int32)
    for bm, rows, needle in ((short, [0], "row"), (narrow, [0], "words per row"), (short, [0, 1], "rows, drafts")):
        keep = bm.clone()
        with pytest.raises(GrammarError, match=needle):
            ops.fill_chains([m], bm, rows, drafts, threads=1)
        assert torch.equal(bm, keep)
        assert state_of(m, v, probe) == before


# -- the serial walk's unchecked calls and the rows' population count ---------------------------


def test_base_matchers_of_every_provider_take_the_unchecked_walk() -> None:
    from maskplug.grammar.bases import MatcherBase, plain_matcher_type

    for name in PROVIDERS:
        m = grammar_provider(name, vocab("spm")).compile(GrammarSpec("regex", "[a-z]{1,4}")).matcher()
        assert isinstance(m, MatcherBase) and plain_matcher_type(type(m)), name


@pytest.mark.parametrize("strategy", ["serial", "threads"])
def test_a_matcher_class_that_overrides_fill_or_accept_is_called_through_them(strategy: str) -> None:
    """A subclass's public ``fill`` / ``accept`` / ``rollback`` run on every row and draft, as before."""
    from maskplug.grammar.bases import plain_matcher_type

    v = vocab("spm")
    base = grammar_provider(PROVIDERS[0], v).compile(GrammarSpec("regex", "[a-z]{1,8}")).matcher()
    calls: list[str] = []

    class Counting(type(base)):  # type: ignore[misc]
        def fill(self, bitmask: torch.Tensor, row: int) -> bool:
            calls.append("fill")
            return super().fill(bitmask, row)

        def accept(self, token: int) -> bool:
            calls.append("accept")
            return super().accept(token)

        def rollback(self, n: int) -> None:
            calls.append("rollback")
            super().rollback(n)

    m = base.fork()
    m.__class__ = Counting
    assert not plain_matcher_type(Counting)
    a = next(i for i, t in enumerate(v.tokens) if t == b"a")
    layout = ScheduledLayout(["r"], [3], [1])
    rows = GrammarRows(["r"])
    bm = v.new_bitmask(rows.num_rows(layout))
    dm = fill_draft_masks([m], [a, a, a], bm, rows, layout, strategy=strategy)
    assert int(dm.acceptable[0]) == 3
    assert calls == ["fill", "accept"] * 3 + ["fill", "rollback"]
    # The same rows as the base class's unchecked walk.
    ref = v.new_bitmask(rows.num_rows(layout))
    fill_draft_masks([base.fork()], [a, a, a], ref, rows, layout, strategy=strategy)
    assert torch.equal(bm, ref)


@given(
    words=st.integers(1, 9),
    n=st.integers(1, 12),
    size_cut=st.integers(0, 31),
    seed=st.integers(0, 2**32 - 1),
    subset=st.booleans(),
    one_size=st.booleans(),
)
def test_row_counts_equal_a_per_row_count(
    words: int, n: int, size_cut: int, seed: int, subset: bool, one_size: bool
) -> None:
    """Both counts of ``row_counts`` against Python's ``int.bit_count`` of each row, sparse rows included."""
    from maskplug.grammar.assembly import row_counts

    rng = np.random.default_rng(seed)
    raw = rng.integers(-(2**31), 2**31, size=(n, words), dtype=np.int64).astype(np.int32)
    # Make rows with no bit, one bit, and bits only past the vocabulary likely.
    for r in range(n):
        kind = rng.integers(0, 4)
        if kind == 0:
            raw[r] = 0
        elif kind == 1:
            raw[r] = 0
            raw[r, rng.integers(0, words)] = np.int32(np.uint32(1 << int(rng.integers(0, 32))).view(np.int32))
        elif kind == 2:
            raw[r] = 0
            raw[r, -1] = np.int32(-(1 << 31))
    bitmask = torch.from_numpy(raw.copy())
    rows = np.sort(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)) if subset else np.arange(n)
    top = words * 32 - size_cut
    sizes: int | np.ndarray = (
        top
        if one_size
        else np.asarray(rng.integers(max(1, (words - 1) * 32 + 1), words * 32 + 1, size=rows.shape[0]), np.int64)
    )
    count, below = row_counts(bitmask, n, rows.astype(np.int64), sizes)
    for i, r in enumerate(rows.tolist()):
        value = int.from_bytes(raw[r].tobytes(), "little")
        size = sizes if isinstance(sizes, int) else int(sizes[i])
        assert int(count[i]) == value.bit_count()
        assert int(below[i]) == (value & ((1 << size) - 1)).bit_count()
