"""``apply_grammar_bitmask``: validate once, then hand off to a kernel backend.

All argument checks happen here, before any backend runs, so a bad call never
writes a single logit. Backends receive normalised arguments (see
:class:`KernelBackend`, defined with everything else a backend needs in
:mod:`maskplug.kernels.sdk`) and only decide how to write.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Literal, cast

import numpy as np
import torch

from ._checks import INT32_MAX, host_int
from .errors import BackendUnavailable, LayoutError
from .kernels import cpu_numba
from .kernels.sdk import BackendBase, KernelBackend
from .kernels.torch_backend import CPU_BITS, FEW_ROWS, TorchBackend, live_rows, mask_rows_cpu
from .layout import RowMapping
from .plugins import KERNEL_BACKEND_ENV, get_registry

__all__ = ["KernelBackend", "apply_grammar_bitmask", "backend_status", "resolve_backend"]

LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _reason(be: Any, device: torch.device) -> str | None:
    """Why ``be`` cannot run on ``device`` (``None``: it can); a probe that raises is a reason, not a crash."""
    try:
        why = be.unavailable_reason(device)
    except Exception as exc:
        return f"availability check failed: {type(exc).__name__}: {exc}"
    if why is not None and not isinstance(why, str):
        return f"availability check failed: returned {type(why).__name__} {why!r} instead of None or a reason"
    return why


def backend_status(device: torch.device | str | None = None) -> dict[str, str | None]:
    """Every registered backend and why it cannot run on ``device`` (``None`` = available)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {name: _reason(be, dev) for name, be in sorted(get_registry().kernels.items())}


# The last resolutions: (registry, name, device, MASKPLUG_KERNEL_BACKEND) -> backend. Only backends built on
# BackendBase are kept: their availability is asked once per device and cannot change within a process.
_resolved: dict[tuple[int, str, torch.device, object], tuple[Any, KernelBackend]] = {}


def _env_switch() -> object:
    """The raw value of ``MASKPLUG_KERNEL_BACKEND`` in ``os.environ`` (``None`` when unset), read afresh on every call.

    Only compared with itself, as part of a cache key. ``os.environ.get``
    encodes the name and decodes the value on every call, which costs most of a
    cached resolution; the mapping it reads from is looked up directly when
    ``os.environ`` is the standard one (``os.environ[...] = ...`` and
    ``monkeypatch.setenv`` update that mapping too).
    """
    env = os.environ
    data = getattr(env, "_data", None) if type(env) is os._Environ else None
    if type(data) is dict:
        return data.get(_ENV_KEY)
    return env.get(KERNEL_BACKEND_ENV)


_ENV_KEY = os.environ.encodekey(KERNEL_BACKEND_ENV) if type(os.environ) is os._Environ else KERNEL_BACKEND_ENV


def _resolve_cached(backend: str, device: torch.device) -> KernelBackend:
    """:func:`resolve_backend`, remembered per registry, name, device and environment switch."""
    reg = get_registry()
    key = (id(reg), backend, device, _env_switch())
    hit = _resolved.get(key)
    if hit is not None and hit[0] is reg:
        return hit[1]
    be = resolve_backend(backend, device)
    # "auto" ranks every backend above the chosen one too; all must answer once and for all.
    if all(isinstance(b, BackendBase) for b in reg.kernels.values()):
        if len(_resolved) > 64:
            _resolved.clear()
        _resolved[key] = (reg, be)
    return be


def resolve_backend(backend: str, device: torch.device) -> KernelBackend:
    """The backend object for ``backend`` (a name or ``"auto"``) on ``device``.

    ``"auto"`` is ``MASKPLUG_KERNEL_BACKEND`` when that is set (to a name
    other than ``auto``), else the available backend of highest priority; a
    backend whose availability probe raises is skipped with that reason.
    """
    reg = get_registry().kernels
    if not isinstance(backend, str):
        raise BackendUnavailable(f"backend: expected a backend name or 'auto', got {backend!r}")
    if backend == "auto":
        env = os.environ.get(KERNEL_BACKEND_ENV, "").strip()
        if env and env != "auto":
            if env not in reg:
                raise BackendUnavailable(f"{KERNEL_BACKEND_ENV}: expected one of {sorted(reg)} or 'auto', got {env!r}")
            return resolve_backend(env, device)
        reasons = []
        for be in sorted(reg.values(), key=lambda b: (-b.priority, b.name)):
            why = _reason(be, device)
            if why is None:
                return be  # type: ignore[no-any-return]
            reasons.append(f"{be.name}: {why}")
        raise BackendUnavailable(f"backend: no registered backend runs on {device} ({'; '.join(reasons)})")
    be = reg.get(backend)
    if be is None:
        raise BackendUnavailable(f"backend: expected one of {sorted(reg)} or 'auto', got {backend!r}")
    why = _reason(be, device)
    if why is not None:
        raise BackendUnavailable(f"backend: {backend!r} cannot run on {device}: {why}")
    return be  # type: ignore[no-any-return]


class _Staging(threading.local):
    """Pinned host buffers reused across calls, so CUDA copies can be non-blocking.

    A buffer is reused only once the copy that last read it has finished
    (``Event.query()``, which never blocks); otherwise a fresh one is taken, so
    the apply path never waits on the host.
    """

    def __init__(self) -> None:
        self.slots: dict[str, list[tuple[torch.Tensor, Any]]] = {}

    def to_device(self, key: str, arr: np.ndarray, device: torch.device) -> torch.Tensor:
        n = arr.shape[0]
        ring = self.slots.setdefault(key, [])
        slot = None
        for i, (buf, ev) in enumerate(ring):
            if buf.shape[0] >= n and (ev is None or ev.query()):
                slot = i
                break
        if slot is None:
            buf = torch.empty(max(n, 256), dtype=torch.int32, pin_memory=True)
            if len(ring) >= 4:
                ring.pop(0)
            ring.append((buf, None))
            slot = len(ring) - 1
        buf = ring[slot][0]
        host = buf[:n]
        host.numpy()[:] = arr
        out = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        # The copy was queued on the target device's current stream, which is not
        # the current device's stream when logits live on another GPU.
        event.record(torch.cuda.current_stream(device))
        ring[slot] = (buf, event)
        return out


_staging = _Staging()


_INT32 = np.dtype(np.int32)  # native byte order


def _int_vector(
    name: str, value: Any, device: torch.device, *, wide: bool = False
) -> tuple[torch.Tensor, np.ndarray | None]:
    """A 1-D int32 tensor on ``device`` plus its host copy when one exists (no sync).

    The host copy is int64 when ``wide`` (for callers that subtract values) or
    when the input was not int32 already; else it is the int32 input itself.
    """
    if isinstance(value, torch.Tensor):
        if value.ndim != 1:
            raise LayoutError(f"{name}: expected a 1-D integer tensor, got shape {tuple(value.shape)}")
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise LayoutError(f"{name}: expected an integer dtype, got {value.dtype}")
        if value.device.type == "cpu":
            host = value.detach().numpy().astype(np.int64, copy=False)
            return _int_vector(name, host, device, wide=wide)
        if value.device != device:
            raise LayoutError(f"{name}: expected a host array or a tensor on {device}, got a tensor on {value.device}")
        return value.to(torch.int32).contiguous(), None
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise LayoutError(f"{name}: expected a 1-D integer array, got shape {arr.shape}")
    if arr.dtype == _INT32 and not wide:
        # Already int32 (a RowMapping's arrays always are): every value fits, and the kernels
        # only read it, so it is handed on as it is, with no copy and no range pass.
        # (A read-only or strided array is copied: torch warns about tensors over read-only memory.)
        arr32 = arr if arr.flags.c_contiguous and arr.flags.writeable else np.array(arr, order="C")
        if device.type == "cuda":
            return _staging.to_device(name, arr32, device), arr32
        return torch.from_numpy(arr32), arr32
    if arr.size and arr.dtype.kind not in "iu":
        raise LayoutError(f"{name}: expected an integer dtype, got {arr.dtype}")
    arr64 = arr.astype(np.int64, copy=False)
    if arr64.size and (arr64.max() > np.iinfo(np.int32).max or arr64.min() < np.iinfo(np.int32).min):
        raise LayoutError(f"{name}: expected values that fit in int32, got {int(arr64.min())}..{int(arr64.max())}")
    arr32 = np.ascontiguousarray(arr64, dtype=np.int32)
    if device.type == "cuda":
        return _staging.to_device(name, arr32, device), arr64
    return torch.from_numpy(arr32), arr64


def apply_grammar_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor | np.ndarray[Any, Any],
    mapping: RowMapping | tuple[Any, Any],
    cu_logits: Any,
    *,
    vocab_size: int | None = None,
    tail: Literal["mask", "keep"] = "mask",
    backend: str = "auto",
) -> None:
    """Apply grammar mask rows to compacted logits, in place.

    Mask row ``i`` with ``(r, p) = (mapping.request[i], mapping.position[i])``
    applies to logits row ``cu_logits[r] + p`` iff ``r >= 0`` and
    ``p < cu_logits[r+1] - cu_logits[r]``; otherwise it is skipped (that draft
    was trimmed). Disallowed tokens become ``-inf``; nothing else changes.

    Args:
        logits: ``(rows, width)`` fp32/fp16/bf16, column stride 1, any row stride.
        bitmask: int32 ``(mask rows, words)`` on the logits device; with CPU
            logits also an int32 numpy array (what vLLM's scheduler hands its
            workers), read in place without a tensor made around it.
        mapping: a :class:`RowMapping` or a ``(request, position)`` pair of
            numpy arrays or tensors, one entry per bitmask row.
        cu_logits: ``n + 1`` active offsets (numpy or a tensor; on CUDA a device
            tensor from :func:`maskplug.active_cu_logits` is read on the device).
        vocab_size: tokens the grammar knows; default ``min(width, 32 × words)``,
            and a bitmask narrower than the logits needs it said explicitly.
        tail: ``"mask"`` sets live rows' columns ``>= vocab_size`` to ``-inf``;
            ``"keep"`` leaves them.
        backend: a registered backend name or ``"auto"``.

    Raises:
        LayoutError: bad shapes, dtypes, devices or offsets (nothing written).
        BackendUnavailable: the named backend cannot run here, with the reason.
    """
    # ---- logits and bitmask --------------------------------------------------
    # (Each shape, stride and dtype is read once: at one request these reads are most of the call.)
    if not isinstance(logits, torch.Tensor):
        raise LayoutError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    shape = logits.shape
    if len(shape) != 2:
        raise LayoutError(f"logits: expected 2-D (rows, vocab), got shape {tuple(shape)}")
    num_logits, width = shape
    if logits.dtype not in LOGITS_DTYPES:
        raise LayoutError(f"logits: expected float32, float16 or bfloat16, got {logits.dtype}")
    if num_logits and width:
        s0, s1 = logits.stride()
        # An empty tensor may report any strides; only a non-empty one must be row-major.
        if width > 1 and s1 != 1:
            raise LayoutError(f"logits: expected column stride 1 (rows may be strided), got strides {(s0, s1)}")
        # Rows that share memory (a row stride below the width, e.g. from as_strided or expand)
        # would be masked through one another: a mask allowing a column in one row could not keep it.
        if num_logits > 1 and s0 < width:
            raise LayoutError(
                f"logits: expected rows that do not overlap in memory (row stride >= width {width}), "
                f"got strides {(s0, s1)}"
            )
    if logits.requires_grad and torch.is_grad_enabled():
        # Masking writes in place, outside autograd: refused as torch refuses in-place ops on such tensors.
        raise LayoutError(
            "logits: expected a tensor that does not require grad (masking writes in place, which autograd "
            "cannot record); mask under torch.no_grad() or pass logits.detach()"
        )
    device = logits.device
    host_words: np.ndarray[Any, Any] | None = None
    if isinstance(bitmask, np.ndarray):
        # Rows as the engine's scheduler made them: on the CPU they are read straight from numpy
        # (a tensor made around them would be turned back into an array to mask with).
        if device != _CPU and device.type != "cpu":
            raise LayoutError(
                f"bitmask: a numpy bitmask needs logits on the CPU, got logits on {device}; "
                f"move it to the logits device first (torch.from_numpy(bitmask).to({str(device)!r}))"
            )
        if bitmask.ndim != 2:
            raise LayoutError(f"bitmask: expected 2-D (rows, words), got shape {bitmask.shape}")
        if bitmask.dtype != np.int32:
            raise LayoutError(f"bitmask: expected int32 (native byte order), got numpy {bitmask.dtype.str}")
        host_words = bitmask if bitmask.flags.c_contiguous else np.ascontiguousarray(bitmask)
        bshape = host_words.shape
    elif not isinstance(bitmask, torch.Tensor):
        raise LayoutError(
            f"bitmask: expected a torch.Tensor or (with CPU logits) a numpy array, got {type(bitmask).__name__}"
        )
    else:
        bshape = bitmask.shape
        if len(bshape) != 2:
            raise LayoutError(f"bitmask: expected 2-D (rows, words), got shape {tuple(bshape)}")
        if bitmask.dtype != torch.int32:
            raise LayoutError(f"bitmask: expected int32, got {bitmask.dtype}")
        if bitmask.device != device:
            raise LayoutError(f"bitmask: expected device {device} (the logits device), got {bitmask.device}")
    rows, words = bshape
    if vocab_size is None:
        if 32 * words < width:
            raise LayoutError(
                f"bitmask: expected at least ceil({width}/32) = {(width + 31) // 32} words to cover the logits "
                f"width, got {words}; pass vocab_size if the columns past 32*words are padding"
            )
        vocab_size = width
    else:
        vocab_size = host_int(
            "vocab_size", vocab_size, LayoutError, lo=1, hi=width, expected="0 < vocab_size <= logits width {hi}"
        )
        if vocab_size > 32 * words:
            raise LayoutError(
                f"vocab_size: expected <= 32 × bitmask words = {32 * words}, got {vocab_size} "
                f"(the bitmask is narrower than the vocabulary)"
            )
    if tail not in ("mask", "keep"):
        raise LayoutError(f"tail: expected 'mask' or 'keep', got {tail!r}")

    # ---- mapping and offsets -------------------------------------------------
    if (
        type(mapping) is RowMapping
        and type(cu_logits) is np.ndarray
        and cu_logits.dtype in _CU_DTYPES
        and cu_logits.ndim == 1
        and (device == _CPU or device.type == "cpu")
        and cpu_numba.serves()
    ):
        be = _resolve_cached(backend, device)
        if type(be) is TorchBackend:
            # The built-in CPU path in one compiled call: it checks the mapping against the offsets
            # before writing anything, finds the live rows and masks them (see cpu_numba.mask_mapped).
            ibits, ninf = CPU_BITS[logits.dtype]
            src = logits.detach() if logits.requires_grad else logits
            xi = src.numpy().view(np.int32) if ibits is torch.int32 else src.view(ibits).numpy()
            if host_words is None:
                host_words = cast(torch.Tensor, bitmask).contiguous().numpy()
            code = cpu_numba.mask_mapped(
                xi, host_words, mapping.request, mapping.position, cu_logits, int(vocab_size), tail == "mask", ninf
            )
            if code:
                # Refused, nothing written: the full checks word the error.
                _rows_and_offsets(mapping, cu_logits, rows, device, num_logits)
                raise LayoutError(f"mapping: refused by the CPU kernel's checks (code {code}) against cu_logits")
            return
    checked = _checked_rows(mapping, cu_logits, rows, device, num_logits)
    if checked is not None:
        be = _resolve_cached(backend, device)
        if rows == 0 or num_logits == 0 or width == 0:
            return
        req_list, pos_list, cu_list = checked
        if type(be) is TorchBackend and rows <= FEW_ROWS:
            # The built-in CPU path on a few checked rows: straight from the lists, no tensors in between.
            live = live_rows(req_list, pos_list, cu_list)
            if live is not None:
                words_in = host_words if host_words is not None else cast(torch.Tensor, bitmask).contiguous()
                mask_rows_cpu(logits, words_in, live, int(vocab_size), tail == "mask")
                return
        assert isinstance(mapping, RowMapping)  # _checked_rows accepts nothing else
        request, position = mapping._tensors()
        cu = torch.tensor(cu_list, dtype=torch.int32)
    else:
        request, position, cu = _rows_and_offsets(mapping, cu_logits, rows, device, num_logits)
        be = _resolve_cached(backend, device)
        if rows == 0 or num_logits == 0 or width == 0:
            return
    be.apply(
        logits,
        torch.from_numpy(host_words) if host_words is not None else cast(torch.Tensor, bitmask).contiguous(),
        request,
        position,
        cu,
        int(vocab_size),
        tail == "mask",
    )


_CPU = torch.device("cpu")  # comparing devices is cheaper than reading a device's type
_CU_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))  # offsets the compiled CPU path reads as they are

#: Checked mappings and offsets up to this many entries are read as Python lists (one ``tolist`` each)
#: rather than by numpy reductions.
_LIST_ROWS = 64


def _checked_rows(
    mapping: Any, cu_logits: Any, rows: int, device: torch.device, num_logits: int
) -> tuple[list[int], list[int], list[int]] | None:
    """``(request, position, cu_logits)`` as lists when the mapping is one maskplug built and checked, else ``None``.

    A :class:`RowMapping` from a layout (read-only, its values checked when it
    was built) needs only its length compared with the bitmask and the offsets
    checked against it; this is done for a few rows and offsets on the host, as
    Python lists. Anything else returns ``None``: the full checks then run (and
    word any error).
    """
    if type(mapping) is not RowMapping or (device != _CPU and device.type != "cpu") or rows > _LIST_ROWS:
        return None
    needs = mapping._trusted_needs()
    if needs is None or mapping.request.shape[0] != rows:
        return None
    if type(cu_logits) is not np.ndarray or cu_logits.ndim != 1 or cu_logits.dtype.kind not in "iu":
        return None
    m = cu_logits.shape[0]
    if m < 1 or m - 1 < needs or m > _LIST_ROWS:
        return None
    cu = cu_logits.tolist()
    if cu[0] != 0 or cu[-1] > num_logits or cu[-1] > INT32_MAX:
        return None
    if m == 2:  # one request (the common case): one comparison instead of a map over the pairs
        if cu[1] < 0:
            return None
    elif any(map(int.__gt__, cu, cu[1:])):
        return None
    req, pos = mapping._lists()
    return req, pos, cu


def _rows_and_offsets(
    mapping: Any, cu_logits: Any, rows: int, device: torch.device, num_logits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every check of the mapping and the offsets, and their normalised tensors on ``device``."""
    if isinstance(mapping, RowMapping):
        req_in, pos_in = mapping.request, mapping.position
    elif isinstance(mapping, tuple) and len(mapping) == 2:
        req_in, pos_in = mapping
    else:
        raise LayoutError(f"mapping: expected a RowMapping or a (request, position) pair, got {type(mapping).__name__}")
    request, req_host = _int_vector("mapping.request", req_in, device)
    position, pos_host = _int_vector("mapping.position", pos_in, device)
    if request.shape[0] != position.shape[0]:
        raise LayoutError(
            f"mapping: expected request and position of equal length, got {request.shape[0]} and {position.shape[0]}"
        )
    if request.shape[0] != rows:
        raise LayoutError(
            f"mapping: expected {rows} entries (one per bitmask row), got {request.shape[0]}; "
            "build the mapping from the scheduled layout, not from the compacted offsets"
        )
    cu, cu_host = _int_vector("cu_logits", cu_logits, device, wide=True)
    if cu.shape[0] < 1:
        raise LayoutError("cu_logits: expected n + 1 >= 1 offsets, got an empty array")
    n = int(cu.shape[0]) - 1
    if cu_host is not None:
        if cu_host[0] != 0:
            raise LayoutError(f"cu_logits: expected to start at 0, got {int(cu_host[0])}")
        d = np.diff(cu_host)
        if d.size and d.min() < 0:
            i = int(np.argmax(d < 0))
            raise LayoutError(
                f"cu_logits: expected non-decreasing offsets, got {int(cu_host[i])} then {int(cu_host[i + 1])} at {i}"
            )
        if int(cu_host[-1]) > num_logits:
            raise LayoutError(
                f"cu_logits: expected a last offset <= the {num_logits} logits rows, got {int(cu_host[-1])}"
            )
    if req_host is not None and req_host.size:
        if req_host.min() < -1 or req_host.max() >= n:
            bad = int(req_host[(req_host < -1) | (req_host >= n)][0])
            raise LayoutError(f"mapping.request: expected -1 or a request index in [0, {n}), got {bad}")
    if pos_host is not None and pos_host.size and pos_host.min() < 0:
        # Only rows that are used must have a position; unused rows (request -1) may hold anything.
        used = pos_host if req_host is None else pos_host[req_host >= 0]
        if used.size and used.min() < 0:
            raise LayoutError(f"mapping.position: expected positions >= 0 for used rows, got {int(used.min())}")
    return request, position, cu
