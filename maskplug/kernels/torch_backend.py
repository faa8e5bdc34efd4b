"""The built-in ``torch`` kernel backend: runs wherever torch does.

CPU path: the live rows are known on the host, so only they are touched, a few
rows at a time so every temporary stays in cache. Each chunk expands its mask
words into an int32 keep-mask (``-1`` keep, ``0`` drop) with one shift pair,
then rewrites the logits bit pattern branch-free:
``x = ((x ^ NINF) & keep) ^ NINF`` leaves kept values bit-identical (NaN
included) and turns dropped ones into exactly ``-inf``. ``masked_fill`` with a
random boolean mask is several times slower here because it branches per
element; nothing of the full logits shape is ever materialised.

CUDA path (fallback when no faster backend is installed): no host sync, so the
live-row rule and duplicates are resolved with device ops: every mask row's
keep-mask is AND-combined into its target logits row (``index_reduce_`` with
``amax`` over {-1, 0} is an AND), trimmed rows are sent to a scratch row, and
the work is split into column blocks to bound temporaries.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..hookspecs import hookimpl
from .sdk import INT_VIEW, NINF_BITS, BackendBase, Launcher

__all__ = ["TorchBackend"]

_CHUNK_ELEMS = 1 << 17  # 512 KB of int32 keep-mask per chunk: it and its logits stay in L2
_DEVICE_BLOCK_ELEMS = 1 << 23  # bounds the device path's combined keep-mask temporaries (32 MB of int32)


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

    # -- CPU: live rows known on the host ----------------------------------------
    def _apply_cpu(
        self,
        logits: torch.Tensor,
        bitmask: torch.Tensor,
        request: torch.Tensor,
        position: torch.Tensor,
        cu_logits: torch.Tensor,
        vocab_size: int,
        mask_tail: bool,
    ) -> None:
        req = request.numpy().astype(np.int64)
        pos = position.numpy().astype(np.int64)
        cu = cu_logits.numpy().astype(np.int64)
        r = np.maximum(req, 0)
        live = (req >= 0) & (pos >= 0) & (pos < cu[r + 1] - cu[r])
        src = np.flatnonzero(live)
        if src.size == 0:
            return
        dst = cu[r[src]] + pos[src]
        order = np.argsort(dst, kind="stable")
        src, dst = src[order], dst[order]
        words = bitmask
        if dst.size > 1 and np.any(dst[1:] == dst[:-1]):
            # Several mask rows for one logits row apply as the AND of their masks.
            starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
            bm = bitmask.numpy()[src]
            words = torch.from_numpy(np.bitwise_and.reduceat(bm, starts, axis=0))
            src, dst = np.arange(starts.size), dst[starts]
        width = logits.shape[1]
        itype = INT_VIEW[logits.dtype]
        ninf = NINF_BITS[logits.dtype]
        xi_all = logits.view(itype)  # same element size: a bit-pattern view, any row stride
        step = max(1, _CHUNK_ELEMS // max(width, 1))
        contiguous_src = src.size == 0 or bool(np.all(np.diff(src) == 1))
        for s in range(0, dst.size, step):
            d = dst[s : s + step]
            if contiguous_src:
                w = words[int(src[s]) : int(src[s]) + d.size]
            else:
                w = words[torch.from_numpy(src[s : s + step])]
            keep = _keep_mask(w, width, vocab_size, mask_tail, itype)
            if int(d[-1]) - int(d[0]) == d.size - 1:
                _apply_rows(xi_all[int(d[0]) : int(d[-1]) + 1], keep, ninf)
            else:
                idx = torch.from_numpy(d)
                rows = xi_all.index_select(0, idx)
                _apply_rows(rows, keep, ninf)
                xi_all.index_copy_(0, idx, rows)

    # -- CUDA (or any device): no host sync ---------------------------------------
    def _apply_device(
        self,
        logits: torch.Tensor,
        bitmask: torch.Tensor,
        request: torch.Tensor,
        position: torch.Tensor,
        cu_logits: torch.Tensor,
        vocab_size: int,
        mask_tail: bool,
    ) -> None:
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


_BACKEND = TorchBackend()


@hookimpl
def maskplug_register_kernels(register: Callable[[Any], None]) -> None:
    """Register the built-in torch backend."""
    register(_BACKEND)


if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("maskplug's torch backend assumes a little-endian host")
