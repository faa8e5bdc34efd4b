"""The outlines-core provider: each normalised engine difference, errors, caching."""

from __future__ import annotations

import json

import numpy as np
import outlines_core
import pytest
import torch
from grammar_testkit import allowed, small_vocab, tid
from maskplug_outlines import OutlinesMatcher, OutlinesProvider

from maskplug import GrammarError
from maskplug.grammar import GrammarSpec, Matcher, Vocab, grammar_provider, grammar_providers, mistral_tekken

NAME = "outlines-core"


def test_registered_with_declared_kinds() -> None:
    assert NAME in grammar_providers()
    p = grammar_provider(NAME, small_vocab())
    assert isinstance(p, OutlinesProvider)
    assert p.kinds == {"regex", "json_schema", "choice"}
    assert p.supports("regex") and not p.supports("ebnf") and not p.supports("lark")
    assert isinstance(p.compile(GrammarSpec("regex", "ab")).matcher(), Matcher)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (GrammarSpec("ebnf", 'root ::= "a"'), "supports"),
        (GrammarSpec("lark", 'start: "a"'), "supports"),
        (GrammarSpec("regex", "a(b"), "failed to compile"),
        (GrammarSpec("regex", 42), "expected a regex str"),
        (GrammarSpec("json_schema", {"type": "strin"}), "cannot turn this JSON schema"),
        (GrammarSpec("json_schema", "{not json"), "not JSON"),
        (GrammarSpec("choice", []), "non-empty list"),
        (GrammarSpec("choice", ["a", ""]), r"spec.source\[1\]"),
        (GrammarSpec("json_object"), "supports"),
    ],
)
def test_bad_specs_raise_grammar_error_and_are_not_cached(spec: GrammarSpec, needle: str) -> None:
    p = OutlinesProvider(small_vocab())
    for _ in range(2):  # a failure is raised again, never served from the cache
        with pytest.raises(GrammarError, match=needle) as info:
            p.compile(spec)
    assert len(p.cache) == 0
    if needle in ("failed to compile", "cannot turn this JSON schema"):
        assert isinstance(info.value.__cause__, ValueError)


def test_compile_cache_per_provider_and_spec() -> None:
    v = small_vocab()
    p = grammar_provider(NAME, v)
    a = p.compile(GrammarSpec("regex", "a+b"))
    assert p.compile(GrammarSpec("regex", "a+b")) is a
    assert p.compile(GrammarSpec("regex", "a+c")) is not a
    assert grammar_provider(NAME, v) is p  # one provider (and cache) per vocabulary
    other = grammar_provider(NAME, small_vocab(extra=32))
    assert other is not p and other.compile(GrammarSpec("regex", "a+b")) is not a


def test_eos_in_final_state_terminates_where_the_engine_raises() -> None:
    v = small_vocab()
    provider = OutlinesProvider(v)
    g = provider.compile(GrammarSpec("regex", "ab"))
    # The engine's own index of the regex as it is (maskplug's has a sentinel suffix, see the provider notes).
    raw = outlines_core.Guide(outlines_core.Index("ab", provider.raw_vocabulary()))
    raw.advance(tid(v, b"ab"), return_tokens=False)
    with pytest.raises(ValueError):
        raw.advance(0, return_tokens=False)  # outlines-core itself refuses EOS in a final state
    m = g.matcher()
    assert not m.accept(0)  # not complete yet: refused, nothing changes
    assert m.accept(tid(v, b"ab")) and m.accept(0) and m.is_terminated()
    assert allowed(m, v) == {0}
    assert not m.accept(tid(v, b"a")) and not m.accept(0)


def test_rollback_counts_the_stop_token_as_one() -> None:
    v = small_vocab()
    m = OutlinesProvider(v).compile(GrammarSpec("regex", "a+b?")).matcher()
    start = allowed(m, v)
    a = tid(v, b"a")
    assert m.accept(a) and m.accept(a)
    after_two = allowed(m, v)
    assert m.accept(0) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and allowed(m, v) == after_two
    m.accept(0)
    m.rollback(3)
    assert allowed(m, v) == start and m.num_accepted == 0


def test_rollback_past_the_engine_limit_and_beyond_history() -> None:
    v = small_vocab()
    m = OutlinesProvider(v).compile(GrammarSpec("regex", "[a-c]{0,200}")).matcher()
    a, b = tid(v, b"a"), tid(v, b"b")
    masks = []
    for i in range(120):  # past outlines-core's bounded rollback window
        masks.append(allowed(m, v))
        assert m.accept(a if i % 3 else b)
    m.rollback(100)
    assert m.num_accepted == 20 and allowed(m, v) == masks[20]
    with pytest.raises(GrammarError, match="at most the 20 accepted"):
        m.rollback(21)
    assert m.num_accepted == 20 and allowed(m, v) == masks[20]
    with pytest.raises(GrammarError):
        m.rollback(-1)


def test_buffer_sized_from_vocab_size_loses_no_id() -> None:
    # tekken: 1,000 control ids in front, so the engine's entry count is 1,000
    # short of the largest id, and a buffer sized from it drops the top ids.
    v = mistral_tekken()
    p = grammar_provider(NAME, v)
    assert isinstance(p, OutlinesProvider)
    g = p.compile(GrammarSpec("regex", "[a-z]+"))
    truth = set(g.index.get_allowed_tokens(g.index.get_initial_state()))
    assert max(truth) >= v.vocab_size - 1000
    entries = sum(1 for t in v.tokens if t) - len(v.special_ids) + 1
    small = torch.zeros(1, v.mask_words, dtype=torch.int32)
    words = (entries + 31) // 32
    outlines_core.Guide(g.index).write_mask_into(small.data_ptr(), words, 4)
    bits = np.unpackbits(small[0].numpy().view(np.uint8), bitorder="little")
    lost = truth - set(np.flatnonzero(bits).tolist())
    assert len(lost) > 0  # the raw engine, with a buffer it accepts, silently loses these
    assert allowed(g.matcher(), v) == truth  # maskplug's full-width row keeps every one


def test_padding_ids_and_out_of_range_tokens() -> None:
    v = small_vocab(extra=40)
    m = OutlinesProvider(v).compile(GrammarSpec("regex", "[a-z]*")).matcher()
    pad = len(v.tokens) + 3
    got = allowed(m, v)
    assert all(i < len(v.tokens) for i in got)
    assert not m.accept(pad)  # padding: a valid id the grammar never allows
    for bad in (v.vocab_size, -1, 1.5, "a"):
        with pytest.raises(GrammarError, match="token"):
            m.accept(bad)  # type: ignore[arg-type]
    assert allowed(m, v) == got


def test_special_tokens_never_allowed_even_when_their_text_matches() -> None:
    tokens = [b"</s>", b"ab", b"a", b"b"]
    v = Vocab(tokens, eos_ids=(0,), special_ids=(1,))
    m = OutlinesProvider(v).compile(GrammarSpec("regex", "ab")).matcher()
    assert allowed(m, v) == {2}
    assert not m.accept(1)


def test_every_stop_id_allowed_in_a_final_state() -> None:
    v = small_vocab(eos=(0, 1))
    m = OutlinesProvider(v).compile(GrammarSpec("regex", "a")).matcher()
    assert 0 not in allowed(m, v) and 1 not in allowed(m, v)
    m.accept(tid(v, b"a"))
    assert {0, 1} <= allowed(m, v)
    assert m.accept(1) and m.is_terminated()


@pytest.mark.parametrize(
    ("bitmask", "row", "needle"),
    [
        (torch.zeros(2, 3, dtype=torch.int32), 0, "words per row"),
        (torch.zeros(2, 4, dtype=torch.int64), 0, "int32"),
        (torch.zeros(2, 8, dtype=torch.int32)[:, ::2], 0, "contiguous"),
        (torch.zeros(2, 4, dtype=torch.int32), 2, "row"),
    ],
)
def test_bad_bitmask_raises_and_writes_nothing(bitmask: torch.Tensor, row: int, needle: str) -> None:
    v = small_vocab()
    assert v.mask_words == 4
    m = OutlinesProvider(v).compile(GrammarSpec("regex", "ab")).matcher()
    before = bitmask.clone()
    with pytest.raises(GrammarError, match=needle):
        m.fill(bitmask, row)
    assert torch.equal(bitmask, before)


def test_fork_reset_validate() -> None:
    v = small_vocab()
    m = OutlinesProvider(v).compile(GrammarSpec("regex", "(ab|cd)+x")).matcher()
    assert isinstance(m, OutlinesMatcher)
    ab, c, d = tid(v, b"ab"), tid(v, b"c"), tid(v, b"d")
    m.accept(ab)
    twin = m.fork()
    x = tid(v, b"x")
    assert twin.accept(c) and twin.accept(d) and twin.accept(x) and twin.accept(0)
    assert m.num_accepted == 1 and not m.is_terminated() and twin.num_accepted == 5
    assert m.validate([c, d, ab, c, x]) == 4 and m.num_accepted == 1
    m.reset()
    assert m.num_accepted == 0 and allowed(m, v) == allowed(OutlinesProvider(v).compile(m.grammar.spec).matcher(), v)


def test_json_schema_and_choice() -> None:
    v = small_vocab()
    p = OutlinesProvider(v)
    m = p.compile(GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})).matcher()
    doc = [tid(v, b'{"'), tid(v, b"a"), tid(v, b'":'), tid(v, b"1"), tid(v, b"}")]
    assert m.validate(doc) == len(doc)
    for t in doc:
        assert m.accept(t)
    assert m.accept(0)
    choice = p.compile(GrammarSpec("choice", ["a.b", "c|d", "x y", "(z)"]))
    for word in (b"a.b", b"c|d", b"x y", b"(z)"):
        assert choice.matcher().validate([tid(v, bytes([c])) for c in word] + [0]) == len(word) + 1
    assert choice.matcher().validate([tid(v, b"a"), tid(v, b"x")]) == 1
    with pytest.raises(GrammarError):
        p.compile(GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})))
