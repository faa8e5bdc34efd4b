"""vLLM 0.33's compacted-worker Triton kernel against maskplug and the oracle, on CPU tensors.

The cases live in ``interp_v033_kernel_cases.py``; they run here in a child
pytest with ``TRITON_INTERPRET=1``, which must be in the environment before
Triton decorates a kernel (and must not leak into the other tests of this
process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

VLLM_RELEASES = ("0.33.0",)

HERE = Path(__file__).resolve().parent


def test_vllm_033_worker_kernel_interpreted_against_maskplug_in_every_regime() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "interp_v033_kernel_cases.py")],
        cwd=HERE.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    m = re.search(r"(\d+) passed", out)
    # 1 identity check + 3 regimes of random batches + 1 pinned step.
    assert m is not None and int(m.group(1)) == 5, out[-3000:]
    assert re.search(r"\d+ (failed|skipped|errors?|xfailed)\b", out) is None, out[-3000:]
