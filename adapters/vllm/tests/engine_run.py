"""Run vLLM's CPU engine once on the tiny model and write what it generated as JSON.

Usage: ``python engine_run.py MODEL_DIR OUT_JSON [--sampled] [--backend NAME]`` (vLLM's
``structured_outputs_config.backend``; default ``xgrammar``, ``auto`` is vLLM's own default). Run in a fresh process per
configuration (vLLM loads its plugins once per process): with
``MASKPLUG_VLLM=1`` the adapter serves structured outputs, without it vLLM's
own xgrammar backend does. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the script can also count how
often maskplug's producer and mask kernel ran, and with how many draft rows.

Two sets of requests, one JSON schema each (two prompts per schema):

* ``greedy``: greedy decoding, always run first, on an engine started with a
  fixed seed (which fixes the dummy weights); compared token for token
  between the adapter and vLLM's own xgrammar path;
* ``sampled`` (with ``--sampled``): seeded temperature-1 sampling, whose
  outputs are validated against their schemas. vLLM 0.32's CPU engine does
  not reproduce seeded sampling run to run once n-gram drafts are verified
  (seen here with and without structured outputs), so this set is not
  compared token for token.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

NUM_SPEC = 3
MAX_TOKENS = 160


def _instrument() -> dict[str, int]:
    """Count maskplug's work inside the engine (only meaningful with the adapter enabled)."""
    import maskplug_vllm.common as mp_common
    import tiny_model

    counts = {"fill_calls": 0, "draft_rows": 0, "apply_calls": 0, "applied_rows": 0}
    real_apply = mp_common.apply_grammar_bitmask
    tiny_model.count_producer_steps(counts)

    def apply(logits: Any, bitmask: Any, mapping: Any, cu: Any, **kw: Any) -> None:
        counts["apply_calls"] += 1
        counts["applied_rows"] += len(mapping)
        real_apply(logits, bitmask, mapping, cu, **kw)

    mp_common.apply_grammar_bitmask = apply
    return counts


def _option(flag: str, default: str) -> str:
    """The value after ``flag`` on the command line, else ``default``."""
    args = sys.argv[3:]
    return args[args.index(flag) + 1] if flag in args else default


def main(model_dir: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_model

    enabled = os.environ.get("MASKPLUG_VLLM") == "1"
    counts = _instrument() if enabled else {}
    backend_name = _option("--backend", "xgrammar")
    llm = tiny_model.ngram_engine(model_dir, NUM_SPEC, max_model_len=1024, max_num_seqs=16, backend=backend_name)
    schemas = [(p.stem, json.loads(p.read_text())) for p in tiny_model.schema_paths()]

    def run(sampled: bool) -> list[dict[str, Any]]:
        prompts, params, names = [], [], []
        for i, (name, schema) in enumerate(schemas):
            for k in range(2):
                # Prompts with JSON-looking text give the n-gram drafter something to match.
                prompts.append(f'{name} {k}: {{"name": "alice", "id": 12, "tags": ["a", "b"]}} -> ')
                params.append(
                    SamplingParams(
                        temperature=1.0 if sampled else 0.0,
                        seed=1000 * i + k if sampled else None,
                        max_tokens=MAX_TOKENS,
                        structured_outputs=StructuredOutputsParams(json=schema),
                    )
                )
                names.append(name)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [
            {
                "schema": name,
                "token_ids": list(o.outputs[0].token_ids),
                "text": o.outputs[0].text,
                "finish_reason": o.outputs[0].finish_reason,
            }
            for name, o in zip(names, outputs, strict=True)
        ]

    sets = {"greedy": run(False)}
    if "--sampled" in sys.argv[3:]:
        sets["sampled"] = run(True)
    runner_info: dict[str, Any] = {}
    if enabled:
        import maskplug_vllm
        from maskplug_vllm.backend import MaskplugBackend

        core = llm.llm_engine.engine_core.engine_core
        backend = core.scheduler.structured_output_manager.backend
        runner = sys.modules["vllm.v1.worker.gpu_model_runner"]
        runner_info = {
            "installed": maskplug_vllm.installed(),
            "backend_is_maskplug": isinstance(backend, MaskplugBackend),
            "runner_apply_is_maskplug": runner.apply_grammar_bitmask is maskplug_vllm.worker.apply_scatter,
        }
        if "--backend" in sys.argv:
            # Which maskplug provider served, and which provider compiled each grammar (auto reports it).
            served = {
                str(getattr(g, "served_by", backend.provider_name)) for g in backend.provider.cache._items.values()
            }
            runner_info["provider"] = {"name": backend.provider_name, "served_by": sorted(served)}
    result = {
        "enabled": enabled,
        "counts": counts,
        "runner": runner_info,
        "sets": sets,
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
