"""Hook specifications of the ``maskplug`` pluggy project.

A plugin is any module or object with functions decorated by
:data:`maskplug.hookimpl`; outside distributions expose one through the
``maskplug`` entry-point group. Built-in plugins are registered through these
same hooks. Every registration hook receives a ``register`` callback: the host
validates what is registered and refuses duplicates with a
:class:`maskplug.PluginError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("maskplug")
hookimpl = pluggy.HookimplMarker("maskplug")


@hookspec
def maskplug_register_kernels(register: Callable[[Any], None]) -> None:
    """Register kernel backends.

    Call ``register(backend)`` once per backend. A backend is an object with
    ``name: str``, ``priority: int`` (``backend="auto"`` picks the available
    backend of highest priority), ``unavailable_reason(device) -> str | None``
    and ``apply(logits, bitmask, request, position, cu_logits, vocab_size,
    mask_tail) -> None``; see :class:`maskplug.KernelBackend`. Backend
    distributions build on :mod:`maskplug.kernels.sdk` (its ``BackendBase``
    caches the availability answer and refuses to run where it is unavailable).
    """


@hookspec
def maskplug_register_grammar_providers(register: Callable[[str, Any], None]) -> None:
    """Register grammar providers.

    Call ``register(name, factory)``; ``factory(vocab)`` returns a provider
    bound to that :class:`maskplug.Vocab` (see :class:`maskplug.GrammarProvider`).
    """


@hookspec
def maskplug_register_schedulers(register: Callable[[str, Any], None]) -> None:
    """Register budget schedulers.

    Call ``register(name, factory)``; ``factory(**config)`` returns an object
    with ``budget(step) -> BudgetDecision`` and ``observe(outcome) -> None``.

    Protocol (see :mod:`maskplug.schedulers`): before each step the engine
    calls ``budget(step)`` with a read-only :class:`maskplug.StepView` (the
    scheduled layout, the cost model, the drafter's confidences as the host
    last saw them, usually two steps old, the grammar's ``DraftMasks`` when
    there are grammar requests, ``max_logits`` and ``num_sampling``); the
    budget must lie in ``[0, step.cap]``. After verification it calls
    ``observe(outcome)`` with a :class:`maskplug.StepOutcome`: drafts verified
    and accepted per request id. An optional ``beliefs(step)`` returning
    per-position acceptance estimates lets ``grammar-aware`` rescore the
    scheduler's budget with the grammar. Users pick a scheduler by name with
    :func:`maskplug.get_scheduler` (``MASKPLUG_SCHEDULER`` is the default).
    """


@hookspec
def maskplug_register_engine_drivers(register: Callable[[str, Any], None]) -> None:
    """Register the engines driven directly that ``maskplug conformance`` compares the providers with.

    Call ``register(provider_name, factory)``; ``factory(vocab, encoding)``
    (``encoding``: the vocabulary's ``tiktoken`` encoding) returns an object
    with ``compile(spec, grammar)`` and ``feed(compiled, ids) -> bool``; see
    :class:`maskplug.conformance.EngineDriver`.
    """


@hookspec
def maskplug_step_end(stats: dict[str, Any]) -> None:
    """Observe one engine step: budget, regime, timings and counts.

    Called by the simulator and by adapters after each step; a hook must not
    modify ``stats`` and should return quickly.
    """
