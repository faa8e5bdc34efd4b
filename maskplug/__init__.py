"""maskplug: structured outputs and adaptive speculative verification, together.

The public API (see the README and DESIGN): layouts and the row mapping, budget
selection, compaction, the mask dispatch, errors and the plugin registry.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .budget import BudgetDecision, CostModel, allocate, choose_budget
from .compaction import Compaction, active_cu_logits, compact
from .dispatch import KernelBackend, apply_grammar_bitmask, backend_status, resolve_backend
from .draftmasks import DraftMasks
from .errors import (
    BackendUnavailable,
    BudgetError,
    GrammarError,
    LayoutError,
    MaskplugError,
    PluginError,
)
from .hookspecs import hookimpl
from .layout import GrammarRows, RowMapping, ScheduledLayout
from .plugins import get_registry, reset_registry
from . import reference  # noqa: E402  (the oracle is part of the API)

__all__ = [
    "BackendUnavailable",
    "BudgetDecision",
    "BudgetError",
    "Compaction",
    "CostModel",
    "DraftMasks",
    "GrammarError",
    "GrammarRows",
    "KernelBackend",
    "LayoutError",
    "MaskplugError",
    "PluginError",
    "RowMapping",
    "ScheduledLayout",
    "__version__",
    "active_cu_logits",
    "allocate",
    "apply_grammar_bitmask",
    "backend_status",
    "choose_budget",
    "compact",
    "get_registry",
    "hookimpl",
    "reset_registry",
    "resolve_backend",
]
