"""A long engine run under maskplug's adaptive verification, with traffic like a server's.

Usage: ``python long_run.py MODEL_DIR OUT_JSON [--requests N] [--seed S]`` with
``MASKPLUG_VLLM=1`` and ``MASKPLUG_VLLM_SCHEDULER`` set by the caller.

vLLM's CPU engine runs in this process (``LLMEngine.add_request`` / ``step`` /
``abort_request``) on the tiny model with dummy weights, n-gram drafting with
5 tokens. Requests (JSON schema, regex, unconstrained) arrive while others
are being decoded; some are aborted mid-flight (or before they ever ran),
some are cut off by a small ``max_tokens``. Every 25 steps while requests
arrive the scheduler changes, between the one named in
``MASKPLUG_VLLM_SCHEDULER``, ``goodput`` and ``random-budget`` (registered
here through ``maskplug_register_schedulers``: budget 0, every draft, or
anything between), so trimmed steps of every kind occur; once every request
is in, a fresh instance of the named scheduler sees the rest to the end. Once everything is done, the script records what came out, the KV
cache's free blocks before and after, what the engine and maskplug's
scheduler still hold, and the step counters.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

NUM_SPEC = 5
PHASE = 25  # steps per scheduler while requests arrive
FULL_MAX_TOKENS = {"json": 120, "regex": 48, "free": 32}
REGEXES = [
    r"[a-z]{3,10}-[0-9]{2,4}",
    r"(yes|no|maybe)",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"(alice|bob)@[a-z]{2,8}\.(com|org)",
    r"\{\"id\": [0-9]{1,5}, \"ok\": (true|false)\}",
]


def _register_random_budget() -> None:
    from maskplug import BudgetDecision, StepOutcome, StepView, get_registry, hookimpl

    class RandomBudget:
        name = "random-budget"

        def __init__(self, seed: int = 0) -> None:
            self.rng = np.random.default_rng(seed)

        def budget(self, step: StepView) -> BudgetDecision:
            kind = int(self.rng.integers(3))
            b = 0 if kind == 0 else step.cap if kind == 1 else int(self.rng.integers(0, step.cap + 1))
            return step.score(b)

        def observe(self, outcome: StepOutcome) -> None:
            pass

    class Plugin:
        @hookimpl
        def maskplug_register_schedulers(self, register: Any) -> None:
            register("random-budget", RandomBudget)

    get_registry().add_plugin(Plugin(), "long-run")


def _tracked_ids(scheduler: Any) -> list[str] | None:
    """The request ids a maskplug scheduler keeps state for (None when it keeps no per-request state)."""
    for obj in (scheduler, getattr(scheduler, "inner", None)):
        table = getattr(obj, "_ids", None)
        if table is not None:
            return [str(k) for k in np.asarray(table.keys).tolist()]
    return None


def main(model_dir: str, out_path: str, argv: list[str]) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # One compute thread, idle OpenMP threads asleep, a one-thread numba pool for the n-gram drafter:
    # on a small machine shared with other work, spinning pool threads stall every speculative step.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    num_requests = int(argv[argv.index("--requests") + 1]) if "--requests" in argv else 300
    seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0
    main_scheduler = os.environ["MASKPLUG_VLLM_SCHEDULER"]
    _register_random_budget()

    import maskplug_vllm
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_model

    llm = tiny_model.ngram_engine(model_dir, NUM_SPEC, max_model_len=512, max_num_seqs=32)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    schemas = [(p.stem, json.loads(p.read_text())) for p in tiny_model.schema_paths()]
    rng = np.random.default_rng(seed)

    def make(i: int) -> tuple[dict[str, Any], str, Any]:
        kind = ("json", "json", "regex", "free")[int(rng.integers(4))]
        cut = rng.random() < 0.3
        max_tokens = int(rng.integers(3, 20)) if cut else FULL_MAX_TOKENS[kind]
        meta: dict[str, Any] = {"id": f"req-{i}", "kind": kind, "max_tokens": max_tokens}
        so = None
        if kind == "json":
            name, schema = schemas[int(rng.integers(len(schemas)))]
            meta["schema"] = name
            so = StructuredOutputsParams(json=schema)
            prompt = f'{name} {i}: {{"name": "alice", "id": {i}, "tags": ["a", "b"]}} -> '
        elif kind == "regex":
            meta["regex"] = REGEXES[int(rng.integers(len(REGEXES)))]
            so = StructuredOutputsParams(regex=meta["regex"])
            prompt = f"pattern {i}: alice-{i} bob-{i + 1} alice-{i} -> "
        else:
            prompt = f'free {i}: {{"name": "bob", "id": {i}}} {{"name": "bob", "id": {i}}} -> '
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
        return meta, prompt, params

    metas: dict[str, dict[str, Any]] = {}
    in_flight: list[str] = []
    submitted = steps = engine_steps = 0
    schedulers = [main_scheduler, "goodput", "random-budget"]
    t0 = time.perf_counter()
    max_in_flight = max_tracked_draining = 0
    draining = False

    def submit(count: int) -> None:
        nonlocal submitted
        for _ in range(count):
            if submitted >= num_requests:
                return
            meta, prompt, params = make(submitted)
            engine.add_request(meta["id"], prompt, params)
            metas[meta["id"]] = meta
            in_flight.append(meta["id"])
            submitted += 1

    # Every grammar of the run compiled once first (vLLM caches them): compilation runs beside the
    # engine, and the traffic below is paced by model steps, not by the clock.
    warm = [StructuredOutputsParams(json=schema) for _, schema in schemas]
    warm += [StructuredOutputsParams(regex=r) for r in REGEXES]
    for i, so in enumerate(warm):
        engine.add_request(f"warm-{i}", "warm up -> ", SamplingParams(max_tokens=1, structured_outputs=so))
    while engine.has_unfinished_requests():
        engine.step()

    submit(12)
    tick = True  # the previous engine step ran the model
    while submitted < num_requests or engine.has_unfinished_requests():
        if tick:
            if submitted < num_requests and steps % PHASE == 0:
                maskplug_vllm.set_scheduler(schedulers[(steps // PHASE) % len(schedulers)])
            elif submitted >= num_requests and not draining:
                # Every request is in: the main scheduler (a fresh one) sees the rest through to the end.
                maskplug_vllm.set_scheduler(main_scheduler)
                draining = True
            # Arrivals while others decode; more when the engine is short of work.
            submit(int(rng.poisson(1.5 if len(in_flight) >= 8 else 4)))
            if in_flight and rng.random() < 0.06:
                victim = in_flight[int(rng.integers(len(in_flight)))]
                engine.abort_request([victim])
                in_flight.remove(victim)
                metas[victim]["aborted"] = steps
            max_in_flight = max(max_in_flight, len(in_flight))
        outs = engine.step()
        engine_steps += 1
        tick = bool(outs)
        for out in outs:
            if not out.finished:
                continue
            meta = metas[out.request_id]
            c = out.outputs[0]
            meta.update(text=c.text, finish_reason=c.finish_reason, num_tokens=len(c.token_ids), step=steps)
            if out.request_id in in_flight:
                in_flight.remove(out.request_id)
        if draining:
            max_tracked_draining = max(max_tracked_draining, len(_tracked_ids(maskplug_vllm.current_scheduler()) or ()))
        steps += tick
    elapsed = time.perf_counter() - t0
    tracked_busy = _tracked_ids(maskplug_vllm.current_scheduler())
    # The engine goes idle: its core runs one more (empty) step, as a server's busy loop does, which
    # hands the ids of the requests finished or aborted last to the model runner and maskplug.
    engine.step()
    info = {
        "steps": steps,
        "engine_steps": engine_steps,
        "seconds": elapsed,
        "max_in_flight": max_in_flight,
        "free_blocks_start": free_at_start,
        "free_blocks_end": pool.get_num_free_blocks(),
        "engine_requests_left": len(core.scheduler.requests),
        "engine_running_left": len(core.scheduler.running),
        "engine_waiting_left": len(core.scheduler.waiting),
        "scheduler": maskplug_vllm.step_stats()["scheduler"],
        "scheduler_tracked_ids_before_idle": tracked_busy,
        "scheduler_tracked_ids_draining_max": max_tracked_draining,
        "scheduler_tracked_ids": _tracked_ids(maskplug_vllm.current_scheduler()),
        "adaptive": maskplug_vllm.adaptive_installed(),
    }
    # The counters over the whole run (they are not reset when the scheduler changes).
    info["stats"] = maskplug_vllm.step_stats()
    Path(out_path).write_text(json.dumps({"info": info, "requests": list(metas.values())}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
