"""Host path per step: layout, budget choice, compaction and the grammar row mapping.

Measures maskplug against a straightforward per-request Python implementation
of the same work, in the same run, at n = 8, 64, 256 and 1024 requests with 7
drafts each, every request under a grammar. Inputs are what an engine's
scheduler holds: string request ids, per-request draft counts and the stale
confidences of the previous step as numpy arrays.

Two maskplug columns: ``functions`` (``ScheduledLayout`` + ``choose_budget`` +
``compact`` + ``GrammarRows(...).mapping`` every step) and ``planner`` (one
:class:`maskplug.steps.StepPlanner` per batch, made outside the timing, and
one ``step`` per step: the same results, the request-only work done once).
Each figure is the median over rounds of the mean per call, as wall-clock and
as CPU time of this thread (the work itself, unaffected by other processes
taking the cores).

Run: ``.venv/bin/python benchmarks/host_path.py [--rounds R] [--calls K]``
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
from maskplug.steps import StepPlanner

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


def per_call_us(fn: Callable[[], Any], rounds: int, calls: int) -> tuple[float, float]:
    """Median over ``rounds`` of the mean wall-clock and CPU time (this thread) per call, µs."""
    for _ in range(max(3, calls // 10)):
        fn()
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        for _ in range(calls):
            fn()
        cpu.append((time.thread_time_ns() - c0) / calls / 1e3)
        wall.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds per cell (default 21)")
    parser.add_argument("--calls", type=int, default=50, help="calls per round (default 50)")
    args = parser.parse_args()
    coeffs = (1.0, 0.01, 5.0, 0.02)
    cost = mp.CostModel.linear(*coeffs, max_reqs=2048, max_tokens=32768)
    pcost = PythonCost(*coeffs)
    rng = np.random.default_rng(0)
    print(f"host path per step, {DRAFTS} drafts per request, every request with a grammar")
    print(f"median over {args.rounds} rounds of the mean of {args.calls} calls; µs as wall / CPU of this thread")
    print(
        f"{'n':>6} {'functions':>15} {'planner':>15} {'python':>15} {'python/planner':>15}"
        f" {'python/functions':>17}  budget"
    )
    for n in SIZES:
        ids = [f"req-{i:05d}-{int(v)}" for i, v in enumerate(rng.integers(0, 10**9, size=n))]
        rng.shuffle(ids)
        nd = np.full(n, DRAFTS, dtype=np.int64)
        nn = np.ones(n, dtype=np.int64)
        conf = rng.uniform(0.3, 0.95, size=(n, DRAFTS))
        grammar_ids = [ids[i] for i in rng.permutation(n)]
        nd_l, nn_l, conf_l = nd.tolist(), nn.tolist(), conf.tolist()
        planner = StepPlanner(ids, grammar_ids, cost=cost)
        b_mp, cu_mp, m_mp = maskplug_step(ids, nd, nn, conf, grammar_ids, cost)
        b_py, cu_py, req_py, pos_py = python_step(ids, nd_l, nn_l, conf_l, grammar_ids, pcost)
        st = planner.step(nd, nn, conf)
        # All implementations must agree before their speed means anything.
        assert b_mp == b_py == st.budget, (b_mp, b_py, st.budget)
        assert cu_mp.tolist() == cu_py == st.compaction.cu_logits.tolist()
        assert m_mp.request.tolist() == req_py == st.mapping.request.tolist()
        assert m_mp.position.tolist() == pos_py == st.mapping.position.tolist()
        t_mp = per_call_us(lambda: maskplug_step(ids, nd, nn, conf, grammar_ids, cost), args.rounds, args.calls)  # noqa: B023
        t_pl = per_call_us(lambda: planner.step(nd, nn, conf), args.rounds, args.calls)  # noqa: B023
        t_py = per_call_us(lambda: python_step(ids, nd_l, nn_l, conf_l, grammar_ids, pcost), args.rounds, args.calls)  # noqa: B023
        cells = " ".join(f"{f'{w:.1f} / {c:.1f}':>15}" for w, c in (t_mp, t_pl, t_py))
        r_pl = f"{t_py[0] / t_pl[0]:.1f}x, {t_py[1] / t_pl[1]:.1f}x"
        r_mp = f"{t_py[0] / t_mp[0]:.1f}x, {t_py[1] / t_mp[1]:.1f}x"
        print(f"{n:>6} {cells} {r_pl:>15} {r_mp:>17}  {b_mp}/{n * DRAFTS}", flush=True)


if __name__ == "__main__":
    main()
