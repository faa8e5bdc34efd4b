"""Running the demo: set up once, run every scheduler on the same workload, report."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from ..budget import CostModel
from ..console import Justify, Progress, render_table
from ..data.tokenizers import load_tokenizer
from ..dispatch import resolve_backend
from ..grammar import grammar_provider
from .config import DEFAULT_SCHEDULERS, SimConfig, default_cost_model
from .engine import Simulation
from .models import TargetModel, structural_tokens
from .results import RunResult
from .tree_drafter import TreeConfig
from .tree_engine import TreeSimulation, is_tree_scheduler
from .workload import Workload

__all__ = ["DemoReport", "format_json", "format_table", "run_demo"]


@dataclass
class DemoReport:
    """Every scheduler's result on one workload, plus the set-up time."""

    config: SimConfig
    results: dict[str, RunResult] = field(default_factory=dict)
    setup_s: float = 0.0
    run_s: float = 0.0
    backend: str = ""
    #: the tree drafter's shape when tree schedulers ran (``tree:INNER``), else None
    tree: TreeConfig | None = None
    #: requests that failed alone (request index -> (request name, why: its grammar did not compile))
    failures: dict[int, tuple[str, str]] = field(default_factory=dict)

    @property
    def violations(self) -> int:
        """Invariant violations over all runs."""
        return sum(len(r.violations) for r in self.results.values())

    @property
    def invalid(self) -> int:
        """Invalid finished outputs over all runs."""
        return sum(r.invalid for r in self.results.values())


def run_demo(
    config: SimConfig,
    schedulers: Sequence[str] = DEFAULT_SCHEDULERS,
    *,
    cost: CostModel | None = None,
    progress: bool = True,
    stream: TextIO | None = None,
    tree: TreeConfig | None = None,
) -> DemoReport:
    """Run each scheduler for ``config.steps`` steps on the same request stream.

    Tree schedulers (``tree:INNER``, :mod:`.tree_engine`) draft trees of shape
    ``tree`` (default :class:`TreeConfig`).
    """
    import torch

    t0 = time.perf_counter()
    tok = load_tokenizer(config.tokenizer)
    provider = grammar_provider(config.provider, tok.vocab)
    backend = resolve_backend(config.backend, torch.device("cpu")).name
    workload = Workload(config, tok, provider)
    target = TargetModel(config.seed, tok.vocab.vocab_size, noise=config.noise, margin=config.margin)
    structural = structural_tokens(tok.vocab)
    cost = cost if cost is not None else default_cost_model()
    report = DemoReport(config, backend=backend)
    if any(is_tree_scheduler(s) for s in schedulers):
        report.tree = tree if tree is not None else TreeConfig()
    report.setup_s = time.perf_counter() - t0
    with Progress(config.steps * len(schedulers), "demo", stream=stream, enabled=progress) as bar:
        for i, name in enumerate(schedulers):
            base = i * config.steps

            def tick(t: int, res: RunResult, base: int = base, name: str = name) -> None:
                bar.update(base + t + 1, f"{name}: {res.tokens} tokens, {res.valid} valid")

            sim: Simulation
            if is_tree_scheduler(name):
                sim = TreeSimulation(
                    config, name, workload, target, cost, on_step=tick, structural=structural, tree=report.tree
                )
            else:
                sim = Simulation(config, name, workload, target, cost, on_step=tick, structural=structural)
            report.results[name] = sim.run()
    report.failures = dict(workload.failures)
    report.run_s = time.perf_counter() - t0 - report.setup_s
    return report


def format_json(report: DemoReport, timing: bool = True) -> str:
    """The one-object ``--json`` output (``docs/design.md`` §9); byte-identical for one seed when ``timing`` is off."""
    obj: dict[str, Any] = {
        "seed": report.config.seed,
        "config": report.config.as_json(),
        "schedulers": {name: r.as_json(timing) for name, r in report.results.items()},
    }
    if report.tree is not None:
        obj["config"]["tree"] = report.tree.as_json(report.config.drafts)
    if report.failures:  # only when some request failed: a run without failures keeps its record
        obj["failed_requests"] = {str(i): {"request": name, "error": why} for i, (name, why) in report.failures.items()}
    return json.dumps(obj, indent=2, sort_keys=False)


def format_table(report: DemoReport) -> str:
    """The human-readable results table and its legend."""
    cfg = report.config
    columns: list[tuple[str, Justify]] = [
        ("scheduler", "left"),
        ("tok/step", "right"),
        ("acc.len", "right"),
        ("full", "right"),
        ("part", "right"),
        ("zero", "right"),
        ("goodput tok/s", "right"),
        ("valid", "right"),
        ("invalid", "right"),
        ("cut-off", "right"),
        ("host µs/step", "right"),
        ("apply ms/step", "right"),
        ("step ms", "right"),
        ("overlapped", "right"),
    ]
    rows = []
    for name, r in report.results.items():
        s = max(r.steps, 1)
        pct = {k: f"{100.0 * v / s:.0f}%" for k, v in r.regimes.items()}
        rows.append(
            [
                name,
                f"{r.tokens_per_step:.2f}",
                f"{r.accepted_length:.2f}",
                pct["full"],
                pct["partial"],
                pct["zero"],
                f"{r.goodput:,.0f}",
                str(r.valid),
                str(r.invalid),
                str(r.cut_off),
                f"{1e6 * r.host_s / s:,.0f}",
                f"{1e3 * r.apply_s / s:.2f}",
                f"{r.serial_ms / s:.1f}",
                f"{r.overlap_ms / s:.1f}",
            ]
        )
    lines = [render_table(columns, rows)]
    checks = sum(len(r.violations) for r in report.results.values())
    lines += [
        "",
        f"{cfg.steps} steps per scheduler, {cfg.concurrency} concurrent requests, K={cfg.drafts} drafts, "
        f"{cfg.tokenizer} vocabulary, {cfg.provider} grammars, {report.backend} kernel, seed {cfg.seed}; "
        f"set-up {report.setup_s:.1f} s, runs {report.run_s:.1f} s",
        "tok/step: tokens emitted per engine step; acc.len: tokens per decoding request per step (accepted drafts + 1);",
        "full/part/zero: steps whose verify budget kept every scheduled draft (or had none to trim) / some / none",
        "(bonus rows only), as maskplug.compaction.regime_of classifies them;",
        "goodput: emitted tokens per simulated second under the cost model; cut-off: outputs stopped by their token",
        "limit (never counted valid); host µs/step: maskplug's host path (draft masks, budget, allocation, compaction,",
        "commit); apply: the mask kernel on this CPU.",
        "step ms: one step's forward pass (the cost model's time) after its draft mask rows (host);",
        "overlapped: the same step with the rows produced while the forward pass runs (fill_draft_masks(...,",
        f"wait=False), measured{'' if cfg.overlap else ': off, --no-overlap'}); schedulers that read the masks choose "
        "the budget from them and cannot overlap.",
        f"invariant checks: {'all passed' if checks == 0 else f'{checks} VIOLATIONS'}",
    ]
    if report.tree is not None:
        tr = report.tree.as_json(cfg.drafts)
        lines[-1:-1] = [
            f"tree:X: draft trees (top-{tr['branch']} branching, depth {tr['depth']}, width {tr['width']}) with X's "
            "budget over tree nodes, same cost model and token limit;",
            "verified greedily for every request (requests that sample in chain rows take the argmax in tree rows).",
        ]
    if report.failures:
        lines.append(
            f"failed requests: {len(report.failures)}, each alone (its grammar did not compile; the run went on):"
        )
        for i, (name, why) in list(report.failures.items())[:5]:
            lines.append(f"  request {i} ({name}): {why}")
    for name, r in report.results.items():
        for v in r.violations[:5]:
            lines.append(f"  {name}: {v}")
        for s_ in r.invalid_samples[:3]:
            lines.append(f"  {name}: invalid output {s_}")
    return "\n".join(lines)
