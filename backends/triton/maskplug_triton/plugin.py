"""The ``maskplug`` plugin module of maskplug-triton (the entry point ``triton``)."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

import maskplug
from maskplug.kernels.sdk import BackendBase, Launcher, cuda_unavailable_reason, device_index, import_reason

__all__ = ["BACKEND", "TritonBackend", "maskplug_register_kernels"]


@functools.cache
def _kernel() -> ModuleType:
    """``maskplug_triton.kernel``, imported on first use (after the availability check)."""
    return importlib.import_module("maskplug_triton.kernel")


class TritonBackend(BackendBase):
    """Kernel backend running :mod:`maskplug_triton.kernel`.

    Priority 10: above the built-in torch backend (0), below maskplug-cupy (20).
    The CUDA C kernel decides per 16-byte pack (skip, one vector store, or
    per-element stores) while this kernel decides per 1,024-column tile, so on
    masks that mix allowed and disallowed tokens at fine grain the CUDA kernel
    issues fewer stores; ``benchmarks/gpu_check.sh`` measures both, and
    ``MASKPLUG_KERNEL_BACKEND=triton`` overrides the choice.

    Importing Triton waits for the first availability check, so a missing or
    broken Triton is that check's answer, not an import error.
    """

    name = "triton"
    priority = 10

    def probe(self, device: torch.device) -> str | None:
        failed = import_reason("maskplug_triton.kernel", "maskplug_triton.ops")
        if failed is not None:
            return f"triton is not importable: {failed}"
        interpreted = bool(_kernel().INTERPRETED)
        if device.type == "cpu":
            if interpreted:
                return None
            return (
                "Triton kernels run on CUDA devices; CPU tensors need TRITON_INTERPRET=1 set before "
                "maskplug_triton.kernel is imported (the interpreter, meant for tests)"
            )
        if device.type != "cuda":
            return f"Triton backend supports CUDA devices only, got device type {device.type!r}"
        if interpreted:
            return (
                "TRITON_INTERPRET=1 was set when maskplug_triton.kernel was imported: the kernel would run "
                "in the Python interpreter, which is meant for CPU tests, not CUDA tensors"
            )
        no_device = cuda_unavailable_reason(device)
        if no_device is not None:
            return no_device
        if torch.version.hip is None:
            major, minor = torch.cuda.get_device_capability(device_index(device))
            if (major, minor) < (7, 5):
                return f"compute capability {major}.{minor} is below the 7.5 that Triton supports"
        return None

    def launcher(self, device: torch.device) -> Launcher:
        """The Triton launcher, called directly rather than through the custom op.

        The op's dispatcher round trip costs host microseconds that a decode
        step at batch 1 would notice; ``torch.ops.maskplug_triton.apply_bitmask``
        is there for code traced by ``torch.compile``.
        """
        return _kernel().launch


BACKEND = TritonBackend()


@maskplug.hookimpl
def maskplug_register_kernels(register: Any) -> None:
    """Register the Triton backend."""
    register(BACKEND)
