"""Draft-row production: fill_draft_masks against a sequential accept/fill/rollback loop.

64 grammar requests × 8 rows (7 drafts + 1 bonus) on the 131,072-token tekken
vocabulary, per registered grammar provider. Every step, both producers run on
the very same matchers and drafts (alternating which goes first); both leave
the matchers where they started, and the rows are checked identical. Then a
random verification outcome is committed so the next step starts elsewhere in
the grammar, as in serving.

Each producer's wall time and CPU time (all threads of the process) are
recorded per step: on a shared machine the wall time depends on what else
runs, the CPU time much less; the load average is printed with the results.

    .venv/bin/python benchmarks/draft_rows.py [--steps 40] [--requests 64] [--drafts 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch

from maskplug import GrammarRows, GrammarSpec, ScheduledLayout, commit, fill_draft_masks, grammar_provider
from maskplug import grammar_providers as list_providers
from maskplug.data import schema_dir
from maskplug.grammar import Matcher, Vocab
from maskplug.grammar.vocabs import mistral_tekken

SCHEMAS = schema_dir()  # bundled with maskplug; MASKPLUG_SCHEMAS overrides
# Unbounded repetitions: xgrammar precomputes masks per grammar state, and
# counted ones ({2,12}) multiply states it then fills token by token at run time
# (10 ms per row at this vocabulary size), which would measure that pathology only.
REGEXES = (
    r"[A-Z][a-z]+( [a-z]+)+\.",
    r"\{\"name\": \"[A-Za-z ]+\", \"age\": [0-9]+, \"tags\": \[(\"[a-z]+\"(, \"[a-z]+\")*)?\]\}",
    r"(0|[1-9][0-9]*)(\.[0-9]+)?(, (0|[1-9][0-9]*)(\.[0-9]+)?)*",
)


def specs() -> list[GrammarSpec]:
    """A mix of JSON schemas (when the shared folder is there), JSON objects and regexes."""
    out = [GrammarSpec("regex", r) for r in REGEXES] + [GrammarSpec("json_object")]
    if SCHEMAS.is_dir():
        for p in sorted(SCHEMAS.glob("*.json"))[:4]:
            out.append(GrammarSpec("json_schema", p.read_text()))
    return out


def sequential(matchers: list[Matcher], drafts: list[list[int]], bitmask: torch.Tensor, num_bonus: int) -> None:
    """The plain per-request loop an engine would write: fill, accept, ..., roll back."""
    row = 0
    for m, d in zip(matchers, drafts, strict=True):
        took, alive = 0, True
        rows = len(d) + num_bonus
        for p in range(rows):
            if alive:
                m.fill(bitmask, row + p)
            else:
                bitmask[row + p].fill_(-1)
            if alive and p < len(d):
                if m.accept(d[p]):
                    took += 1
                    alive = not m.is_terminated()
                else:
                    alive = False
        if took:
            m.rollback(took)
        row += rows


def _walk(m: Matcher, v: Vocab, rng: random.Random, n: int, bm: torch.Tensor) -> list[int]:
    """Up to ``n`` allowed tokens at random (text tokens mostly; the matcher is restored)."""
    out: list[int] = []
    while len(out) < n:
        m.fill(bm, 0)
        bits = np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")[: v.vocab_size]
        ids = np.flatnonzero(bits)
        if ids.size == 0:
            break
        t = int(ids[rng.randrange(ids.size)])
        if t in v.eos_ids and ids.size > 1 and rng.random() < 0.9:
            continue
        if not m.accept(t):
            break
        out.append(t)
        if m.is_terminated():
            break
    if out:
        m.rollback(len(out))
    return out


def bench_provider(name: str, v: Vocab, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prov = grammar_provider(name, v)
    sp = [s for s in specs() if prov.supports(s.kind)]
    t0 = time.perf_counter()
    comp = [prov.compile(s) for s in sp]
    compile_s = time.perf_counter() - t0
    n, k, bonus = args.requests, args.drafts, 1
    matchers = [comp[i % len(comp)].matcher() for i in range(n)]
    layout = ScheduledLayout(list(range(n)), [k] * n, [1] * n, num_bonus=bonus)
    rows = GrammarRows(list(range(n)))
    total = rows.num_rows(layout)
    scratch = v.new_bitmask(1)
    producers = ["sequential"] + [f"fill_draft_masks[{st}]" for st in args.strategies.split(",") if st]
    masks = {p: v.new_bitmask(total) for p in producers}
    times: dict[str, list[float]] = {p: [] for p in producers}
    cpu: dict[str, list[float]] = {p: [] for p in producers}
    for step in range(args.warmup + args.steps):
        drafts = []
        for m in matchers:
            d = _walk(m, v, rng, k, scratch)
            if rng.random() < 0.25 and d:  # a drafter mistake at a random position
                d[rng.randrange(len(d))] = rng.randrange(1000, len(v.tokens))
            d += [rng.randrange(1000, len(v.tokens)) for _ in range(k - len(d))]
            drafts.append(d)
        # Rotate the order so no producer always runs first (warm caches favour the second).
        shift = step % len(producers)
        for which in producers[shift:] + producers[:shift]:
            start, cpu0 = time.perf_counter(), time.process_time()
            if which == "sequential":
                sequential(matchers, drafts, masks[which], bonus)
            else:
                strategy = which[len("fill_draft_masks[") : -1]
                out = fill_draft_masks(
                    matchers, drafts, masks[which], rows, layout, threads=args.threads, strategy=strategy
                )
            dt, dc = time.perf_counter() - start, time.process_time() - cpu0
            if step >= args.warmup:
                times[which].append(dt)
                cpu[which].append(dc)
        for which in producers[1:]:
            if not torch.equal(masks["sequential"], masks[which]):
                raise SystemExit(f"{name}: {which} disagrees with the sequential loop at step {step}")
        # Verification outcome: a random accepted prefix plus a bonus token from its row.
        bm = masks["sequential"]
        for g, m in enumerate(matchers):
            a = rng.randint(0, int(out.acceptable[g]))
            emitted = drafts[g][:a]
            if not any(t in v.eos_ids for t in emitted):
                bits = np.unpackbits(bm[g * (k + bonus) + a].numpy().view(np.uint8), bitorder="little")
                ids = np.flatnonzero(bits[: v.vocab_size])
                if ids.size:
                    emitted.append(int(ids[rng.randrange(ids.size)]))
            commit(m, emitted)
            if m.is_terminated():
                m.reset()

    def summary(ts: list[float], cs: list[float]) -> dict[str, float]:
        arr = np.array(ts) * 1e3
        return {
            "rows_per_s": total / float(np.mean(arr) / 1e3),
            "p50_ms": float(np.percentile(arr, 50)),
            "p99_ms": float(np.percentile(arr, 99)),
            "cpu_ms_mean": float(np.mean(cs) * 1e3),
        }

    stats = {p: summary(times[p], cpu[p]) for p in producers}
    base = stats["sequential"]
    for p in producers:
        stats[p]["speedup_p50"] = base["p50_ms"] / stats[p]["p50_ms"]
        stats[p]["speedup_rows_per_s"] = stats[p]["rows_per_s"] / base["rows_per_s"]
        stats[p]["speedup_cpu"] = base["cpu_ms_mean"] / stats[p]["cpu_ms_mean"]
    return {"provider": name, "grammars": len(sp), "compile_s": compile_s, "producers": stats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--drafts", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--strategies", default="auto,batch,threads,serial", help="fill_draft_masks strategies to measure")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--providers", default=",".join(list_providers()))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    v = mistral_tekken()
    results = []
    load0 = os.getloadavg()
    for name in [p for p in args.providers.split(",") if p]:
        print(f"[{name}] compiling and running {args.steps} steps ...", file=sys.stderr, flush=True)
        results.append(bench_provider(name, v, args))
    load1 = os.getloadavg()
    if args.json:
        print(json.dumps({"load_average": [load0, load1], "cpus": os.cpu_count(), "results": results}, indent=2))
        return 0
    rows = args.requests * (args.drafts + 1)
    print(f"{args.requests} grammar requests x {args.drafts + 1} rows = {rows} rows/step, vocab {v.vocab_size}")
    print(
        f"{os.cpu_count()} CPUs; load average (1/5/15 min) before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
        f"after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}"
    )
    head = f"{'provider':<14}{'producer':<28}{'rows/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'speedup':>9}"
    print(head + f"{'CPU ms':>9}{'CPU x':>8}")
    for r in results:
        for label, st in r["producers"].items():
            sp = f"{st['speedup_p50']:.2f}x"
            cx = f"{st['speedup_cpu']:.2f}x"
            print(
                f"{r['provider']:<14}{label:<28}{st['rows_per_s']:>10.0f}{st['p50_ms']:>9.2f}{st['p99_ms']:>9.2f}{sp:>9}"
                f"{st['cpu_ms_mean']:>9.2f}{cx:>8}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
