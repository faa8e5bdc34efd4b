"""The ``maskplug`` plugin module of maskplug-cupy (the entry point ``cupy``)."""

from __future__ import annotations

import importlib
import threading
from typing import Any

import torch

import maskplug

__all__ = ["BACKEND", "CupyBackend", "maskplug_register_kernels"]


class CupyBackend:
    """Kernel backend running the CUDA C kernels of ``kernel.cu`` through CuPy.

    Priority 20, the highest of the bundled backends (torch 0, triton 10): the
    CUDA kernel decides per 16-byte pack whether to skip, store one vector or
    store single elements, where the Triton kernel can only decide per
    1,024-column tile, so it issues the fewest stores on masks that mix allowed
    and disallowed tokens at fine grain. ``benchmarks/gpu_check.sh`` measures
    both; ``MASKPLUG_KERNEL_BACKEND=triton`` overrides the choice.
    """

    name = "cupy"
    priority = 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reasons: dict[tuple[str, int | None], str | None] = {}

    def _reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"CuPy kernels run on CUDA devices only, got device type {device.type!r}"
        if torch.version.hip is not None:
            return "torch is built for ROCm (HIP); this backend's kernel is CUDA C"
        try:
            importlib.import_module("cupy")
        except Exception as exc:
            return f"cupy is not importable: {type(exc).__name__}: {exc}"
        if not torch.cuda.is_available():
            return "no CUDA device: torch.cuda.is_available() is False"
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            return f"no CUDA device {index}: torch sees {torch.cuda.device_count()}"
        try:
            kern = importlib.import_module("maskplug_cupy.kernel")
            importlib.import_module("maskplug_cupy.ops")
            kern.load_functions(index)
        except Exception as exc:
            return f"the CUDA kernel did not compile or load on cuda:{index} (CuPy/NVRTC): {type(exc).__name__}: {exc}"
        return None

    def unavailable_reason(self, device: torch.device) -> str | None:
        """``None`` when the kernel can run on ``device``, else the precise reason.

        On a CUDA device the first call compiles and loads the kernel, so a
        missing NVRTC is reported here rather than at the first apply.
        """
        key = (device.type, device.index)
        if key not in self._reasons:
            with self._lock:
                if key not in self._reasons:
                    self._reasons[key] = self._reason(device)
        return self._reasons[key]

    def apply(
        self,
        logits: torch.Tensor,
        bitmask: torch.Tensor,
        request: torch.Tensor,
        position: torch.Tensor,
        cu_logits: torch.Tensor,
        vocab_size: int,
        mask_tail: bool,
    ) -> None:
        """Mask ``logits`` in place (normalised arguments, see ``maskplug.KernelBackend``).

        Calls the launcher directly, skipping the custom op's dispatcher round
        trip; ``torch.ops.maskplug_cupy.apply_bitmask`` is for code traced by
        ``torch.compile``.
        """
        why = self.unavailable_reason(logits.device)
        if why is not None:
            raise maskplug.BackendUnavailable(f"backend: 'cupy' cannot run on {logits.device}: {why}")
        from .kernel import launch

        launch(logits, bitmask, request, position, cu_logits, vocab_size, mask_tail)


BACKEND = CupyBackend()


@maskplug.hookimpl
def maskplug_register_kernels(register: Any) -> None:
    """Register the CuPy backend."""
    register(BACKEND)
