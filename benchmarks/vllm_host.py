"""vLLM host overhead per step: vLLM 0.32's own code against maskplug's, in the same run.

Runs in the vLLM environment (``adapters/.venv-vllm``, made by
``make -C adapters test-vllm``), because the peer is vLLM's own code, called
unmodified:

* **mapping**: what ``StructuredOutputsWorker.apply_grammar_bitmask`` does on
  the host each step before its kernel: ``_build_grammar_mapping`` (a Python
  list of ``request * stride + position``) and the list-to-tensor conversion,
  against :func:`maskplug_vllm.step_rows` (scheduled layout plus the
  ``(request, position)`` int32 arrays the kernel reads);
* **budget + compaction**: ``AdaptiveVerificationManager.get_num_tokens`` and
  ``compact_batch`` against :func:`maskplug.choose_budget` and
  :func:`maskplug.compact` (same cost tables, same stale confidences);
* **whole step**: both parts together on vLLM's side, against one
  :meth:`maskplug.steps.StepPlanner.step` (layout, budget, compaction and
  mapping) on maskplug's. The planner is made once per batch, outside the
  timing, as vLLM's request states are (its id index lives across steps too).

n grammar requests × 7 drafts, every request under a grammar, the grammar
order a shuffle of the batch order, string request ids as vLLM holds them.
Both sides must give the same mapping and the same budget before anything is
timed. Rounds alternate which side goes first; the figure is the median over
rounds of the mean time per call.

Run: ``adapters/.venv-vllm/bin/python benchmarks/vllm_host.py [--rounds R] [--calls K]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from maskplug_vllm import step_rows
from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av
from vllm.v1.worker.gpu.structured_outputs import _build_grammar_mapping

import maskplug as mp
from maskplug.steps import StepPlanner

DRAFTS = 7
NUM_BONUS = 1
SIZES = (8, 64, 256, 1024)


def _case(n: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    req_ids = [f"cmpl-{rng.integers(1 << 48):012x}-0" for _ in range(n)]
    grammar_ids = [req_ids[i] for i in rng.permutation(n)]
    nd = np.full(n, DRAFTS, dtype=np.int32)
    non_draft = np.ones(n, dtype=np.int32)
    cu = np.concatenate([[0], np.cumsum(nd + NUM_BONUS)]).astype(np.int32)
    max_reqs, max_tokens = 2048, 16384
    draft_curve = [(1, 1.0), (64, 1.4), (256, 2.5), (1024, 6.0), (2048, 11.0)]
    verify_curve = [(1, 5.0), (512, 6.0), (2048, 9.0), (8192, 25.0), (16384, 48.0)]
    stale = rng.uniform(0.3, 1.0, size=(max_reqs, DRAFTS)).astype(np.float32)
    slots = rng.permutation(max_reqs)[:n]
    manager = object.__new__(av.AdaptiveVerificationManager)
    manager.req_states = SimpleNamespace(
        req_id_to_index=dict(zip(req_ids, slots.tolist(), strict=True)),
        num_computed_tokens_np=np.full(max_reqs, 100),
        prefill_len=SimpleNamespace(np=np.full(max_reqs, 10)),
        num_speculative_steps=DRAFTS,
    )
    manager.num_speculative_steps = DRAFTS
    # The capture limit at the table end: the regime where both cost tables agree.
    manager.cost_tables = av.build_cost_tables_from_curves(draft_curve, verify_curve, max_reqs, max_tokens, max_tokens)
    manager._stale_confidences = [SimpleNamespace(np=stale)]
    manager._stale_idx = 0
    manager._max_total_logits = max_tokens
    manager.num_bonus_tokens = NUM_BONUS
    cost = mp.CostModel.from_curves(draft_curve, verify_curve, max_reqs, max_tokens, graph_limit=max_tokens)
    return {
        "req_ids": req_ids,
        "grammar_ids": grammar_ids,
        "nd": nd,
        "non_draft": non_draft,
        "cu": cu,
        "manager": manager,
        "cost": cost,
        "stale": stale[slots],
        "tokens_per_req": dict(zip(req_ids, (nd + non_draft).tolist(), strict=True)),
        "draft_tokens": {r: [0] * DRAFTS for r in req_ids},
        "planner": StepPlanner(req_ids, grammar_ids, num_bonus=NUM_BONUS, cost=cost),
    }


def vllm_mapping(c: dict[str, Any]) -> torch.Tensor:
    """vLLM's per-step host work in the GPU runner's ``StructuredOutputsWorker`` (minus the copies)."""
    m = _build_grammar_mapping(c["req_ids"], c["grammar_ids"], c["cu"], c["nd"], NUM_BONUS, DRAFTS + NUM_BONUS)
    return torch.tensor(m, dtype=torch.int32)


def maskplug_mapping(c: dict[str, Any]) -> mp.RowMapping:
    """The adapter's per-step host work for the same kernel call."""
    return step_rows(c["req_ids"], c["grammar_ids"], c["nd"], NUM_BONUS).mapping


def vllm_budget(c: dict[str, Any]) -> int:
    m = c["manager"]
    m.get_num_tokens(c["tokens_per_req"], c["draft_tokens"])
    m.compact_batch(c["nd"], c["nd"] + c["non_draft"], c["cu"])
    return int(m._batch_budget[2])


def maskplug_budget(c: dict[str, Any]) -> int:
    layout = mp.ScheduledLayout(c["req_ids"], c["nd"], c["non_draft"], NUM_BONUS)
    d = mp.choose_budget(c["stale"], layout, c["cost"], num_sampling=layout.n, max_logits=16384)
    mp.compact(layout, d.budget)
    return d.budget


def vllm_step(c: dict[str, Any]) -> int:
    """vLLM's whole per-step host work: the grammar mapping, then budget and compaction."""
    vllm_mapping(c)
    return vllm_budget(c)


def maskplug_step(c: dict[str, Any]) -> int:
    """The same step with a planner made once for the batch."""
    step = c["planner"].step(c["nd"], c["non_draft"], c["stale"], num_sampling=len(c["req_ids"]), max_logits=16384)
    return step.budget


def _time(fn: Callable[[dict[str, Any]], Any], c: dict[str, Any], calls: int) -> tuple[float, float]:
    """Mean wall-clock and mean CPU time (of this thread) per call, µs."""
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(calls):
        fn(c)
    cpu = time.thread_time_ns() - c0
    return (time.perf_counter_ns() - t0) / calls / 1e3, cpu / calls / 1e3


def measure(
    c: dict[str, Any], a: Callable[..., Any], b: Callable[..., Any], rounds: int, calls: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median over rounds of (wall, cpu) per call for ``a`` and for ``b``, rounds alternating which goes first."""
    for _ in range(20):
        a(c)
        b(c)
    ta: list[tuple[float, float]] = []
    tb: list[tuple[float, float]] = []
    for r in range(rounds):
        first, second = (a, b) if r % 2 == 0 else (b, a)
        x = _time(first, c, calls)
        y = _time(second, c, calls)
        if first is a:
            ta.append(x)
            tb.append(y)
        else:
            ta.append(y)
            tb.append(x)

    def med(ts: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)

    return med(ta), med(tb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    import vllm

    print(f"vLLM {vllm.__version__} host path per step, {DRAFTS} drafts per request, all under a grammar")
    print(f"median over {args.rounds} rounds of the mean of {args.calls} calls, µs")
    print("wall: wall-clock; cpu: CPU time of this thread (what the work costs when the machine is shared)")
    print(
        f"{'n':>6} {'part':>20} {'vLLM wall':>10} {'maskplug wall':>14} {'speed-up':>9}"
        f" {'vLLM cpu':>9} {'maskplug cpu':>13} {'speed-up':>9}"
    )
    for n in SIZES:
        c = _case(n, seed=n)
        theirs = vllm_mapping(c).numpy().astype(np.int64)
        mine = maskplug_mapping(c)
        if not np.array_equal(theirs, mine.request.astype(np.int64) * (DRAFTS + NUM_BONUS) + mine.position):
            raise SystemExit(f"n={n}: mappings differ; nothing timed")
        if vllm_budget(c) != maskplug_budget(c):
            raise SystemExit(f"n={n}: budgets differ ({vllm_budget(c)} vs {maskplug_budget(c)}); nothing timed")
        step = c["planner"].step(c["nd"], c["non_draft"], c["stale"], num_sampling=n, max_logits=16384)
        same_rows = np.array_equal(
            theirs, step.mapping.request.astype(np.int64) * (DRAFTS + NUM_BONUS) + step.mapping.position
        )
        if not same_rows or step.budget != vllm_budget(c):
            raise SystemExit(f"n={n}: the planner's step differs from vLLM's; nothing timed")
        for part, a, b in (
            ("mapping", vllm_mapping, maskplug_mapping),
            ("budget + compaction", vllm_budget, maskplug_budget),
            ("whole step", vllm_step, maskplug_step),
        ):
            (tv, cv), (tm, cm) = measure(c, a, b, args.rounds, args.calls)
            print(
                f"{n:>6} {part:>20} {tv:>10.1f} {tm:>14.1f} {tv / tm:>8.1f}x {cv:>9.1f} {cm:>13.1f} {cv / cm:>8.1f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
