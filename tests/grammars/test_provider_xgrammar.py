"""xgrammar's raw behaviour next to maskplug's wrapping of it: each difference the wrapper hides."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from grammar_testkit import allowed_ids, vocab
from maskplug_xgrammar import XGrammarProvider

from maskplug import GrammarError, GrammarSpec, Vocab, grammar_provider, grammar_providers

xgr = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.skipif("xgrammar" not in grammar_providers(), reason="maskplug-xgrammar is not installed")


def _registered(v: Vocab) -> XGrammarProvider:
    """The registered xgrammar provider for ``v``."""
    p = grammar_provider("xgrammar", v)
    assert isinstance(p, XGrammarProvider)
    return p


def _ids(v, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    """Single-byte tokens spelling ``text`` (always present in both vocabularies)."""
    out = []
    for b in text.encode():
        out.append(next(i for i, t in enumerate(v.tokens) if t == bytes([b]) and i not in v.special_ids))
    return out


def test_raw_xgrammar_treats_literal_special_text_as_grammar_text() -> None:
    # Handing xgrammar the special tokens' literal text lets a grammar allow "</s>" the control token.
    v = vocab("tekken")
    raw_info = xgr.TokenizerInfo(v.tokens, xgr.VocabType.RAW, vocab_size=v.vocab_size, stop_token_ids=[2])
    raw = xgr.GrammarMatcher(xgr.GrammarCompiler(raw_info).compile_regex(r"\[INST\]"))
    bm = v.new_bitmask(1)
    raw.fill_next_token_bitmask(bm, 0)
    assert 3 in allowed_ids(bm[0], v.vocab_size)  # id 3 is [INST]
    m = grammar_provider("xgrammar", v).compile(GrammarSpec("regex", r"\[INST\]")).matcher()
    m.fill(bm, 0)
    assert 3 not in allowed_ids(bm[0], v.vocab_size)
    assert not m.accept(3)
    assert all(m.accept(t) for t in _ids(v, "[INST]"))


def test_raw_rollback_and_wrapper_rollback_agree_on_the_stop_token() -> None:
    v = vocab("spm")
    p = _registered(v)
    c = p.compile(GrammarSpec("regex", "ab"))
    m = c.matcher()
    for t in _ids(v, "ab"):
        assert m.accept(t)
    assert m.accept(2) and m.is_terminated()
    m.rollback(2)  # the stop token and "b"
    assert not m.is_terminated()
    assert m.validate([*_ids(v, "b"), 2]) == 2
    # The raw engine after a stop token: no more tokens, and a fill of only stop tokens.
    raw = xgr.GrammarMatcher(c.raw)
    for t in _ids(v, "ab"):
        assert raw.accept_token(t)
    assert raw.accept_token(2) and raw.is_terminated()


def test_raw_errors_are_runtime_errors_wrapper_raises_grammar_error() -> None:
    v = vocab("spm")
    c = _registered(v).compile(GrammarSpec("regex", "ab"))
    wide = torch.zeros(1, v.mask_words + 1, dtype=torch.int32)
    with pytest.raises(RuntimeError):
        xgr.GrammarMatcher(c.raw).fill_next_token_bitmask(wide, 0)
    with pytest.raises(GrammarError, match="words per row"):
        c.matcher().fill(wide, 0)
    assert (wide == 0).all()


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
         '{"a": 12}'),
        (GrammarSpec("json_object"), '{"k": [1, "x", null]}'),
        (GrammarSpec("regex", r"[0-9]{3}-[a-z]+;"), "123-abc;"),
        (GrammarSpec("ebnf", 'root ::= "x" num "."\nnum ::= [0-9]+'), "x42."),
        (GrammarSpec("lark", 'start: "hi" NAME "!"\nNAME: /[a-z]+/'), "hibob!"),
        (GrammarSpec("choice", ['say "yes"', "naïve", "🚀"]), "naïve"),
    ],
)  # fmt: skip
def test_every_kind_compiles_and_accepts_a_document(spec: GrammarSpec, text: str) -> None:
    v = vocab("spm")
    m = grammar_provider("xgrammar", v).compile(spec).matcher()
    toks = _ids(v, text)
    assert m.validate([*toks, 2]) == len(toks) + 1
    assert m.validate([*_ids(v, text[:-1]), 2]) == len(text.encode()) - 1  # one character short: no stop yet


def test_bad_specs() -> None:
    p = grammar_provider("xgrammar", vocab("spm"))
    cases = [
        (GrammarSpec("json_schema", "{bad"), "not JSON"),
        (GrammarSpec("json_schema", {"type": "strin"}), "strin"),
        (GrammarSpec("json_schema", 5), "dict or str"),
        (GrammarSpec("regex", "(a"), "parenthesis"),
        (GrammarSpec("ebnf", "root ::= undefined_rule"), "undefined_rule"),
        (GrammarSpec("choice", []), "non-empty"),
        (GrammarSpec("choice", "ab"), "list of strings"),
        (GrammarSpec("regex", None), "str"),
    ]
    for spec, reason in cases:
        with pytest.raises(GrammarError, match=reason):
            p.compile(spec)
        assert spec not in p.cache  # type: ignore[attr-defined]


# -- the compile worker's round trip -------------------------------------------------------------------------------
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
_WARNS = {"type": "object", "properties": {"e": {"type": "string", "format": "email", "minLength": 3}}}


def test_the_worker_sends_a_grammar_only_when_its_transfer_costs_more_than_compiling_again() -> None:
    import math

    from maskplug_xgrammar.provider import worker_compiler

    v = vocab("spm")
    spec = GrammarSpec("json_schema", _SCHEMA)
    again = worker_compiler(v, 1, 0.0)
    assert again(spec) == (None, [])
    sent, warns = worker_compiler(v, 1, math.inf)(spec)
    assert isinstance(sent, str) and warns == []
    # A compile that warns is always sent: compiled again in the caller, its warnings would reach the console.
    ser, warns = again(GrammarSpec("json_schema", _WARNS))
    assert isinstance(ser, str) and any("minLength" in w for w in warns)


def test_a_grammar_compiled_again_is_the_in_process_grammar(capfd: pytest.CaptureFixture[str]) -> None:
    """A grammar the worker does not send is compiled again in the caller, quietly, to the same grammar."""
    from maskplug_xgrammar.provider import worker_compiler

    from maskplug.grammar.sdk import CompileWorker

    v = vocab("tekken")
    worker = XGrammarProvider(v, max_threads=1)  # the default limit: compiles in the worker
    # Whether a grammar is sent depends on its compile's CPU time: a rate of 0 never sends one.
    worker.worker.close()
    worker.worker = CompileWorker(worker.name, worker_compiler, (v.with_encoder(None), 1, 0.0))
    here = XGrammarProvider(v, compile_limit_s=None)
    worker.worker.start()
    spec = GrammarSpec("json_schema", _SCHEMA)
    capfd.readouterr()
    g = worker.compile(spec)
    assert worker._compiled_again == 1
    assert g.raw.serialize_json() == here.compile(spec).raw.serialize_json()
    assert capfd.readouterr() == ("", "")
    # Bit for bit the same rows along a document.
    bm_a, bm_b = v.new_bitmask(1), v.new_bitmask(1)
    ma, mb = g.matcher(), here.compile(spec).matcher()
    for t in [*v.encode('{"a": 12, "b": "x y"}'), v.eos_ids[0]]:
        ma.fill(bm_a, 0)
        mb.fill(bm_b, 0)
        assert torch.equal(bm_a, bm_b)
        assert ma.accept(t) and mb.accept(t)
    # One that warns comes back from the worker, its warnings with it.
    w = worker.compile(GrammarSpec("json_schema", _WARNS))
    assert worker._compiled_again == 1 and any("minLength" in x for x in w.warnings)
    worker.worker.close()


def test_matchers_call_xgrammars_object_directly_and_walk_as_the_public_methods() -> None:
    import maskplug_xgrammar.provider as xp

    v = vocab("spm")
    c = _registered(v).compile(
        GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    )
    m = c.matcher()
    assert xp._DIRECT is True  # this xgrammar takes the calls as its Python methods pass them
    # Bound to closures over the C++ object, not to xgrammar's Python methods.
    assert getattr(m._fill, "__self__", None) is None and getattr(m._rollback, "__self__", None) is m.raw._handle
    raw = xgr.GrammarMatcher(c.raw, terminate_without_stop_token=False, max_rollback_tokens=-1)
    ours, theirs = v.new_bitmask(1), v.new_bitmask(1)
    for t in _ids(v, '{"a": 12'):
        m.fill(ours, 0)
        raw.fill_next_token_bitmask(theirs, 0)
        assert torch.equal(ours, theirs)
        assert m.accept(t) and raw.accept_token(t)
    assert not m.accept(_ids(v, "x")[0]) and not raw.accept_token(_ids(v, "x")[0])
    m.rollback(3)
    raw.rollback(3)
    m.fill(ours, 0)
    raw.fill_next_token_bitmask(theirs, 0)
    assert torch.equal(ours, theirs)


def test_an_xgrammar_that_has_moved_on_keeps_the_public_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    import maskplug_xgrammar.provider as xp

    class _TwoArgs:
        """A C++ object whose calls take no ``debug_print``."""

        def __init__(self, real: Any) -> None:
            self.real = real

        def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
            return bool(self.real.fill_next_token_bitmask(bitmask, row, False))

        def accept_token(self, token: int) -> bool:
            return bool(self.real.accept_token(token, False))

        def rollback(self, n: int) -> None:
            self.real.rollback(n)

    class _Thin:
        """Python methods that only forward to ``_handle``, as xgrammar's do (this one's takes two arguments)."""

        def __init__(self, real: Any) -> None:
            self.real = real
            self._handle: Any = _TwoArgs(real._handle)

        def fork(self) -> Any:
            return type(self)(self.real.fork())

        def accept_token(self, token_id: int) -> bool:
            return self._handle.accept_token(token_id)

        def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
            return self._handle.fill_next_token_bitmask(bitmask, index)

        def rollback(self, num_tokens: int = 1) -> None:
            self._handle.rollback(num_tokens)

    class _Converts(_Thin):
        """Python methods that do more than forward (here: a contiguous copy of the bitmask first)."""

        def __init__(self, real: Any) -> None:
            self.real = real
            self._handle = real._handle

        def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
            return bool(self._handle.fill_next_token_bitmask(bitmask.contiguous(), index, False))

        def accept_token(self, token_id: int) -> bool:
            return bool(self._handle.accept_token(token_id, False))

    v = vocab("spm")
    c = _registered(v).compile(GrammarSpec("regex", "ab"))
    real = xgr.GrammarMatcher(c.raw, terminate_without_stop_token=False, max_rollback_tokens=-1)
    assert xp._direct_calls_agree(real, v.mask_words)
    # The probe refuses calls the object does not take; the code check refuses methods that do more
    # (whose calls would otherwise pass the probe).
    assert not xp._direct_calls_agree(_Thin(real), v.mask_words)
    assert not xp._direct_calls_agree(_Converts(real), v.mask_words)
    h = real._handle
    assert h.fill_next_token_bitmask(v.new_bitmask(1), 0, False) in (True, False)
    monkeypatch.setattr(xp, "_DIRECT", None)
    assert xp._direct_calls(_Converts(real), v.mask_words) is None
    assert xp._DIRECT is False
    # With the calls refused, a matcher is bound to xgrammar's public methods.
    m = c.matcher()
    assert m._fill == m.raw.fill_next_token_bitmask and m._accept == m.raw.accept_token
    assert all(m.accept(t) for t in _ids(v, "ab"))
