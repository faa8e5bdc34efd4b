"""Test-suite conventions shared by maskplug's distributions.

The core suite and each engine adapter's suite (run in their own virtual
environments) load the same hypothesis profiles and skip GPU-only tests the
same way. ``hypothesis`` and ``pytest`` are test dependencies, imported only
when these helpers are called.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

__all__ = ["load_hypothesis_profile", "skip_gpu_tests"]


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
