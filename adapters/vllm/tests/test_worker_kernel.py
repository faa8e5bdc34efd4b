"""vLLM's own compacted-worker Triton kernel against maskplug and the oracle, on CPU tensors.

The cases live in ``interp_worker_kernel_cases.py``; they run here in a child
pytest with ``TRITON_INTERPRET=1``, which must be in the environment before
Triton decorates a kernel (and must not leak into the other tests of this
process). About 30 s on two cores: the interpreter costs about a millisecond
per program, so the batches stay small.
"""

from __future__ import annotations

from pathlib import Path

from vllm_release import run_interpreted_cases

HERE = Path(__file__).resolve().parent


def test_vllm_worker_kernel_interpreted_against_maskplug_in_every_regime() -> None:
    # 1 identity check + 3 regimes x 2 layouts of random batches + 2 pinned steps.
    out = run_interpreted_cases(HERE / "interp_worker_kernel_cases.py", passed=9)
    assert "skipped" not in out and "failed" not in out, out[-3000:]
