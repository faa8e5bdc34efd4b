"""How the drafts of each half of the mixed workload fare in vLLM's engine, per request kind.

Runs in the vLLM environment from the repository root::

    adapters/.venv-vllm/bin/python benchmarks/vllm_mixed_kinds.py [--concurrency 8] [--requests 32]

``benchmarks/vllm_engine.py --workload mixed`` compares budgets on a workload
meant to be half requests whose n-gram drafts are mostly accepted and half
whose drafts mostly fail. Whether it is depends on what a random-weight model
does with each prompt, so this script checks it: one engine (n-gram drafts of
up to 5 tokens, the same tiny Llama as ``vllm_engine.py``: hidden 1024,
8 layers, vocabulary 512, dummy fp32 weights) runs the workload's closed loop
under maskplug's ``verify-all`` (every draft verified) and then under
``goodput``, each wrapped to record every step's drafts, verified drafts and
accepted drafts per request. It prints, per kind (``copy``: even requests,
``letters``: odd ones), drafts scheduled, verified and accepted, and the
acceptance at each draft position given the ones before it (accepted / seen).
Under ``goodput`` the "verified" counts include the first trimmed draft that
each step judges by the emitted token (see the vLLM adapter's README); the
line ``budget`` below them counts only the drafts the step verified (the
plan's split of the budget) and those of them accepted, and, apart, the drafts
verified on each request's first step with drafts, when ``goodput`` knows
nothing of the request yet (it starts from the population's estimates).

``goodput`` weighs each draft against the cost of verifying it, so the cost
curve decides what it verifies: ``--cost FILE`` uses a cost file, and without
it the script calibrates the engine first, as ``benchmarks/vllm_engine.py``
does (about a minute here), and prints the curve it measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_tiny as tiny

MAX_SPEC = 5
KINDS = ("copy", "letters")


def _tally(log: list[tuple[str, list[str], list[int], list[int]]], tag: str) -> dict[str, dict[str, Any]]:
    """Per kind: drafts scheduled, verified, accepted, and (accepted, seen) per position.

    Request ids are ``{tag}-{i}`` with a suffix vLLM adds; the workload alternates kinds by ``i``.
    """
    out: dict[str, dict[str, Any]] = {
        k: {"scheduled": 0, "verified": 0, "accepted": 0, "positions": [[0, 0] for _ in range(MAX_SPEC)]} for k in KINDS
    }
    for what, ids, a, b in log:
        for r, x, y in zip(ids, a, b, strict=True):
            t = out[KINDS[int(r[len(tag) + 1 :].split("-")[0]) % 2]]
            if what == "plan":
                t["scheduled"] += x
                continue
            t["verified"] += x
            t["accepted"] += y
            for p in range(min(x, y + 1)):  # positions seen: every verified one up to the first rejection
                t["positions"][p][0] += 1
                t["positions"][p][1] += int(p < y)
    return out


def _budget_tally(
    plans: list[tuple[list[str], list[int], list[int]]], outcomes: list[tuple[list[str], list[int]]], tag: str
) -> dict[str, list[int]]:
    """Per kind: drafts the plans verified, those accepted, and the drafts verified on a request's first drafting step.

    ``plans`` and ``outcomes`` are the steps in order (one outcome per planned
    step): request ids with their scheduled drafts and planned capacities, and
    with the accepted counts.
    """
    out = {k: [0, 0, 0] for k in KINDS}
    started: set[str] = set()
    for (ids, drafts, caps), (oids, accepted) in zip(plans, outcomes, strict=True):
        acc = dict(zip(oids, accepted, strict=True))
        for r, d, c in zip(ids, drafts, caps, strict=True):
            t = out[KINDS[int(r[len(tag) + 1 :].split("-")[0]) % 2]]
            t[0] += c
            t[1] += min(acc.get(r, 0), c)  # a judged first trimmed draft is not a verified one
            if d and r not in started:
                started.add(r)
                t[2] += c
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--cost", default=None, help="the engine's cost file (default: calibrate first)")
    args = p.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for k, v in {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "NUMBA_NUM_THREADS": "1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ["MASKPLUG_VLLM"] = "1"
    os.environ["MASKPLUG_VLLM_SCHEDULER"] = "verify-all"
    os.environ["MASKPLUG_VLLM_MAX_WHITESPACE"] = "none"
    from vllm import LLM

    from maskplug import BudgetDecision, StepOutcome, StepView
    from maskplug.schedulers import GoodputScheduler

    log: list[tuple[str, list[str], list[int], list[int]]] = []

    class Recorded(GoodputScheduler):
        """``goodput`` (or, with ``verify_all``, every draft) with each step written to ``log``."""

        def __init__(self, verify_all: bool) -> None:
            super().__init__()
            self.verify_all = verify_all

        def budget(self, step: StepView) -> BudgetDecision:
            lay = step.layout
            d = step.score(step.cap) if self.verify_all else super().budget(step)
            log.append(("plan", [str(r) for r in lay.req_ids], lay.num_drafts.tolist(), [0] * lay.n))
            return d

        def observe(self, outcome: StepOutcome) -> None:
            ids = [str(r) for r in outcome.req_ids]
            log.append(("outcome", ids, outcome.verified.tolist(), outcome.accepted.tolist()))
            super().observe(outcome)

    with tempfile.TemporaryDirectory(prefix="maskplug-mixed-kinds-") as tmp:
        model = str(
            tiny.build_model(
                Path(tmp) / "model", vocab_size=512, hidden_size=1024, intermediate_size=3072, num_layers=8
            )
        )
        if args.cost is None:
            import vllm_engine

            cost_path = Path(tmp) / "cost.json"
            cost = vllm_engine._calibrate(model, cost_path, [args.concurrency], "cpu")
            print(
                "calibrated verify cost (CPU ms by tokens per step): "
                + ", ".join(f"{n}: {ms:.1f}" for n, ms in cost["verify"])
            )
        else:
            cost_path = Path(args.cost)
        os.environ["MASKPLUG_VLLM_COST"] = str(cost_path.resolve())  # read when the engine loads maskplug
        llm = LLM(**tiny.engine_kwargs(model, tiny.ngram(MAX_SPEC), args.concurrency))
        import maskplug_vllm  # after the engine: its plugin is loaded by then
        from maskplug_vllm import adaptive

        # Each planned step's split of the budget, paired with the outcome the scheduler observes in it.
        plans: list[tuple[list[str], list[int], list[int]]] = []
        outcomes: list[tuple[list[str], list[int]]] = []
        finish = adaptive._Controller.finish

        def recorded_finish(ctl: Any, plan: Any, output: Any) -> None:
            before = len(log)
            finish(ctl, plan, output)
            new = [e for e in log[before:] if e[0] == "outcome"]
            if new:
                lay = plan.layout
                plans.append(([str(r) for r in lay.req_ids], lay.num_drafts.tolist(), plan.capacity.tolist()))
                outcomes.append((new[-1][1], new[-1][3]))

        adaptive._Controller.finish = recorded_finish  # type: ignore[method-assign]

        engine = llm.llm_engine
        tiny.closed_loop(engine, tiny.mixed_workload(64, 0), 64, 2, "compile")
        digests = set()
        for name, verify_all in (("verify-all", True), ("goodput", False)):
            maskplug_vllm.set_scheduler(Recorded(verify_all))
            log.clear()
            plans.clear()
            outcomes.clear()
            res = tiny.closed_loop(
                engine, tiny.mixed_workload(args.requests, 8), args.concurrency, args.max_tokens, f"run-{name}"
            )
            digests.add(res["digest"])
            print(f"{name}: {res['tokens_per_cpu_s']:.1f} output tokens per CPU second")
            for kind, t in _tally(log, f"run-{name}").items():
                pos = " ".join(f"{h}/{n}" for n, h in t["positions"])
                print(
                    f"  {kind:<8} drafts scheduled {t['scheduled']:5d}, verified {t['verified']:5d}, "
                    f"accepted {t['accepted']:5d}; by position (accepted/seen): {pos}"
                )
            for kind, (verified, accepted, first) in _budget_tally(plans, outcomes, f"run-{name}").items():
                print(
                    f"  {kind:<8} budget: verified {verified:5d}, accepted {accepted:5d}; "
                    f"verified on the request's first drafting step {first:4d}"
                )
    print("identical tokens under both schedulers: " + ("yes" if len(digests) == 1 else "NO"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
