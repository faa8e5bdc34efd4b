"""The ``auto`` provider: each spec served by the provider that enforces all of it, with fallbacks and reasons."""

from __future__ import annotations

from typing import Any

import pytest
from grammar_testkit import SLOW_OUTLINES

from maskplug.conformance import SUBSET_PATH
from maskplug.errors import GrammarError
from maskplug.grammar import GrammarSpec, grammar_provider, grammar_providers
from maskplug.grammar.auto import AutoProvider
from maskplug.grammar.limits import wall_backstop
from maskplug.grammar.vocabs import mistral_sentencepiece, mistral_tekken

DATA = SUBSET_PATH
# xgrammar warns that it does not enforce multipleOf on numbers; llguidance enforces it.
MULTIPLE_OF = {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 3}}, "required": ["n"]}


def _accepts(grammar: object, text: str) -> bool:
    v = mistral_sentencepiece()
    m = grammar.matcher()  # type: ignore[attr-defined]
    return all(m.accept(t) for t in v.encode(text)) and m.accept(v.eos_ids[0])


def test_auto_is_a_provider_per_vocabulary() -> None:
    v = mistral_sentencepiece()
    a = grammar_provider("auto", v)
    assert isinstance(a, AutoProvider) and grammar_provider("auto", v) is a
    assert a.candidates[:3] == ["llguidance", "xgrammar", "outlines-core"]
    # Registered like every provider, and never its own candidate.
    assert "auto" in grammar_providers() and "auto" not in a.candidates


def test_prefers_the_provider_that_enforces_every_keyword() -> None:
    a = AutoProvider(mistral_sentencepiece(), candidates=["xgrammar", "llguidance"])
    spec = GrammarSpec("json_schema", MULTIPLE_OF)
    g = a.compile(spec)
    assert g.served_by == "llguidance" and "enforces every keyword" in g.why
    choice = a.explain(spec)
    assert choice is not None and choice.served_by == "llguidance"
    assert choice.tried[0][0] == "xgrammar" and "multipleOf" in choice.tried[0][1]
    assert _accepts(g, '{"n": 9}') and not _accepts(g, '{"n": 10}')
    assert _accepts(a.provider("xgrammar").compile(spec), '{"n": 10}')  # what xgrammar would have let through


def test_when_every_provider_leaves_something_out_the_fewest_serves() -> None:
    # llguidance does not implement uniqueItems, xgrammar does not enforce multipleOf on numbers.
    schema = {
        "type": "object",
        "properties": {"n": {"type": "number", "multipleOf": 3}, "xs": {"type": "array", "uniqueItems": True}},
    }
    a = AutoProvider(mistral_sentencepiece(), candidates=["llguidance", "xgrammar"])
    g = a.compile(GrammarSpec("json_schema", schema))
    choice = a.explain(GrammarSpec("json_schema", schema))
    assert choice is not None and [n for n, _ in choice.tried] == ["llguidance", "xgrammar"]
    assert g.served_by in ("llguidance", "xgrammar") and "leaves out the fewest" in g.why
    assert g.warnings  # what is not enforced stays visible on the grammar


def test_falls_back_on_grammar_error() -> None:
    a = AutoProvider(mistral_sentencepiece(), candidates=["outlines-core", "xgrammar"])
    g = a.compile(GrammarSpec("ebnf", 'root ::= "a" | "b"'))
    choice = a.explain(GrammarSpec("ebnf", 'root ::= "a" | "b"'))
    assert g.served_by == "xgrammar" and choice is not None
    assert choice.tried[0] == ("outlines-core", "does not support ebnf")
    g2 = a.compile(GrammarSpec("json_schema", MULTIPLE_OF, strict_keys=False))
    choice2 = a.explain(GrammarSpec("json_schema", MULTIPLE_OF, strict_keys=False))
    assert g2.served_by == "xgrammar" and choice2 is not None
    assert "strict_keys" in choice2.tried[0][1]


def test_falls_back_on_the_compile_time_limit() -> None:
    v = mistral_sentencepiece()
    a = AutoProvider(v, candidates=["outlines-core", "llguidance"])
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}}})
    slow: Any = grammar_provider("outlines-core", v)  # the outlines-core provider, with its compile_limit_s
    before = slow.compile_limit_s
    slow.compile_limit_s = 0.001  # this provider's limit; llguidance keeps its own
    try:
        g = a.compile(spec)
    finally:
        slow.compile_limit_s = before
    choice = a.explain(spec)
    assert g.served_by == "llguidance" and choice is not None
    assert "within its limit" in choice.tried[0][1]


def test_no_provider_compiles_it() -> None:
    a = AutoProvider(mistral_sentencepiece(), candidates=["xgrammar", "llguidance"])
    with pytest.raises(GrammarError, match=r"^spec: no grammar provider could compile this regex spec \(xgrammar: "):
        a.compile(GrammarSpec("regex", "a(b"))
    assert a.explain(GrammarSpec("regex", "a(b")) is None


def test_bad_candidates_name_the_argument() -> None:
    with pytest.raises(GrammarError, match=r"^candidates: "):
        AutoProvider(mistral_sentencepiece(), candidates=["nope"])
    with pytest.raises(GrammarError, match=r"^candidates: expected registered providers .*'auto'"):
        AutoProvider(mistral_sentencepiece(), candidates=["auto"])
    with pytest.raises(GrammarError, match=r"^candidates: expected at least one"):
        AutoProvider(mistral_sentencepiece(), candidates=[])


def test_auto_goal_on_the_subset() -> None:
    """Compiled and valid accepted >= the best single provider's; invalid accepted <= xgrammar's."""
    from maskplug.conformance import load_cases, run

    cases = load_cases(DATA)
    reports = run(["xgrammar", "llguidance", "auto"], cases, mistral_tekken(), engine=False, compile_limit_s=120.0)
    by = {r.provider: r for r in reports}
    auto = by["auto"]
    assert auto.compiled >= max(by["xgrammar"].compiled, by["llguidance"].compiled)
    assert auto.valid_accepted >= max(by["xgrammar"].valid_accepted, by["llguidance"].valid_accepted)
    assert auto.invalid_accepted <= by["xgrammar"].invalid_accepted
    assert sum(auto.summary()["served_by"].values()) == auto.compiled


def test_the_compile_limit_holds_for_auto_as_a_whole() -> None:
    """All attempts together stay within auto's limit; candidates left when it is spent are not tried."""
    import time

    v = mistral_tekken()
    a = AutoProvider(v, candidates=["outlines-core", "llguidance"], compile_limit_s=0.3)
    spec = SLOW_OUTLINES  # its outlines-core automaton over tekken's 131k tokens takes seconds
    for name in a.candidates:
        a.provider(name).cache.clear()
        a.provider(name).worker.start()  # start-up is not a request's time
    began = time.monotonic()
    with pytest.raises(GrammarError, match="was spent"):
        a.compile(spec)
    # The budget counts the compile servers' CPU time; wall-clock, the compile's backstop bounds it.
    cpu = a.provider("outlines-core").worker.last_cpu_s
    assert cpu is not None and 0.3 <= cpu < 0.3 + 0.2
    assert time.monotonic() - began < wall_backstop(0.3) + 2.0
    assert a.explain(spec) is None
    b = AutoProvider(v, candidates=["llguidance", "outlines-core"], compile_limit_s=30.0)
    assert b.compile(spec).served_by == "llguidance"
