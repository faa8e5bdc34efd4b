"""Host path per step: layout, budget choice, compaction and the grammar row mapping.

Measures maskplug against a straightforward per-request Python implementation
of the same work, in the same run, at n = 8, 64, 256 and 1024 requests with 7
drafts each, every request under a grammar. Inputs are what an engine's
scheduler holds: string request ids, per-request draft counts and the stale
confidences of the previous step as numpy arrays.

Run: ``.venv/bin/python benchmarks/host_path.py [--repeat N]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import maskplug as mp
from maskplug.baselines import PythonCost, python_step  # the per-request Python peer

DRAFTS = 7
SIZES = (8, 64, 256, 1024)


# --------------------------------------------------------------------------- baseline


# --------------------------------------------------------------------------- maskplug


def maskplug_step(
    req_ids: list[str],
    num_drafts: np.ndarray,
    num_non_draft: np.ndarray,
    conf: np.ndarray,
    grammar_ids: list[str],
    cost: mp.CostModel,
) -> tuple[int, np.ndarray, mp.RowMapping]:
    layout = mp.ScheduledLayout(req_ids, num_drafts, num_non_draft)
    decision = mp.choose_budget(conf, layout, cost)
    comp = mp.compact(layout, decision.budget)
    mapping = mp.GrammarRows(grammar_ids).mapping(layout)
    return decision.budget, comp.cu_logits, mapping


def median_us(fn: Callable[[], Any], repeat: int) -> float:
    for _ in range(max(3, repeat // 10)):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=500, help="timed steps per size (default 500)")
    args = parser.parse_args()
    coeffs = (1.0, 0.01, 5.0, 0.02)
    cost = mp.CostModel.linear(*coeffs, max_reqs=2048, max_tokens=32768)
    pcost = PythonCost(*coeffs)
    rng = np.random.default_rng(0)
    print(f"host path per step, {DRAFTS} drafts per request, every request with a grammar; median of {args.repeat}")
    print(f"{'n':>6} {'maskplug µs':>12} {'python µs':>10} {'speed-up':>9}  budget")
    for n in SIZES:
        ids = [f"req-{i:05d}-{int(v)}" for i, v in enumerate(rng.integers(0, 10**9, size=n))]
        rng.shuffle(ids)
        nd = np.full(n, DRAFTS, dtype=np.int64)
        nn = np.ones(n, dtype=np.int64)
        conf = rng.uniform(0.3, 0.95, size=(n, DRAFTS))
        grammar_ids = [ids[i] for i in rng.permutation(n)]
        nd_l, nn_l, conf_l = nd.tolist(), nn.tolist(), conf.tolist()
        b_mp, cu_mp, m_mp = maskplug_step(ids, nd, nn, conf, grammar_ids, cost)
        b_py, cu_py, req_py, pos_py = python_step(ids, nd_l, nn_l, conf_l, grammar_ids, pcost)
        # Both implementations must agree before their speed means anything.
        assert b_mp == b_py, (b_mp, b_py)
        assert cu_mp.tolist() == cu_py
        assert m_mp.request.tolist() == req_py and m_mp.position.tolist() == pos_py
        t_mp = median_us(lambda: maskplug_step(ids, nd, nn, conf, grammar_ids, cost), args.repeat)  # noqa: B023
        t_py = median_us(lambda: python_step(ids, nd_l, nn_l, conf_l, grammar_ids, pcost), args.repeat)  # noqa: B023
        print(f"{n:>6} {t_mp:>12.1f} {t_py:>10.1f} {t_py / t_mp:>8.1f}x  {b_mp}/{n * DRAFTS}")


if __name__ == "__main__":
    main()
