"""Test-suite conventions shared by maskplug's distributions.

The core suite and each engine adapter's suite (run in their own virtual
environments) load the same hypothesis profiles, skip GPU-only tests the same
way and run Triton kernels under Triton's interpreter the same way. ``hypothesis``
and ``pytest`` are test dependencies, imported only when these helpers are called.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["InterpretedRun", "load_hypothesis_profile", "run_interpreted", "skip_gpu_tests"]


def load_hypothesis_profile() -> str:
    """Register the ``ci`` and ``dev`` profiles and load one; returns its name.

    ``ci`` (chosen when ``CI`` is set) runs every property with 1,000
    derandomised examples; ``dev`` keeps local runs quick. ``HYPOTHESIS_PROFILE``
    overrides the choice.
    """
    from hypothesis import HealthCheck, settings

    slow_ok = [HealthCheck.too_slow, HealthCheck.data_too_large]
    settings.register_profile("ci", max_examples=1000, deadline=None, suppress_health_check=slow_ok, derandomize=True)
    settings.register_profile("dev", max_examples=150, deadline=None, suppress_health_check=slow_ok)
    name = os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
    settings.load_profile(name)
    return name


def skip_gpu_tests(items: Iterable[Any], reason: str = "needs a CUDA device; none on this machine") -> None:
    """Mark every test carrying the ``gpu`` marker as skipped (with ``reason``) when no CUDA device exists."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass(frozen=True)
class InterpretedRun:
    """What a child pytest run by :func:`run_interpreted` ended with."""

    returncode: int
    #: stdout then stderr
    output: str
    #: the tests its summary counts as passed (``None`` when it has no such count)
    passed: int | None


def run_interpreted(
    cases: str | os.PathLike[str], *, cwd: str | os.PathLike[str], timeout: float = 600
) -> InterpretedRun:
    """Run the pytest module ``cases`` in a child process with ``TRITON_INTERPRET=1``.

    Triton reads the variable when it decorates a kernel, so it must be in the
    environment before the kernel's module is imported, and must not leak into
    the other tests of the calling process: hence a child, started from ``cwd``
    with this interpreter. The child runs quietly, in file order (no cache,
    xdist or random-order plugin; ``PYTHONHASHSEED=0``).
    """
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONHASHSEED="0")
    env.pop("PYTEST_XDIST_WORKER", None)
    off = [arg for name in ("cacheprovider", "xdist", "randomly") for arg in ("-p", f"no:{name}")]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *off, str(Path(cases))],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    m = re.search(r"(\d+) passed", out)
    return InterpretedRun(proc.returncode, out, int(m.group(1)) if m is not None else None)
