"""GrammarSpec.max_whitespace: the most whitespace characters in a row between JSON items.

A bounded run stops a model that keeps emitting whitespace; the default
admits pretty-printed JSON (``json.dumps(indent=2)``). Every provider is
held to the same table of cases: xgrammar through ``max_whitespace_cnt``,
llguidance and outlines-core through the whitespace pattern
``json_whitespace_regex`` gives.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
from grammar_testkit import allowed
from maskplug_llguidance import LLGuidanceProvider
from maskplug_outlines import OutlinesProvider
from maskplug_xgrammar import XGrammarProvider

from maskplug.conformance import SUBSET_PATH
from maskplug.errors import GrammarError
from maskplug.grammar import GrammarSpec, Vocab
from maskplug.grammar.sdk import json_whitespace_regex
from maskplug.grammar.spec import DEFAULT_MAX_WHITESPACE
from maskplug.grammar.vocabs import mistral_sentencepiece

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}
CLASSES = {"xgrammar": XGrammarProvider, "llguidance": LLGuidanceProvider, "outlines-core": OutlinesProvider}
NAMES = sorted(CLASSES)
WS = frozenset(b" \t\n\r")


@cache
def provider(name: str) -> Any:
    return CLASSES[name](mistral_sentencepiece(), compile_limit_s=120.0)


def vocab() -> Vocab:
    return mistral_sentencepiece()


def accepts(name: str, spec: GrammarSpec, text: str) -> bool:
    v = vocab()
    m = provider(name).compile(spec).matcher()
    return all(m.accept(t) for t in v.encode(text)) and m.accept(v.eos_ids[0])


# -- the option itself ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [True, False, -1, 1.5, "20", float("inf")])
def test_bad_values_are_refused_by_name(bad: Any) -> None:
    with pytest.raises(GrammarError, match="max_whitespace"):
        GrammarSpec("json_schema", SCHEMA, max_whitespace=bad)


def test_default_options_and_key() -> None:
    spec = GrammarSpec("json_schema", SCHEMA)
    assert spec.max_whitespace == DEFAULT_MAX_WHITESPACE == 24
    assert spec.options["max_whitespace"] == DEFAULT_MAX_WHITESPACE
    assert GrammarSpec("json_schema", SCHEMA, max_whitespace=0).options["max_whitespace"] == 0
    assert GrammarSpec("json_schema", SCHEMA, max_whitespace=None).options["max_whitespace"] is None
    keys = {GrammarSpec("json_schema", SCHEMA, max_whitespace=n).key() for n in (None, 0, 1, 24, 100)}
    assert len(keys) == 5
    # The default adds nothing to the key (keys made before the option existed still match).
    assert (
        spec.key()
        == GrammarSpec("json_schema", SCHEMA, max_whitespace=24).key()
        == "json_schema:" + json.dumps(SCHEMA, sort_keys=True, separators=(",", ":"))
    )
    with pytest.raises(TypeError):
        GrammarSpec("json_schema", SCHEMA, 10)  # type: ignore[arg-type,misc]  # keyword-only


@pytest.mark.parametrize("bad", [True, -1, 1.5, "20"])
def test_the_sdk_pattern_refuses_bad_bounds_by_name(bad: Any) -> None:
    with pytest.raises(GrammarError, match="max_whitespace"):
        json_whitespace_regex(bad)


def test_the_sdk_pattern() -> None:
    assert json_whitespace_regex(None) == r"[\x20\x0A\x0D\x09]*"
    assert json_whitespace_regex(0) == ""
    assert json_whitespace_regex(1) == r"[\x20\x0A\x0D\x09]{0,1}"
    assert json_whitespace_regex(24) == r"[\x20\x0A\x0D\x09]{0,24}"


@pytest.mark.parametrize("n", [None, 1, 7, DEFAULT_MAX_WHITESPACE])
def test_outlines_regex_has_the_bound_at_every_whitespace_position(n: int | None) -> None:
    regex = provider("outlines-core").regex_for(GrammarSpec("json_schema", SCHEMA, max_whitespace=n))
    ws = json_whitespace_regex(n)
    # Around the braces, the key, the colon and the comma of {"a": 1, "b": ""}.
    assert regex.count(ws) >= 7, regex
    assert "[ ]?" not in regex.replace(ws, "")


def test_provider_cache_tells_bounds_apart() -> None:
    p = provider("llguidance")
    a = p.compile(GrammarSpec("json_schema", SCHEMA, max_whitespace=3))
    b = p.compile(GrammarSpec("json_schema", SCHEMA, max_whitespace=4))
    assert a is not b and a is p.compile(GrammarSpec("json_schema", SCHEMA, max_whitespace=3))


# -- runaways ------------------------------------------------------------------------------------------------------
def space_run(name: str, spec: GrammarSpec, prefix: str, limit: int) -> int:
    """Feed ``prefix``, then single-space tokens up to ``limit``; return how many were accepted."""
    v = vocab()
    m = provider(name).compile(spec).matcher()
    assert all(m.accept(t) for t in v.encode(prefix))
    space = v.tokens.index(b" ")
    n = 0
    while n < limit and m.accept(space):
        n += 1
    # The JSON can still go on and end after the run.
    assert all(m.accept(t) for t in v.encode("1}")) and m.accept(v.eos_ids[0])
    return n


def greedy_whitespace(name: str, spec: GrammarSpec, prefix: str) -> int:
    """After ``prefix``, take the longest allowed all-whitespace token while any is allowed; the run's length."""
    v = vocab()
    m = provider(name).compile(spec).matcher()
    assert all(m.accept(t) for t in v.encode(prefix))
    ws_ids = sorted(
        (i for i, t in enumerate(v.tokens) if t and set(t) <= WS and i not in v.special_ids),
        key=lambda i: -len(v.tokens[i]),
    )
    run = 0
    for _ in range(10_000):
        ok = allowed(m, v)
        pick = next((i for i in ws_ids if i in ok), None)
        if pick is None:
            break
        assert m.accept(pick)
        run += len(v.tokens[pick])
    return run


@pytest.mark.parametrize("name", NAMES)
def test_ten_thousand_spaces_stop_at_the_bound(name: str) -> None:
    spec = GrammarSpec("json_schema", SCHEMA)
    assert space_run(name, spec, '{"a":', 10_000) == DEFAULT_MAX_WHITESPACE
    assert space_run(name, GrammarSpec("json_schema", SCHEMA, max_whitespace=5), '{"a":', 10_000) == 5
    assert greedy_whitespace(name, spec, '{"a": 1,') == DEFAULT_MAX_WHITESPACE
    assert greedy_whitespace(name, GrammarSpec("json_schema", SCHEMA, max_whitespace=7), "{") == 7


@pytest.mark.parametrize("name", NAMES)
def test_a_bound_of_one_takes_one_character_of_any_kind(name: str) -> None:
    spec = GrammarSpec("json_schema", SCHEMA, max_whitespace=1)
    assert space_run(name, spec, '{"a":', 10_000) == 1
    for ws in (" ", "\n", "\t", "\r"):
        assert accepts(name, spec, '{"a":' + ws + "1}"), repr(ws)
    assert not accepts(name, spec, '{"a":\n 1}')


@pytest.mark.parametrize("name", NAMES)
def test_no_bound_lets_a_long_run_through(name: str) -> None:
    spec = GrammarSpec("json_schema", SCHEMA, max_whitespace=None)
    assert space_run(name, spec, '{"a":', 300) == 300


@pytest.mark.parametrize("name", NAMES)
def test_zero_and_compact_allow_no_whitespace(name: str) -> None:
    for spec in (
        GrammarSpec("json_schema", SCHEMA, max_whitespace=0),
        GrammarSpec("json_schema", SCHEMA, whitespace="compact"),
        GrammarSpec("json_schema", SCHEMA, whitespace="compact", max_whitespace=None),
        GrammarSpec("json_schema", SCHEMA, whitespace="compact", max_whitespace=100),
    ):
        assert accepts(name, spec, '{"a":1,"b":"x y"}'), spec
        assert not accepts(name, spec, '{"a": 1}'), spec
        assert not accepts(name, spec, '{ "a":1}'), spec


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_json_object_is_bounded_too(name: str) -> None:
    spec = GrammarSpec("json_object", max_whitespace=3)
    assert accepts(name, spec, '{"k":   [1, 2]}')
    assert not accepts(name, spec, '{"k":    [1, 2]}')
    assert accepts(name, GrammarSpec("json_object"), '{\n  "k": {\n    "j": 1\n  }\n}')


# -- pretty-printed JSON -------------------------------------------------------------------------------------------
def depth(x: Any) -> int:
    if isinstance(x, dict):
        return 1 + max((depth(v) for v in x.values()), default=0)
    if isinstance(x, list):
        return 1 + max((depth(v) for v in x), default=0)
    return 0


@cache
def nested_instances() -> list[tuple[str, Any, Any]]:
    """Valid instances of the packaged JSONSchemaBench subset nested at least 3 levels deep."""
    out = []
    with open(SUBSET_PATH, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            for t in row["tests"]:
                if t["valid"] and depth(t["data"]) >= 3:
                    out.append((row["id"], row["schema"], t["data"]))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_pretty_printed_instances_are_accepted(name: str) -> None:
    cases = nested_instances()
    assert len(cases) >= 5
    tried = 0
    for sid, schema, data in cases:
        spec = GrammarSpec("json_schema", schema)
        try:
            provider(name).compile(spec)
        except GrammarError:
            continue
        compact = json.dumps(data, ensure_ascii=False)
        if not accepts(name, spec, compact):
            continue  # an engine gap unrelated to whitespace (counted in conformance)
        tried += 1
        for indent in (2, 4):
            pretty = json.dumps(data, indent=indent, ensure_ascii=False)
            lines = pretty.split("\n")[1:]
            longest = 1 + max(len(r) - len(r.lstrip(" ")) for r in lines)  # the newline and the indentation
            assert longest < DEFAULT_MAX_WHITESPACE
            assert accepts(name, spec, pretty), (sid, indent)
    assert tried >= 5


@pytest.mark.parametrize("name", NAMES)
def test_deep_indentation_meets_the_bound(name: str) -> None:
    """The bound counts the newline too: 23 spaces after it fit the default, 24 do not."""
    spec = GrammarSpec("json_schema", SCHEMA)
    assert accepts(name, spec, '{"a":\n' + " " * 23 + "1}")
    assert not accepts(name, spec, '{"a":\n' + " " * 24 + "1}")

    # The newline and the indentation are one run: a smaller bound refuses it.
    small = GrammarSpec("json_schema", SCHEMA, max_whitespace=2)
    assert accepts(name, small, '{\n "a": 1\n}')
    assert not accepts(name, small, '{\n  "a": 1\n}')
