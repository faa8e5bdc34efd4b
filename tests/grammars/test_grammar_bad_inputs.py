"""Bad arguments to the grammar side's entry points are GrammarErrors naming the argument, never errors from deep inside."""

from __future__ import annotations

import json
from typing import Any

import pytest

from maskplug import GrammarError, GrammarSpec, Vocab, grammar_provider
from maskplug.grammar.spec import MAX_SCHEMA_DEPTH
from maskplug.grammar.vocabs import mistral_sentencepiece

TOKENS = [b"<s>", b"</s>", b"a", b"b"]


@pytest.mark.parametrize("name", [["xgrammar"], ("llguidance",), None, 3, b"xgrammar"])
def test_grammar_provider_name_of_the_wrong_type(name: Any) -> None:
    with pytest.raises(GrammarError, match=r"^name: expected a provider name \(str\)"):
        grammar_provider(name, mistral_sentencepiece())


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"eos_ids": ["x"]}, r"eos_ids\[0\]"),
        ({"eos_ids": [1.5]}, r"eos_ids\[0\]"),
        ({"eos_ids": [True]}, r"eos_ids\[0\]"),
        ({"eos_ids": "1"}, "eos_ids"),
        ({"eos_ids": [1], "special_ids": [0, None]}, r"special_ids\[1\]"),
        ({"eos_ids": [1], "special_ids": 0}, "special_ids"),
        ({"eos_ids": [1], "vocab_size": 8.0}, "vocab_size"),
        ({"eos_ids": [1], "vocab_size": "8"}, "vocab_size"),
    ],
)
def test_vocab_ids_that_are_not_ints(kwargs: dict[str, Any], arg: str) -> None:
    with pytest.raises(GrammarError, match=rf"^{arg}: expected"):
        Vocab(TOKENS, **kwargs)


def test_vocab_ids_as_numpy_ints_still_work() -> None:
    np = pytest.importorskip("numpy")
    v = Vocab(TOKENS, eos_ids=[np.int64(1)], special_ids=np.array([0]), vocab_size=np.int32(8))
    assert v.eos_ids == (1,) and v.special_ids == frozenset({0, 1}) and v.vocab_size == 8


def _deep(levels: int) -> dict[str, Any]:
    root: dict[str, Any] = {"type": "object", "properties": {}}
    cur = root
    for _ in range(levels):
        nxt: dict[str, Any] = {"type": "object", "properties": {}}
        cur["properties"]["a"] = nxt
        cur = nxt
    return root


@pytest.mark.parametrize("levels", [MAX_SCHEMA_DEPTH, 1_000, 3_000])
@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_nested_too_deep_is_refused_by_the_spec(levels: int, as_text: bool) -> None:
    schema: Any = _deep(levels)
    if as_text:
        # json.dumps recurses; build the text iteratively like a client would send it.
        inner = '{"type":"object","properties":{}}'
        for _ in range(levels):
            inner = '{"type":"object","properties":{"a":' + inner + "}}"
        schema = inner
    with pytest.raises(GrammarError, match=rf"^source: expected a JSON schema nested at most {MAX_SCHEMA_DEPTH}"):
        GrammarSpec("json_schema", schema)


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps({"type": "string", "pattern": "[" * 2_000, "description": "{" * 2_000})
    assert GrammarSpec("json_schema", text).source == text


def test_a_deep_but_allowed_schema_still_compiles() -> None:
    spec = GrammarSpec("json_schema", _deep(20))
    prov = grammar_provider("llguidance", mistral_sentencepiece()) if "llguidance" in _providers() else None
    if prov is None:
        pytest.skip("llguidance is not installed")
    assert prov.compile(spec).matcher() is not None


def _providers() -> list[str]:
    from maskplug import grammar_providers

    return grammar_providers()
