"""GrammarSpec options mean the same for every provider, or the provider refuses them by name.

whitespace (flexible / compact), strict_keys (unlisted object keys) and
unsupported (ignore and report / refuse), fed with the model's own
tokenization; xgrammar's warnings go to logging and the grammar's
``warnings``, never to the console.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import pytest
from maskplug_llguidance import LLGuidanceProvider
from maskplug_outlines import OutlinesProvider
from maskplug_xgrammar import XGrammarProvider

from maskplug.errors import GrammarError
from maskplug.grammar import GrammarSpec, Vocab
from maskplug.grammar.spec import schema_keywords
from maskplug.grammar.vocabs import mistral_sentencepiece

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
CLASSES = {"xgrammar": XGrammarProvider, "llguidance": LLGuidanceProvider, "outlines-core": OutlinesProvider}


@cache
def provider(name: str) -> Any:
    return CLASSES[name](mistral_sentencepiece(), compile_limit_s=120.0)


def accepts(name: str, spec: GrammarSpec, text: str) -> bool:
    v: Vocab = mistral_sentencepiece()
    m = provider(name).compile(spec).matcher()
    return all(m.accept(t) for t in v.encode(text)) and m.accept(v.eos_ids[0])


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_whitespace_compact_allows_none(name: str) -> None:
    spec = GrammarSpec("json_schema", SCHEMA, whitespace="compact")
    assert accepts(name, spec, '{"a":1,"b":"x y"}')
    assert not accepts(name, spec, '{"a": 1}')
    assert not accepts(name, spec, '{"a":1, "b":"x"}')


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_whitespace_flexible_takes_json_dumps_separators(name: str) -> None:
    spec = GrammarSpec("json_schema", SCHEMA)
    assert spec.whitespace == "flexible"
    for text in ('{"a": 1, "b": "x"}', '{"a":1,"b":"x"}'):
        assert accepts(name, spec, text), text


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_whitespace_flexible_takes_any_json_whitespace(name: str) -> None:
    assert accepts(name, GrammarSpec("json_schema", SCHEMA), '{\n  "a" :  1 ,\n\t"b": "x"\n}')


def test_outlines_takes_no_whitespace_before_an_array_comma() -> None:
    """Documented gap: outlines-core's regex has no whitespace position before the comma between array items.

    ``json.dumps`` never writes whitespace there, with or without ``indent``.
    """
    spec = GrammarSpec("json_schema", {"type": "array", "items": {"type": "integer"}})
    for name in ("xgrammar", "llguidance"):
        assert accepts(name, spec, "[1 , 2]"), name
    assert accepts("outlines-core", spec, "[1, 2]")
    assert accepts("outlines-core", spec, "[\n  1,\n  2\n]")
    assert not accepts("outlines-core", spec, "[1 , 2]")


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_strict_keys_refuse_unlisted_keys(name: str) -> None:
    spec = GrammarSpec("json_schema", SCHEMA)
    assert spec.strict_keys is True
    assert accepts(name, spec, '{"a": 1, "b": "x"}')
    assert not accepts(name, spec, '{"a": 1, "c": 2}')


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_strict_keys_false_allows_unlisted_keys(name: str) -> None:
    spec = GrammarSpec("json_schema", SCHEMA, strict_keys=False)
    assert accepts(name, spec, '{"a": 1, "c": 2}')
    assert not accepts(name, spec, '{"a": "not an integer"}')
    # A schema that closes its object itself stays closed.
    closed = GrammarSpec("json_schema", {**SCHEMA, "additionalProperties": False}, strict_keys=False)
    assert not accepts(name, closed, '{"a": 1, "c": 2}')


def test_outlines_cannot_honour_strict_keys_false() -> None:
    p = provider("outlines-core")
    with pytest.raises(GrammarError, match=r"^strict_keys: outlines-core cannot honour strict_keys=False"):
        p.compile(GrammarSpec("json_schema", SCHEMA, strict_keys=False))
    closed = GrammarSpec("json_schema", {**SCHEMA, "additionalProperties": False}, strict_keys=False)
    assert accepts("outlines-core", closed, '{"a": 1}')


UNSUPPORTED = {
    "type": "object",
    "properties": {"n": {"type": "number", "multipleOf": 3}, "xs": {"type": "array", "uniqueItems": True}},
}
# The keyword each engine leaves unenforced in UNSUPPORTED.
IGNORED = {"xgrammar": "multipleOf", "llguidance": "uniqueItems", "outlines-core": "multipleOf"}


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_unsupported_ignore_reports_refuse_raises(name: str) -> None:
    g = provider(name).compile(GrammarSpec("json_schema", UNSUPPORTED))
    assert any(IGNORED[name] in w for w in g.warnings), g.warnings
    with pytest.raises(GrammarError, match=rf"^unsupported: .*{IGNORED[name]}"):
        provider(name).compile(GrammarSpec("json_schema", UNSUPPORTED, unsupported="refuse"))
    clean = provider(name).compile(GrammarSpec("json_schema", SCHEMA, unsupported="refuse"))
    assert clean.warnings == []


@pytest.mark.parametrize("limit", [120.0, None])
def test_xgrammar_warnings_go_to_logging_not_the_console(
    limit: float | None, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    p = XGrammarProvider(mistral_sentencepiece(), compile_limit_s=limit)
    spec = GrammarSpec(
        "json_schema", {"type": "object", "properties": {"e": {"type": "string", "format": "email", "minLength": 3}}}
    )
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="maskplug.xgrammar"):
        g = p.compile(spec)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert any("minLength" in w for w in g.warnings)
    logged = [r.getMessage() for r in caplog.records if r.name == "maskplug.xgrammar"]
    assert any("minLength" in m for m in logged)
    p.worker.close()


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"whitespace": "tabs"}, "whitespace"),
        ({"strict_keys": "yes"}, "strict_keys"),
        ({"unsupported": "warn"}, "unsupported"),
    ],
)
def test_bad_options_name_the_argument(kwargs: dict[str, Any], arg: str) -> None:
    with pytest.raises(GrammarError, match=f"^{arg}: expected"):
        GrammarSpec("json_schema", SCHEMA, **kwargs)


def test_options_are_part_of_the_cache_key() -> None:
    a = GrammarSpec("json_schema", SCHEMA)
    assert a.key() == GrammarSpec("json_schema", dict(reversed(list(SCHEMA.items())))).key()
    keys = {
        a.key(),
        GrammarSpec("json_schema", SCHEMA, whitespace="compact").key(),
        GrammarSpec("json_schema", SCHEMA, strict_keys=False).key(),
        GrammarSpec("json_schema", SCHEMA, unsupported="refuse").key(),
    }
    assert len(keys) == 4
    p = provider("xgrammar")
    assert p.compile(a) is not p.compile(GrammarSpec("json_schema", SCHEMA, strict_keys=False))


def test_schema_keywords_skip_names_data_and_annotations() -> None:
    schema = {
        "title": "t",
        "type": "object",
        "properties": {"minimum": {"type": "integer", "description": "a property called minimum"}},
        "enum": [{"pattern": "data"}],
        "$defs": {"x": {"type": "string", "format": "date"}},
    }
    assert schema_keywords(schema) == {"type", "properties", "enum", "$defs", "format"}
