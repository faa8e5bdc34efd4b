"""The ``maskplug`` plugin module of maskplug-cupy (the entry point ``cupy``)."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

import maskplug
from maskplug.kernels.sdk import BackendBase, Launcher, cuda_unavailable_reason, device_index, import_reason

__all__ = ["BACKEND", "CupyBackend", "maskplug_register_kernels"]


@functools.cache
def _kernel() -> ModuleType:
    """``maskplug_cupy.kernel``, imported on first use (after the availability check)."""
    return importlib.import_module("maskplug_cupy.kernel")


class CupyBackend(BackendBase):
    """Kernel backend running the CUDA C kernels of ``kernel.cu`` through CuPy.

    Priority 20, the highest of the bundled backends (torch 0, triton 10): the
    CUDA kernel decides per 16-byte pack whether to skip, store one vector or
    store single elements, where the Triton kernel can only decide per
    1,024-column tile, so it issues the fewest stores on masks that mix allowed
    and disallowed tokens at fine grain. ``benchmarks/gpu_check.sh`` measures
    both; ``MASKPLUG_KERNEL_BACKEND=triton`` overrides the choice.

    On a CUDA device the first availability check compiles and loads the
    kernel, so a missing NVRTC is reported there rather than at the first apply.
    """

    name = "cupy"
    priority = 20

    def probe(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"CuPy kernels run on CUDA devices only, got device type {device.type!r}"
        if torch.version.hip is not None:
            return "torch is built for ROCm (HIP); this backend's kernel is CUDA C"
        failed = import_reason("cupy")
        if failed is not None:
            return f"cupy is not importable: {failed}"
        no_device = cuda_unavailable_reason(device)
        if no_device is not None:
            return no_device
        index = device_index(device)
        try:
            importlib.import_module("maskplug_cupy.ops")  # registers torch.ops.maskplug_cupy
            _kernel().load_functions(index)
        except Exception as exc:
            return f"the CUDA kernel did not compile or load on cuda:{index} (CuPy/NVRTC): {type(exc).__name__}: {exc}"
        return None

    def launcher(self, device: torch.device) -> Launcher:
        """The CuPy launcher, called directly, skipping the custom op's dispatcher round trip.

        ``torch.ops.maskplug_cupy.apply_bitmask`` is for code traced by ``torch.compile``.
        """
        return _kernel().launch


BACKEND = CupyBackend()


@maskplug.hookimpl
def maskplug_register_kernels(register: Any) -> None:
    """Register the CuPy backend."""
    register(BACKEND)
