"""maskplug's step counters as Prometheus series on vLLM's ``/metrics``.

vLLM's engine core (where maskplug's budget is decided and its outcome seen)
runs in a process of its own behind the OpenAI server, and its own statistics
reach the server as fixed-field records. maskplug's counters take a shorter
way: the engine core writes them into a small memory-mapped file (a handful
of int64 slots, one aligned store each, no lock and no system call per step),
and a Prometheus collector registered in the server's process reads the file
when ``/metrics`` is scraped. The file's folder is chosen by the first process
that loads the adapter (the server, or the process that calls ``LLM(...)``)
and passed down to the engine core through :data:`METRICS_DIR_ENV`, which
child processes inherit. Each engine core (one per data-parallel rank) writes
its own file, labelled ``engine``.

Series (all ``maskplug_*``; counters end in ``_total``):

=====================================  ==========================================================
``maskplug_steps_total``               engine steps that ran the model
``maskplug_regime_steps_total``        steps with drafts of structured requests, by ``regime``
                                       (``full``, ``partial``, ``zero``)
``maskplug_drafts_scheduled_total``    drafts vLLM scheduled
``maskplug_drafts_verified_total``     drafts the budget kept (the chosen budgets, summed)
``maskplug_drafts_accepted_total``     drafts accepted
``maskplug_tokens_emitted_total``      sampled tokens
``maskplug_structured_steps_total``    the steps counted by regime
``maskplug_budget``                    the last step's budget (gauge)
``maskplug_scheduler_info``            1, labelled with the scheduler's ``name``
=====================================  ==========================================================
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FIELDS", "METRICS_DIR_ENV", "StepMetrics", "ensure_metrics_dir", "read_metrics", "register_collector"]

METRICS_DIR_ENV = "MASKPLUG_VLLM_METRICS_DIR"
"""Folder of the engine cores' counter files (set by the adapter in the first process; inherited)."""

FIELDS = (
    "steps",
    "regime_full",
    "regime_partial",
    "regime_zero",
    "drafts_scheduled",
    "drafts_verified",
    "drafts_accepted",
    "tokens_emitted",
    "structured_steps",
    "budget",
)
"""The counters in an engine core's file, in order: native int64s (what :meth:`StepMetrics.write` takes)."""
_SIZE = 8 * len(FIELDS)
#: The counters' layout in the file: native int64s in :data:`FIELDS` order (what the reader's numpy view reads).
_PACK = struct.Struct(f"={len(FIELDS)}q")
_tmp: tempfile.TemporaryDirectory[str] | None = None


def ensure_metrics_dir() -> Path:
    """The counters' folder: :data:`METRICS_DIR_ENV` if set, else a new temporary folder (then set)."""
    global _tmp
    path = os.environ.get(METRICS_DIR_ENV, "").strip()
    if not path:
        _tmp = tempfile.TemporaryDirectory(prefix="maskplug-vllm-metrics-")
        path = _tmp.name
        os.environ[METRICS_DIR_ENV] = path
    return Path(path)


class StepMetrics:
    """The writer, in the engine core: one file ``engine-<index>.bin`` (+ ``.json`` with the scheduler name)."""

    def __init__(self, folder: Path, engine: int, scheduler: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"engine-{engine}.bin"
        with open(self.path, "w+b") as f:
            f.write(b"\0" * _SIZE)
            f.flush()
            self._map = mmap.mmap(f.fileno(), _SIZE)
        self.set_scheduler(scheduler)

    def set_scheduler(self, name: str) -> None:
        """Record the scheduler's name (written once per change, beside the counters)."""
        side = self.path.with_suffix(".json")
        tmp = side.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"scheduler": name}))
        os.replace(tmp, side)

    def publish(self, stats: Mapping[str, Any], budget: int) -> None:
        """Write the counters (``stats`` as :func:`maskplug_vllm.step_stats` gives them) and the last budget."""
        regimes = stats["regimes"]
        self.write(
            (
                stats["steps"],
                regimes["full"],
                regimes["partial"],
                regimes["zero"],
                stats["drafts_scheduled"],
                stats["drafts_verified"],
                stats["drafts_accepted"],
                stats["tokens_emitted"],
                stats["structured_steps"],
                budget,
            )
        )

    def write(self, counts: Sequence[int]) -> None:
        """Write ten counters in the file's order (:data:`FIELDS`: ``steps`` first, ``budget`` last)."""
        # One packed write into the map: a numpy assignment from a tuple costs several times more per step.
        _PACK.pack_into(self._map, 0, *counts)


def read_metrics(folder: Path | None = None) -> dict[str, dict[str, Any]]:
    """Every engine core's counters in ``folder`` (default: :data:`METRICS_DIR_ENV`): engine → field → value."""
    if folder is None:
        path = os.environ.get(METRICS_DIR_ENV, "").strip()
        if not path:
            return {}
        folder = Path(path)
    out: dict[str, dict[str, Any]] = {}
    for f in sorted(folder.glob("engine-*.bin")):
        data = f.read_bytes()
        if len(data) != _SIZE:
            continue
        values = dict(zip(FIELDS, np.frombuffer(data, dtype=np.int64).tolist(), strict=True))
        try:
            values["scheduler"] = json.loads(f.with_suffix(".json").read_text()).get("scheduler", "")
        except (OSError, ValueError):
            values["scheduler"] = ""
        out[f.stem.split("-", 1)[1]] = values
    return out


class _Collector:
    """A Prometheus collector reading the engine cores' files at scrape time."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engines = read_metrics(self.folder)
        plain = {
            "steps": ("maskplug_steps", "Engine steps that ran the model."),
            "drafts_scheduled": ("maskplug_drafts_scheduled", "Drafts vLLM scheduled."),
            "drafts_verified": ("maskplug_drafts_verified", "Drafts kept by maskplug's verify budget."),
            "drafts_accepted": ("maskplug_drafts_accepted", "Verified drafts that were accepted."),
            "tokens_emitted": ("maskplug_tokens_emitted", "Tokens sampled."),
            "structured_steps": ("maskplug_structured_steps", "Steps with drafts of structured-output requests."),
        }
        for key, (name, doc) in plain.items():
            fam = CounterMetricFamily(name, doc, labels=["engine"])
            for eng, v in engines.items():
                fam.add_metric([eng], v[key])
            yield fam
        reg = CounterMetricFamily(
            "maskplug_regime_steps", "Steps with structured drafts, by budget regime.", labels=["engine", "regime"]
        )
        for eng, v in engines.items():
            for regime in ("full", "partial", "zero"):
                reg.add_metric([eng, regime], v[f"regime_{regime}"])
        yield reg
        budget = GaugeMetricFamily("maskplug_budget", "The last step's verify budget.", labels=["engine"])
        info = GaugeMetricFamily(
            "maskplug_scheduler_info", "The maskplug scheduler choosing budgets.", labels=["engine", "name"]
        )
        for eng, v in engines.items():
            budget.add_metric([eng], v["budget"])
            info.add_metric([eng, v["scheduler"]], 1)
        yield budget
        yield info


_registered = False


def register_collector() -> None:
    """Register the collector in this process's default Prometheus registry (once; no-op without the client)."""
    global _registered
    if _registered:
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # vLLM depends on it; without it there is no /metrics to serve
        return
    REGISTRY.register(_Collector(ensure_metrics_dir()))
    _registered = True
