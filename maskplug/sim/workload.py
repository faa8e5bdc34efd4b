"""The simulated requests: JSON-schema, regex and unconstrained, each with a reference document.

Every request carries the document the synthetic target model prefers to
write: for a JSON-schema request a schema-valid instance (properties in schema
order, as grammar engines emit them), for a regex request a string drawn from
the pattern, for an unconstrained request a few sentences of prose. The
document is tokenised with the simulation's real tokenizer.

Requests are a pure function of ``(seed, index)``, so every scheduler of a run
serves exactly the same stream. :class:`Workload` is that stream bound to a
tokenizer and a grammar provider: each request's tokenised reference and
compiled grammar, made once and shared by every run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..data import Tokenizer, load_schemas, schema_dir
from ..errors import GrammarError
from ..grammar import GrammarProvider, GrammarSpec
from .config import SimConfig, WorkloadMix
from .regexgen import sample_regex

__all__ = [
    "REGEXES",
    "PreparedRequest",
    "RequestSpec",
    "Workload",
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


@dataclass
class PreparedRequest:
    """One request of the stream, ready to run: its reference tokens and compiled grammar, or why it failed."""

    spec: RequestSpec
    ref: npt.NDArray[np.int64]  # reference tokens followed by the stop token
    compiled: Any  # CompiledGrammar or None
    max_tokens: int
    error: str | None = None  # why the request failed (its grammar did not compile); None when it runs


class Workload:
    """The request stream of one seed: specs, tokenised references, compiled grammars (shared by all runs)."""

    def __init__(self, config: SimConfig, tokenizer: Tokenizer, provider: GrammarProvider | None) -> None:
        self.config = config
        self.tok = tokenizer
        self.provider = provider
        self.schemas = load_schemas(config.schema_dir)
        self._cache: dict[int, PreparedRequest] = {}
        self._by_bytes: dict[bytes, list[int]] | None = None
        self._longest = 0
        #: Requests that failed (request index -> (request name, the grammar error)), in the order reached.
        self.failures: dict[int, tuple[str, str]] = {}
        # One compile per grammar: a spec that failed fails every request that asks for it.
        self._failed_specs: dict[str, str] = {}

    def _guided(self, text: str, matcher: Any) -> list[int] | None:
        """Tokenise ``text`` greedily (longest token first) among the tokens the grammar allows.

        Where several ids spell the same bytes (a piece and its byte-fallback
        token), the first the grammar allows is taken: a provider holding
        forced text to the tokenizer's own spelling allows only one of them.
        """
        if self._by_bytes is None:
            vocab = self.tok.vocab
            self._by_bytes = {}
            for i, t in enumerate(vocab.tokens):
                if t and i not in vocab.special_ids:
                    self._by_bytes.setdefault(t, []).append(i)
            self._longest = max(len(t) for t in self._by_bytes)
        raw = text.encode("utf-8")
        bm = self.tok.vocab.new_bitmask(1)
        ids: list[int] = []
        pos = 0
        while pos < len(raw):
            matcher.fill(bm, 0)
            words = bm[0].numpy()
            for n in range(min(self._longest, len(raw) - pos), 0, -1):
                tid = next(
                    (i for i in self._by_bytes.get(raw[pos : pos + n], ()) if (int(words[i >> 5]) >> (i & 31)) & 1),
                    None,
                )
                if tid is not None and matcher.accept(tid):
                    ids.append(tid)
                    pos += n
                    break
            else:
                return None
        eos = self.tok.eos
        return [*ids, eos] if matcher.accept(eos) else None

    def get(self, index: int) -> PreparedRequest:
        """Request ``index``: the reference is the first serialisation its grammar accepts."""
        got = self._cache.get(index)
        if got is not None:
            return got
        spec, texts = make_request(self.config.seed, index, self.schemas, self.config.mix)
        eos = self.tok.eos
        compiled = None
        ids: list[int] | None = None
        if spec.grammar is not None:
            if self.provider is None:
                raise GrammarError("provider: expected a grammar provider for grammar requests, got none")
            key = spec.grammar.key()
            error = self._failed_specs.get(key)
            if error is None:
                try:
                    compiled = self.provider.compile(spec.grammar)
                except GrammarError as exc:  # that request's error, as a serving engine reports it
                    error = self._failed_specs[key] = str(exc)
            if error is not None:
                failed = PreparedRequest(spec, np.zeros(0, dtype=np.int64), None, 0, error)
                self._cache[index] = failed
                self.failures[index] = (spec.name, error)
                return failed
            assert compiled is not None  # compiled above, or the request failed
            for text in texts:
                cand = [*self.tok.encode(text), eos]
                if compiled.matcher().validate(cand) == len(cand):
                    ids = cand
                    break
            if ids is None:
                # Some providers accept only certain tokenisations of forced text
                # (llguidance keeps it canonical): let the grammar pick the split.
                ids = self._guided(texts[0], compiled.matcher())
            if ids is None:
                raise GrammarError(
                    f"workload: no serialisation of request {index}'s {spec.name} reference is accepted by "
                    f"{self.config.provider}: {texts[0][:80]!r}"
                )
        else:
            ids = [*self.tok.encode(spec.text), eos]
        ref = np.asarray(ids, dtype=np.int64)
        n = int(ref.shape[0])
        max_tokens = max(2, int(n * 0.6)) if spec.short_limit else n + 4
        prep = PreparedRequest(spec, ref, compiled, max_tokens)
        self._cache[index] = prep
        return prep
