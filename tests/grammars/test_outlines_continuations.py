"""outlines-core: continuations after a state where the text is already complete.

outlines-core 0.2.14 drops a token whose end state its DFA marks as "a match
ended one byte ago" unless that state is also a full match, so a top-level
number refused ``1.7`` and ``a|ab`` ended at ``a``. maskplug compiles the
regex with a sentinel suffix (``maskplug_outlines.provider.sentinel_pattern``);
these tables pin what must be accepted and refused, with the model's own
tokenisation and one token per character, and check that every row the
matcher fills agrees with what it accepts (the stop ids exactly where the
text is complete).
"""

from __future__ import annotations

from functools import cache

import outlines_core
import pytest
from grammar_testkit import allowed, small_vocab
from maskplug_outlines import OutlinesProvider
from maskplug_outlines.provider import SENTINEL, sentinel_pattern

from maskplug.grammar import GrammarSpec, Vocab
from maskplug.grammar.vocabs import mistral_sentencepiece

NUMBER = GrammarSpec("json_schema", {"type": "number"})
DECIMAL = GrammarSpec("regex", r"(0|[1-9][0-9]*)(\.[0-9]+)?")

# (spec, text, whole text accepted with the stop token)
CASES: list[tuple[GrammarSpec, str, bool]] = [
    (NUMBER, "1.7", True),
    (NUMBER, "12.25", True),
    (NUMBER, "-0.5e+3", True),
    (NUMBER, "7", True),
    (NUMBER, "1.", False),
    (NUMBER, "01", False),
    (GrammarSpec("json_schema", {"type": "integer"}), "120", True),
    (GrammarSpec("json_schema", {"type": "string"}), '"ab"', True),
    (GrammarSpec("json_schema", {"type": "string"}), '"ab', False),
    (GrammarSpec("json_schema", {"type": "object", "properties": {"x": {"type": "number"}}}), '{"x": 1.7}', True),
    (GrammarSpec("json_schema", {"type": "array", "items": {"type": "integer"}}), "[1, 22]", True),
    (DECIMAL, "12.25", True),
    (DECIMAL, "0", True),
    (DECIMAL, "0.5", True),
    (DECIMAL, "12.", False),
    (DECIMAL, "012", False),
    (GrammarSpec("regex", "a|ab"), "ab", True),
    (GrammarSpec("regex", "a|ab"), "a", True),
    (GrammarSpec("regex", "a|ab"), "abb", False),
    (GrammarSpec("choice", ["a", "ab", "abc"]), "abc", True),
    (GrammarSpec("choice", ["a", "ab", "abc"]), "ab", True),
    (GrammarSpec("regex", "[a-z]{1,8}( [0-9]{1,3}){0,3}"), "ab 1 22", True),
    (GrammarSpec("regex", "[a-z]{1,8}( [0-9]{1,3}){0,3}"), "ab ", False),
    (GrammarSpec("regex", "a+b?"), "aab", True),
    (GrammarSpec("regex", "^[a-z]+$"), "abc", True),
    (GrammarSpec("regex", "^[a-z]+$"), "ab1", False),
    # The sentinel is a character these patterns could read: the stop ids must still wait for a whole match.
    (GrammarSpec("regex", ".*"), "", True),
    (GrammarSpec("regex", ".*"), "hi there", True),
    (GrammarSpec("regex", "[^x]*y"), "aby", True),
    (GrammarSpec("regex", "[^x]*y"), "ab", False),
    # Compiled as they are (an inner anchor; the verbose flag).
    (GrammarSpec("regex", "a$|b"), "a", True),
    (GrammarSpec("regex", "a$|b"), "b", True),
    (GrammarSpec("regex", "(?x) a b  # a comment"), "ab", True),
    (GrammarSpec("regex", "(?x) a b  # a comment"), "a", False),
]


@cache
def provider(name: str) -> OutlinesProvider:
    v = small_vocab() if name == "small" else mistral_sentencepiece()
    return OutlinesProvider(v, compile_limit_s=None)


def spellings(v: Vocab, text: str) -> list[list[int]]:
    """The model's own tokenisation (where the vocabulary has an encoder) and one token per byte."""
    out = []
    if v.has_encoder:
        out.append(v.encode(text))
    per_byte = [v.tokens.index(bytes([b])) for b in text.encode()]
    out.append(per_byte)
    return out


def walk(spec: GrammarSpec, v: Vocab, ids: list[int], name: str) -> bool:
    """Feed ``ids`` and a stop token; at every step the filled row must agree with accept and completeness."""
    m = provider(name).compile(spec).matcher()
    stop = v.eos_ids[0]
    for t in ids:
        row = allowed(m, v)
        assert (stop in row) == (m.validate([stop]) == 1)
        ok = m.accept(t)
        assert ok == (t in row)
        if not ok:
            return False
    row = allowed(m, v)
    assert (stop in row) == (m.validate([stop]) == 1)
    return m.accept(stop) and m.is_terminated()


@pytest.mark.parametrize("name", ["small", "spm"])
@pytest.mark.parametrize(("spec", "text", "expected"), CASES, ids=[f"{c[0].kind}:{c[1]!r}" for c in CASES])
def test_table(name: str, spec: GrammarSpec, text: str, expected: bool) -> None:
    v = provider(name).vocab
    for ids in spellings(v, text):
        assert walk(spec, v, ids, name) is expected, (text, ids)


@pytest.mark.parametrize(
    ("regex", "pattern"),
    [
        ("ab", "(?:ab)\\x{10FFFF}"),
        ("^ab$", "(?:ab)\\x{10FFFF}"),
        ("^ab", "(?:ab)\\x{10FFFF}"),
        ("ab\\$", "(?:ab\\$)\\x{10FFFF}"),
        ("[$^]x", "(?:[$^]x)\\x{10FFFF}"),
        ("[]^]x", "(?:[]^]x)\\x{10FFFF}"),
        ("[^]$]", "(?:[^]$])\\x{10FFFF}"),
        ("^$", "(?:)\\x{10FFFF}"),
        ("a$|b", None),
        ("a|^b", None),
        ("(?m)a$", "(?:(?m)a)\\x{10FFFF}"),
        ("\\Aab", None),
        ("ab\\z", None),
        ("(?x)a b", None),
        ("(?ix:a b)", None),
    ],
)
def test_sentinel_pattern(regex: str, pattern: str | None) -> None:
    assert sentinel_pattern(regex) == pattern


def test_the_engine_alone_drops_the_continuation() -> None:
    """The engine fact behind the workaround: its own index of ``1(\\.5)?`` has no ``.`` after ``1``."""
    p = provider("small")
    v = p.vocab
    raw = outlines_core.Index(r"1(\.5)?", p.raw_vocabulary())
    after_one = raw.get_next_state(raw.get_initial_state(), v.tokens.index(b"1"))
    assert after_one is not None and raw.is_final_state(after_one)
    assert raw.get_next_state(after_one, v.tokens.index(b".")) is None
    # maskplug's grammar takes it.
    assert walk(GrammarSpec("regex", r"1(\.5)?"), v, [v.tokens.index(c.encode()) for c in "1.5"], "small")


def test_sentinel_lead_byte_tokens_never_allowed() -> None:
    """Tokens holding U+10FFFF's lead byte are out of the engine's vocabulary: never allowed, even by ``.*``."""
    v = Vocab([b"</s>", b"a", b"\xf4", b"\xf4\x8f", b"b"], eos_ids=(0,))
    p = OutlinesProvider(v, compile_limit_s=None)
    m = p.compile(GrammarSpec("regex", "(?s).*")).matcher()
    assert allowed(m, v) == {0, 1, 4}
    assert SENTINEL.encode()[:1] == b"\xf4"
