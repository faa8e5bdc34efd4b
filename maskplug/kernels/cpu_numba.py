"""The CPU mask kernel compiled by numba: one pass over each live logits row, on the calling thread.

The torch backend's CPU path masks a wide row with numpy in several passes
(unpack the bits, widen them into a keep-mask, three bitwise passes over the
row). Here each row is read and written once: for every mask byte, its eight
logits are rewritten branch-free as ``(x & keep) | (NINF & ~keep)`` (kept
values bit-identical, NaN included; dropped ones exactly ``-inf``), a loop
LLVM vectorises. A row then costs about what copying it costs, whatever its
mask looks like.

numba is imported on the first wide row (not with maskplug) and compiles the
kernel on its first call in a process (a few seconds, once per integer width; cached on disk next to this module when the directory is
writable, so later processes load it in well under a second) and runs it
without the GIL on the calling thread only, never a thread pool. Without
numba (not installed, or ``MASKPLUG_CPU_KERNEL=numpy``) the torch backend
keeps its numpy path, which writes the same bits; :func:`kernel_name` says
which one runs (``maskplug plugins`` prints it).

numba is imported on the first wide row, not with maskplug, also because
vLLM 0.32's CPU platform cannot create an engine in a process that has
already imported numba (its scan for Triton kernels trips over llvmlite's
objects at worker start; vLLM's own n-gram drafter imports numba too, so a
second in-process engine after an n-gram run fails the same way without
maskplug). In such a process set ``MASKPLUG_CPU_KERNEL=numpy`` before the
first apply.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["CPU_KERNEL_ENV", "available", "installed", "kernel_name", "mask_rows"]

CPU_KERNEL_ENV = "MASKPLUG_CPU_KERNEL"
"""``numpy`` keeps the torch backend's CPU path on numpy even where numba is installed (``numba``, or unset: numba when it imports)."""

_UNLOADED = object()
_kernel: Any = _UNLOADED  # the compiled kernel's dispatcher, None without numba; imported on first use


def _load() -> Any:
    """The kernel's dispatcher (numba imported now, compiled on its first call), or None without numba."""
    global _kernel
    if _kernel is _UNLOADED:
        try:  # an optional dependency (maskplug[numba]); importing it costs about 0.2 s, so not at import
            import numba
        except Exception:  # pragma: no cover - depends on the environment
            _kernel = None
        else:
            _kernel = _compile(numba)
    return _kernel


def _compile(numba: Any) -> Any:
    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def kernel(xi: Any, by: Any, src: Any, dst: Any, vocab_size: int, mask_tail: bool, ninf: Any) -> None:
        width = xi.shape[1]
        n = min(vocab_size, width)
        whole = n >> 3
        for j in range(dst.shape[0]):
            row = xi[dst[j]]
            b8 = by[src[j]]
            # Little-endian words: byte k holds tokens 8k..8k+7, bit b of it token 8k+b.
            for k in range(whole):
                v = np.int32(b8[k])
                base = k * 8
                for b in range(8):
                    keep = -((v >> b) & 1)
                    row[base + b] = (row[base + b] & keep) | (ninf & ~keep)
            for c in range(whole * 8, n):
                if (np.int32(b8[c >> 3]) >> (c & 7)) & 1 == 0:
                    row[c] = ninf
            if mask_tail:
                for c in range(n, width):
                    row[c] = ninf

    return kernel


def installed() -> bool:
    """Whether numba imports in this environment (the kernel may still be switched off, see :func:`available`)."""
    return _load() is not None


def available() -> bool:
    """Whether the numba kernel serves the CPU path now (numba imports and :data:`CPU_KERNEL_ENV` is not ``numpy``)."""
    return os.environ.get(CPU_KERNEL_ENV, "").strip().lower() != "numpy" and _load() is not None


def kernel_name() -> str:
    """``"numba"`` or ``"numpy"``: what masks wide rows on the CPU in this process now."""
    return "numba" if available() else "numpy"


def mask_rows(
    xi: npt.NDArray[Any],
    words: npt.NDArray[np.int32],
    src: npt.NDArray[np.int64],
    dst: npt.NDArray[np.int64],
    vocab_size: int,
    mask_tail: bool,
    ninf: np.signedinteger[Any],
) -> None:
    """Mask logits rows ``dst`` of the integer view ``xi`` with mask rows ``src`` of ``words`` (distinct ``dst``).

    ``words`` is C-contiguous with at least ``ceil(min(vocab_size, width) / 32)``
    words per row; columns from ``vocab_size`` on are set to ``-inf`` when
    ``mask_tail``, else left as they are. Requires :func:`available`.
    """
    _load()(xi, words.view(np.uint8), src, dst, int(vocab_size), bool(mask_tail), ninf)
