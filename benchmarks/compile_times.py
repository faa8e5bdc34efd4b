"""Compile times of one grammar provider on JSONSchemaBench schemas, each under a generous limit.

What the per-provider default compile limits are set from: each schema is
compiled once, in the provider's compile server, under ``--limit-s`` CPU
seconds, and the wall-clock and server CPU seconds are printed as they come
(a slow schema can take many minutes; progress is one line per schema).

    .venv/bin/python benchmarks/compile_times.py --provider outlines-core --every 30 --first 24
    .venv/bin/python benchmarks/compile_times.py --provider outlines-core --ids BFCL_java_14,BFCL_java_56
    .venv/bin/python benchmarks/compile_times.py --summary benchmarks/compile_times/outlines-core.jsonl

``--every N --first M`` takes schemas 0, N, 2N, ... of the sample (the first M
of them; ``--skip S`` leaves out the first S); ``--ids`` takes the named ones. The vocabulary is tekken's 131k
tokens (the ``mistral-common`` wheel's file), the spec maskplug's defaults.

A pass over the whole sample takes CPU hours for outlines-core, so it can be
spread over several runs: ``--out FILE`` appends one JSON line per schema
(id, outcome, wall and compile CPU seconds, limit, load average, date) and
leaves out the schemas the file already holds, so the same command resumes
where the last run stopped::

    nice -n 19 .venv/bin/python benchmarks/compile_times.py --provider outlines-core --every 1 \
        --out benchmarks/compile_times/outlines-core.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from maskplug import GrammarSpec, grammar_provider
from maskplug.grammar.vocabs import mistral_tekken

SAMPLE = Path(__file__).resolve().parents[1] / ".." / "shared" / "jsonschemabench" / "maskbench-sample.jsonl"


def _records(path: Path, every: int, skip: int, first: int | None, ids: list[str] | None) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    if ids:
        by_id = {r["id"]: r for r in map(json.loads, lines)}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise SystemExit(f"--ids: not in {path}: {missing}")
        return [by_id[i] for i in ids]
    picked = [json.loads(lines[i]) for i in range(0, len(lines), every)]
    return picked[skip : first if first is not None else None]


def _kind(outcome: str) -> str:
    """The class of one line's outcome: compiled, refused up front, memory limit, CPU limit, or other."""
    if outcome == "compiled":
        return "compiled"
    if "at its memory limit" in outcome:
        return "memory limit"
    if "within its limit" in outcome:
        return "CPU limit"
    if "cannot turn this JSON schema" in outcome or "failed to compile" in outcome:
        return "refused"
    return "other"


def summarize(path: Path, data: Path, slowest: int = 10) -> str:
    """What a ``--out`` file holds: outcomes by class, compile CPU p50/p90/p99/max, the slowest schemas."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_id = {r["id"]: r for r in lines}
    total = sum(1 for line in data.read_text().splitlines() if line.strip())
    kinds: dict[str, int] = {}
    for r in by_id.values():
        k = _kind(r["outcome"])
        kinds[k] = kinds.get(k, 0) + 1
    out = [f"{path}: {len(by_id)} of {total} schemas ({len(lines) - len(by_id)} ids twice)"]
    out.append("  " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])))
    cpu = sorted(r["cpu_s"] for r in by_id.values() if r["outcome"] == "compiled" and r["cpu_s"] is not None)
    if cpu:
        # numpy's percentile, as maskplug conformance reports them.
        pcts = " / ".join(f"{float(np.percentile(cpu, q)):.2f}" for q in (50, 90, 99))
        out.append(f"  compile CPU s of the {len(cpu)} compiled: p50 / p90 / p99 {pcts}, max {cpu[-1]:.1f}")
    ranked = sorted(
        (r for r in by_id.values() if r["cpu_s"] is not None and _kind(r["outcome"]) != "refused"),
        key=lambda r: -r["cpu_s"],
    )
    for r in ranked[:slowest]:
        out.append(f"  {r['id']:<44} cpu {r['cpu_s']:8.1f} s  {_kind(r['outcome'])}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--provider", default="outlines-core")
    p.add_argument("--data", type=Path, default=SAMPLE)
    p.add_argument("--every", type=int, default=30, help="take every Nth schema (default: %(default)s)")
    p.add_argument("--first", type=int, default=None, help="only the first M of those")
    p.add_argument("--skip", type=int, default=0, help="leave out the first S of those (default: %(default)s)")
    p.add_argument("--ids", default=None, help="comma-separated schema ids instead")
    p.add_argument("--limit-s", type=float, default=1800.0, help="CPU seconds per compile (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="append a JSON line per schema; skip ids it holds")
    p.add_argument("--summary", type=Path, default=None, help="print what an --out file holds, compile nothing")
    a = p.parse_args(argv)
    if a.summary is not None:
        print(summarize(a.summary, a.data))
        return 0
    if a.every < 1:
        p.error(f"--every: expected an int >= 1, got {a.every}")
    recs = _records(a.data, a.every, a.skip, a.first, a.ids.split(",") if a.ids else None)
    if a.out is not None and a.out.exists():
        seen = {json.loads(line)["id"] for line in a.out.read_text().splitlines() if line.strip()}
        recs = [r for r in recs if r["id"] not in seen]
        print(f"{a.out}: {len(seen)} schemas measured before, {len(recs)} to go", flush=True)
    prov: Any = grammar_provider(a.provider, mistral_tekken())
    print(f"{a.provider}: {len(recs)} schemas, limit {a.limit_s:g} CPU s each", flush=True)
    done: list[float] = []
    for j, rec in enumerate(recs):
        t0 = time.perf_counter()
        try:
            prov.compile(GrammarSpec("json_schema", rec["schema"], compile_limit_s=a.limit_s))
            out = "compiled"
        except Exception as exc:  # a refusal or the limit: printed, the next schema goes on
            out = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        wall = time.perf_counter() - t0
        cache = getattr(prov, "cache", None)
        if cache is not None:
            # Each schema is compiled once: the provider's cache of compiled grammars (up to 256, some of
            # them hundreds of MB over tekken's vocabulary) would only hold memory a later compile needs.
            cache.clear()
        worker = getattr(prov, "worker", None)
        cpu = getattr(worker, "last_cpu_s", None) if worker is not None else None
        cpu_s = f"{cpu:8.1f}" if isinstance(cpu, (int, float)) else "       -"
        if out == "compiled":
            done.append(wall)
        print(f"{j:3d} {rec['id']:<44} wall {wall:8.1f} s  cpu {cpu_s} s  {out}", flush=True)
        if a.out is not None:
            line = {
                "id": rec["id"],
                "provider": a.provider,
                "outcome": out,
                "wall_s": round(wall, 3),
                "cpu_s": round(cpu, 3) if isinstance(cpu, (int, float)) else None,
                "limit_s": a.limit_s,
                "load": round(os.getloadavg()[0], 2),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            }
            a.out.parent.mkdir(parents=True, exist_ok=True)
            with a.out.open("a") as fh:
                fh.write(json.dumps(line) + "\n")
    if done:
        print(
            f"compiled {len(done)} of {len(recs)}: wall median {statistics.median(done):.1f} s, max {max(done):.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
