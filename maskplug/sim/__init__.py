"""The simulator: a deterministic engine loop over real tokenizers, grammars and kernels.

``maskplug demo`` runs it; tests and budget research import it. See
:mod:`maskplug.sim.engine` for what one step does, :mod:`maskplug.sim.checks`
for what it checks, :mod:`maskplug.sim.config` and :mod:`maskplug.sim.workload`
for what defines a run and its requests, and :mod:`maskplug.sim.models` for
the synthetic target and drafter.
"""

from __future__ import annotations

from .config import DEFAULT_SCHEDULERS, SimConfig, WorkloadMix, default_cost_model, make_scheduler
from .engine import Simulation
from .results import RunResult
from .run import DemoReport, format_json, format_table, run_demo
from .tree_drafter import TreeConfig
from .tree_engine import TREE_SCHEDULERS, TreeSimulation
from .workload import Workload

__all__ = [
    "DEFAULT_SCHEDULERS",
    "TREE_SCHEDULERS",
    "DemoReport",
    "RunResult",
    "SimConfig",
    "Simulation",
    "TreeConfig",
    "TreeSimulation",
    "Workload",
    "WorkloadMix",
    "default_cost_model",
    "format_json",
    "format_table",
    "make_scheduler",
    "run_demo",
]
