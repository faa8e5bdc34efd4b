"""Host cost of one scheduler step, per built-in scheduler.

For n = 8, 64, 256 and 1024 requests with 7 drafts each (half of them under a
grammar), times building the read-only ``StepView`` plus ``budget()`` (plus
``observe()`` for ``goodput``), against two peers measured in the same run:

* ``bare choose_budget``: the core call an engine would make without the
  scheduler layer (no view, no validation of the view);
* ``python goodput``: the same exponentially weighted acceptance tracking and
  budget argmax written request by request with dicts and lists.

Run: ``.venv/bin/python benchmarks/schedulers.py [--repeat N]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import maskplug as mp

DRAFTS = 7
SIZES = (8, 64, 256, 1024)
COST = mp.CostModel.linear(draft_base_ms=1.0, draft_per_req_ms=0.01, verify_base_ms=5.0, verify_per_token_ms=0.02)


class PythonGoodput:
    """Per-request EWMA of acceptance and the budget argmax, one request at a time."""

    def __init__(self, alpha: float = 0.1, prior: float = 0.5) -> None:
        self.alpha, self.prior = alpha, prior
        self.est: dict[Any, list[float]] = {}

    def budget(self, req_ids: list[str], num_drafts: list[int], num_non_draft: int) -> int:
        surv: list[float] = []
        for rid, nd in zip(req_ids, num_drafts, strict=True):
            e = self.est.get(rid, [self.prior] * DRAFTS)
            run = 1.0
            for p in range(nd):
                run *= e[p]
                surv.append(run)
        surv.sort(reverse=True)
        n = len(req_ids)
        best, best_b, est = -1.0, 0, float(n)
        for b in range(len(surv) + 1):
            if b:
                est += surv[b - 1]
            # the same linear model as COST, in plain floats (no numpy per call)
            r = est / (1.0 + 0.01 * n + 5.0 + 0.02 * (num_non_draft + b))
            if r > best:
                best, best_b = r, b
        return best_b

    def observe(self, req_ids: list[str], verified: list[int], accepted: list[int]) -> None:
        for rid, v, a in zip(req_ids, verified, accepted, strict=True):
            e = self.est.setdefault(rid, [self.prior] * DRAFTS)
            for p in range(min(v, a + 1)):
                x = 1.0 if p < a else 0.0
                e[p] += self.alpha * (x - e[p])


def timeit(fn: Callable[[], Any], repeat: int) -> float:
    """Median microseconds per call."""
    fn()
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e6


def bench_size(n: int, rng: np.random.Generator, repeat: int) -> list[tuple[str, float]]:
    """Every row of the table for one batch size."""
    ids = np.array([f"req-{i:05d}" for i in range(n)])
    nd = np.full(n, DRAFTS)
    lay = mp.ScheduledLayout(ids, nd, np.ones(n, dtype=np.int64))
    conf = rng.uniform(0.3, 1.0, size=(n, DRAFTS))
    g = n // 2
    masks = mp.DraftMasks(
        request=np.arange(0, n, 2)[:g],
        acceptable=rng.integers(0, DRAFTS + 1, size=g),
        forced=rng.random((g, DRAFTS + 1)) < 0.3,
    )
    verified = rng.integers(0, DRAFTS + 1, size=n)
    accepted = np.minimum(verified, rng.integers(0, DRAFTS + 1, size=n))
    outcome = mp.StepOutcome(ids, verified, accepted)
    rows: list[tuple[str, float]] = []
    rows.append(("bare choose_budget", timeit(lambda: mp.choose_budget(conf, lay, COST), repeat)))
    for name in ("dspark", "verify-all", "no-spec"):
        s = mp.get_scheduler(name)
        rows.append((name, timeit(lambda s=s: s.budget(mp.StepView(lay, COST, confidences=conf)), repeat)))
    ga = mp.get_scheduler("grammar-aware", inner="dspark")
    rows.append(
        (
            "grammar-aware(dspark)",
            timeit(lambda: ga.budget(mp.StepView(lay, COST, confidences=conf, grammar=masks)), repeat),
        )
    )
    gp = mp.get_scheduler("goodput")
    gp.observe(outcome)

    def goodput_step() -> None:
        gp.budget(mp.StepView(lay, COST))
        gp.observe(outcome)

    rows.append(("goodput (budget+observe)", timeit(goodput_step, repeat)))
    py = PythonGoodput()
    id_list, nd_list = ids.tolist(), nd.tolist()
    v_list, a_list = verified.tolist(), accepted.tolist()
    py.observe(id_list, v_list, a_list)

    def python_step() -> None:
        py.budget(id_list, nd_list, n)
        py.observe(id_list, v_list, a_list)

    rows.append(("python goodput (peer)", timeit(python_step, repeat)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'n':>5} {'what':<28} {'µs/step':>10}")
    for n in SIZES:
        for what, us in bench_size(n, rng, args.repeat):
            print(f"{n:>5} {what:<28} {us:>10.1f}")


if __name__ == "__main__":
    main()
