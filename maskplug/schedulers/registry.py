"""Finding schedulers by name: the built-ins' registration, :func:`schedulers` and :func:`get_scheduler`.

Schedulers are registered through the ``maskplug_register_schedulers`` hook.
The built-ins are registered by :func:`maskplug_register_schedulers` below,
a hook implementation the plugin registry loads exactly like an outside
plugin's (see ``BUILTIN_PLUGINS`` in :mod:`maskplug.plugins`), so an outside
plugin can neither shadow nor be shadowed by one silently.

``MASKPLUG_SCHEDULER``
    the scheduler :func:`get_scheduler` builds when no name is given
    (default :data:`DEFAULT_SCHEDULER`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import BudgetError, PluginError
from ..hookspecs import hookimpl
from ..plugins import get_registry
from .protocol import Scheduler

__all__ = ["DEFAULT_SCHEDULER", "get_scheduler", "maskplug_register_schedulers", "schedulers"]

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


def get_scheduler(name: str | None = None, **config: Any) -> Scheduler:
    """A new scheduler ``name`` built with ``config``.

    ``name=None`` takes ``MASKPLUG_SCHEDULER`` from the environment, or
    :data:`DEFAULT_SCHEDULER`. An unknown name raises :class:`PluginError`
    listing the registered ones; a configuration the scheduler refuses raises
    :class:`BudgetError`; an object without a callable ``budget`` and
    ``observe``, or with a ``uses_grammar`` that is not a bool, raises
    :class:`PluginError`.
    """
    if name is None:
        name = os.environ.get("MASKPLUG_SCHEDULER") or DEFAULT_SCHEDULER
        source = "MASKPLUG_SCHEDULER"
    else:
        source = "name"
    factories = get_registry().schedulers
    if not isinstance(name, str) or name not in factories:
        raise PluginError(f"{source}: expected one of the registered schedulers {sorted(factories)}, got {name!r}")
    try:
        sched = factories[name](**config)
    except TypeError as exc:
        raise BudgetError(f"config: scheduler {name!r} refused {sorted(config)}: {exc}") from exc
    for attr in ("budget", "observe"):
        if not callable(getattr(sched, attr, None)):
            raise PluginError(
                f"scheduler {name!r}: expected an object with a callable {attr!r}, got {type(sched).__name__}"
            )
    flag = getattr(sched, "uses_grammar", False)
    if not isinstance(flag, bool):
        raise PluginError(f"scheduler {name!r}: expected uses_grammar to be a bool, got {flag!r}")
    return sched
