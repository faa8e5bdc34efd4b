"""The ``auto`` grammar provider: each spec compiled by the provider best suited to it.

For every spec, the registered providers that support its kind are tried in
order of preference (:data:`PREFERENCE`: llguidance, xgrammar, outlines-core,
then any other). The first that enforces every keyword of the schema serves
it. "Enforces" is maskplug's own knowledge of each engine
(:data:`KEYWORD_COVERAGE`, one table per provider, each entry tested against
the installed engine): the schema uses no keyword (or format) the table does
not list as enforced, *and* the compiled grammar has no ``warnings``. An
engine's silence is not enough: xgrammar leaves ``not``, ``uniqueItems``,
``if``/``then``, ``contains`` and ``dependentRequired`` out without a word.
A provider with no table (a plugin's) is judged by its warnings alone.

With ``unsupported="refuse"``, a provider whose table lacks a keyword of the
schema is not tried; when none is left, :class:`GrammarError` naming
``unsupported``. A provider that raises :class:`GrammarError` (it cannot read
the spec, cannot honour an option, or ran past its compile limit) is passed
over with its reason, except when the error says the schema admits no value
at all (:data:`UNSATISFIABLE`, and maskplug's own check that a grammar's
start allows a token): that is final, since the next provider could only
build a looser grammar. When every provider that compiles the spec leaves
something unenforced, the one leaving out the fewest constraints serves it,
and its warnings stay on the grammar (the coverage gaps are in
:class:`AutoChoice` ``tried``).

Compile limits: by default (``compile_limit_s=None``) each candidate compiles
under its own provider's limit, so auto stops a compile exactly where the
provider serving it alone would. A ``compile_limit_s`` (or the spec's own)
bounds all attempts together: each candidate gets what is left (or its own
limit, when smaller), and when nothing is left the candidates not yet tried are
passed over. As for each provider, the budget counts the compile servers' CPU
seconds (wall-clock for a compile in this process).

``auto`` is a built-in plugin: this module registers :class:`AutoProvider`
through ``maskplug_register_grammar_providers``, as any provider distribution
registers its own, so :func:`~maskplug.grammar.grammar_providers` lists it and
no plugin can register another ``"auto"`` unnoticed.

The choice is reported: the grammar gets ``served_by`` (the provider's name)
and ``why`` (a sentence), :meth:`AutoProvider.explain` returns the
:class:`AutoChoice` for a spec, and each choice is logged at INFO on the
``maskplug.auto`` logger.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import GrammarError
from ..hookspecs import hookimpl
from .bases import ProviderBase
from .checks import schema_dict
from .limits import check_limit, effective_limit, wall_backstop
from .spec import SPEC_KINDS, GrammarSpec, Vocab

__all__ = [
    "CONSTRAINT_KEYWORDS",
    "KEYWORD_COVERAGE",
    "PREFERENCE",
    "UNSATISFIABLE",
    "AutoChoice",
    "AutoProvider",
    "Coverage",
    "coverage_gaps",
    "maskplug_register_grammar_providers",
    "schema_constraints",
    "unsatisfiable",
]

#: Providers tried first, in this order (others registered follow, by name).
PREFERENCE = ("llguidance", "xgrammar", "outlines-core")

logger = logging.getLogger("maskplug.auto")
logger.addHandler(logging.NullHandler())


@dataclass
class AutoChoice:
    """Which provider serves a spec and why; ``tried`` holds each provider's outcome in order."""

    served_by: str
    why: str
    tried: list[tuple[str, str]] = field(default_factory=list)


class AutoProvider(ProviderBase[Any]):
    """Compiles each spec with the first provider enforcing all of it (see the module notes)."""

    name = "auto"
    kinds = frozenset(SPEC_KINDS)
    # Each grammar served is a candidate's, already checked by the candidate's own compile.
    checks_start = False

    def __init__(
        self,
        vocab: Vocab,
        candidates: list[str] | None = None,
        compile_limit_s: float | None = None,
    ) -> None:
        super().__init__(vocab)
        #: Seconds all attempts at one spec may take together (None: each candidate's own limit only).
        self.compile_limit_s = check_limit(compile_limit_s, "compile_limit_s")
        from .registry import grammar_providers

        names = [n for n in grammar_providers() if n != self.name]
        ordered = [n for n in PREFERENCE if n in names] + sorted(n for n in names if n not in PREFERENCE)
        if candidates is not None:
            unknown = [c for c in candidates if c not in names]
            if unknown:
                raise GrammarError(f"candidates: expected registered providers {names}, got unknown {unknown}")
            if not candidates:
                raise GrammarError("candidates: expected at least one registered grammar provider, got none")
            ordered = list(candidates)
        self.candidates = ordered
        if not ordered:
            # No provider but auto is installed: auto supports no kind, so whatever goes through every
            # registered provider (selftest, bench) passes it over, and a compile says what to install.
            self.kinds = frozenset()
        self._choices: dict[str, AutoChoice] = {}
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Any:
        """The grammar of the candidate chosen for ``spec`` (see the module notes)."""
        if not self.candidates and isinstance(spec, GrammarSpec):
            raise GrammarError(
                f"spec.kind: no grammar provider besides auto is registered to compile this {spec.kind} spec; "
                "install one, e.g. maskplug-llguidance, maskplug-xgrammar or maskplug-outlines"
            )
        return super().compile(spec)

    def provider(self, name: str) -> Any:
        """The candidate provider ``name`` bound to this vocabulary."""
        from .registry import grammar_provider

        return grammar_provider(name, self.vocab)

    def explain(self, spec: GrammarSpec) -> AutoChoice | None:
        """The choice made for ``spec`` (None when it was not compiled here yet)."""
        with self._lock:
            return self._choices.get(spec.key())

    def _compile(self, spec: GrammarSpec) -> Any:
        tried: list[tuple[str, str]] = []
        fallback: tuple[int, str, Any] | None = None
        budget = effective_limit(check_limit(self.compile_limit_s, "compile_limit_s"), spec)
        spent = 0.0
        for name in self.candidates:
            prov = self.provider(name)
            if not prov.supports(spec.kind):
                tried.append((name, f"does not support {spec.kind}"))
                continue
            # What maskplug knows the engine leaves out, warned about or not.
            gaps = coverage_gaps(name, spec) or []
            if gaps and spec.unsupported == "refuse":
                tried.append((name, f"does not enforce {gaps} (unsupported='refuse')"))
                continue
            attempt = spec
            if budget is not None:
                left = budget - spent
                if left <= 0:
                    tried.append((name, f"not tried: auto's compile limit of {budget:g} s was spent"))
                    continue
                # A call's own limit is what this compile may take in all; without
                # one, each candidate also keeps its provider's limit.
                own = getattr(prov, "compile_limit_s", None) if spec.compile_limit_s is None else None
                share = left if own is None else min(own, left)
                attempt = replace(spec, compile_limit_s=share)
                worker = getattr(prov, "worker", None)
                if worker is not None and worker.pid is None and attempt not in prov.cache:
                    # A worker's start-up is not a request's time, but it is bounded by the compile's backstop.
                    try:
                        worker.start(wall_backstop(share))
                    except GrammarError as exc:
                        tried.append((name, f"GrammarError: {exc}"))
                        continue
            t0 = time.monotonic()
            worker = getattr(prov, "worker", None)
            seen = (getattr(worker, "compiles", None), getattr(worker, "killed", None))
            try:
                grammar = prov.compile(attempt)
            except GrammarError as exc:
                spent += _spent(worker, seen, t0)
                if unsatisfiable(name, exc):
                    # The schema admits nothing: a looser grammar from the next provider would accept
                    # what it refuses (outlines-core concatenates allOf, accepts the empty output).
                    tried.append((name, f"GrammarError: {exc}"))
                    raise GrammarError(
                        f"spec: this {spec.kind} spec admits no value ({name}: {exc}); no other provider is tried"
                    ) from exc
                tried.append((name, f"GrammarError: {exc}"))
                continue
            spent += _spent(worker, seen, t0)
            warns = list(getattr(grammar, "warnings", []) or [])
            warns += [f"{name} does not enforce {k!r}" for k in gaps if not _mentioned(k, warns)]
            if not warns:
                tried.append((name, "enforces every keyword"))
                why = f"{name} enforces every keyword of this {spec.kind} spec"
                return self._serve(spec, grammar, name, why, tried)
            tried.append((name, f"leaves unenforced: {'; '.join(warns)}"))
            if fallback is None or len(warns) < fallback[0]:
                fallback = (len(warns), name, grammar)
        if fallback is not None:
            _, name, grammar = fallback
            why = f"no provider enforces every keyword of this {spec.kind} spec; {name} leaves out the fewest"
            return self._serve(spec, grammar, name, why, tried)
        reasons = "; ".join(f"{n}: {r}" for n, r in tried)
        if spec.unsupported == "refuse" and any("unsupported='refuse'" in r for _, r in tried):
            raise GrammarError(
                f"unsupported: no grammar provider enforces every keyword of this {spec.kind} spec "
                f"(unsupported='refuse'; {reasons})"
            )
        raise GrammarError(f"spec: no grammar provider could compile this {spec.kind} spec ({reasons})")

    def _serve(self, spec: GrammarSpec, grammar: Any, name: str, why: str, tried: list[tuple[str, str]]) -> Any:
        choice = AutoChoice(name, why, tried)
        with self._lock:
            self._choices[spec.key()] = choice
        try:
            grammar.served_by = name
            grammar.why = why
        except AttributeError:  # a grammar type with fixed attributes: explain() still answers
            pass
        logger.info("auto: %s spec served by %s (%s)", spec.kind, name, why)
        return grammar


@hookimpl
def maskplug_register_grammar_providers(register: Callable[[str, Any], None]) -> None:
    """Register the built-in ``"auto"`` provider (factory: ``AutoProvider(vocab)``)."""
    register(AutoProvider.name, AutoProvider)


def _spent(worker: Any, seen: tuple[Any, Any], t0: float) -> float:
    """What one attempt took out of auto's budget: the worker's CPU seconds when it compiled, else wall-clock."""
    now = (getattr(worker, "compiles", None), getattr(worker, "killed", None))
    cpu = getattr(worker, "last_cpu_s", None)
    if worker is not None and now != seen and isinstance(cpu, float):
        return cpu
    return time.monotonic() - t0


# --------------------------------------------------------------------------
# What each engine enforces, as maskplug has tested it
# --------------------------------------------------------------------------

#: JSON Schema keywords that constrain an instance (validation and applicator keywords, drafts 4 to 2020-12).
#: Annotations (``title``, ``default``, ``contentEncoding``, ...) and unknown keys constrain nothing.
CONSTRAINT_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "minItems",
        "maxItems",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "anyOf",
        "oneOf",
        "allOf",
        "not",
        "if",
        "then",
        "else",
        "$ref",
        "$dynamicRef",
        "$recursiveRef",
        "$defs",
        "definitions",
    }
)


@dataclass(frozen=True)
class Coverage:
    """One engine's coverage of JSON Schema, as maskplug has tested it.

    Entries are keywords, and ``format:<name>`` for each format. ``enforces``
    holds what the engine was shown to enforce (an instance breaking only
    that keyword is refused), ``ignores`` what it was shown to leave out
    (such an instance is accepted, or the engine refuses the keyword). A
    keyword in neither was not tested and is not counted as enforced.
    ``tests/grammars/test_adversarial_auto.py`` has one probe per entry and
    fails when an engine's behaviour departs from its table.
    """

    enforces: frozenset[str]
    ignores: frozenset[str]


_NOBODY = frozenset(
    {
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "not",
        "if",
        "then",
        "else",
        "format:idn-email",
        "format:iri",
        "format:regex",
    }
)

#: Keywords that one engine enforces and another leaves out (each engine's table below says which).
_SPLIT = frozenset({"patternProperties", "additionalItems", "allOf", "propertyNames", "unevaluatedItems"})
#: What xgrammar and llguidance both enforce: every constraint keyword but those no engine enforces, the split
#: ones, ``format`` itself (counted per format) and the dynamic references (not tested).
_COMMON = CONSTRAINT_KEYWORDS - _NOBODY - _SPLIT - {"format", "$dynamicRef", "$recursiveRef"}
#: What outlines-core leaves out of the common keywords: additionalProperties and prefixItems refuse valid
#: instances too; oneOf takes overlapping branches as anyOf without a word.
_OUTLINES_LEFT_OUT = frozenset(
    {
        "additionalProperties",
        "minProperties",
        "maxProperties",
        "prefixItems",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "oneOf",
    }
)
#: The formats every engine but outlines-core enforces.
_FORMATS = frozenset(
    f"format:{f}" for f in ("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri")
)
#: Per provider name: what its engine enforces and leaves out (tested against the installed engines).
KEYWORD_COVERAGE: dict[str, Coverage] = {
    "xgrammar": Coverage(
        enforces=_COMMON
        | _FORMATS
        | {"propertyNames", "unevaluatedItems", "format:uri-reference", "format:json-pointer"},
        # patternProperties: valid keys refused too (xgrammar 0.2.9); additionalItems: the draft-4 tuple
        # form is refused; allOf with several branches is left out (with a warning).
        ignores=_NOBODY | {"patternProperties", "additionalItems", "allOf"},
    ),
    "llguidance": Coverage(
        enforces=_COMMON | _FORMATS | {"patternProperties", "additionalItems", "allOf"},
        ignores=_NOBODY | {"propertyNames", "unevaluatedItems", "format:uri-reference", "format:json-pointer"},
    ),
    "outlines-core": Coverage(
        enforces=(_COMMON - _OUTLINES_LEFT_OUT)
        | {f"format:{f}" for f in ("date", "time", "date-time", "email", "uuid")},
        # allOf: concatenated or refused; the formats: refused.
        ignores=_NOBODY
        | _OUTLINES_LEFT_OUT
        | {"patternProperties", "propertyNames", "additionalItems", "allOf"}
        | {f"format:{f}" for f in ("duration", "hostname", "ipv4", "ipv6", "uri", "uri-reference", "json-pointer")},
    ),
}


def _walk_constraints(node: Any, found: set[str]) -> None:
    if isinstance(node, list):
        for x in node:
            _walk_constraints(x, found)
        return
    if not isinstance(node, dict):
        return
    for k, v in node.items():
        if k in CONSTRAINT_KEYWORDS:
            found.add(k)
            if k == "format" and isinstance(v, str):
                found.add(f"format:{v}")
        if k in ("enum", "const", "required", "dependentRequired") or k not in CONSTRAINT_KEYWORDS:
            continue  # data, or an annotation / unknown key: nothing below is a schema
        if k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(v, dict):
            for sub in v.values():
                _walk_constraints(sub, found)
        elif k == "dependencies" and isinstance(v, dict):
            for sub in v.values():
                if isinstance(sub, dict):
                    _walk_constraints(sub, found)
        elif isinstance(v, (dict, list)):
            _walk_constraints(v, found)


def schema_constraints(schema: Any) -> frozenset[str]:
    """The constraint keywords a JSON schema uses anywhere, with ``format:<name>`` for each format it names."""
    found: set[str] = set()
    _walk_constraints(schema, found)
    return frozenset(found)


def coverage_gaps(provider: str, spec: GrammarSpec) -> list[str] | None:
    """The constraints of ``spec`` that ``provider``'s engine is not known to enforce (None: no table for it).

    Only ``json_schema`` specs have keywords; every other kind gives ``[]``.
    """
    cov = KEYWORD_COVERAGE.get(provider)
    if cov is None:
        return None
    if spec.kind != "json_schema":
        return []
    try:
        schema = schema_dict(spec.source)
    except GrammarError:
        return []  # the compile reports it
    used = schema_constraints(schema)
    return sorted(k for k in used if k not in cov.enforces and not (k == "format" and _formats_known(used, cov)))


def _formats_known(used: frozenset[str], cov: Coverage) -> bool:
    # ``format`` itself is judged by the formats named (each its own entry).
    return all(k in cov.enforces for k in used if k.startswith("format:"))


#: Parts of engine errors saying that a schema admits no value at all (then no looser grammar may serve it).
UNSATISFIABLE: dict[str, tuple[str, ...]] = {
    "llguidance": (r"Unsatisfiable schema",),
    "xgrammar": (
        r"enum array must not be empty",
        r"Invalid range: minimum greater than maximum",
        r"minLength \d+ is greater than maxLength",
        r"minItems is greater than maxItems",
        r"minProperties is greater than maxProperties",
        r"cannot accept any value",
        r"range contains no multipleOf value",
    ),
    # maskplug's own check of every compiled grammar's start (maskplug.grammar.bases).
    "*": (r"admits no text", r"admits only the empty output"),
}


def unsatisfiable(provider: str, error: BaseException) -> bool:
    """Whether ``provider``'s compile ``error`` says the spec admits no value (see :data:`UNSATISFIABLE`)."""
    text = str(error)
    pats = UNSATISFIABLE.get(provider, ()) + UNSATISFIABLE["*"]
    return any(re.search(p, text) for p in pats)


def _mentioned(entry: str, warnings: list[str]) -> bool:
    """Whether an engine warning already names coverage entry ``entry`` (so it is counted once)."""
    if entry.startswith("format:"):  # llguidance: "Unknown format: uri-reference"
        pat = re.compile(rf"format:?\s*['\"]?{re.escape(entry[7:])}(?![\w-])")
    else:  # quoted, as every engine names keys: 'not', "uniqueItems"
        pat = re.compile(rf"(['\"]){re.escape(entry)}\1")
    return any(pat.search(w) for w in warnings)
