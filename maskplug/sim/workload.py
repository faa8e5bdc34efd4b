"""The simulated requests: JSON-schema, regex and unconstrained, each with a reference document.

Every request carries the document the synthetic target model prefers to
write: for a JSON-schema request a schema-valid instance (properties in schema
order, as grammar engines emit them), for a regex request a string drawn from
the pattern, for an unconstrained request a few sentences of prose. The
document is tokenised with the simulation's real tokenizer.

Requests are a pure function of ``(seed, index)``, so every scheduler of a run
serves exactly the same stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..data import load_schemas, schema_dir
from ..errors import GrammarError
from ..grammar import GrammarSpec
from .regexgen import sample_regex

__all__ = [
    "REGEXES",
    "RequestSpec",
    "WorkloadMix",
    "default_schema_dir",
    "json_texts",
    "load_schemas",
    "make_request",
    "sample_instance",
]

#: Regex requests: ``(name, pattern)``; patterns the sampler and every provider understand.
REGEXES: tuple[tuple[str, str], ...] = (
    ("phone", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("date", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])"),
    ("email", r"[a-z]{3,10}\.[a-z]{2,8}@[a-z]{4,9}\.(com|org|net)"),
    ("ipv4", r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])(\.(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])){3}"),
    ("semver", r"v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}"),
    ("uuid", r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"),
    ("answer", r"(yes|no|maybe), because [a-z]{3,8}( [a-z]{3,8}){2,5}\."),
)

_WORDS = (
    "alpha bravo cedar delta ember falcon garden harbor island jasper kernel lumen meadow nectar "
    "orbit pepper quartz river saffron timber umber violet willow xenon yarrow zephyr amber basil "
    "copper dune echo fable glacier hazel indigo juniper kelp lotus maple nova onyx pine quill "
    "raven sage tundra unity vale wren yonder zinc atlas beacon comet drift"
).split()
_ACCENTED = ("café", "naïve", "Zoë", "über", "año", "façade")


def default_schema_dir() -> Path:
    """The schema folder the workload reads: :func:`maskplug.data.schema_dir`."""
    return schema_dir()


def _words(rng: np.random.Generator, lo: int, hi: int) -> str:
    n = int(rng.integers(lo, hi + 1))
    picks = [str(_WORDS[int(i)]) for i in rng.integers(len(_WORDS), size=n)]
    if n and rng.random() < 0.15:
        picks[int(rng.integers(n))] = _ACCENTED[int(rng.integers(len(_ACCENTED)))]
    return " ".join(picks)


def _string(schema: dict[str, Any], rng: np.random.Generator) -> str:
    lo = int(schema.get("minLength", 0))
    hi = int(schema.get("maxLength", 48))
    if "pattern" in schema:
        return sample_regex(str(schema["pattern"]), rng, max_len=hi)
    for _ in range(8):
        s = _words(rng, 1, 4)
        if lo <= len(s) <= hi:
            return s
    return ("x" * max(lo, 1))[: max(hi, 1)]


def sample_instance(schema: dict[str, Any], rng: np.random.Generator, depth: int = 0) -> Any:
    """A random instance of ``schema`` (the subset of JSON Schema the bundled schemas use).

    Supported: ``type`` object/array/string/integer/number/boolean/null,
    ``properties``/``required`` (optional properties included at random, in
    schema order), ``minItems``/``maxItems``, ``minLength``/``maxLength``,
    ``pattern``, ``minimum``/``maximum``, ``enum``, ``const`` and ``anyOf``.
    Other keywords raise :class:`GrammarError`, so no invalid document is made.
    """
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][int(rng.integers(len(schema["enum"])))]
    if "anyOf" in schema:
        branches = schema["anyOf"]
        return sample_instance(branches[int(rng.integers(len(branches)))], rng, depth + 1)
    t = schema.get("type")
    if isinstance(t, list):
        t = t[int(rng.integers(len(t)))]
    if t == "object":
        props: dict[str, Any] = schema.get("properties", {})
        required = set(schema.get("required", []))
        out: dict[str, Any] = {}
        for key, sub in props.items():
            if key in required or rng.random() < 0.6:
                out[key] = sample_instance(sub, rng, depth + 1)
        return out
    if t == "array":
        lo = int(schema.get("minItems", 0))
        hi = min(int(schema.get("maxItems", lo + 3)), lo + 3)
        items = schema.get("items", {"type": "string"})
        return [sample_instance(items, rng, depth + 1) for _ in range(int(rng.integers(lo, hi + 1)))]
    if t == "string":
        return _string(schema, rng)
    if t == "integer":
        lo = int(schema.get("minimum", 0))
        hi = int(schema.get("maximum", max(lo, 0) + 999))
        return int(rng.integers(lo, hi + 1))
    if t == "number":
        flo = float(schema.get("minimum", 0.0))
        fhi = float(schema.get("maximum", flo + 500.0))
        return round(float(rng.uniform(flo, fhi)), 2)
    if t == "boolean":
        return bool(rng.random() < 0.5)
    if t == "null":
        return None
    raise GrammarError(f"schema: expected a keyword the instance sampler supports, got {json.dumps(schema)[:120]}")


def _prose(rng: np.random.Generator) -> str:
    sentences = []
    for _ in range(int(rng.integers(1, 4))):
        s = _words(rng, 4, 10)
        sentences.append(s[:1].upper() + s[1:] + ".")
    return " ".join(sentences)


@dataclass(frozen=True)
class WorkloadMix:
    """Shares of request kinds, and how often a request gets a token limit below its document length."""

    json: float = 0.5
    regex: float = 0.25
    free: float = 0.25
    #: share of requests whose ``max_tokens`` cuts the document short (they end "cut off")
    short_limit: float = 0.05

    def __post_init__(self) -> None:
        vals = (self.json, self.regex, self.free, self.short_limit)
        if any(not np.isfinite(v) or v < 0 for v in vals) or self.json + self.regex + self.free <= 0:
            raise GrammarError(f"mix: expected non-negative shares with a positive sum, got {vals}")


@dataclass(frozen=True)
class RequestSpec:
    """One simulated request, before it is bound to a matcher.

    Attributes:
        index: its position in the request stream (also its id).
        kind: ``"json"``, ``"regex"`` or ``"free"``.
        name: the schema or regex name (``"prose"`` for free text).
        grammar: the grammar spec, ``None`` for unconstrained requests.
        schema: the JSON schema (JSON requests) for validating the output.
        pattern: the regex (regex requests) for validating the output.
        text: the reference document.
        prompt_len: prompt tokens, prefilled in the request's first step.
        short_limit: the request's token limit is set below its document's
            length (the output ends cut off).
        skill: the drafter's base accuracy on this request's content tokens.
        sampled: verification by rejection sampling (else greedy).
    """

    index: int
    kind: str
    name: str
    grammar: GrammarSpec | None
    schema: dict[str, Any] | None
    pattern: str | None
    text: str
    prompt_len: int
    short_limit: bool
    skill: float
    sampled: bool


def json_texts(value: Any) -> list[str]:
    """Serialisations of one JSON value, tried in order until the grammar accepts one."""
    return [
        json.dumps(value, ensure_ascii=False, separators=(", ", ": ")),
        json.dumps(value, ensure_ascii=False, separators=(",", ":")),
        json.dumps(value, ensure_ascii=False, separators=(",", ": ")),
        json.dumps(value, ensure_ascii=False, indent=2),
    ]


def make_request(
    seed: int,
    index: int,
    schemas: list[tuple[str, dict[str, Any]]],
    mix: WorkloadMix,
) -> tuple[RequestSpec, list[str]]:
    """Request ``index`` of the stream of ``seed``, plus the candidate texts for its reference."""
    rng = np.random.default_rng([int(seed), int(index), 0x5EED])
    shares = np.array([mix.json, mix.regex, mix.free], dtype=np.float64)
    kind = ("json", "regex", "free")[int(rng.choice(3, p=shares / shares.sum()))]
    grammar: GrammarSpec | None
    schema = pattern = None
    if kind == "json":
        name, schema = schemas[int(rng.integers(len(schemas)))]
        value = sample_instance(schema, rng)
        texts = json_texts(value)
        # Key order matters: grammar engines emit properties in schema order.
        grammar = GrammarSpec("json_schema", json.dumps(schema))
    elif kind == "regex":
        name, pattern = REGEXES[int(rng.integers(len(REGEXES)))]
        texts = [sample_regex(pattern, rng)]
        grammar = GrammarSpec("regex", pattern)
    else:
        name = "prose"
        texts = [_prose(rng)]
        grammar = None
    # Structured content is easier to draft than prose; each request differs.
    skill = float(rng.uniform(0.45, 0.9) if kind != "free" else rng.uniform(0.3, 0.75))
    short = bool(rng.random() < mix.short_limit)
    spec = RequestSpec(
        index=int(index),
        kind=kind,
        name=name,
        grammar=grammar,
        schema=schema,
        pattern=pattern,
        text=texts[0],
        prompt_len=int(rng.integers(16, 97)),
        short_limit=short,
        skill=skill,
        sampled=bool(rng.random() < 0.5),
    )
    return spec, texts
