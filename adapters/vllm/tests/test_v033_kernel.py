"""vLLM 0.33's compacted-worker Triton kernel against maskplug and the oracle, on CPU tensors.

The cases live in ``interp_v033_kernel_cases.py``; they run here in a child
pytest with ``TRITON_INTERPRET=1``, which must be in the environment before
Triton decorates a kernel (and must not leak into the other tests of this
process).
"""

from __future__ import annotations

import re
from pathlib import Path

from vllm_release import run_interpreted_cases

VLLM_RELEASES = ("0.33.0",)

HERE = Path(__file__).resolve().parent


def test_vllm_033_worker_kernel_interpreted_against_maskplug_in_every_regime() -> None:
    # 1 identity check + 3 regimes of random batches + 1 pinned step.
    out = run_interpreted_cases(HERE / "interp_v033_kernel_cases.py", passed=5)
    assert re.search(r"\d+ (failed|skipped|errors?|xfailed)\b", out) is None, out[-3000:]
