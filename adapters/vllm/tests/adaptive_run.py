"""One vLLM CPU engine, several maskplug schedulers: what each generated, and the step counters.

Usage: ``python adaptive_run.py MODEL_DIR OUT_JSON --spec K [--schedulers a,b,...] [--logprobs]``.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the
tiny model with dummy weights (fixed seed), greedy decoding, a mixed batch of
JSON-schema, regex and unconstrained requests (:func:`workload`), all
submitted at once. ``--spec K`` turns on n-gram drafting with ``K`` tokens
(``0``: no speculative decoding). With ``MASKPLUG_VLLM=1`` and
``MASKPLUG_VLLM_SCHEDULER`` set by the caller, the batch is generated once per
scheduler of ``--schedulers``, switched in place with
:func:`maskplug_vllm.set_scheduler`; ``random-budget`` is a scheduler this
script registers through ``maskplug_register_schedulers`` (uniform draws
among budget 0, every draft, and anything between). With ``--logprobs`` the
top-2 log-probabilities of every output position are recorded too (used to
show that a difference between runs is a near-tie).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

MAX_TOKENS = {"json": 80, "regex": 48, "free": 40}
NUM_REQUESTS = 36

REGEXES = [
    r"[a-z]{3,10}-[0-9]{2,4}",
    r"(yes|no|maybe)",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"(alice|bob)@[a-z]{2,8}\.(com|org)",
    r"\{\"id\": [0-9]{1,5}, \"ok\": (true|false)\}",
    r"[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}",
]

#: Small schemas beside the shared ones: short outputs, so more structured requests finish.
SMALL_SCHEMAS = {
    "flag": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    "level": {
        "type": "object",
        "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["level"],
        "additionalProperties": False,
    },
    "letters": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    "colour": {"enum": ["red", "green", "blue"]},
}


def workload(schema_paths: list[Path]) -> list[dict[str, Any]]:
    """The mixed batch: ``kind`` (``json``/``regex``/``free``), its constraint, and the prompt.

    Half JSON schemas (every shared schema, then the small ones), a quarter
    regexes, a quarter unconstrained.
    """
    schemas = [(p.stem, json.loads(p.read_text())) for p in schema_paths] + list(SMALL_SCHEMAS.items())
    reqs: list[dict[str, Any]] = []
    nj = nr = 0
    for i in range(NUM_REQUESTS):
        kind = ("json", "regex", "json", "free")[i % 4]
        if kind == "json":
            name, schema = schemas[nj % len(schemas)]
            nj += 1
            prompt = f'{name} {i}: {{"name": "alice", "id": {i}, "tags": ["a", "b"]}} -> '
            reqs.append({"kind": "json", "name": name, "schema": schema, "prompt": prompt})
        elif kind == "regex":
            k = nr % len(REGEXES)
            nr += 1
            prompt = f"pattern {i}: alice-{i} bob-{i + 1} alice-{i} -> "
            reqs.append({"kind": "regex", "name": f"regex{k}", "regex": REGEXES[k], "prompt": prompt})
        else:
            prompt = f'free {i}: {{"name": "bob", "id": {i}}} {{"name": "bob", "id": {i}}} -> '
            reqs.append({"kind": "free", "name": "free", "prompt": prompt})
    return reqs


def _register_test_plugin() -> dict[str, int]:
    """Register ``random-budget`` and a ``maskplug_step_end`` counter through maskplug's hooks."""
    from maskplug import BudgetDecision, StepOutcome, StepView, get_registry, hookimpl

    counts = {"step_end": 0, "random_budgets": 0}

    class RandomBudget:
        name = "random-budget"

        def __init__(self, seed: int = 0) -> None:
            self.rng = np.random.default_rng(seed)

        def budget(self, step: StepView) -> BudgetDecision:
            counts["random_budgets"] += 1
            kind = int(self.rng.integers(3))
            b = 0 if kind == 0 else step.cap if kind == 1 else int(self.rng.integers(0, step.cap + 1))
            return step.score(b)

        def observe(self, outcome: StepOutcome) -> None:
            pass

    class Plugin:
        @hookimpl
        def maskplug_register_schedulers(self, register: Any) -> None:
            register("random-budget", RandomBudget)

        @hookimpl
        def maskplug_step_end(self, stats: dict[str, Any]) -> None:
            counts["step_end"] += 1

    get_registry().add_plugin(Plugin(), "engine-test")
    return counts


def _instrument() -> dict[str, int]:
    """Count the draft rows maskplug's producer filled."""
    import tiny_model

    counts = {"fill_calls": 0, "draft_rows": 0}
    tiny_model.count_producer_steps(counts)
    return counts


def _tracked(llm: Any, maskplug_vllm: Any) -> int | None:
    """Requests the scheduler still keeps history for, once the batch's finished ids reached it.

    vLLM tells the model runner which requests finished on the step after; one
    short request makes that step happen. ``None`` for schedulers without history.
    """
    from vllm import SamplingParams

    sched = maskplug_vllm.current_scheduler()
    sched = getattr(sched, "inner", sched)
    table = getattr(sched, "_ids", None)
    if table is None:
        return None
    llm.generate(["flush"], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return int(table.keys.size)


def main(model_dir: str, out_path: str, argv: list[str]) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    spec = int(argv[argv.index("--spec") + 1])
    schedulers = argv[argv.index("--schedulers") + 1].split(",") if "--schedulers" in argv else [""]
    want_logprobs = "--logprobs" in argv

    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_model

    enabled = os.environ.get("MASKPLUG_VLLM") == "1"
    adaptive = enabled and bool(os.environ.get("MASKPLUG_VLLM_SCHEDULER"))
    hooks = _register_test_plugin() if enabled else {}
    producer = _instrument() if enabled else {}
    kwargs: dict[str, Any] = {}
    if spec:
        kwargs["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": spec,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    llm = LLM(
        model=model_dir,
        tokenizer=model_dir,
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=512,
        max_num_seqs=48,
        seed=0,
        structured_outputs_config={"backend": "xgrammar"},
        **kwargs,
    )
    reqs = workload(tiny_model.schema_paths())
    params = []
    for r in reqs:
        so = None
        if r["kind"] == "json":
            so = StructuredOutputsParams(json=r["schema"])
        elif r["kind"] == "regex":
            so = StructuredOutputsParams(regex=r["regex"])
        params.append(
            SamplingParams(
                temperature=0.0,
                max_tokens=MAX_TOKENS[r["kind"]],
                structured_outputs=so,
                logprobs=2 if want_logprobs else None,
            )
        )

    import maskplug_vllm

    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    runs = []
    for name in schedulers:
        if adaptive:
            maskplug_vllm.set_scheduler(name)
            maskplug_vllm.reset_step_stats()
        before = dict(hooks), dict(producer)
        outputs = llm.generate([r["prompt"] for r in reqs], params, use_tqdm=False)
        results = []
        for r, o in zip(reqs, outputs, strict=True):
            c = o.outputs[0]
            item: dict[str, Any] = {
                "kind": r["kind"],
                "name": r["name"],
                "token_ids": list(c.token_ids),
                "text": c.text,
                "finish_reason": c.finish_reason,
            }
            if want_logprobs:
                item["top2"] = [
                    sorted((float(lp.logprob), int(t)) for t, lp in d.items())[::-1][:2] for d in c.logprobs
                ]
            results.append(item)
        runs.append(
            {
                "scheduler": name,
                "outputs": results,
                "stats": maskplug_vllm.step_stats() if adaptive else None,
                "step_end_calls": hooks.get("step_end", 0) - before[0].get("step_end", 0),
                "producer_draft_rows": producer.get("draft_rows", 0) - before[1].get("draft_rows", 0),
                "free_blocks": pool.get_num_free_blocks(),
                "tracked_requests": _tracked(llm, maskplug_vllm) if adaptive else None,
            }
        )
    info = {
        "enabled": enabled,
        "adaptive": adaptive and maskplug_vllm.adaptive_installed(),
        "spec": spec,
        "free_blocks_at_start": free_at_start,
    }
    Path(out_path).write_text(json.dumps({"info": info, "requests": reqs, "runs": runs}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
