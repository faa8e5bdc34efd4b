"""The normalised matcher contract, for every registered provider.

Each engine difference maskplug hides (special tokens in raw vocabularies, what
rollback counts, the stop token in a final state, terminated matchers, buffer
width and padding, ids outside the vocabulary) has a test here.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from grammar_testkit import PROVIDERS, REGEXES, allowed_ids, compiled, disallowed_token, random_walk, state_of, vocab

from maskplug import GrammarError, GrammarSpec, Vocab, grammar_provider
from maskplug.grammar import SPEC_KINDS, Matcher, MatcherBase, ProviderBase

pytestmark = pytest.mark.skipif(not PROVIDERS, reason="no grammar provider is installed")
params = pytest.mark.parametrize("provider", PROVIDERS)


def _row(m: Matcher, v: Vocab) -> torch.Tensor:
    bm = v.new_bitmask(1)
    m.fill(bm, 0)
    return bm[0]


def _tokens_spelling(v: Vocab, text: bytes) -> int:
    return next(i for i, t in enumerate(v.tokens) if t == text and i not in v.special_ids)


@params
def test_special_tokens_are_never_allowed(provider: str) -> None:
    # The literal texts of control tokens ("</s>", "[INST]") match this regex, yet the
    # control tokens themselves must never be allowed: they are not text.
    v = vocab("tekken")
    c = compiled(provider, "tekken", GrammarSpec("regex", r"(<[/a-z]+>|\[[A-Z_/]+\])+"))
    m = c.matcher()
    bm = v.new_bitmask(1)
    rng = random.Random(5)
    specials = np.array(sorted(v.special_ids - set(v.eos_ids)))
    for _ in range(6):
        m.fill(bm, 0)
        ok = allowed_ids(bm[0], v.vocab_size)
        assert not np.isin(ok, specials).any()
        for s in (0, 1, 3, 4, 999):
            assert not m.accept(s)
        text = [int(t) for t in ok if int(t) not in v.eos_ids]
        if not text:
            break
        assert m.accept(rng.choice(text))
    # The text "</s>" itself is reachable through ordinary tokens.
    m2 = c.matcher()
    assert all(m2.accept(_tokens_spelling(v, bytes([b]))) for b in b"</s>")
    assert not m2.is_terminated()


@params
def test_stop_token_only_when_complete_and_rollback_counts_it(provider: str) -> None:
    v = vocab("spm")
    c = compiled(provider, "spm", GrammarSpec("regex", r"ab(cd)?"))
    m = c.matcher()
    eos = v.eos_ids[0]
    start = state_of(m, v, [eos])
    assert not m.accept(eos)  # incomplete text: refused, state unchanged
    assert state_of(m, v, [eos]) == start
    for ch in b"ab":
        assert m.accept(_tokens_spelling(v, bytes([ch])))
    before_stop = state_of(m, v, [])
    bm = v.new_bitmask(1)
    m.fill(bm, 0)
    assert eos in allowed_ids(bm[0], v.vocab_size)
    assert m.accept(eos) and m.is_terminated()
    m.fill(bm, 0)
    assert allowed_ids(bm[0], v.vocab_size).tolist() == [eos]  # a terminated matcher allows only stop tokens
    assert not m.accept(_tokens_spelling(v, b"c")) and not m.accept(eos)
    m.rollback(1)  # the stop token counts as one
    assert not m.is_terminated() and state_of(m, v, []) == before_stop
    assert m.accept(eos)
    m.rollback(3)  # stop + two letters
    assert state_of(m, v, [eos]) == start


@params
def test_validate_does_not_advance(provider: str) -> None:
    v = vocab("spm")
    c = compiled(provider, "spm", GrammarSpec("regex", REGEXES[0]))
    m = c.matcher()
    walk = random_walk(m, v, random.Random(2), 6, stop=True)
    before = state_of(m, v, [])
    assert m.validate(walk) == len(walk)
    assert state_of(m, v, []) == before
    assert m.validate([disallowed_token(m, v, random.Random(4))]) == 0
    assert m.accept(walk[0])
    bad_next = disallowed_token(m, v, random.Random(5))
    m.rollback(1)
    assert m.validate([walk[0], bad_next, walk[0]]) == 1
    assert state_of(m, v, []) == before


@params
def test_bad_buffers_and_ids_raise_and_touch_nothing(provider: str) -> None:
    v = vocab("spm")
    c = compiled(provider, "spm", GrammarSpec("regex", REGEXES[0]))
    m = c.matcher()
    before = state_of(m, v, [5, 6])
    good = torch.zeros(4, v.mask_words, dtype=torch.int32)
    bad_buffers: list[Any] = [
        torch.zeros(2, v.mask_words + 1, dtype=torch.int32),  # too wide
        torch.zeros(2, v.mask_words - 1, dtype=torch.int32),  # too narrow
        torch.zeros(2, v.mask_words, dtype=torch.int64),
        torch.zeros(v.mask_words, dtype=torch.int32),  # 1-D
        torch.zeros(v.mask_words, 4, dtype=torch.int32).t(),  # strided
        np.zeros((2, v.mask_words), dtype=np.int32),
    ]
    for buf in bad_buffers:
        snapshot = buf.clone() if isinstance(buf, torch.Tensor) else buf.copy()
        with pytest.raises(GrammarError, match="bitmask"):
            m.fill(buf, 0)  # type: ignore[arg-type]
        assert (buf == snapshot).all()
    for row in (-1, 4):
        with pytest.raises(GrammarError, match="row"):
            m.fill(good, row)
    assert (good == 0).all()
    for tok in (-1, v.vocab_size, 10**9):
        with pytest.raises(GrammarError, match="token"):
            m.accept(tok)
        with pytest.raises(GrammarError, match="token"):
            m.validate([tok])
    assert state_of(m, v, [5, 6]) == before


@params
def test_fill_writes_only_its_row_even_in_a_view(provider: str) -> None:
    v = vocab("spm")
    m = compiled(provider, "spm", GrammarSpec("regex", REGEXES[1])).matcher()
    ref = v.new_bitmask(1)
    m.fill(ref, 0)
    big = torch.full((6, v.mask_words), 7, dtype=torch.int32)
    view = big[2:5]  # contiguous, with a storage offset
    assert m.fill(view, 1) is True
    assert torch.equal(big[3], ref[0])
    assert (big[[0, 1, 2, 4, 5]] == 7).all()


@params
def test_padded_vocabulary(provider: str) -> None:
    # A logits width past the tokenizer (and not a multiple of 32): padding ids are never allowed,
    # the mask is exactly ceil(vocab_size/32) words wide, and every allowed id survives the fill.
    base = vocab("spm")
    v = Vocab(base.tokens, base.eos_ids, base.special_ids, vocab_size=32_000 + 77)
    p = grammar_provider(provider, v)
    m = p.compile(GrammarSpec("regex", r"[a-z ]{0,20}")).matcher()
    assert v.mask_words == (32_077 + 31) // 32
    bm = v.new_bitmask(1)
    m.fill(bm, 0)
    ok = allowed_ids(bm[0], 32 * v.mask_words)
    assert ok.max() < len(v.tokens)
    unpadded = base.new_bitmask(1)
    compiled(provider, "spm", GrammarSpec("regex", r"[a-z ]{0,20}")).matcher().fill(unpadded, 0)
    assert ok.tolist() == allowed_ids(unpadded[0], base.vocab_size).tolist()
    assert not m.accept(32_000 + 5)  # padding: refused, not an error
    with pytest.raises(GrammarError):
        m.accept(32_077)


@params
def test_fork_and_reset(provider: str) -> None:
    v = vocab("spm")
    c = compiled(provider, "spm", GrammarSpec("regex", REGEXES[0]))
    m = c.matcher()
    walk = random_walk(m, v, random.Random(9), 4, stop=False)
    start = state_of(m, v, walk)
    for t in walk[:2]:
        assert m.accept(t)
    mid = state_of(m, v, walk[2:])
    twin = m.fork()
    assert twin is not m and state_of(twin, v, walk[2:]) == mid  # the same state
    for t in walk[2:]:
        assert twin.accept(t)
    assert state_of(m, v, walk[2:]) == mid  # advancing the twin leaves the original alone
    twin.rollback(len(walk[2:]))
    assert state_of(twin, v, walk[2:]) == mid
    m.reset()
    assert state_of(m, v, walk) == start
    assert state_of(twin, v, walk[2:]) == mid  # and resetting the original leaves the twin alone


@params
def test_fork_keeps_termination_and_rollback_undoes_it_separately(provider: str) -> None:
    v = vocab("spm")
    m = compiled(provider, "spm", GrammarSpec("regex", r"ab(cd)?")).matcher()
    for ch in b"ab":
        assert m.accept(_tokens_spelling(v, bytes([ch])))
    eos = v.eos_ids[0]
    assert m.accept(eos)
    twin = m.fork()
    assert twin.is_terminated()
    twin.rollback(1)
    assert not twin.is_terminated() and m.is_terminated()
    assert eos in allowed_ids(_row(twin, v), v.vocab_size)  # "ab" is complete: the stop is allowed again
    twin.rollback(2)  # back to the start, where the stop is refused
    assert twin.validate([eos]) == 0
    assert allowed_ids(_row(m, v), v.vocab_size).tolist() == [eos]
    m.reset()
    assert not m.is_terminated() and not twin.is_terminated() and twin.validate([eos]) == 0


@params
def test_compile_errors_and_caching(provider: str) -> None:
    p = grammar_provider(provider, vocab("spm"))
    spec = GrammarSpec("regex", REGEXES[2])
    assert p.compile(spec) is p.compile(spec)
    for kind in SPEC_KINDS:
        if not p.supports(kind):
            with pytest.raises(GrammarError, match="kind"):
                p.compile(GrammarSpec(kind, "x"))
    bad = [GrammarSpec("regex", "(ab"), GrammarSpec("json_schema", '{"type": "strin"}')]
    bad.append(GrammarSpec("json_schema", "{not json"))
    for spec in bad:
        if not p.supports(spec.kind):
            continue
        for _ in range(2):  # a failure is reported again, never cached as a success
            with pytest.raises(GrammarError):
                p.compile(spec)
    with pytest.raises(GrammarError, match="kind"):
        GrammarSpec("yaml", "x")


@params
def test_batch_ops_agree_with_single_calls(provider: str) -> None:
    v = vocab("spm")
    c = compiled(provider, "spm", GrammarSpec("regex", REGEXES[0]))
    ms = [c.matcher() for _ in range(5)]
    ops = getattr(ms[0], "batch_ops", None)
    if ops is None:
        pytest.skip(f"{provider} offers no batch operations (fill_draft_masks uses its per-request path)")
    rng = random.Random(11)
    walks = [random_walk(ms[0], v, rng, 3, stop=True) for _ in ms]
    twins = [c.matcher() for _ in ms]
    toks = [w[0] if w else 5 for w in walks]
    toks[1] = v.eos_ids[0]
    toks[2] = v.vocab_size - 1
    got = ops.accept(ms, toks)
    assert got == [t.accept(x) for t, x in zip(twins, toks, strict=True)]
    bm_a, bm_b = v.new_bitmask(5), v.new_bitmask(5)
    ops.fill(ms, bm_a, [4, 3, 2, 1, 0])
    for i, t in enumerate(twins):
        t.fill(bm_b, 4 - i)
    assert torch.equal(bm_a, bm_b)
    counts = [1 if ok else 0 for ok in got]
    ops.rollback(ms, counts)
    for t, k in zip(twins, counts, strict=True):
        t.rollback(k)
    fresh = c.matcher()
    assert all(state_of(m, v, []) == state_of(fresh, v, []) for m in ms)


class _Flaky(ProviderBase):
    name = "flaky"
    kinds = frozenset({"regex"})

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        self.calls = 0

    def _compile(self, spec: GrammarSpec):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 1:
            raise GrammarError("spec.source: transient failure")
        return object()


def test_provider_base_never_caches_failures() -> None:
    p = _Flaky(Vocab([b"a", b"</s>"], [1]))
    spec = GrammarSpec("regex", "a")
    with pytest.raises(GrammarError, match="transient"):
        p.compile(spec)
    assert spec not in p.cache
    first = p.compile(spec)
    assert p.compile(spec) is first and p.calls == 2
    assert (p.cache.hits, p.cache.misses) == (1, 2)
    with pytest.raises(GrammarError, match="supports"):
        p.compile(GrammarSpec("ebnf", "root ::= 'a'"))


def test_matcher_base_requires_engine_primitives() -> None:
    m = MatcherBase(Vocab([b"a", b"</s>"], [1]))
    with pytest.raises(NotImplementedError):
        m.accept(0)


@params
@pytest.mark.parametrize("extra", [1, 5, 1000])
def test_rollback_past_the_history_is_refused_and_changes_nothing(provider: str, extra: int) -> None:
    # Undoing more than was accepted is a GrammarError naming n, on a terminated
    # matcher too, and leaves the matcher as it was: still terminated, same row,
    # and a rollback within the history still works afterwards.
    v = vocab("spm")
    m = compiled(provider, "spm", GrammarSpec("regex", r"[a-c]{2,4}")).matcher()
    walk = random_walk(m, v, random.Random(extra), 8, stop=True)
    for t in walk:
        assert m.accept(t)
    assert m.is_terminated()
    before = _row(m, v).clone()
    with pytest.raises(GrammarError, match=r"^n: "):
        m.rollback(len(walk) + extra)
    assert m.is_terminated()
    assert torch.equal(_row(m, v), before)
    m.rollback(len(walk))
    assert not m.is_terminated()
    assert all(m.accept(t) for t in walk) and m.is_terminated()
