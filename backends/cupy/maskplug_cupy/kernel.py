"""Host side of the CUDA C kernel in ``kernel.cu``: launch plan, compilation, launch.

The plan (:func:`plan_launch`) is pure host arithmetic on shapes, strides and
data pointers, so it is tested on machines without a GPU; :func:`launch` adds
only the CuPy calls. CuPy compiles the source with NVRTC on first use (and
caches the binary on disk), then launches it on the caller's current torch
stream through the driver, so the launch neither synchronises nor breaks CUDA
graph capture.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np
import torch

from maskplug.kernels.sdk import LaunchArgs, Launcher, device_index, launch_extent, launcher_from, ninf_bits, num_sms

__all__ = [
    "ARG_NAMES",
    "BLOCK",
    "KERNELS",
    "MAX_ITERS",
    "LaunchPlan",
    "cuda_source",
    "launch",
    "load_functions",
    "plan_launch",
]

BLOCK = 256  # threads per block (the kernels' __launch_bounds__)
MAX_ITERS = 16  # packs per thread for large batches
_BLOCKS_PER_SM = 8  # 8 × 256 threads fill an SM; fewer leave the row-lookup latency exposed

KERNELS = {4: "maskplug_mask_b32", 2: "maskplug_mask_b16"}
"""Kernel name per element size in bytes."""

ARG_NAMES = (
    "logits",
    "row_stride",
    "bitmask",
    "words",
    "request",
    "position",
    "cu",
    "num_requests",
    "vocab_size",
    "limit",
    "chunks_per_row",
    "packs_per_chunk",
    "aligned",
    "ninf",
)
"""The kernels' parameters, in order (``kernel.cu``)."""


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one launch needs; ``args`` follow :data:`ARG_NAMES`.

    Pointers travel as ``numpy.uint64`` and the 64-bit stride as
    ``numpy.int64``: CuPy passes a NumPy scalar by value with its own width,
    which is the width of the kernel parameter it fills.
    """

    kernel: str
    grid: int
    block: int
    pack: int  # columns per 16-byte pack
    chunks_per_row: int
    packs_per_chunk: int
    aligned: bool
    args: tuple[np.generic, ...]


def plan_launch(args: LaunchArgs, num_sms: int) -> LaunchPlan | None:
    """The launch for normalised arguments (see ``maskplug.KernelBackend``); ``None`` when nothing is to do.

    Chunking: start from ``MAX_ITERS`` packs per thread and halve while the
    grid would give fewer than ``8 × num_sms`` blocks, so a single decode row
    is spread over the whole card and large batches amortise the row lookup.
    """
    logits, bitmask, request, position, cu_logits, vocab_size, mask_tail = args
    extent = launch_extent(logits, bitmask, vocab_size, mask_tail)
    if extent is None:
        return None
    rows, limit, row_stride = extent.rows, extent.limit, extent.row_stride
    esize = logits.element_size()
    pack = 16 // esize
    packs_per_row = -(-limit // pack)
    block = BLOCK if packs_per_row >= BLOCK else max(32, -(-packs_per_row // 32) * 32)
    target = _BLOCKS_PER_SM * max(num_sms, 1)
    iters = MAX_ITERS
    while iters > 1 and rows * -(-packs_per_row // (block * iters)) < target:
        iters //= 2
    iters = min(iters, 1 << (-(-packs_per_row // block) - 1).bit_length())  # never more than a row needs
    packs_per_chunk = block * iters
    chunks = -(-packs_per_row // packs_per_chunk)
    aligned = logits.data_ptr() % 16 == 0 and (row_stride * esize) % 16 == 0
    params: tuple[np.generic, ...] = (
        np.uint64(logits.data_ptr()),
        np.int64(row_stride),
        np.uint64(bitmask.data_ptr()),
        np.int32(bitmask.shape[1]),
        np.uint64(request.data_ptr()),
        np.uint64(position.data_ptr()),
        np.uint64(cu_logits.data_ptr()),
        np.int32(cu_logits.shape[0] - 1),
        np.int32(vocab_size),
        np.int32(limit),
        np.int32(chunks),
        np.int32(packs_per_chunk),
        np.int32(1 if aligned else 0),
        np.uint32(ninf_bits(logits.dtype, unsigned=True)),
    )
    return LaunchPlan(KERNELS[esize], rows * chunks, block, pack, chunks, packs_per_chunk, aligned, params)


def cuda_source() -> str:
    """The CUDA C source of both kernels."""
    return resources.files("maskplug_cupy").joinpath("kernel.cu").read_text(encoding="utf-8")


_lock = threading.Lock()
_functions: dict[int, dict[str, Any]] = {}


def load_functions(index: int) -> dict[str, Any]:
    """Compile (NVRTC, through CuPy, cached on disk) and load both kernels on CUDA device ``index``."""
    fns = _functions.get(index)
    if fns is None:
        with _lock:
            fns = _functions.get(index)
            if fns is None:
                import cupy

                with cupy.cuda.Device(index):
                    module = cupy.RawModule(code=cuda_source(), options=("--std=c++17",))
                    module.compile()  # NVRTC errors surface here, as the backend's unavailability reason
                    fns = {name: module.get_function(name) for name in KERNELS.values()}
                    for fn in fns.values():
                        _ = fn.num_regs  # forces compile + load now, not inside a later graph capture
                _functions[index] = fns
    return fns


class _StreamRef:
    """A foreign stream handle in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


@functools.lru_cache(maxsize=64)
def _cupy_stream(ptr: int, index: int) -> Any:
    """A CuPy view of torch's stream ``ptr`` (cached: streams outlive many launches)."""
    import cupy

    if ptr == 0:
        return cupy.cuda.Stream.null
    if hasattr(cupy.cuda.Stream, "from_external"):
        try:
            return cupy.cuda.Stream.from_external(_StreamRef(ptr))
        except (TypeError, ValueError):
            pass  # a CuPy whose protocol check differs: the older wrapper still works
    return cupy.cuda.ExternalStream(ptr, index)


def _launch(args: LaunchArgs) -> None:
    """Launch on the current torch stream of ``logits``' device (normalised arguments)."""
    import cupy

    index = device_index(args.logits.device)
    plan = plan_launch(args, num_sms(index))
    if plan is None:
        return
    fn = load_functions(index)[plan.kernel]
    stream = _cupy_stream(int(torch.cuda.current_stream(index).cuda_stream), index)
    with cupy.cuda.Device(index), stream:
        fn((plan.grid,), (plan.block,), plan.args)


launch: Launcher = launcher_from(_launch)
"""``launch(logits, bitmask, request, position, cu_logits, vocab_size, mask_tail)``: launch on the current
torch stream of ``logits``' device (normalised arguments, see ``maskplug.KernelBackend``)."""
