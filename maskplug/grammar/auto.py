"""The ``auto`` grammar provider: each spec compiled by the provider best suited to it.

For every spec, the registered providers that support its kind are tried in
order of preference (:data:`PREFERENCE`: llguidance, xgrammar, outlines-core,
then any other). The first whose compiled grammar enforces every keyword of
the schema (no ``warnings``) serves it. A provider that raises
:class:`GrammarError` (it cannot read the spec, cannot honour an option, or
ran past its compile limit) is passed over with its reason. When every
provider that compiles the spec leaves something unenforced, the one leaving
out the fewest constraints serves it, and its warnings stay on the grammar.

The compile limit holds for auto as a whole: ``compile_limit_s`` (default
:data:`maskplug.grammar.limits.DEFAULT_COMPILE_LIMIT_S`, or the spec's own)
bounds all attempts together; each candidate gets what is left (or its own
limit, when smaller), and when nothing is left the candidates not yet tried are
passed over. As for each provider, the budget counts the compile servers' CPU
seconds (wall-clock for a compile in this process).

The choice is reported: the grammar gets ``served_by`` (the provider's name)
and ``why`` (a sentence), :meth:`AutoProvider.explain` returns the
:class:`AutoChoice` for a spec, and each choice is logged at INFO on the
``maskplug.auto`` logger.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import GrammarError
from .bases import ProviderBase
from .limits import DEFAULT_COMPILE_LIMIT_S, check_limit, effective_limit, wall_backstop
from .spec import SPEC_KINDS, GrammarSpec, Vocab

__all__ = ["PREFERENCE", "AutoChoice", "AutoProvider"]

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

    def __init__(
        self,
        vocab: Vocab,
        candidates: list[str] | None = None,
        compile_limit_s: float | None = DEFAULT_COMPILE_LIMIT_S,
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
            ordered = list(candidates)
        if not ordered:
            raise GrammarError("candidates: expected at least one registered grammar provider, got none")
        self.candidates = ordered
        self._choices: dict[str, AutoChoice] = {}
        self._lock = threading.Lock()

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
                tried.append((name, f"GrammarError: {exc}"))
                continue
            spent += _spent(worker, seen, t0)
            warns = list(getattr(grammar, "warnings", []) or [])
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


def _spent(worker: Any, seen: tuple[Any, Any], t0: float) -> float:
    """What one attempt took out of auto's budget: the worker's CPU seconds when it compiled, else wall-clock."""
    now = (getattr(worker, "compiles", None), getattr(worker, "killed", None))
    cpu = getattr(worker, "last_cpu_s", None)
    if worker is not None and now != seen and isinstance(cpu, float):
        return cpu
    return time.monotonic() - t0
