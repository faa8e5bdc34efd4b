"""maskplug for vLLM.

Installing this distribution changes nothing: vLLM loads its
``vllm.general_plugins`` entry point in every process, and :func:`register`
returns at once unless ``MASKPLUG_VLLM=1``. Enabled, it routes vLLM's
structured-output work through maskplug:

* grammar requests are compiled and matched by a maskplug grammar provider
  (``MASKPLUG_VLLM_PROVIDER``, default: the provider named like vLLM's chosen
  backend, e.g. ``xgrammar``);
* the scheduler's mask rows come from :func:`maskplug.fill_draft_masks`;
* both places vLLM 0.32 applies masks (the CPU model runner's scatter path and
  the newer GPU runner's ``StructuredOutputsWorker``) call
  :func:`maskplug.apply_grammar_bitmask` with a mapping built from the
  scheduled layout, correct in every adaptive-verification budget regime.

With ``MASKPLUG_VLLM_SCHEDULER=<name>`` as well, a maskplug scheduler picks
every step's verify budget and the step is compacted to the kept drafts (see
:mod:`maskplug_vllm.adaptive`); :func:`step_stats` counts the steps by regime.

vLLM has no registry for any of this, so the adapter patches a handful of
named attributes (see :mod:`maskplug_vllm.patches`) after checking that the
installed vLLM is a release it was tested with; any other release is refused
with a :class:`maskplug.PluginError` that says so.
"""

from __future__ import annotations

import os
import warnings

from . import patches as _patches
from .adaptive import (
    COST_ENV,
    SCHEDULER_ENV,
    _uninstall_adaptive,
    adaptive_installed,
    current_scheduler,
    install_adaptive,
    load_cost_model,
    reset_step_stats,
    set_cost_model,
    set_scheduler,
    step_stats,
)
from .host import StepRows, draft_counts, step_rows
from .patches import TESTED_VLLM_VERSIONS, check_vllm_version, install, installed

__all__ = [
    "COST_ENV",
    "ENABLE_ENV",
    "PROVIDER_ENV",
    "SCHEDULER_ENV",
    "TESTED_VLLM_VERSIONS",
    "StepRows",
    "adaptive_installed",
    "adaptive_requested",
    "check_vllm_version",
    "current_scheduler",
    "draft_counts",
    "enabled",
    "install",
    "install_adaptive",
    "installed",
    "load_cost_model",
    "register",
    "reset_step_stats",
    "set_cost_model",
    "set_scheduler",
    "step_rows",
    "step_stats",
    "uninstall",
]

__version__ = "0.1.0"

ENABLE_ENV = "MASKPLUG_VLLM"
"""Set to ``1`` to enable the adapter; anything else (or unset) leaves vLLM untouched."""

PROVIDER_ENV = "MASKPLUG_VLLM_PROVIDER"
"""Name of the maskplug grammar provider that serves vLLM's structured outputs."""


def enabled() -> bool:
    """Whether ``MASKPLUG_VLLM`` asks for the adapter in this process."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def adaptive_requested() -> bool:
    """Whether ``MASKPLUG_VLLM_SCHEDULER`` asks for maskplug's budgets in this process."""
    return bool(os.environ.get(SCHEDULER_ENV, "").strip())


def register() -> None:
    """vLLM's ``general_plugins`` entry point: install the patches when enabled, else do nothing.

    With ``MASKPLUG_VLLM_SCHEDULER`` set as well, the adaptive-verification
    patches go in too (:func:`install_adaptive`).
    """
    if enabled():
        install()
        if adaptive_requested():
            install_adaptive()
    elif adaptive_requested():
        warnings.warn(
            f"{SCHEDULER_ENV} is set but {ENABLE_ENV} is not; maskplug is off and vLLM verifies its drafts "
            f"as usual (set {ENABLE_ENV}=1 for maskplug's budgets)",
            RuntimeWarning,
            stacklevel=2,
        )


def uninstall() -> None:
    """Put vLLM's own implementations back (the adaptive-verification patches included)."""
    _patches.uninstall()
    _uninstall_adaptive()
