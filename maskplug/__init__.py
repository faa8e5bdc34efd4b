"""maskplug: structured outputs and adaptive speculative verification, together.

The public API (see the README and docs/design.md): layouts and the row mapping, budget
selection, compaction, the mask dispatch, errors and the plugin registry.
"""

from __future__ import annotations

from . import reference, schedulers  # the oracle is API; so is the schedulers package
from .budget import BudgetDecision, CostModel, allocate, choose_budget
from .compaction import Compaction, active_cu_logits, compact
from .confidence import ConfidenceHistory
from .dispatch import KernelBackend, apply_grammar_bitmask, backend_status, resolve_backend
from .draftmasks import DraftMasks
from .errors import (
    BackendUnavailable,
    BudgetError,
    GrammarError,
    LayoutError,
    MaskplugError,
    MatcherInUse,
    PluginError,
)
from .grammar import (
    CommitResult,
    DraftMasksJob,
    GrammarProvider,
    GrammarSpec,
    Matcher,
    Vocab,
    commit,
    commit_many,
    fill_draft_masks,
    grammar_provider,
    grammar_providers,
)
from .grammar_trees import fill_tree_masks
from .hookspecs import hookimpl
from .layout import GrammarRows, RowMapping, ScheduledLayout
from .plugins import get_registry, reset_registry
from .schedulers import Scheduler, StepOutcome, StepView, allocate_step, get_scheduler, scheduler_names
from .steps import Step, StepPlanner
from .trees import (
    DraftTree,
    TreeCompaction,
    TreeMasks,
    allocate_tree,
    choose_tree_budget,
    compact_tree,
    node_values,
    select_subtree,
)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "BudgetDecision",
    "BudgetError",
    "CommitResult",
    "Compaction",
    "ConfidenceHistory",
    "CostModel",
    "DraftMasks",
    "DraftMasksJob",
    "DraftTree",
    "GrammarError",
    "GrammarProvider",
    "GrammarRows",
    "GrammarSpec",
    "KernelBackend",
    "LayoutError",
    "MaskplugError",
    "Matcher",
    "MatcherInUse",
    "PluginError",
    "RowMapping",
    "ScheduledLayout",
    "Scheduler",
    "Step",
    "StepOutcome",
    "StepPlanner",
    "StepView",
    "TreeCompaction",
    "TreeMasks",
    "Vocab",
    "__version__",
    "active_cu_logits",
    "allocate",
    "allocate_step",
    "allocate_tree",
    "apply_grammar_bitmask",
    "backend_status",
    "choose_budget",
    "choose_tree_budget",
    "commit",
    "commit_many",
    "compact",
    "compact_tree",
    "fill_draft_masks",
    "fill_tree_masks",
    "get_registry",
    "get_scheduler",
    "grammar_provider",
    "grammar_providers",
    "hookimpl",
    "node_values",
    "reference",
    "reset_registry",
    "resolve_backend",
    "scheduler_names",
    "schedulers",
    "select_subtree",
]
