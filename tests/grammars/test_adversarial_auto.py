"""``auto`` serves only what it knows an engine enforces, and an unsatisfiable schema is final.

Every entry of :data:`maskplug.grammar.auto.KEYWORD_COVERAGE` is checked
against the installed engine with a probe: a schema, an instance it admits
and one it refuses only because of that keyword. An entry under
``enforces`` must see the engine accept the good instance and refuse the bad
one (or warn that it cannot: auto counts a warning as a gap); one under
``ignores`` must see the engine fail somewhere (refuse the compile, refuse
the good instance or accept the bad one). So a table that no longer matches
an engine fails here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from grammar_testkit import small_vocab

from maskplug.errors import GrammarError
from maskplug.grammar import GrammarSpec, Vocab, grammar_provider
from maskplug.grammar.auto import (
    CONSTRAINT_KEYWORDS,
    KEYWORD_COVERAGE,
    AutoProvider,
    coverage_gaps,
    schema_constraints,
    unsatisfiable,
)

Probe = tuple[Any, Any, Any]  # schema, an instance it admits, an instance only this entry refuses

_OBJ_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
PROBES: dict[str, list[Probe]] = {
    "type": [({"type": "integer"}, 5, "x")],
    "enum": [({"enum": [1, "a"]}, 1, 2)],
    "const": [({"const": 7}, 7, 8)],
    "properties": [({"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": 1}, {"a": "x"})],
    "required": [({"type": "object", "properties": _OBJ_AB, "required": ["a"]}, {"a": 1}, {"b": 1})],
    "additionalProperties": [
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"}},
            {"a": 1, "z": 2},
            {"a": 1, "z": "q"},
        )
    ],
    "patternProperties": [
        ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"xa": 1}, {"xa": "s"})
    ],
    "propertyNames": [({"type": "object", "propertyNames": {"maxLength": 2}}, {"ab": 1}, {"abcd": 1})],
    "minProperties": [({"type": "object", "minProperties": 2}, {"a": 1, "b": 2}, {"a": 1})],
    "maxProperties": [({"type": "object", "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2})],
    "dependentRequired": [
        ({"type": "object", "properties": _OBJ_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1})
    ],
    "dependentSchemas": [
        (
            {"type": "object", "properties": _OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}},
            {"a": 1, "b": 2},
            {"a": 1},
        )
    ],
    "dependencies": [
        ({"type": "object", "properties": _OBJ_AB, "dependencies": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1})
    ],
    "unevaluatedProperties": [
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False},
            {"a": 1},
            {"a": 1, "b": 2},
        ),
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": {"type": "integer"}},
            {"a": 1, "b": 2},
            {"a": 1, "b": "x"},
        ),
    ],
    "items": [({"type": "array", "items": {"type": "integer"}}, [1, 2], [1, "x"])],
    "prefixItems": [
        ({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}}, ["a", 1], [1, 1])
    ],
    "additionalItems": [
        ({"type": "array", "items": [{"type": "string"}], "additionalItems": {"type": "integer"}}, ["a", 1], ["a", "b"])
    ],
    "unevaluatedItems": [
        ({"type": "array", "prefixItems": [{"type": "string"}], "unevaluatedItems": False}, ["a"], ["a", 1])
    ],
    "minItems": [({"type": "array", "minItems": 2}, [1, 2], [1])],
    "maxItems": [({"type": "array", "maxItems": 1}, [1], [1, 2])],
    "uniqueItems": [({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1])],
    "contains": [({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, [1, 3], [1, 2])],
    "minContains": [
        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}, "minContains": 2}, [3, 3], [3, 1])
    ],
    "maxContains": [
        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}, "maxContains": 1}, [3, 1], [3, 3])
    ],
    "minLength": [({"type": "string", "minLength": 3}, "abc", "ab")],
    "maxLength": [({"type": "string", "maxLength": 2}, "ab", "abc")],
    "pattern": [({"type": "string", "pattern": "^[a-c]+$"}, "ab", "xy")],
    "minimum": [({"type": "integer", "minimum": 5}, 5, 4)],
    "maximum": [({"type": "integer", "maximum": 5}, 5, 6)],
    "exclusiveMinimum": [({"type": "integer", "exclusiveMinimum": 5}, 6, 5)],
    "exclusiveMaximum": [({"type": "integer", "exclusiveMaximum": 5}, 4, 5)],
    "multipleOf": [({"type": "integer", "multipleOf": 3}, 6, 7)],
    "anyOf": [({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x")],
    # Disjoint branches must be exact; overlapping ones (both admit "a") exact or warned about.
    "oneOf": [
        ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
        ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 1}]}, "ab", "a"),
    ],
    "allOf": [
        ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, 5, 4),
        ({"allOf": [{"type": "string"}, {"maxLength": 2}]}, "ab", "abc"),
    ],
    "not": [({"type": "integer", "not": {"const": 2}}, 3, 2)],
    "if": [({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}}, 12, 11)],
    "then": [({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}}, 12, 11)],
    "else": [({"type": "integer", "if": {"minimum": 10}, "then": {"const": 10}, "else": {"const": 3}}, 3, 4)],
    "$ref": [({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i"}, 1, "x")],
    "$defs": [({"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i"}, 1, "x")],
    "definitions": [({"definitions": {"i": {"type": "integer"}}, "$ref": "#/definitions/i"}, 1, "x")],
}
FORMATS: dict[str, tuple[str, str]] = {
    "date": ("2020-01-02", "hello"),
    "time": ("10:20:30Z", "hello"),
    "date-time": ("2020-01-02T10:20:30Z", "hello"),
    "duration": ("P3D", "hello"),
    "email": ("a@b.com", "hello"),
    "hostname": ("example.com", "-bad-!"),
    "ipv4": ("1.2.3.4", "hello"),
    "ipv6": ("::1", "hello"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "hello"),
    "uri": ("http://a.b/c", "hello"),
    "uri-reference": ("/a/b", "a b"),
    "idn-email": ("a@b.com", "hello"),
    "iri": ("http://a.b/c", "hello"),
    "json-pointer": ("/a/b", "hello"),
    "regex": ("a+", "(("),
}
for _f, (_good, _bad) in FORMATS.items():
    PROBES[f"format:{_f}"] = [({"type": "string", "format": _f}, _good, _bad)]

ENTRIES = [
    (prov, entry, verdict)
    for prov, cov in sorted(KEYWORD_COVERAGE.items())
    for verdict, entries in (("enforces", cov.enforces), ("ignores", cov.ignores))
    for entry in sorted(entries)
]


def _vocab() -> Vocab:
    return small_vocab()


def _ids(v: Vocab, data: Any) -> list[int]:
    return [v.tokens.index(bytes([c])) for c in json.dumps(data).encode()]


def _admits(g: Any, v: Vocab, data: Any) -> bool:
    m = g.matcher()
    return all(m.accept(t) for t in _ids(v, data)) and m.accept(v.eos_ids[0])


def _outcome(provider: str, probe: Probe) -> tuple[str, list[str]]:
    """``"exact"``, ``"warned"``, or how the engine failed the probe (``"compile error"``, ``"refuses valid"``, ...)."""
    schema, good, bad = probe
    v = _vocab()
    p = grammar_provider(provider, v)
    spec = GrammarSpec("json_schema", schema, strict_keys=False, compile_limit_s=float("inf"))
    try:
        g = p.compile(spec)
    except GrammarError as exc:
        if "strict_keys" not in str(exc):  # outlines-core closes every object: ask it so
            return "compile error", [str(exc)]
        try:
            g = p.compile(GrammarSpec("json_schema", schema, compile_limit_s=float("inf")))
        except GrammarError as exc2:
            return "compile error", [str(exc2)]
    warns = list(getattr(g, "warnings", []) or [])
    if not _admits(g, v, good):
        return "refuses valid", warns
    if _admits(g, v, bad):
        return ("warned" if warns else "accepts invalid"), warns
    return ("warned" if warns else "exact"), warns


def test_every_entry_has_a_probe_and_is_a_constraint() -> None:
    for _, entry, _ in ENTRIES:
        assert entry in PROBES, entry
        assert entry.startswith("format:") or entry in CONSTRAINT_KEYWORDS, entry
    for cov in KEYWORD_COVERAGE.values():
        assert not cov.enforces & cov.ignores


@pytest.mark.parametrize(("provider", "entry", "verdict"), ENTRIES, ids=[f"{p}-{v}-{e}" for p, e, v in ENTRIES])
def test_the_coverage_table_matches_the_engine(provider: str, entry: str, verdict: str) -> None:
    outcomes = [_outcome(provider, probe) for probe in PROBES[entry]]
    if verdict == "enforces":
        # Exact on every probe; where the engine cannot be exact it must say so (auto counts warnings).
        assert all(o in ("exact", "warned") for o, _ in outcomes), outcomes
        assert outcomes[0][0] == "exact", outcomes
    else:
        # Left out: some probe shows it (a refused compile, a refused valid instance or an accepted
        # invalid one, warned about or not).
        assert any(o != "exact" for o, _ in outcomes), outcomes


# -- auto never claims an engine enforces what it drops ---------------------------------------------

SILENT_DROPS = [
    {"type": "integer", "not": {"const": 2}},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}},
    {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}},
    {"type": "object", "properties": _OBJ_AB, "dependentRequired": {"a": ["b"]}},
]


@pytest.mark.parametrize("schema", SILENT_DROPS, ids=lambda s: sorted(schema_constraints(s) - {"type", "items"})[0])
def test_auto_refuses_what_no_engine_enforces_with_unsupported_refuse(schema: dict[str, Any]) -> None:
    auto = AutoProvider(_vocab())
    with pytest.raises(GrammarError, match=r"^unsupported: no grammar provider enforces every keyword"):
        auto.compile(GrammarSpec("json_schema", schema, unsupported="refuse"))


@pytest.mark.parametrize("schema", SILENT_DROPS, ids=lambda s: sorted(schema_constraints(s) - {"type", "items"})[0])
def test_auto_never_says_enforces_every_keyword_for_a_dropped_one(schema: dict[str, Any]) -> None:
    auto = AutoProvider(_vocab())
    spec = GrammarSpec("json_schema", schema)
    g = auto.compile(spec)
    choice = auto.explain(spec)
    assert choice is not None
    assert "no provider enforces every keyword" in choice.why
    assert all("enforces every keyword" != r for _, r in choice.tried), choice.tried
    assert g.served_by in KEYWORD_COVERAGE


def test_the_not_case_of_the_report() -> None:
    """``not`` with refuse: xgrammar used to serve it and accept 2."""
    auto = AutoProvider(_vocab(), candidates=["xgrammar"])
    with pytest.raises(GrammarError, match=r"xgrammar: does not enforce \['not'\]"):
        auto.compile(GrammarSpec("json_schema", {"type": "integer", "not": {"const": 2}}, unsupported="refuse"))


def test_auto_still_serves_what_an_engine_enforces() -> None:
    auto = AutoProvider(_vocab())
    spec = GrammarSpec(
        "json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}, unsupported="refuse"
    )
    g = auto.compile(spec)
    assert g.served_by == "llguidance" and "enforces every keyword" in g.why


def test_a_provider_with_no_table_is_judged_by_its_warnings() -> None:
    assert coverage_gaps("some-plugin", GrammarSpec("json_schema", {"not": {}})) is None
    assert coverage_gaps("xgrammar", GrammarSpec("regex", "a+")) == []


CONSTRAINTS = [
    ({"type": "string", "format": "uri", "title": "x", "x-foo": {"not": {}}}, {"type", "format", "format:uri"}),
    ({"enum": [{"not": 1}], "const": {"uniqueItems": True}}, {"enum", "const"}),
    ({"properties": {"not": {"type": "integer"}}}, {"properties", "type"}),
    ({"$defs": {"a": {"contains": {}}}, "default": {"minimum": 1}}, {"$defs", "contains"}),
    ({"dependencies": {"a": ["b"], "c": {"uniqueItems": True}}}, {"dependencies", "uniqueItems"}),
    ({"anyOf": [{"if": {}}, {"else": {}}]}, {"anyOf", "if", "else"}),
    ({"unknownKeyword": {"not": {}}}, set()),
]


@pytest.mark.parametrize(("schema", "want"), CONSTRAINTS)
def test_schema_constraints_finds_keywords_not_data(schema: dict[str, Any], want: set[str]) -> None:
    assert schema_constraints(schema) == want


# -- an unsatisfiable schema is final ---------------------------------------------------------------

UNSAT = [
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"enum": []},
    {"type": "integer", "minimum": 5, "maximum": 3},
    {"type": "string", "minLength": 5, "maxLength": 2},
    {"type": "array", "minItems": 3, "maxItems": 1},
    {"type": []},
    {"anyOf": []},
    {"oneOf": []},
    {"allOf": [{"const": 1}, {"const": 2}]},
    {"type": "string", "enum": [1, 2]},
    {"type": "object", "properties": {"a": False}, "required": ["a"]},
    {"type": "object", "required": ["a"], "additionalProperties": False},
    {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4},
    {"type": "integer", "multipleOf": 2, "minimum": 3, "maximum": 3},
]


@pytest.mark.parametrize("schema", UNSAT, ids=json.dumps)
@pytest.mark.parametrize("unsupported", ["ignore", "refuse"])
def test_auto_never_turns_unsatisfiable_into_a_looser_grammar(schema: Any, unsupported: str) -> None:
    auto = AutoProvider(_vocab())
    spec = GrammarSpec("json_schema", schema, unsupported=unsupported)
    with pytest.raises(GrammarError, match=r"admits no value|no grammar provider") as info:
        auto.compile(spec)
    assert "outlines-core:" not in str(info.value), "an unsatisfiable schema was handed on to outlines-core"


@pytest.mark.parametrize("schema", UNSAT[:2], ids=json.dumps)
def test_the_cases_of_the_report_accept_nothing(schema: Any) -> None:
    """``"a"5`` under the allOf and the empty output under ``enum: []`` were accepted through outlines-core."""
    auto = AutoProvider(_vocab())
    with pytest.raises(GrammarError, match=r"^spec: this json_schema spec admits no value \(llguidance: "):
        auto.compile(GrammarSpec("json_schema", schema))
    assert auto.explain(GrammarSpec("json_schema", schema)) is None  # nothing served


UNSAT_MESSAGES = [
    ("llguidance", "Unsatisfiable schema: anyOf is empty", True),
    ("xgrammar", "enum array must not be empty", True),
    ("xgrammar", "Invalid range: minimum greater than maximum", True),
    ("xgrammar", "minLength 5 is greater than maxLength 2", True),
    ("xgrammar", "Schema 'false' cannot accept any value", True),
    ("xgrammar", "range contains no multipleOf value", True),
    ("outlines-core", "the grammar admits no text", True),
    ("llguidance", "Unimplemented keys: ['not']", False),
    ("xgrammar", "items must be a boolean or an object", False),
    ("outlines-core", "Unsupported JSON Schema struct", False),
    ("xgrammar", "did not compile this json_schema spec within its limit of 5 s", False),
]


@pytest.mark.parametrize(("provider", "message", "final"), UNSAT_MESSAGES)
def test_unsatisfiable_reads_the_engines_words(provider: str, message: str, final: bool) -> None:
    assert unsatisfiable(provider, GrammarError(message)) is final
