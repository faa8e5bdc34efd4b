"""A grammar whose start allows no token (or, for JSON, only the stop token) is a compile error, in every provider."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from maskplug.errors import GrammarError
from maskplug.grammar import GrammarSpec, Vocab, grammar_provider
from maskplug.grammar.bases import ProviderBase, check_start
from maskplug.grammar.vocabs import mistral_sentencepiece

NO_TEXT = r"admits no text: .* start allows no token, not even a stop token"
EMPTY_ONLY = r"admits only the empty output, which is no JSON value"

# (provider, spec, what the error says): each engine compiles these into a grammar with a dead start,
# or refuses them itself (then the engine's words).
DEAD_STARTS = [
    ("llguidance", GrammarSpec("json_schema", {"$ref": "#"}), NO_TEXT),
    ("llguidance", GrammarSpec("regex", r"[^\s\S]"), NO_TEXT),
    ("xgrammar", GrammarSpec("regex", r"[^\s\S]"), NO_TEXT),
    ("xgrammar", GrammarSpec("json_schema", {"anyOf": []}), EMPTY_ONLY),
    ("xgrammar", GrammarSpec("json_schema", {"oneOf": []}), EMPTY_ONLY),
    ("outlines-core", GrammarSpec("json_schema", {"enum": []}), EMPTY_ONLY),
    ("outlines-core", GrammarSpec("regex", r"[^\s\S]"), r"outlines-core failed to compile"),
    ("auto", GrammarSpec("json_schema", {"$ref": "#"}), r"admits no value \(llguidance: .*" + NO_TEXT),
    ("auto", GrammarSpec("regex", r"[^\s\S]"), r"admits no value \(llguidance: .*" + NO_TEXT),
    ("auto", GrammarSpec("json_schema", {"anyOf": []}), r"admits no value"),
]


@pytest.mark.parametrize(
    ("provider", "spec", "message"), DEAD_STARTS, ids=[f"{p}-{s.kind}-{s.source}" for p, s, _ in DEAD_STARTS]
)
def test_a_dead_start_is_a_compile_error(provider: str, spec: GrammarSpec, message: str) -> None:
    p: Any = grammar_provider(provider, mistral_sentencepiece())
    with pytest.raises(GrammarError, match=message):
        p.compile(spec)
    assert spec not in p.cache  # never cached: it raises again


# Languages holding the empty text are fine where the kind allows it.
LIVE_STARTS = [
    ("xgrammar", GrammarSpec("regex", "")),
    ("llguidance", GrammarSpec("regex", "")),
    ("outlines-core", GrammarSpec("regex", "")),
    ("xgrammar", GrammarSpec("choice", [""])),
    ("auto", GrammarSpec("regex", "(ab)?")),
    ("llguidance", GrammarSpec("json_schema", {"type": "integer"})),
]


@pytest.mark.parametrize(("provider", "spec"), LIVE_STARTS, ids=[f"{p}-{s.kind}-{s.source}" for p, s in LIVE_STARTS])
def test_a_live_start_compiles(provider: str, spec: GrammarSpec) -> None:
    v = mistral_sentencepiece()
    g = grammar_provider(provider, v).compile(spec)
    b = v.new_bitmask(1)
    g.matcher().fill(b, 0)
    assert bool(b.any())


class _Row:
    """A matcher whose first row is fixed (what a broken engine would write)."""

    def __init__(self, vocab: Vocab, ids: list[int]) -> None:
        self.vocab, self.ids = vocab, ids

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        bitmask[row].zero_()
        for t in self.ids:
            bitmask[row, t >> 5] |= 1 << (t & 31)
        return True


class _Fixed:
    def __init__(self, vocab: Vocab, ids: list[int]) -> None:
        self.vocab, self.ids = vocab, ids

    def matcher(self) -> _Row:
        return _Row(self.vocab, self.ids)


class _Broken(_Fixed):
    def matcher(self) -> _Row:
        raise RuntimeError("engine exploded")


class _FixedProvider(ProviderBase[Any]):
    """A provider (as a plugin would write one) whose grammars allow exactly ``ids`` at the start."""

    name = "fixed"
    kinds = frozenset({"regex", "json_schema"})

    def __init__(self, vocab: Vocab, ids: list[int]) -> None:
        super().__init__(vocab)
        self.ids = ids

    def _compile(self, spec: GrammarSpec) -> Any:
        return _Fixed(self.vocab, self.ids)


def _small() -> Vocab:
    return Vocab([b"</s>", b"a", b"b", b"{"], eos_ids=(0,), vocab_size=40)


CHECKS = [
    ("regex", [], NO_TEXT),
    ("json_schema", [], NO_TEXT),
    ("json_schema", [0], EMPTY_ONLY),
    ("regex", [0], None),  # a regex matching only the empty text: fine
    ("json_schema", [3], None),
    ("json_schema", [0, 3], None),
    ("regex", [1, 2], None),
]


@pytest.mark.parametrize(("kind", "ids", "message"), CHECKS)
def test_the_check_is_the_providers_base_not_each_engines(kind: str, ids: list[int], message: str | None) -> None:
    v = _small()
    p = _FixedProvider(v, ids)
    spec = GrammarSpec(kind, "a" if kind == "regex" else {"type": "object"})
    if message is None:
        assert p.compile(spec).ids == ids
        assert len(p.cache) == 1
    else:
        with pytest.raises(GrammarError, match=r"^spec\.source: this " + kind + " spec " + message):
            p.compile(spec)
        assert len(p.cache) == 0


def test_an_engine_failing_on_its_first_row_is_a_compile_error() -> None:
    v = _small()
    with pytest.raises(GrammarError, match=r"fixed could not fill the first row: engine exploded"):
        check_start(_Broken(v, [1]), GrammarSpec("regex", "a"), v, "fixed")
