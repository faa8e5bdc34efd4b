"""``LLM(...)`` with vLLM's defaults (its engine core in a process of its own) and a maskplug scheduler.

Usage: ``python llm_default_run.py MODEL_DIR OUT_JSON``. The caller sets
``MASKPLUG_VLLM=1`` and ``MASKPLUG_VLLM_SCHEDULER``; this script does not touch
``VLLM_ENABLE_V1_MULTIPROCESSING``. It generates :func:`test_server.workload`
greedily with n-gram drafting (3 tokens) and writes each output's token ids
and finish reason, and :func:`maskplug_vllm.step_stats` as read in this
process (which does not schedule: the counters come from the engine core).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    import maskplug_vllm
    from openai_server import NGRAM
    from test_server import workload
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(
        model=model,
        tokenizer=model,
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        seed=0,
        max_model_len=512,
        max_num_seqs=16,
        speculative_config=NGRAM,
        structured_outputs_config={"backend": "xgrammar"},
    )
    prompts, params = [], []
    for req in workload():
        so = None
        if "json" in req:
            so = StructuredOutputsParams(json=req["json"])
        elif "regex" in req:
            so = StructuredOutputsParams(regex=req["regex"])
        prompts.append(req["prompt"])
        params.append(SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], structured_outputs=so))
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "outputs": [
            {"tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason} for o in outs
        ],
        "stats": maskplug_vllm.step_stats(),
    }
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
