"""Finding schedulers by name: the built-ins' registration, the scheduler spec, :func:`get_scheduler`.

Schedulers are registered through the ``maskplug_register_schedulers`` hook.
The built-ins are registered by :func:`maskplug_register_schedulers` below,
a hook implementation the plugin registry loads exactly like an outside
plugin's (see ``BUILTIN_PLUGINS`` in :mod:`maskplug.plugins`), so an outside
plugin can neither shadow nor be shadowed by one silently.

A scheduler *spec* is what users write (the CLI, the engine adapters'
environment variables, ``MASKPLUG_SCHEDULER``): a registered name
(``"goodput"``) or ``OUTER:INNER`` for a scheduler that wraps another
(``"grammar-aware:goodput"``: ``grammar-aware`` wrapping ``goodput``; INNER
may itself be a spec). :func:`parse_scheduler_spec` is the one parser of that
spelling; :func:`get_scheduler` takes either form.

``MASKPLUG_SCHEDULER``
    the scheduler spec :func:`get_scheduler` builds when no name is given
    (default :data:`DEFAULT_SCHEDULER`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from ..errors import BudgetError, PluginError
from ..hookspecs import hookimpl
from ..plugins import get_registry
from .protocol import Scheduler

__all__ = [
    "DEFAULT_SCHEDULER",
    "SchedulerSpec",
    "get_scheduler",
    "maskplug_register_schedulers",
    "parse_scheduler_spec",
    "scheduler_names",
    "schedulers",
]

#: The scheduler :func:`get_scheduler` returns when neither a name nor ``MASKPLUG_SCHEDULER`` is given.
DEFAULT_SCHEDULER = "dspark"


@hookimpl
def maskplug_register_schedulers(register: Callable[[str, Any], None]) -> None:
    """Register the built-in schedulers (through the same hook as outside plugins)."""
    # Imported here, when the registry loads its plugins: ``grammar-aware``
    # builds the scheduler it wraps with get_scheduler, from this module.
    from .dspark import DSparkScheduler
    from .goodput import GoodputScheduler
    from .grammar_aware import GrammarAwareScheduler
    from .no_spec import NoSpecScheduler
    from .verify_all import VerifyAllScheduler

    for cls in (DSparkScheduler, VerifyAllScheduler, NoSpecScheduler, GoodputScheduler, GrammarAwareScheduler):
        register(cls.name, cls)


def schedulers() -> list[str]:
    """Names of the registered schedulers, sorted."""
    return sorted(get_registry().schedulers)


def scheduler_names() -> list[str]:
    """Names of the registered schedulers, sorted (as :func:`maskplug.grammar_providers` lists providers).

    Each is a scheduler spec by itself; a scheduler that wraps another (one
    whose factory takes ``inner``, such as ``grammar-aware``) is also
    written ``NAME:INNER`` (:func:`parse_scheduler_spec`).
    """
    return schedulers()


class SchedulerSpec(NamedTuple):
    """A parsed scheduler spec: the registered ``name`` and the configuration the spelling carries.

    ``"grammar-aware:goodput"`` is ``SchedulerSpec("grammar-aware",
    {"inner": "goodput"})``; a plain name has an empty ``config``.
    """

    name: str
    config: Mapping[str, Any]


def _takes_inner(factory: Any) -> bool:
    """Whether a scheduler factory wraps another: it takes an ``inner`` argument."""
    try:
        return "inner" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # not introspectable: not a wrapper as far as specs go
        return False


def parse_scheduler_spec(spec: Any, source: str = "name") -> SchedulerSpec:
    """The one parser of scheduler specs: ``NAME`` or ``OUTER:INNER`` (INNER a spec itself), checked.

    Surrounding whitespace is ignored. ``OUTER`` must be a registered
    scheduler that wraps another (its factory takes ``inner``) and ``INNER``
    a spec naming registered schedulers all the way down. Every bad spelling
    raises :class:`PluginError` naming ``source`` (the argument or the
    environment variable the spec came from): not a str, an unknown name
    (the message lists the registered ones), an outer name that does not
    wrap, an empty inner name.
    """
    factories = get_registry().schedulers
    listed = sorted(factories)
    if not isinstance(spec, str):
        raise PluginError(f"{source}: expected one of the registered schedulers {listed}, got {spec!r}")
    text = spec.strip()
    if text in factories:  # a registered name, even one with a ':' in it
        return SchedulerSpec(text, MappingProxyType({}))
    if ":" not in text:
        raise PluginError(f"{source}: expected one of the registered schedulers {listed}, got {spec!r}")
    wrappers = [n for n in listed if _takes_inner(factories[n])]
    # Walk down the spelling (OUTER:OUTER:...:NAME), so an error names the part at fault and the whole spec.
    rest, prefix = text, ""
    while rest not in factories:
        if ":" not in rest:
            raise PluginError(
                f"{source}: expected one of the registered schedulers {listed} after {prefix!r}, "
                f"got {rest!r} in {spec!r}"
            )
        outer, rest = (part.strip() for part in rest.split(":", 1))
        if outer not in wrappers:
            raise PluginError(
                f"{source}: expected a registered scheduler that wraps another before ':' (one of {wrappers}), "
                f"got {outer!r} in {spec!r}"
            )
        prefix += outer + ":"
        if not rest:
            raise PluginError(f"{source}: expected a scheduler name after {prefix!r}, got {spec!r}")
    outer, inner = (part.strip() for part in text.split(":", 1))
    return SchedulerSpec(outer, MappingProxyType({"inner": inner}))


def get_scheduler(name: str | None = None, **config: Any) -> Scheduler:
    """A new scheduler built from the spec ``name`` with ``config``.

    ``name`` is a registered name or ``OUTER:INNER`` (see
    :func:`parse_scheduler_spec`: ``"grammar-aware:goodput"`` builds
    ``grammar-aware`` wrapping ``goodput``; ``config`` then goes to the
    outer scheduler, which passes what it does not take to the inner one).
    ``name=None`` takes the spec in ``MASKPLUG_SCHEDULER`` from the
    environment, or :data:`DEFAULT_SCHEDULER`. A bad spec raises
    :class:`PluginError` naming where it came from and listing the
    registered schedulers; a configuration the scheduler refuses (``inner``
    given both in the spec and in ``config`` included) raises
    :class:`BudgetError`; an object without a callable ``budget`` and
    ``observe``, or with a ``uses_grammar`` that is not a bool, raises
    :class:`PluginError`.
    """
    if name is None:
        name = os.environ.get("MASKPLUG_SCHEDULER") or DEFAULT_SCHEDULER
        source = "MASKPLUG_SCHEDULER"
    else:
        source = "name"
    spec = parse_scheduler_spec(name, source)
    clash = sorted(set(spec.config) & set(config))
    if clash:
        raise BudgetError(f"config: {clash} given both in the scheduler spec {name!r} and as configuration")
    config = {**spec.config, **config}
    factory = get_registry().schedulers[spec.name]
    try:
        sched = factory(**config)
    except TypeError as exc:
        raise BudgetError(f"config: scheduler {spec.name!r} refused {sorted(config)}: {exc}") from exc
    for attr in ("budget", "observe"):
        if not callable(getattr(sched, attr, None)):
            raise PluginError(
                f"scheduler {spec.name!r}: expected an object with a callable {attr!r}, got {type(sched).__name__}"
            )
    flag = getattr(sched, "uses_grammar", False)
    if not isinstance(flag, bool):
        raise PluginError(f"scheduler {spec.name!r}: expected uses_grammar to be a bool, got {flag!r}")
    return sched
