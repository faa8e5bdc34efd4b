"""``maskplug demo --plot``: goodput against concurrency per scheduler, and one run's budget over time.

matplotlib is needed only here (it is in the ``test`` extra, not a core
dependency); without it :func:`plot_demo` raises
:class:`maskplug.BackendUnavailable` saying so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..console import Progress
from ..errors import BackendUnavailable
from .config import DEFAULT_SCHEDULERS, SimConfig
from .run import DemoReport, run_demo

__all__ = ["SWEEP_CONCURRENCY", "plot_demo", "sweep"]

#: Concurrency levels of the goodput sweep.
SWEEP_CONCURRENCY = (1, 8, 64, 256)


def sweep(
    base: SimConfig,
    schedulers: Sequence[str] = DEFAULT_SCHEDULERS,
    levels: Sequence[int] = SWEEP_CONCURRENCY,
    *,
    steps: int = 20,
    tokenizer: str = "spm",
    progress: bool = True,
    stream: TextIO | None = None,
) -> dict[str, list[float]]:
    """Goodput (tokens per simulated second) per scheduler at each concurrency level.

    Each level is one :func:`run_demo` on the same seed with ``steps`` steps;
    the engine's token limit grows with the concurrency (8 tokens per slot,
    at least the base config's) so that large batches are not starved.
    """
    out: dict[str, list[float]] = {s: [] for s in schedulers}
    with Progress(len(levels), "sweep", stream=stream, enabled=progress) as bar:
        for i, c in enumerate(levels):
            limit = base.max_batch_tokens
            if limit is not None:
                limit = max(limit, 8 * c)
            cfg = dataclasses.replace(
                base, concurrency=c, steps=steps, tokenizer=tokenizer, max_batch_tokens=limit, overlap=False
            )
            rep = run_demo(cfg, schedulers, progress=False)
            for s in schedulers:
                out[s].append(rep.results[s].goodput)
            bar.update(i + 1, f"concurrency {c}")
    return out


def plot_demo(
    path: str | Path,
    report: DemoReport,
    goodput: dict[str, list[float]],
    levels: Sequence[int] = SWEEP_CONCURRENCY,
    budget_run: str = "grammar-aware:dspark",
) -> Path:
    """Draw the sweep and ``budget_run``'s budget per step of ``report`` into a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BackendUnavailable(f"plot: expected matplotlib to draw {str(path)!r}, got none installed") from exc
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, values in goodput.items():
        ax1.plot(list(levels), values, marker="o", label=name)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(list(levels), [str(x) for x in levels])
    ax1.set_xlabel("concurrent requests")
    ax1.set_ylabel("simulated goodput (tokens / s)")
    ax1.set_title("Goodput against concurrency")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    run = report.results.get(budget_run) or next(iter(report.results.values()))
    steps = list(range(len(run.budgets)))
    ax2.step(steps, run.max_budgets, where="mid", color="0.7", label="largest admissible budget")
    ax2.step(steps, run.budgets, where="mid", label=f"chosen budget ({run.scheduler})")
    ax2.set_xlabel("engine step")
    ax2.set_ylabel("drafts verified")
    ax2.set_title(f"Verify budget over time, {report.config.concurrency} requests")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
