"""The vLLM adapter's per-step planning and outcome in the engine core, on vLLM's own scheduler output.

Runs in the vLLM environment from the repository root::

    adapters/.venv-vllm/bin/python benchmarks/vllm_plan.py [--requests 1,16] [--calls 20000]

Builds vLLM 0.32's ``SchedulerOutput`` for ``n`` decoding requests with three
n-gram drafts each (every request under a grammar, as in a structured
workload) and times :class:`maskplug_vllm.adaptive`'s ``plan`` (before the
forward pass) and ``finish`` (the sampled tokens back) per step, in CPU time
of the calling thread, for the built-in ``verify-all`` (which needs no view
and learns nothing) and for ``goodput`` (a view, a budget and an outcome).
Both controllers see the same steps; ``verify-all``'s counters are checked
equal to those of a subclass of it that takes the general path.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any

from maskplug_vllm import adaptive
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

from maskplug.schedulers import VerifyAllScheduler, get_scheduler

DRAFTS = 3


class _General(VerifyAllScheduler):
    """verify-all through the general path (a subclass is not the built-in)."""


def _step(n: int) -> tuple[SchedulerOutput, Any, Any]:
    ids = [f"cmpl-{i:08x}-0" for i in range(n)]
    so = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={r: 1 + DRAFTS for r in ids},
        total_num_scheduled_tokens=n * (1 + DRAFTS),
        scheduled_spec_decode_tokens={r: [11, 12, 13] for r in ids},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    grammar = SimpleNamespace(structured_output_request_ids=ids)
    out = SimpleNamespace(sampled_token_ids=[[5, 6, 7] for _ in ids], req_id_to_index={r: i for i, r in enumerate(ids)})
    return so, grammar, out


def _time(ctl: Any, so: Any, grammar: Any, out: Any, calls: int) -> tuple[float, float]:
    for _ in range(200):
        ctl.finish(ctl.plan(so, grammar), out)
    plan_s = finish_s = 0.0
    for _ in range(calls):
        t0 = time.thread_time()
        p = ctl.plan(so, grammar)
        t1 = time.thread_time()
        ctl.finish(p, out)
        t2 = time.thread_time()
        plan_s += t1 - t0
        finish_s += t2 - t1
    return 1e6 * plan_s / calls, 1e6 * finish_s / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="1,16", help="comma-separated batch sizes (default 1,16)")
    parser.add_argument("--calls", type=int, default=20000, help="timed steps per cell (default 20000)")
    args = parser.parse_args()
    cost = adaptive.default_cost_model()
    print("CPU µs per step of the calling thread (plan / finish)")
    print(f"{'n':>5} {'verify-all':>18} {'verify-all, general':>22} {'goodput':>18}")
    for n in (int(x) for x in args.requests.split(",")):
        so, grammar, out = _step(n)
        fast = adaptive._Controller(VerifyAllScheduler(), "verify-all", cost)
        general = adaptive._Controller(_General(), "verify-all", cost)
        goodput = adaptive._Controller(get_scheduler("goodput"), "goodput", cost)
        cells = [_time(c, so, grammar, out, args.calls) for c in (fast, general, goodput)]
        if fast.stats != general.stats:
            raise SystemExit(f"n={n}: verify-all's counters differ from the general path's; nothing reported")
        print(f"{n:>5}" + "".join(f" {p:>9.1f} / {f:>6.1f}" for p, f in cells), flush=True)


if __name__ == "__main__":
    main()
