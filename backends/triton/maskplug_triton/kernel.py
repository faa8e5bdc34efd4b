"""The Triton kernel that applies grammar mask rows to compacted logits.

Semantics (``docs/design.md``, "Applying masks"): mask row ``i`` with
``(r, p) = (request[i], position[i])`` writes logits row ``cu_logits[r] + p``
iff ``0 <= r < n``, ``p >= 0`` and ``p < cu_logits[r+1] - cu_logits[r]``. Columns
``< vocab_size`` whose bit is 0 become ``-inf``; columns in
``[vocab_size, limit)`` become ``-inf`` too (``limit`` is the logits width with
``tail="mask"``, ``vocab_size`` with ``tail="keep"``). Nothing else is written.

Design choices, each for bandwidth or for correctness:

* **Store-only.** The kernel never reads a logit. It writes the bit pattern of
  ``-inf`` where a column is disallowed and leaves every other column alone, so
  the traffic is the bitmask plus the stores and nothing more. This is also what
  makes duplicate mask rows (several rows mapped to one logits row) correct
  without any coordination: each program only ever stores ``-inf``, so any
  interleaving of two programs yields the AND of their masks. A read-modify-write
  of whole vectors could put back a value another program had just masked.
* **Bit patterns, not floats.** Logits are passed as an integer view of the same
  width (int32 for fp32, int16 for fp16/bf16), so one compiled kernel serves two
  dtypes and bf16 runs in the interpreter too. ``NINF`` is the dtype's ``-inf``
  pattern.
* **Decisions per tile of 32 words (1,024 columns).** A tile fully inside the
  vocabulary is classified from its 32 words alone (a 32-lane reduction, far
  cheaper than one over 1,024 elements): all ones → no store at all; all zeros →
  one unmasked store of the tile, which Triton emits as 16-byte vector stores;
  otherwise two predicated stores. The tile is shaped (word, 16-byte pack,
  element), so the first store's predicate ("nothing in this pack is allowed")
  is constant over each pack and compiles to one predicated 16-byte store per
  pack; the second covers only packs that mix allowed and disallowed tokens,
  element by element. Tiles that reach the vocabulary tail take a general
  element-wise path.
* **Launch shape.** One program per (mask row, chunk of ``TILES`` tiles),
  flattened into one grid axis (axis 0 allows 2^31 - 1 programs; axes 1 and 2
  only 65,535, fewer than a big batch × chunks). A single decode row of 131,072
  columns becomes 128 one-tile programs, enough to occupy every SM; thousands of
  rows get up to 16 tiles per program so the per-program row lookup (four
  dependent scalar loads) is amortised. The live-row test runs on the device, so
  trimmed rows cost one early exit and the host never waits.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from maskplug.kernels.sdk import (
    LaunchArgs,
    Launcher,
    device_index,
    int_view,
    launch_extent,
    launcher_from,
    ninf_bits,
    num_sms,
)

__all__ = ["BLOCK_W", "INTERPRETED", "MAX_TILES", "kernel_fn", "launch", "launch_shape"]

BLOCK_W = 32  # mask words per tile: 1,024 columns
MAX_TILES = 16  # tiles per program for large batches
_PROGRAMS_PER_SM = 8  # enough resident programs to hide the row-lookup latency


@triton.jit
def _mask_kernel(
    logits_ptr,  # integer view of the logits
    row_stride,  # elements between logits rows
    bitmask_ptr,  # int32 (rows, words)
    words,
    request_ptr,  # int32 (rows,)
    position_ptr,  # int32 (rows,)
    cu_ptr,  # int32 (n + 1,)
    num_requests,  # n: a request index outside [0, n) is treated as an unused row, never read past cu
    vocab_size,
    limit,  # last column (exclusive) that may be written
    chunks_per_row,
    NINF: tl.constexpr,
    PACK: tl.constexpr,  # elements per 16 bytes: 4 (32-bit) or 8 (16-bit)
    BLOCK_W: tl.constexpr,
    TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid // chunks_per_row
    chunk = pid % chunks_per_row
    r = tl.load(request_ptr + i)
    p = tl.load(position_ptr + i)
    ok = (r >= 0) & (r < num_requests)
    rs = tl.where(ok, r, 0)  # an unused row must not read outside cu_logits
    c0 = tl.load(cu_ptr + rs)
    c1 = tl.load(cu_ptr + rs + 1)
    live = ok & (p >= 0) & (p < c1 - c0)
    if live:
        row = (c0 + p).to(tl.int64)
        out = logits_ptr + row * row_stride
        bm = bitmask_ptr + i.to(tl.int64) * words
        # A tile is (word, 16-byte pack within the word, element within the pack).
        G: tl.constexpr = 32 // PACK
        widx = tl.arange(0, BLOCK_W)
        grp = tl.arange(0, G)
        elem = tl.arange(0, PACK)
        shift = grp[None, :, None] * PACK + elem[None, None, :]  # bit index within the word
        full: tl.constexpr = (1 << PACK) - 1
        ninf = tl.full([BLOCK_W, G, PACK], NINF, out.dtype.element_ty)
        for t in tl.static_range(TILES):
            w0 = (chunk * TILES + t) * BLOCK_W
            wi = w0 + widx
            wv = tl.load(bm + wi, mask=wi < words, other=0)
            cols = wi[:, None, None] * 32 + shift
            if (w0 + BLOCK_W) * 32 <= vocab_size:
                # Whole tile inside the vocabulary: decide from the words.
                any_set = tl.max((wv != 0).to(tl.int32), axis=0)
                any_clear = tl.max((wv != -1).to(tl.int32), axis=0)
                if any_set == 0:
                    tl.store(out + cols, ninf)
                elif any_clear != 0:
                    packbits = (wv[:, None] >> (grp[None, :] * PACK)) & full
                    # A mask that is constant over each pack lets Triton emit one
                    # predicated 16-byte store per pack with nothing allowed ...
                    tl.store(out + cols, ninf, mask=(packbits == 0)[:, :, None])
                    # ... and only packs mixing allowed and disallowed tokens fall
                    # back to per-element stores.
                    mixed = (packbits != 0) & (packbits != full)
                    drop = mixed[:, :, None] & (((wv[:, None, None] >> shift) & 1) == 0)
                    tl.store(out + cols, ninf, mask=drop)
            elif w0 * 32 < limit:
                allowed = (((wv[:, None, None] >> shift) & 1) != 0) & (cols < vocab_size)
                drop = (cols < limit) & (allowed == 0)
                tl.store(out + cols, ninf, mask=drop)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a small machine, so small test shapes still use several tiles
    return num_sms(device_index(device))


def launch_shape(rows: int, limit: int, num_sms: int) -> tuple[int, int, int]:
    """``(tiles per program, chunks per row, programs)`` for ``rows`` mask rows.

    Start from the widest chunk and halve it while the grid would leave SMs
    idle, so one decode row spreads over the whole card and a large batch keeps
    programs long enough to amortise their row lookup.
    """
    tiles_per_row = max(1, -(-limit // (32 * BLOCK_W)))
    target = _PROGRAMS_PER_SM * num_sms
    tiles = MAX_TILES
    while tiles > 1 and rows * -(-tiles_per_row // tiles) < target:
        tiles //= 2
    tiles = min(tiles, 1 << (tiles_per_row - 1).bit_length())  # never more tiles than a row has
    chunks = -(-tiles_per_row // tiles)
    return tiles, chunks, rows * chunks


def _launch(args: LaunchArgs) -> None:
    """Launch the kernel on normalised arguments (see ``maskplug.KernelBackend``).

    Everything read here is host metadata (shapes, strides, SM count), so the
    launch never synchronises and can be captured in a CUDA graph.
    """
    logits, bitmask, request, position, cu_logits, vocab_size, mask_tail = args
    extent = launch_extent(logits, bitmask, vocab_size, mask_tail)
    if extent is None:
        return
    limit = extent.limit
    tiles, chunks, programs = launch_shape(extent.rows, limit, _sm_count(logits.device))
    _mask_kernel[(programs,)](
        int_view(logits),
        extent.row_stride,
        bitmask,
        int(bitmask.shape[1]),
        request,
        position,
        cu_logits,
        int(cu_logits.shape[0]) - 1,
        int(vocab_size),
        limit,
        chunks,
        NINF=ninf_bits(logits.dtype),
        PACK=16 // logits.element_size(),
        BLOCK_W=BLOCK_W,
        TILES=tiles,
        num_warps=4,
    )


launch: Launcher = launcher_from(_launch)
"""``launch(logits, bitmask, request, position, cu_logits, vocab_size, mask_tail)``: the kernel on normalised
arguments (see ``maskplug.KernelBackend``), reading host metadata only (no sync, CUDA-graph safe)."""


def _is_interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every supported Triton has it
        return False
    return isinstance(_mask_kernel, InterpretedFunction)


INTERPRETED: bool = _is_interpreted()
"""Whether ``TRITON_INTERPRET=1`` was set when this module was imported."""


def kernel_fn() -> Any:
    """The ``@triton.jit`` function itself (for ahead-of-time compilation)."""
    return _mask_kernel
