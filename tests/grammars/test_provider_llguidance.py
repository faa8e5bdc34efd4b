"""The llguidance provider: each normalised engine difference, errors, caching, batch fills."""

from __future__ import annotations

from typing import Any

import llguidance
import numpy as np
import pytest
import torch
from grammar_testkit import allowed, small_vocab, tid
from maskplug_llguidance import LLGuidanceMatcher, LLGuidanceProvider

from maskplug import GrammarError
from maskplug.data import load_schemas
from maskplug.grammar import GrammarSpec, Matcher, Vocab, grammar_provider, grammar_providers, mistral_sentencepiece

NAME = "llguidance"
SCHEMAS = dict(load_schemas())


def _registered(v: Vocab) -> LLGuidanceProvider:
    """The registered llguidance provider for ``v``."""
    p = grammar_provider(NAME, v)
    assert isinstance(p, LLGuidanceProvider)
    return p


def test_registered_with_every_kind() -> None:
    assert NAME in grammar_providers()
    p = grammar_provider(NAME, small_vocab())
    assert isinstance(p, LLGuidanceProvider)
    assert p.kinds == {"json_schema", "json_object", "regex", "ebnf", "lark", "choice"}
    assert isinstance(p.compile(GrammarSpec("regex", "ab")).matcher(), Matcher)


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (GrammarSpec("regex", "a[0-9]+"), b"a12", b"ab"),
        (GrammarSpec("lark", 'start: "a" NUM\nNUM: /[0-9]+/'), b"a12", b"ab"),
        (GrammarSpec("ebnf", 'root ::= "a" [0-9]+'), b"a12", b"ab"),
        (GrammarSpec("choice", ["a12", 'q"x', "z\\y"]), b'q"x', b"a1x"),
        (GrammarSpec("json_object"), b'{"a":1}', b"[1]"),
        (
            GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}),
            b'{"a":12}',
            b'{"a":"',
        ),
    ],
)
def test_every_kind_compiles_and_matches(spec: GrammarSpec, good: bytes, bad: bytes) -> None:
    v = small_vocab()
    g = LLGuidanceProvider(v).compile(spec)
    ids = [tid(v, bytes([c])) for c in good]
    m = g.matcher()
    for t in ids:
        assert m.accept(t), (spec, bytes([v.tokens[t][0]]))
    assert m.accept(0) and m.is_terminated()
    wrong = [tid(v, bytes([c])) for c in bad]
    assert g.matcher().validate(wrong) < len(wrong)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (GrammarSpec("regex", "a(b"), "could not compile this regex spec"),
        (GrammarSpec("regex", 3), "expected a str"),
        (GrammarSpec("lark", "start: nothing_defined"), "could not compile this lark spec"),
        (GrammarSpec("ebnf", "root ::= ("), "ebnf"),
        (GrammarSpec("json_schema", {"type": "strin"}), "could not compile this json_schema spec"),
        (GrammarSpec("json_schema", "{not json"), "not JSON"),
        (GrammarSpec("json_schema", [1]), "expected a JSON schema object"),
        (GrammarSpec("choice", "ab"), "non-empty list"),
        (GrammarSpec("choice", ["a", 2]), r"spec.source\[1\]"),
    ],
)
def test_bad_specs_raise_grammar_error_and_are_not_cached(spec: GrammarSpec, needle: str) -> None:
    p = LLGuidanceProvider(small_vocab())
    for _ in range(2):
        with pytest.raises(GrammarError, match=needle):
            p.compile(spec)
    assert len(p.cache) == 0


def test_compile_cache_per_provider_and_spec() -> None:
    v = small_vocab()
    p = _registered(v)
    a = p.compile(GrammarSpec("regex", "a+b"))
    assert p.compile(GrammarSpec("regex", "a+b")) is a and p.cache.hits >= 1
    assert p.compile(GrammarSpec("lark", 'start: "a"')) is not a
    assert grammar_provider(NAME, v) is p


def test_no_sticky_error_state() -> None:
    v = small_vocab()
    g = LLGuidanceProvider(v).compile(GrammarSpec("regex", "a[0-9]+"))
    a, x, one = tid(v, b"a"), tid(v, b"x"), tid(v, b"1")
    # The raw engine: a refused token puts it in an error state that rollback does not leave.
    raw = llguidance.LLMatcher(g.provider.tokenizer, g.grammar, log_level=0)
    assert raw.consume_token(a) and not raw.consume_token(x) and raw.is_error()
    raw.rollback(1)
    assert raw.is_error()
    # maskplug: refused, state unchanged, and the matcher goes on.
    m = g.matcher()
    assert m.accept(a)
    before = allowed(m, v)
    assert not m.accept(x) and not m.accept(tid(v, b"ab")) and not m.accept(0)
    assert not m.engine.is_error() and allowed(m, v) == before
    assert m.accept(one) and m.accept(0)


def test_engine_refusal_after_a_mask_allowed_token_is_recovered() -> None:
    """If the engine ever refused a token its mask allowed, the matcher is rebuilt, never left in error."""
    v = small_vocab()
    g = LLGuidanceProvider(v).compile(GrammarSpec("regex", "a[0-9]+"))
    m = g.matcher()
    a, x, one = tid(v, b"a"), tid(v, b"x"), tid(v, b"1")
    assert m.accept(a)
    before = allowed(m, v)

    class Refusing:
        """Forwards to the real engine, but makes it fail the next consume."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def consume_token(self, token: int) -> bool:
            return bool(self.inner.consume_token(x))  # puts the real engine in its error state

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    m.engine = Refusing(m.engine)  # type: ignore[assignment]  # a stand-in engine, on purpose
    assert not m.accept(one)
    assert isinstance(m.engine, llguidance.LLMatcher) and not m.engine.is_error()
    assert m.num_accepted == 1 and allowed(m, v) == before
    assert m.accept(one) and m.accept(0)


def test_accept_agrees_with_the_canonical_mask() -> None:
    """llguidance's mask keeps forced text canonical while its consume_token takes other spellings."""
    v = mistral_sentencepiece()
    schema = SCHEMAS["weather_tool_call"]
    g = _registered(v).compile(GrammarSpec("json_schema", schema))
    tok = g.provider.tokenizer
    prefix = tok.tokenize_str('{"name":"')
    m = g.matcher()
    for t in prefix:
        assert m.accept(t)
    get, g_ = v.tokens.index(b"get"), v.tokens.index(b"g")
    assert allowed(m, v) == {get}  # forced "get_weather": only its canonical first token
    raw = llguidance.LLMatcher(tok, g.grammar, log_level=0)
    assert raw.consume_tokens(prefix) and raw.validate_tokens([g_]) == 1  # the raw engine would take "g"
    assert not m.accept(g_)  # maskplug's accept agrees with the mask
    assert m.accept(get)


def test_rollback_counts_the_stop_token_as_one() -> None:
    v = small_vocab()
    g = LLGuidanceProvider(v).compile(GrammarSpec("regex", "(ab)+"))
    ab = tid(v, b"ab")
    # The raw engine: EOS does not count, so rollback(1) after it undoes "ab".
    raw = llguidance.LLMatcher(g.provider.tokenizer, g.grammar, log_level=0)
    assert raw.consume_tokens([ab, ab, 0])
    raw.rollback(1)
    assert not raw.is_stopped() and raw.validate_tokens([0]) == 1
    m = g.matcher()
    start = allowed(m, v)
    assert m.accept(ab) and m.accept(ab)
    after_two = allowed(m, v)
    assert m.accept(0) and m.is_terminated() and allowed(m, v) == {0}
    m.rollback(1)
    assert not m.is_terminated() and allowed(m, v) == after_two and m.num_accepted == 2
    m.accept(0)
    m.rollback(3)
    assert allowed(m, v) == start and m.num_accepted == 0
    with pytest.raises(GrammarError, match="at most the 0 accepted"):
        m.rollback(1)


def test_padded_vocabulary_and_special_tokens() -> None:
    v = small_vocab(extra=70, eos=(0, 1))
    m = LLGuidanceProvider(v).compile(GrammarSpec("regex", "[a-c]+")).matcher()
    assert v.mask_words * 32 >= v.vocab_size > len(v.tokens)
    got = allowed(m, v)
    assert got and max(got) < len(v.tokens) and 0 not in got and 1 not in got
    assert not m.accept(len(v.tokens) + 5)
    with pytest.raises(GrammarError, match="token"):
        m.accept(v.vocab_size)
    m.accept(tid(v, b"a"))
    assert {0, 1} <= allowed(m, v)  # every stop id once the text is complete
    assert m.accept(1) and m.is_terminated()
    # A control token whose text the grammar would match is still never allowed.
    w = Vocab([b"</s>", b"ab", b"a", b"b"], eos_ids=(0,), special_ids=(1,))
    n = LLGuidanceProvider(w).compile(GrammarSpec("regex", "ab")).matcher()
    assert allowed(n, w) == {2} and not n.accept(1)


def test_wrong_bitmask_raises_and_writes_nothing() -> None:
    v = small_vocab()
    m = LLGuidanceProvider(v).compile(GrammarSpec("regex", "ab")).matcher()
    for bm, row in (
        (torch.zeros(2, v.mask_words + 1, dtype=torch.int32), 0),
        (torch.zeros(2, v.mask_words, dtype=torch.int32), 5),
    ):
        before = bm.clone()
        with pytest.raises(GrammarError):
            m.fill(bm, row)
        assert torch.equal(bm, before)


def test_fork_reset_validate() -> None:
    v = small_vocab()
    m = LLGuidanceProvider(v).compile(GrammarSpec("regex", "(ab|cd)+x")).matcher()
    assert isinstance(m, LLGuidanceMatcher)
    ab, c, d, x = tid(v, b"ab"), tid(v, b"c"), tid(v, b"d"), tid(v, b"x")
    m.accept(ab)
    twin = m.fork()
    assert twin.accept(c) and twin.accept(d) and twin.accept(x) and twin.accept(0)
    assert m.num_accepted == 1 and twin.num_accepted == 5
    assert m.validate([c, d, ab, c, x]) == 4 and m.num_accepted == 1
    m.reset()
    assert m.num_accepted == 0 and allowed(m, v) == allowed(m.grammar.matcher(), v)


def test_batch_fill_matches_one_by_one() -> None:
    """The executor's parallel fill writes exactly what each matcher's own fill writes."""
    v = mistral_sentencepiece()
    p = _registered(v)
    tok = p.tokenizer
    schema = SCHEMAS["order"]
    doc = '{"order_id":"ORD-123456","items":[{"sku":"a b","qty":3,"price":9.5}],"paid":true,"currency":"EUR"}'
    ids = tok.tokenize_str(doc)
    specs = [GrammarSpec("json_schema", schema), GrammarSpec("regex", "[a-z]+( [a-z]+)*"), GrammarSpec("json_object")]
    rng = np.random.default_rng(0)
    ms: list[LLGuidanceMatcher] = []
    for k in range(24):
        m = p.compile(specs[k % 3]).matcher()
        if k % 3 == 0:
            for t in ids[: int(rng.integers(0, len(ids) + 1))]:
                assert m.accept(t)
            if k == 0:
                for t in ids[m.num_accepted :]:
                    assert m.accept(t)
                assert m.accept(v.eos_ids[0])  # one terminated matcher among them
        elif k % 3 == 1:
            m.accept(v.tokens.index(b"hello"))
        ms.append(m)
    rows = rng.permutation(len(ms) + 3)[: len(ms)].tolist()
    batch = v.new_bitmask(len(ms) + 3)
    batch.zero_()
    p.batch_ops.fill(ms, batch, rows)
    one = v.new_bitmask(len(ms) + 3)
    one.zero_()
    for m, r in zip(ms, rows, strict=True):
        fresh = m.fork()  # no cached mask: computed again from the engine
        fresh.fill(one, r)
    assert torch.equal(batch, one)
    # Accept right after a batch fill agrees with the filled rows.
    for m, r in zip(ms, rows, strict=True):
        row = batch[r]
        pick = [t for t in rng.integers(0, len(v.tokens), 40).tolist()]
        for t in pick:
            ok = bool((int(row[t >> 5]) >> (t & 31)) & 1)
            assert m.accept(t) == ok
            if ok:
                m.rollback(1)


def test_batch_accept_and_rollback_match_one_by_one() -> None:
    """The executor's parallel consume gives the results and states of each matcher's own accept."""
    v = mistral_sentencepiece()
    p = _registered(v)
    schema = SCHEMAS["order"]
    doc = '{"order_id":"ORD-123456","items":[{"sku":"a b","qty":3,"price":9.5}],"paid":true,"currency":"EUR"}'
    ids = p.tokenizer.tokenize_str(doc)
    g = p.compile(GrammarSpec("json_schema", schema))
    rng = np.random.default_rng(1)
    ms = []
    for k in range(16):
        m = g.matcher()
        for t in ids[: k * len(ids) // 16]:
            assert m.accept(t)
        ms.append(m)
    twins = [m.fork() for m in ms]
    bm = v.new_bitmask(len(ms))
    p.batch_ops.fill(ms, bm, list(range(len(ms))))
    # Half the tokens are the document's next (allowed), half random (mostly refused), plus odd ones.
    toks = [ids[k * len(ids) // 16] if k % 2 == 0 else int(rng.integers(0, len(v.tokens))) for k in range(len(ms))]
    toks[1], toks[3] = v.eos_ids[0], 0  # a stop token that is not allowed yet, a control token
    got = p.batch_ops.accept(ms, toks)
    want = [t.accept(tok) for t, tok in zip(twins, toks, strict=True)]
    assert got == want and any(got) and not all(got)
    for m, twin in zip(ms, twins, strict=True):
        assert m.num_accepted == twin.num_accepted and allowed(m, v) == allowed(twin, v)
    p.batch_ops.rollback(ms, [int(x) for x in got])
    for k, m in enumerate(ms):
        assert m.num_accepted == k * len(ids) // 16
        assert torch.equal(torch.from_numpy(m._mask), bm[k]) or not m._mask_ok
        fresh = v.new_bitmask(1)
        m.fill(fresh, 0)
        assert torch.equal(fresh[0], bm[k])
