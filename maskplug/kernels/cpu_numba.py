"""The CPU mask kernels compiled by numba: one pass over each live logits row, on the calling thread.

The torch backend's CPU path masks a wide row with numpy in several passes
(unpack the bits, widen them into a keep-mask, three bitwise passes over the
row). Here each row is read and written once: for every mask bit, its logit
is rewritten branch-free as ``(x & keep) | (NINF & ~keep)`` (kept values
bit-identical, NaN included; dropped ones exactly ``-inf``), a loop LLVM
vectorises. A row then costs about what copying it costs, whatever its mask
looks like.

:func:`mask_mapped` is the whole apply through a row mapping in one call: it
checks the mapping against the offsets, skips trimmed drafts' rows and masks
the live ones, so a step's apply is one compiled call whether it has one
mask row or hundreds. Between forward passes every numpy call, view and
Python-level list a step makes costs several microseconds more than in a
loop (the caches are cold), and at one request that was most of the apply.
:func:`mask_rows` masks rows the caller has already found live.

numba is imported on the first CPU apply that can use it (a wide row, or a
:class:`~maskplug.RowMapping` with numpy offsets; not with maskplug) and
compiles a kernel on its first call in a process (a few seconds, once per
kind of argument: logits width in bits, offsets' dtype, contiguous or not; cached on disk next to this module when the directory is
writable, so later processes load it in well under a second) and runs it
without the GIL on the calling thread only, never a thread pool. Without
numba (not installed, or ``MASKPLUG_CPU_KERNEL=numpy``) the torch backend
keeps its numpy path, which writes the same bits; :func:`kernel_name` says
which one runs (``maskplug plugins`` prints it).

numba is imported on first use, not with maskplug, also because
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

__all__ = ["CPU_KERNEL_ENV", "available", "installed", "kernel_name", "mask_mapped", "mask_rows", "serves"]

CPU_KERNEL_ENV = "MASKPLUG_CPU_KERNEL"
"""``numpy`` keeps the torch backend's CPU path on numpy even where numba is installed (``numba``, or unset: numba when it imports)."""

_UNLOADED = object()
_kernel: Any = _UNLOADED  # the compiled kernel's dispatcher, None without numba; imported on first use
_mapped: Any = None  # the mapped kernel's dispatcher, made with _kernel


def _load() -> Any:
    """The kernel's dispatcher (numba imported now, compiled on its first call), or None without numba."""
    global _kernel, _mapped
    if _kernel is _UNLOADED:
        try:  # an optional dependency (maskplug[numba]); importing it costs about 0.2 s, so not at import
            import numba
        except Exception:  # pragma: no cover - depends on the environment
            _kernel = None
        else:
            _kernel, _mapped = _compile(numba)
    return _kernel


def _compile(numba: Any) -> tuple[Any, Any]:
    """The two kernels' dispatchers: rows already found live, and the whole apply through a mapping."""

    @numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
    def mask_row(row: Any, w: Any, nb: int, mask_tail: bool, ninf: Any) -> None:
        # Token 32k + b is bit b of word k, read by shifts (no byte order involved).
        whole = nb >> 5
        for k in range(whole):
            word = w[k]
            base = k * 32
            for b in range(32):
                # All in int32: promoted to int64 the loop does not vectorise (several times slower).
                keep = np.int32(0) - ((word >> np.int32(b)) & np.int32(1))
                row[base + b] = (row[base + b] & keep) | (ninf & ~keep)
        for c in range(whole * 32, nb):
            if (np.int32(w[c >> 5]) >> (c & 31)) & 1 == 0:
                row[c] = ninf
        if mask_tail:
            for c in range(nb, row.shape[0]):
                row[c] = ninf

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def rows_kernel(xi: Any, words: Any, src: Any, dst: Any, vocab_size: int, mask_tail: bool, ninf: Any) -> None:
        nb = min(vocab_size, xi.shape[1])
        for j in range(dst.shape[0]):
            mask_row(xi[dst[j]], words[src[j]], nb, mask_tail, ninf)

    @numba.njit(nogil=True, cache=True, boundscheck=False)
    def mapped(xi: Any, words: Any, req: Any, pos: Any, cu: Any, vocab_size: int, mask_tail: bool, ninf: Any) -> int:
        # Every check first, so a bad call writes nothing.
        rows = words.shape[0]
        if req.shape[0] != rows or pos.shape[0] != rows:
            return 1
        m = cu.shape[0]
        if m < 1 or cu[0] != 0 or cu[m - 1] > xi.shape[0]:
            return 2
        for j in range(1, m):
            if cu[j] < cu[j - 1]:
                return 2
        n = m - 1
        for i in range(rows):
            r = req[i]
            if r < -1 or r >= n:
                return 3
            if r >= 0 and pos[i] < 0:
                return 4
        nb = min(vocab_size, xi.shape[1])
        for i in range(rows):
            r = req[i]
            if r < 0:
                continue
            p = pos[i]
            if p >= cu[r + 1] - cu[r]:
                continue  # a trimmed draft's row
            # Rows are applied one after another, so two mask rows for one logits row give their AND.
            mask_row(xi[cu[r] + p], words[i], nb, mask_tail, ninf)
        return 0

    return rows_kernel, mapped


def installed() -> bool:
    """Whether numba imports in this environment (the kernel may still be switched off, see :func:`available`)."""
    return _load() is not None


def available() -> bool:
    """Whether the numba kernel serves the CPU path now (numba imports and :data:`CPU_KERNEL_ENV` is not ``numpy``)."""
    return os.environ.get(CPU_KERNEL_ENV, "").strip().lower() != "numpy" and _load() is not None


_ENV_KEY = os.environ.encodekey(CPU_KERNEL_ENV) if type(os.environ) is os._Environ else CPU_KERNEL_ENV
_switch: list[Any] = [_UNLOADED, False]  # the last raw value of CPU_KERNEL_ENV seen and what it meant


def serves() -> bool:
    """:func:`available`, for the apply's hot path: the switch's raw value is compared with the last one seen.

    ``os.environ.get`` encodes the name and decodes the value on every call;
    the mapping behind ``os.environ`` (which ``os.environ[...] = ...`` and
    ``monkeypatch.setenv`` update too) is read directly where it is the
    standard one, so a changed switch still takes effect on the next call.
    """
    env = os.environ
    data = getattr(env, "_data", None) if type(env) is os._Environ else None
    raw = data.get(_ENV_KEY) if type(data) is dict else env.get(CPU_KERNEL_ENV)
    if raw is not _switch[0] and raw != _switch[0]:
        _switch[1] = available()
        _switch[0] = raw
    return bool(_switch[1])


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
    _load()(xi, words, src, dst, int(vocab_size), bool(mask_tail), ninf)


def mask_mapped(
    xi: npt.NDArray[Any],
    words: npt.NDArray[np.int32],
    request: npt.NDArray[np.int32],
    position: npt.NDArray[np.int32],
    cu: npt.NDArray[np.int64] | npt.NDArray[np.int32],
    vocab_size: int,
    mask_tail: bool,
    ninf: np.signedinteger[Any],
) -> int:
    """The whole CPU apply through a row mapping in one compiled call: checks, live rows, masking.

    Mask row ``i`` masks logits row ``cu[r] + p`` of the integer view ``xi``
    (``r, p = request[i], position[i]``) when ``r >= 0`` and ``p < cu[r + 1] -
    cu[r]``; rows aiming at one logits row apply as the AND of their masks.
    ``words`` is int32 ``(rows, W)`` with ``32 W >= min(vocab_size, width)``.
    First checks the lengths, the offsets (from 0, non-decreasing, at most
    ``xi``'s rows), requests in ``[-1, n)`` and positions ``>= 0`` for used
    rows; returns 0 after masking, or the failed check's code (1 lengths,
    2 offsets, 3 requests, 4 positions)
    with nothing written (the caller words the error). Requires :func:`available`.
    """
    _load()
    return int(_mapped(xi, words, request, position, cu, vocab_size, mask_tail, ninf))
