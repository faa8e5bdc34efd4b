"""Budget schedulers: who decides how many drafts a step verifies.

A scheduler is chosen by name with :func:`get_scheduler` (``MASKPLUG_SCHEDULER``
picks the default) and registered through the ``maskplug_register_schedulers``
hook, the built-ins exactly like an outside plugin's.

The package, one concept per module:

``protocol``
    :class:`StepView` (what a scheduler sees before a step), :class:`StepOutcome`
    (what verification found), the :class:`Scheduler` protocol (with its
    optional ``uses_grammar`` flag and ``beliefs`` method) and
    :func:`grammar_limits`.
``dspark``
    :class:`DSparkScheduler`: ``choose_budget`` on the view's (stale)
    confidences, the budget maximising expected emitted tokens per
    millisecond. Needs a confidence head.
``verify_all``
    :class:`VerifyAllScheduler` (``verify-all``): fixed-width speculation,
    every scheduled draft that fits the row limit.
``no_spec``
    :class:`NoSpecScheduler` (``no-spec``): always budget 0 (bonus token only).
``goodput``
    :class:`GoodputScheduler`: for drafters without a confidence head, per
    request and position an exponentially weighted average of past
    acceptance, then the same argmax as ``dspark``.
``grammar_aware``
    :class:`GrammarAwareScheduler` (``grammar-aware``): wraps any scheduler
    (``get_scheduler("grammar-aware:goodput")``, or
    ``get_scheduler("grammar-aware", inner="goodput")``); drafts the grammar
    rejects, and all after them, are worth nothing, and accepted drafts at
    positions the grammar forces to one token are certain.
``registry``
    the built-ins' hook implementation, :func:`schedulers` and
    :func:`scheduler_names` (the registered names), :func:`parse_scheduler_spec`
    (the one parser of scheduler specs, ``NAME`` or ``OUTER:INNER`` such as
    ``grammar-aware:goodput``) and :func:`get_scheduler`, which takes a spec.

The allocation (which drafts of which request make up the budget) runs on
the device with the live confidences: :func:`~maskplug.schedulers.allocate_step`
(re-exported here) does it and, on a step with draft masks, never admits a
draft the grammar rejected.

The registered names are listed by :func:`scheduler_names` (also
``maskplug.scheduler_names()``); :func:`schedulers` is the same listing under
its older name. ``maskplug.schedulers`` is this package, an ordinary module.
"""

from __future__ import annotations

from .allocation import allocate_step
from .dspark import DSparkScheduler
from .goodput import GoodputScheduler
from .grammar_aware import GrammarAwareScheduler
from .no_spec import NoSpecScheduler
from .protocol import Scheduler, StepOutcome, StepView, grammar_limits
from .registry import (
    DEFAULT_SCHEDULER,
    SchedulerSpec,
    get_scheduler,
    parse_scheduler_spec,
    scheduler_names,
    schedulers,
)
from .verify_all import VerifyAllScheduler

__all__ = [
    "DEFAULT_SCHEDULER",
    "DSparkScheduler",
    "GoodputScheduler",
    "GrammarAwareScheduler",
    "NoSpecScheduler",
    "Scheduler",
    "SchedulerSpec",
    "StepOutcome",
    "StepView",
    "VerifyAllScheduler",
    "allocate_step",
    "get_scheduler",
    "grammar_limits",
    "parse_scheduler_spec",
    "scheduler_names",
    "schedulers",
]
