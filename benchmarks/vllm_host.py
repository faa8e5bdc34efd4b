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
Two draft patterns (``--pattern``):

* ``fixed``: every request drafts 7 every step (the counts repeat);
* ``changing``: an n-gram drafter's pattern: each step a random third of the
  requests draft fewer (1 to 6), so the counts change every step. Steps cycle
  through 16 prepared ones, the same sequence on both sides.

Both sides must give the same mapping, the same budget and the same
compaction at every prepared step before anything is timed. Rounds alternate
which side goes first; the figure is the median over rounds of the mean time
per call.

Run: ``adapters/.venv-vllm/bin/python benchmarks/vllm_host.py [--rounds R] [--calls K] [--pattern fixed,changing]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from maskplug_vllm import step_rows
from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av
from vllm.v1.worker.gpu.structured_outputs import _build_grammar_mapping

import maskplug as mp
from maskplug.steps import StepPlanner

DRAFTS = 7
NUM_BONUS = 1
SIZES = (8, 64, 256, 1024)


STEPS = 16  # prepared steps per case in the changing pattern, cycled through


def _step(nd: npt.NDArray[np.int32], req_ids: list[str]) -> dict[str, Any]:
    """One step's inputs, in the forms each side holds them (vLLM's dicts and lists, maskplug's arrays)."""
    non_draft = np.ones(nd.shape[0], dtype=np.int32)
    return {
        "nd": nd,
        "non_draft": non_draft,
        "cu": np.concatenate([[0], np.cumsum(nd + NUM_BONUS)]).astype(np.int32),
        "tokens_per_req": dict(zip(req_ids, (nd + non_draft).tolist(), strict=True)),
        "draft_tokens": {r: [0] * int(d) for r, d in zip(req_ids, nd.tolist(), strict=True)},
    }


def _case(n: int, seed: int, pattern: str) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    req_ids = [f"cmpl-{rng.integers(1 << 48):012x}-0" for _ in range(n)]
    grammar_ids = [req_ids[i] for i in rng.permutation(n)]
    if pattern == "fixed":
        steps = [_step(np.full(n, DRAFTS, dtype=np.int32), req_ids)]
    else:
        steps = []
        for _ in range(STEPS):
            nd = np.full(n, DRAFTS, dtype=np.int32)
            fewer = rng.permutation(n)[: max(1, round(n / 3))]
            # 1 to K-1, never 0: vLLM keeps verification requests first in the batch, so a request
            # dropping to no drafts would reorder it; here the batch order stays, only counts change.
            nd[fewer] = rng.integers(1, DRAFTS, size=fewer.shape[0])
            steps.append(_step(nd, req_ids))
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
        "steps": steps,
        "manager": manager,
        "cost": cost,
        "stale": stale[slots],
        "planner": StepPlanner(req_ids, grammar_ids, num_bonus=NUM_BONUS, cost=cost),
    }


def vllm_mapping(c: dict[str, Any], s: dict[str, Any]) -> torch.Tensor:
    """vLLM's per-step host work in the GPU runner's ``StructuredOutputsWorker`` (minus the copies)."""
    m = _build_grammar_mapping(c["req_ids"], c["grammar_ids"], s["cu"], s["nd"], NUM_BONUS, DRAFTS + NUM_BONUS)
    return torch.tensor(m, dtype=torch.int32)


def maskplug_mapping(c: dict[str, Any], s: dict[str, Any]) -> mp.RowMapping:
    """The adapter's per-step host work for the same kernel call."""
    return step_rows(c["req_ids"], c["grammar_ids"], s["nd"], NUM_BONUS).mapping


def _vllm_budget(c: dict[str, Any], s: dict[str, Any]) -> tuple[int, np.ndarray, np.ndarray]:
    m = c["manager"]
    m.get_num_tokens(s["tokens_per_req"], s["draft_tokens"])
    tokens, cu = m.compact_batch(s["nd"], s["nd"] + s["non_draft"], s["cu"])
    return int(m._batch_budget[2]), tokens, cu


def vllm_budget(c: dict[str, Any], s: dict[str, Any]) -> int:
    return _vllm_budget(c, s)[0]


def maskplug_budget(c: dict[str, Any], s: dict[str, Any]) -> int:
    layout = mp.ScheduledLayout(c["req_ids"], s["nd"], s["non_draft"], NUM_BONUS)
    d = mp.choose_budget(c["stale"], layout, c["cost"], num_sampling=layout.n, max_logits=16384)
    mp.compact(layout, d.budget)
    return d.budget


def vllm_step(c: dict[str, Any], s: dict[str, Any]) -> int:
    """vLLM's whole per-step host work: the grammar mapping, then budget and compaction."""
    vllm_mapping(c, s)
    return vllm_budget(c, s)


def maskplug_step(c: dict[str, Any], s: dict[str, Any]) -> int:
    """The same step with a planner made once for the batch."""
    step = c["planner"].step(s["nd"], s["non_draft"], c["stale"], num_sampling=len(c["req_ids"]), max_logits=16384)
    return step.budget


def check(c: dict[str, Any]) -> None:
    """Every prepared step: the same mapping, budget and compaction on both sides (else nothing is timed)."""
    n = len(c["req_ids"])
    for i, s in enumerate(c["steps"]):
        theirs = vllm_mapping(c, s).numpy().astype(np.int64)
        mine = maskplug_mapping(c, s)
        if not np.array_equal(theirs, mine.request.astype(np.int64) * (DRAFTS + NUM_BONUS) + mine.position):
            raise SystemExit(f"n={n}, step {i}: mappings differ; nothing timed")
        budget, tokens, cu = _vllm_budget(c, s)
        if budget != maskplug_budget(c, s):
            raise SystemExit(f"n={n}, step {i}: budgets differ ({budget} vs {maskplug_budget(c, s)}); nothing timed")
        step = c["planner"].step(s["nd"], s["non_draft"], c["stale"], num_sampling=n, max_logits=16384)
        same_rows = np.array_equal(
            theirs, step.mapping.request.astype(np.int64) * (DRAFTS + NUM_BONUS) + step.mapping.position
        )
        comp = step.compaction
        # vLLM's partial split is its own placeholder (even shares); the total and the offsets are exact.
        same_comp = int(np.sum(tokens)) == comp.num_tokens and np.array_equal(np.asarray(cu, np.int64), comp.cu_logits)
        if comp.exact:
            same_comp = same_comp and np.array_equal(np.asarray(tokens, np.int64), comp.num_tokens_per_req)
        if not same_rows or step.budget != budget or not same_comp:
            raise SystemExit(f"n={n}, step {i}: the planner's step differs from vLLM's; nothing timed")


def _time(fn: Callable[[dict[str, Any], dict[str, Any]], Any], c: dict[str, Any], calls: int) -> tuple[float, float]:
    """Mean wall-clock and mean CPU time (of this thread) per call, µs; calls cycle through the prepared steps."""
    steps = c["steps"]
    seq = [steps[i % len(steps)] for i in range(calls)]
    t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
    for s in seq:
        fn(c, s)
    cpu = time.thread_time_ns() - c0
    return (time.perf_counter_ns() - t0) / calls / 1e3, cpu / calls / 1e3


def measure(
    c: dict[str, Any], a: Callable[..., Any], b: Callable[..., Any], rounds: int, calls: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median over rounds of (wall, cpu) per call for ``a`` and for ``b``, rounds alternating which goes first."""
    for s in c["steps"] * max(1, 20 // len(c["steps"])):
        a(c, s)
        b(c, s)
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
    ap.add_argument("--pattern", default="fixed,changing", help="comma-separated: fixed, changing (default both)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated batch sizes")
    args = ap.parse_args()
    patterns = [p.strip() for p in args.pattern.split(",")]
    if any(p not in ("fixed", "changing") for p in patterns):
        ap.error(f"--pattern: expected 'fixed' and/or 'changing', got {args.pattern!r}")
    import vllm

    print(f"vLLM {vllm.__version__} host path per step, up to {DRAFTS} drafts per request, all under a grammar")
    print(f"median over {args.rounds} rounds of the mean of {args.calls} calls, µs")
    print("wall: wall-clock; cpu: CPU time of this thread (what the work costs when the machine is shared)")
    print(
        f"{'pattern':>8} {'n':>6} {'part':>20} {'vLLM wall':>10} {'maskplug wall':>14} {'speed-up':>9}"
        f" {'vLLM cpu':>9} {'maskplug cpu':>13} {'speed-up':>9}"
    )
    for pattern in patterns:
        for n in (int(x) for x in args.sizes.split(",")):
            c = _case(n, seed=n, pattern=pattern)
            check(c)
            for part, a, b in (
                ("mapping", vllm_mapping, maskplug_mapping),
                ("budget + compaction", vllm_budget, maskplug_budget),
                ("whole step", vllm_step, maskplug_step),
            ):
                (tv, cv), (tm, cm) = measure(c, a, b, args.rounds, args.calls)
                print(
                    f"{pattern:>8} {n:>6} {part:>20} {tv:>10.1f} {tm:>14.1f} {tv / tm:>8.1f}x"
                    f" {cv:>9.1f} {cm:>13.1f} {cv / cm:>8.1f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
