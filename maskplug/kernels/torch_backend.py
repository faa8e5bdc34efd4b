"""The built-in ``torch`` kernel backend: runs wherever torch does.

CPU path: the live rows are known on the host, so only they are touched.
Where numba is installed, :func:`maskplug.apply_grammar_bitmask` hands a
:class:`~maskplug.RowMapping` with numpy offsets straight to one compiled
call (:func:`maskplug.kernels.cpu_numba.mask_mapped`: checks, live rows and
masking together); what follows is the path for everything else.
Rows wider than ``_SMALL_ROW`` columns, and every row of a batch of more
than ``FEW_ROWS`` mask rows, go to the numba kernel
(:mod:`maskplug.kernels.cpu_numba`: one branch-free pass per row, about the
cost of copying it) where numba is installed; otherwise, and for narrow rows,
numpy works on them, a block of at most ``_CHUNK_ELEMS`` logits (a wide row)
at a time. Each block
expands its mask bytes into an integer keep-mask of the logits' width (``-1``
keep, ``0`` drop), then rewrites the logits bit pattern branch-free:
``x = ((x ^ NINF) & keep) ^ NINF`` leaves kept values bit-identical (NaN
included) and turns dropped ones into exactly ``-inf``. ``masked_fill`` with a
random boolean mask is several times slower here because it branches per
element; nothing of the full logits shape is ever materialised. Two kinds of
row skip that work: a row whose mask words are mostly ``0`` (a grammar between
structural tokens) keeps aside its few allowed values, fills the row with
``-inf`` and puts them back, and a row whose words are mostly ``-1`` only
stores ``-inf`` at its dropped columns; a narrow row (one decode step of a
small vocabulary) takes one boolean store, the fewest numpy calls.

The CPU path runs on the calling thread only, by design: its element-wise work
is done by numpy on views of the logits' memory, never by torch's intra-op
thread pool. That pool's workers wait for each other at the end of every
operation, so on a machine whose cores are busy (a CPU serving engine's always
are) a one-row operation can take as long as the slowest worker's time slice;
a single thread keeps its speed whatever else runs and whatever
``torch.set_num_threads`` the caller chose, and it changes no global setting.

CUDA path (fallback when no faster backend is installed): no host sync, so the
live-row rule and duplicates are resolved with device ops: every mask row's
keep-mask is AND-combined into its target logits row (``index_reduce_`` with
``amax`` over {-1, 0} is an AND), trimmed rows are sent to a scratch row, and
the work is split into column blocks to bound temporaries.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..hookspecs import hookimpl
from . import cpu_numba
from .sdk import INT_VIEW, NINF_BITS, BackendBase, LaunchArgs, Launcher, launcher_from

__all__ = ["CPU_BITS", "FEW_ROWS", "TorchBackend", "live_rows", "mask_rows_cpu"]

_CHUNK_ELEMS = (
    1 << 17
)  # logits per CPU block: 512 KB of int32 keep-mask; fewer, longer numpy calls beat a block that fits L2 with room to spare
_NP_INT: dict[torch.dtype, type[np.signedinteger[Any]]] = {torch.int32: np.int32, torch.int16: np.int16}
FEW_ROWS = 16
"""Up to this many mask rows, the CPU path finds live rows in Python and masks them one by one."""
_SMALL_ROW = 1024  # up to this many columns a row is masked by one masked store
_SPARSE_MIN_WORDS = 64  # rows of at least this many whole mask words look for mostly-0 or mostly--1 words
_SPARSE_SHARE = 4  # ... and gather the other words when they are at most 1 / _SPARSE_SHARE of the row's
_DEVICE_BLOCK_ELEMS = 1 << 23  # bounds the device path's combined keep-mask temporaries (32 MB of int32)


_DROP_BITS = (np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 0).view(np.uint64)[
    :, 0
]
"""``_DROP_BITS[b]``: the 8 columns a mask byte ``b`` drops, as 8 booleans in one ``uint64`` (one ``take`` per row)."""
CPU_BITS: dict[torch.dtype, tuple[torch.dtype, np.signedinteger[Any]]] = {
    dt: (INT_VIEW[dt], _NP_INT[INT_VIEW[dt]](NINF_BITS[dt])) for dt in INT_VIEW
}
"""Per logits dtype: the integer view and its ``-inf`` bit pattern as a numpy scalar (looked up once per call)."""
_NO_KEEP = np.empty(0, dtype=np.int32)  # rows of at most _SMALL_ROW columns need no keep-mask scratch

_VIEW_MAX_BYTES = 1 << 16  # storages up to this size may have their integer view remembered
_VIEW_SLOTS = 16
_views: dict[tuple[int, torch.Size, tuple[int, ...], torch.dtype], npt.NDArray[Any]] = {}
"""Integer numpy views of small CPU tensors, by (address, shape, strides, dtype).

Making a tensor's numpy view costs more than masking a narrow row. A view is
reused only for a tensor with the same first-element address, shape, strides
and dtype, which addresses exactly the same bytes; the remembered view holds
the storage it was made over, so that memory is never freed and reused under
it. Only small storages are kept, and few of them.
"""


def _int_view(t: torch.Tensor, ibits: torch.dtype) -> npt.NDArray[Any]:
    """A numpy view of CPU tensor ``t``'s memory as ``ibits`` (same element size), writes going to ``t``."""
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype)
    view = _views.get(key)
    if view is None:
        src = t.detach() if t.requires_grad else t
        view = (src if src.dtype == ibits else src.view(ibits)).numpy()
        if 0 < src.untyped_storage().nbytes() <= _VIEW_MAX_BYTES:
            if len(_views) >= _VIEW_SLOTS:
                _views.clear()
            _views[key] = view
    return view


class _Scratch(threading.local):
    """Keep-mask scratch per thread and integer dtype, reused across calls.

    A fresh buffer of a wide row's size comes from the system as untouched
    pages, and faulting them in on every call costs more than masking a row.
    """

    def __init__(self) -> None:
        self.buffers: dict[np.dtype[Any], npt.NDArray[Any]] = {}


_scratch_buffers = _Scratch()


def _scratch(dtype: np.dtype[Any] | type[np.signedinteger[Any]], n: int) -> npt.NDArray[Any]:
    """At least ``n`` elements of ``dtype`` this thread may overwrite (contents undefined)."""
    key = np.dtype(dtype)
    buf = _scratch_buffers.buffers.get(key)
    if buf is None or buf.shape[0] < n:
        buf = np.empty(max(n, 1024), dtype=key)
        _scratch_buffers.buffers[key] = buf
    return buf


def _keep_mask(words: torch.Tensor, width: int, vocab_size: int, mask_tail: bool, itype: torch.dtype) -> torch.Tensor:
    """Expand ``(c, W)`` mask words into a ``(c, width)`` keep-mask of ``itype`` (-1 keep, 0 drop)."""
    c, w = words.shape
    shifts = torch.arange(31, -1, -1, dtype=torch.int32, device=words.device)
    # Bit b of a word moved to the sign bit, then an arithmetic shift smears it: -1 or 0.
    bits = words.unsqueeze(-1) << shifts
    bits >>= 31  # in place: a second temporary of the chunk's size costs more than the shift itself
    bits = bits.view(c, 32 * w)
    if itype != torch.int32:
        bits = bits.to(itype)
    if 32 * w == width and (vocab_size == width or not mask_tail):
        if vocab_size < width:
            bits[:, vocab_size:] = -1
        return bits
    keep = torch.empty((c, width), dtype=itype, device=words.device)
    n = min(vocab_size, width)
    keep[:, :n] = bits[:, :n]
    keep[:, n:] = 0 if mask_tail else -1
    return keep


def _apply_rows(xi: torch.Tensor, keep: torch.Tensor, ninf: int) -> None:
    xi.bitwise_xor_(ninf).bitwise_and_(keep).bitwise_xor_(ninf)


def _apply_rows_cpu(
    xi: npt.NDArray[Any],
    words: npt.NDArray[np.int32],
    src: npt.NDArray[np.int64],
    dst: npt.NDArray[np.int64],
    vocab_size: int,
    mask_tail: bool,
    ninf: np.signedinteger[Any],
) -> None:
    """Mask logits rows ``dst`` (of the integer view ``xi``) with mask rows ``src`` of ``words``, on this thread.

    ``dst`` is sorted and duplicate-free. Works in blocks of at most
    ``_CHUNK_ELEMS`` logits: a group of whole rows when rows are narrow, a
    column range of one row when they are wide (ranges start on a byte of the
    mask, so a multiple of 8 columns).
    """
    width = xi.shape[1]
    itype = xi.dtype
    if width == 0 or dst.size == 0:
        return
    if cpu_numba.available():
        # One pass per row, whatever the mask (see maskplug.kernels.cpu_numba); narrow rows too: one
        # call for the batch instead of a handful of numpy calls per block.
        cpu_numba.mask_rows(xi, words, src, dst, vocab_size, mask_tail, ninf)
        return
    group = max(1, _CHUNK_ELEMS // width)
    if group == 1 or width >= 32 * _SPARSE_MIN_WORDS:
        # Wide rows one by one: each row then takes the cheapest of the one-row ways.
        keep = _scratch(itype, min(width, max(32, _CHUNK_ELEMS // 32 * 32)))
        for d, i in zip(dst.tolist(), src.tolist(), strict=True):
            _apply_row_cpu(xi[d], words[i], vocab_size, mask_tail, ninf, keep)
        return
    cols = width if group > 1 else max(8, _CHUNK_ELEMS // 8 * 8)
    keep_buf = _scratch(itype, group * min(cols, width))
    tail_fill = 0 if mask_tail else -1
    for s in range(0, dst.size, group):
        d = dst[s : s + group]
        sr = src[s : s + group]
        g = d.size
        d_run = int(d[-1]) - int(d[0]) == g - 1  # dst is strictly increasing: the ends tell
        s_run = g == 1 or (int(sr[-1]) - int(sr[0]) == g - 1 and bool((sr[1:] > sr[:-1]).all()))  # in dst's order
        for c0 in range(0, width, cols):
            c1 = min(width, c0 + cols)
            keep = keep_buf[: g * (c1 - c0)].reshape(g, c1 - c0)
            nbits = max(0, min(c1, vocab_size) - c0)  # columns of this block the mask decides
            if nbits:
                b0, b1 = c0 // 32, (c0 + nbits + 31) // 32
                w = words[int(sr[0]) : int(sr[0]) + g, b0:b1] if s_run else words[sr, b0:b1]
                # Little-endian words: byte k holds tokens 8k..8k+7, bit j of it token 8k+j.
                by = np.ascontiguousarray(w).view(np.uint8)
                skip = c0 % 32  # c0 is a multiple of 8: whole bytes of the first word to skip
                by = by[:, skip // 8 :]
                bits = np.unpackbits(by, axis=1, count=nbits, bitorder="little").view(np.int8)
                # 0/1 to 0/-1 in bytes, then sign-extended: faster than negating into the wide type.
                np.negative(bits, out=bits)
                np.copyto(keep[:, :nbits], bits)
            if nbits < c1 - c0:
                keep[:, nbits:] = tail_fill
            if d_run:
                rows = xi[int(d[0]) : int(d[0]) + g, c0:c1]
            else:
                rows = xi[d, c0:c1]  # a gathered copy, written back below
            # x = ((x ^ NINF) & keep) ^ NINF: kept bits unchanged, dropped ones exactly NINF.
            np.bitwise_xor(rows, ninf, out=rows)
            np.bitwise_and(rows, keep, out=rows)
            np.bitwise_xor(rows, ninf, out=rows)
            if not d_run:
                xi[d, c0:c1] = rows


def _dense_block(x: npt.NDArray[Any], by: npt.NDArray[np.uint8], nbits: int, keep: npt.NDArray[Any], ninf: Any) -> None:
    """Mask the first ``nbits`` columns of ``x`` (1-D or ``(k, c)``) with the bits of ``by`` (bytes per row), branch-free.

    ``keep`` is scratch of at least ``x.size`` elements of ``x``'s dtype.
    """
    bits = np.unpackbits(by, axis=-1, count=nbits, bitorder="little").view(np.int8)
    # 0/1 to 0/-1 in bytes, then sign-extended: faster than negating into the wide type.
    np.negative(bits, out=bits)
    r = x[..., :nbits]
    k = keep[: r.size].reshape(r.shape)
    np.copyto(k, bits)
    # x = ((x ^ NINF) & keep) ^ NINF: kept bits unchanged, dropped ones exactly NINF.
    np.bitwise_xor(r, ninf, out=r)
    np.bitwise_and(r, k, out=r)
    np.bitwise_xor(r, ninf, out=r)


def _set_columns(w: npt.NDArray[np.int32], idx: npt.NDArray[np.intp], clear: bool) -> npt.NDArray[np.intp]:
    """The columns of words ``w[idx]`` whose bit is set (``clear``: whose bit is clear), in increasing order."""
    sel = w[idx]
    if clear:
        np.invert(sel, out=sel)
    # Little-endian words: byte k holds tokens 8k..8k+7, bit j of it token 8k+j.
    t = np.unpackbits(sel.view(np.uint8), bitorder="little").view(np.bool_).nonzero()[0]
    cols = idx[t >> 5]
    cols <<= 5
    cols |= t & 31
    return cols


def _apply_row_cpu(
    x: npt.NDArray[Any],
    words: npt.NDArray[np.int32],
    vocab_size: int,
    mask_tail: bool,
    ninf: np.signedinteger[Any],
    keep: npt.NDArray[Any],
) -> None:
    """Mask one logits row ``x`` (an integer view) with one mask row ``words``.

    Three ways, each writing exactly what the branch-free form would:

    * a narrow row (``<= _SMALL_ROW`` columns): one masked store of ``NINF``
      at the dropped columns (fewest numpy calls; branching per element costs
      nothing at this width);
    * a row whose whole mask words are mostly ``0`` (nothing allowed, as a
      grammar gives between structural tokens): the allowed columns, found
      from the other words alone, are read, the row is filled with ``NINF``
      (a write-only pass, cheaper than a copy) and they are put back; a row
      whose words are mostly ``-1`` (everything allowed): ``NINF`` is stored
      at the dropped columns only;
    * otherwise branch-free, ``len(keep)`` columns at a time (a multiple of 32,
      so every block starts on a mask word).
    """
    width = x.shape[0]
    n = min(vocab_size, width)  # columns the mask decides
    if width <= _SMALL_ROW:
        if n:
            # Little-endian words: byte k holds tokens 8k..8k+7, bit j of it token 8k+j (a table row of 8).
            nw = (n + 31) // 32
            drop = _DROP_BITS.take((words if words.shape[0] == nw else words[:nw]).view(np.uint8)).view(np.bool_)
            if n == width == drop.shape[0]:  # the mask decides exactly the row's columns: no slicing
                x[drop] = ninf
            else:
                x[:n][drop[:n]] = ninf
        if mask_tail and n < width:
            x[n:] = ninf
        return
    nw = n // 32  # whole words; the columns past them take the general path below
    done = 0
    if nw >= _SPARSE_MIN_WORDS:
        w = words[:nw]
        body = x[: 32 * nw]
        some = w != 0  # words allowing something (nonzero of a bool array is several times faster)
        if np.count_nonzero(some) <= nw // _SPARSE_SHARE:
            cols = _set_columns(w, some.nonzero()[0], False)  # the allowed columns
            kept = body[cols]
            body.fill(ninf)
            body[cols] = kept
            done = 32 * nw
        else:
            some = w != -1  # words dropping something
            if np.count_nonzero(some) <= nw // _SPARSE_SHARE:
                body[_set_columns(w, some.nonzero()[0], True)] = ninf  # the dropped columns
                done = 32 * nw
    step = keep.shape[0]
    for c0 in range(done, width, step):
        c1 = min(width, c0 + step)
        nbits = max(0, min(c1, n) - c0)  # columns of this block the mask decides
        if nbits:
            _dense_block(x[c0:c1], words[c0 // 32 : (c0 + nbits + 31) // 32].view(np.uint8), nbits, keep, ninf)
        if mask_tail and nbits < c1 - c0:
            x[c0 + nbits : c1] = ninf


def _apply_run_cpu(
    x: npt.NDArray[Any], words: npt.NDArray[np.int32], vocab_size: int, mask_tail: bool, ninf: np.signedinteger[Any]
) -> None:
    """Mask narrow logits rows ``x[j]`` (``<= _SMALL_ROW`` columns, an integer view) with ``words[j]``, all at once.

    What :func:`_apply_row_cpu` writes row by row, branch-free over all of
    them (a masked store costs several times more per element once there are
    more than a few hundred).
    """
    width = x.shape[1]
    n = min(vocab_size, width)
    if n:
        nw = (n + 31) // 32
        w = words if words.shape[1] == nw else words[:, :nw]
        _dense_block(x, w.view(np.uint8), n, _scratch(ninf.dtype, x.shape[0] * n), ninf)
    if mask_tail and n < width:
        x[:, n:] = ninf


def live_rows(request: list[int], position: list[int], cu: list[int]) -> list[tuple[int, int]] | None:
    """``(logits row, mask row)`` of every live mask row, by logits row; ``None`` if two share a logits row.

    For a few rows, on checked values as Python lists: row ``i`` is live iff
    ``request[i] >= 0`` and ``0 <= position[i] < cu[r + 1] - cu[r]``.
    """
    if len(request) == 1:  # one decode row: no sort, no duplicate to find
        r, p = request[0], position[0]
        return [(cu[r] + p, 0)] if r >= 0 and 0 <= p < cu[r + 1] - cu[r] else []
    live = sorted(
        (cu[r] + p, i)
        for i, (r, p) in enumerate(zip(request, position, strict=True))
        if r >= 0 and 0 <= p < cu[r + 1] - cu[r]
    )
    if len({d for d, _ in live}) != len(live):
        return None
    return live


def mask_rows_cpu(
    logits: torch.Tensor,
    bitmask: torch.Tensor | npt.NDArray[np.int32],
    live: list[tuple[int, int]],
    vocab_size: int,
    mask_tail: bool,
) -> None:
    """Mask CPU ``logits`` row ``d`` with ``bitmask`` row ``i`` for each ``(d, i)`` of ``live`` (distinct ``d``).

    Normalised arguments as :class:`~maskplug.kernels.sdk.KernelBackend` gets
    them (``bitmask`` contiguous: a tensor, or its numpy array); on the
    calling thread only.
    """
    if not live:
        return
    ibits, ninf = CPU_BITS[logits.dtype]
    xi = _int_view(logits, ibits)
    words = bitmask if isinstance(bitmask, np.ndarray) else _int_view(bitmask, torch.int32)
    width = xi.shape[1]
    if width > _SMALL_ROW and cpu_numba.available():
        cpu_numba.mask_rows(
            xi,
            words,
            np.fromiter((i for _, i in live), dtype=np.int64, count=len(live)),
            np.fromiter((d for d, _ in live), dtype=np.int64, count=len(live)),
            vocab_size,
            mask_tail,
            ninf,
        )
        return
    if width <= _SMALL_ROW and len(live) > 1:
        d0, i0 = live[0]
        m = len(live)
        if live[-1] == (d0 + m - 1, i0 + m - 1) and all(d == d0 + j and i == i0 + j for j, (d, i) in enumerate(live)):
            # A request's drafts and bonus: mask rows i0.. onto logits rows d0.., in one masked store.
            _apply_run_cpu(xi[d0 : d0 + m], words[i0 : i0 + m], vocab_size, mask_tail, ninf)
            return
        # Several requests: their rows gathered, masked in one store, put back (the logits rows are distinct).
        dst = np.fromiter((d for d, _ in live), dtype=np.intp, count=m)
        src = np.fromiter((i for _, i in live), dtype=np.intp, count=m)
        rows = xi[dst]
        _apply_run_cpu(rows, words[src], vocab_size, mask_tail, ninf)
        xi[dst] = rows
        return
    keep = _NO_KEEP if width <= _SMALL_ROW else _scratch(ninf.dtype, min(width, max(32, _CHUNK_ELEMS // 32 * 32)))
    for d, i in live:
        _apply_row_cpu(xi[d], words[i], vocab_size, mask_tail, ninf, keep)


def _apply_cpu(args: LaunchArgs) -> None:
    """The CPU path: live rows found on the host, masked on this thread."""
    logits, bitmask, request, position, cu_logits, vocab_size, mask_tail = args
    if request.shape[0] <= FEW_ROWS:
        # At one request the numpy calls that find live rows for a whole batch cost several times the
        # masking itself: a few rows are worked out in Python. Two mask rows aiming at one logits row
        # (``few is None``, nothing written) take the batch path below, which ANDs them.
        few = live_rows(request.numpy().tolist(), position.numpy().tolist(), cu_logits.numpy().tolist())
        if few is not None:
            mask_rows_cpu(logits, bitmask, few, vocab_size, mask_tail)
            return
    itype = _NP_INT[INT_VIEW[logits.dtype]]
    # Read only: no copy where they are int64 already (the planner's are).
    req = np.asarray(request.numpy(), dtype=np.int64)
    pos = np.asarray(position.numpy(), dtype=np.int64)
    cu = np.asarray(cu_logits.numpy(), dtype=np.int64)
    r = np.maximum(req, 0)
    live = (req >= 0) & (pos >= 0) & (pos < cu[r + 1] - cu[r])
    src = np.flatnonzero(live)
    if src.size == 0:
        return
    dst = cu[r[src]] + pos[src]
    words = bitmask
    # Mask rows usually come in logits order, one per logits row: then neither a sort nor the AND below is needed.
    if dst.size > 1 and not bool((dst[1:] > dst[:-1]).all()):
        order = np.argsort(dst, kind="stable")
        src, dst = src[order], dst[order]
        if bool((dst[1:] == dst[:-1]).any()):
            # Several mask rows for one logits row apply as the AND of their masks.
            starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
            bm = bitmask.numpy()[src]
            words = torch.from_numpy(np.bitwise_and.reduceat(bm, starts, axis=0))
            src, dst = np.arange(starts.size), dst[starts]
    # Same element size: a bit-pattern view of the logits' own memory, any row stride.
    xi = logits.detach().view(INT_VIEW[logits.dtype]).numpy()
    _apply_rows_cpu(xi, words.numpy(), src, dst, vocab_size, mask_tail, itype(NINF_BITS[logits.dtype]))


def _apply_device(args: LaunchArgs) -> None:
    """The sync-free path for CUDA (or any device): live rows and duplicates resolved by device ops."""
    logits, bitmask, request, position, cu_logits, vocab_size, mask_tail = args
    num_rows, width = logits.shape
    req = request.to(torch.int64)
    pos = position.to(torch.int64)
    cu = cu_logits.to(torch.int64)
    n = cu.shape[0] - 1
    r = req.clamp(0, max(n - 1, 0))
    if n > 0:
        size = cu[r + 1] - cu[r]
        live = (req >= 0) & (pos >= 0) & (pos < size)
        dst = torch.where(live, cu[r] + pos, torch.full_like(pos, num_rows))
    else:
        live = torch.zeros_like(req, dtype=torch.bool)
        dst = torch.full_like(pos, num_rows)
    dst = dst.clamp(0, num_rows)  # defensive: never index past the scratch row
    itype = INT_VIEW[logits.dtype]
    ninf = NINF_BITS[logits.dtype]
    xi = logits.view(itype)
    keep_all = _keep_mask(bitmask, width, vocab_size, mask_tail, itype)
    block = max(32, _DEVICE_BLOCK_ELEMS // max(num_rows + 1, 1) // 32 * 32)
    for c0 in range(0, width, block):
        c1 = min(width, c0 + block)
        comb = torch.full((num_rows + 1, c1 - c0), -1, dtype=itype, device=logits.device)
        comb.index_reduce_(0, dst, keep_all[:, c0:c1], "amax", include_self=True)
        _apply_rows(xi[:, c0:c1], comb[:num_rows], ninf)


class TorchBackend(BackendBase):
    """Pure-torch kernel backend; exact on every device torch supports."""

    name = "torch"
    priority = 0  # the fallback: any installed specialised backend wins on "auto"

    def probe(self, device: torch.device) -> str | None:
        if device.type in ("cpu", "cuda"):
            return None
        return f"untested device type {device.type!r}"

    def launcher(self, device: torch.device) -> Launcher:
        """The host-driven CPU path, or the sync-free device path."""
        return self._apply_cpu if device.type == "cpu" else self._apply_device

    # Seven-argument launchers (the :data:`~maskplug.kernels.sdk.Launcher` form) over the record functions.
    _apply_cpu = staticmethod(launcher_from(_apply_cpu))
    _apply_device = staticmethod(launcher_from(_apply_device))


_BACKEND = TorchBackend()


@hookimpl
def maskplug_register_kernels(register: Callable[[Any], None]) -> None:
    """Register the built-in torch backend."""
    register(_BACKEND)


if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("maskplug's torch backend assumes a little-endian host")
