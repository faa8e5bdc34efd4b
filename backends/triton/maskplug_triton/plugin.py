"""The ``maskplug`` plugin module of maskplug-triton (the entry point ``triton``)."""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any

import torch

import maskplug

__all__ = ["BACKEND", "TritonBackend", "maskplug_register_kernels"]


class TritonBackend:
    """Kernel backend running :mod:`maskplug_triton.kernel`.

    Priority 10: above the built-in torch backend (0), below maskplug-cupy (20).
    The CUDA C kernel decides per 16-byte pack (skip, one vector store, or
    per-element stores) while this kernel decides per 1,024-column tile, so on
    masks that mix allowed and disallowed tokens at fine grain the CUDA kernel
    issues fewer stores; ``benchmarks/gpu_check.sh`` measures both, and
    ``MASKPLUG_KERNEL_BACKEND=triton`` overrides the choice.
    """

    name = "triton"
    priority = 10

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kernel: ModuleType | None = None
        self._import_error: str | None = None
        self._reasons: dict[tuple[str, int | None], str | None] = {}

    def _load(self) -> ModuleType | None:
        """Import the kernel module once; remember why it failed if it did."""
        if self._kernel is None and self._import_error is None:
            with self._lock:
                if self._kernel is None and self._import_error is None:
                    try:
                        self._kernel = importlib.import_module("maskplug_triton.kernel")
                        importlib.import_module("maskplug_triton.ops")
                    except Exception as exc:  # reported as the unavailability reason
                        self._import_error = f"triton is not importable: {type(exc).__name__}: {exc}"
        return self._kernel

    def _reason(self, device: torch.device) -> str | None:
        kern = self._load()
        if kern is None:
            return self._import_error
        interpreted = bool(kern.INTERPRETED)
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
        if not torch.cuda.is_available():
            return "no CUDA device: torch.cuda.is_available() is False"
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            return f"no CUDA device {index}: torch sees {torch.cuda.device_count()}"
        if torch.version.hip is None:
            major, minor = torch.cuda.get_device_capability(index)
            if (major, minor) < (7, 5):
                return f"compute capability {major}.{minor} is below the 7.5 that Triton supports"
        return None

    def unavailable_reason(self, device: torch.device) -> str | None:
        """``None`` when the kernel can run on ``device``, else the precise reason."""
        key = (device.type, device.index)
        if key not in self._reasons:
            # Cached: dispatch asks on every call, and the answer cannot change in a process.
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

        Calls the launcher directly rather than through the custom op: the op's
        dispatcher round trip costs host microseconds that a decode step at
        batch 1 would notice. The op (``torch.ops.maskplug_triton.apply_bitmask``)
        is there for code traced by ``torch.compile``.
        """
        kern = self._load()
        if kern is None:
            raise maskplug.BackendUnavailable(f"backend: 'triton' cannot run: {self._import_error}")
        kern.launch(logits, bitmask, request, position, cu_logits, vocab_size, mask_tail)


BACKEND = TritonBackend()


@maskplug.hookimpl
def maskplug_register_kernels(register: Any) -> None:
    """Register the Triton backend."""
    register(BACKEND)
