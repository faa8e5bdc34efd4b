"""Everything a kernel backend needs from maskplug, in one public module.

A kernel backend (built in, or a plugin distribution such as maskplug-triton or
maskplug-cupy) implements :class:`KernelBackend`. Most do it by subclassing
:class:`BackendBase`, which answers ``unavailable_reason`` once per device
(cached, thread-safe), refuses to run where it is unavailable and otherwise
hands the normalised arguments to the backend's launcher. Around that:

* :class:`LaunchArgs`, :func:`launcher_from`: the normalised arguments as one
  record, and a seven-argument :data:`Launcher` made from a function that takes
  that record (how the bundled launchers are written);
* :data:`NINF_BITS`, :data:`INT_VIEW`, :func:`ninf_bits`, :func:`int_view`:
  the ``-inf`` bit pattern and the same-width integer view of every logits
  dtype, for kernels that store bit patterns instead of floats;
* :func:`device_index`, :func:`num_sms`, :func:`cuda_unavailable_reason`:
  the device questions every CUDA backend asks;
* :func:`import_reason`: import a backend's optional dependency once and turn a
  failure into a reason string;
* :class:`Extent`, :func:`launch_extent`: the host metadata every launcher
  derives from the normalised arguments (rows, width, the columns to touch,
  the row stride), or ``None`` when a launch has nothing to do;
* :func:`define_apply_op`: the backend's launcher as a ``torch.library`` custom
  op with a fake implementation, so ``torch.compile(fullgraph=True)`` traces a
  step that masks its logits as one opaque node.

Arguments called "normalised" are those :func:`maskplug.apply_grammar_bitmask`
passes after validating everything (see :class:`KernelBackend`).
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from ..errors import BackendUnavailable

__all__ = [
    "INT_VIEW",
    "NINF_BITS",
    "BackendBase",
    "Extent",
    "KernelBackend",
    "LaunchArgs",
    "Launcher",
    "cuda_unavailable_reason",
    "define_apply_op",
    "device_index",
    "import_reason",
    "int_view",
    "launch_extent",
    "launcher_from",
    "ninf_bits",
    "num_sms",
]

Launcher = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool], None]
"""``launch(logits, bitmask, request, position, cu_logits, vocab_size, mask_tail)`` on normalised arguments."""


class LaunchArgs(NamedTuple):
    """The normalised arguments of one apply as one record, in :data:`Launcher` order.

    A launcher that passes the arguments on (to a launch plan, to the shape
    helpers) takes this record instead of repeating the seven parameters;
    :func:`launcher_from` turns such a function into a :data:`Launcher`.
    """

    logits: torch.Tensor
    """2-D fp32/fp16/bf16, column stride 1, any row stride."""
    bitmask: torch.Tensor
    """Contiguous int32 ``(rows, words)`` on the logits device."""
    request: torch.Tensor
    """Contiguous int32 ``(rows,)``: the request of each mask row, ``-1`` for an unused row."""
    position: torch.Tensor
    """Contiguous int32 ``(rows,)``: the position of each mask row within its request."""
    cu_logits: torch.Tensor
    """Contiguous int32 ``(n + 1,)``: the active logits offsets."""
    vocab_size: int
    """Columns ``< vocab_size`` follow the bits."""
    mask_tail: bool
    """Set live rows' columns ``>= vocab_size`` to ``-inf``."""


def launcher_from(run: Callable[[LaunchArgs], None]) -> Launcher:
    """The :data:`Launcher` that calls ``run`` with its seven arguments as one :class:`LaunchArgs`.

    The launcher keeps ``run``'s name, module and docstring, so a custom op
    made from it by :func:`define_apply_op` names ``run``.
    """
    make = LaunchArgs._make  # a classmethod lookup per call would be most of the wrapper's cost

    def launch(*args: Any) -> None:
        run(make(args))

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(launch, attr, getattr(run, attr, None))
    return launch


@runtime_checkable
class KernelBackend(Protocol):
    """What a kernel plugin registers through ``maskplug_register_kernels``.

    ``apply`` receives validated, normalised arguments:

    * ``logits``: 2-D fp32/fp16/bf16, column stride 1, any row stride;
    * ``bitmask``: contiguous int32 ``(rows, words)`` on the logits device;
    * ``request``, ``position``: contiguous int32 ``(rows,)`` on the logits
      device (``request == -1`` marks an unused row);
    * ``cu_logits``: contiguous int32 ``(n + 1,)`` on the logits device;
    * ``vocab_size``: columns ``< vocab_size`` follow the bits
      (``vocab_size <= 32 * words`` and ``<= logits width``);
    * ``mask_tail``: set live rows' columns ``>= vocab_size`` to ``-inf``.

    It must write ``-inf`` exactly at the disallowed columns of live rows, change
    nothing else, apply duplicate rows as the AND of their masks, and never
    synchronise with the host on a CUDA device.
    """

    name: str
    priority: int

    def unavailable_reason(self, device: torch.device) -> str | None:
        """``None`` when the backend can run on ``device``, else why not."""
        ...

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
        """Mask ``logits`` in place."""
        ...


# ---- bit patterns -----------------------------------------------------------------------------------------

NINF_BITS: MappingProxyType[torch.dtype, int] = MappingProxyType(
    {torch.float32: -8388608, torch.float16: -1024, torch.bfloat16: -128}  # 0xFF800000, 0xFC00, 0xFF80
)
"""The bit pattern of ``-inf`` per logits dtype, as a signed integer of the element's width."""

INT_VIEW: MappingProxyType[torch.dtype, torch.dtype] = MappingProxyType(
    {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
)
"""The signed integer dtype of the same width as each logits dtype."""


def ninf_bits(dtype: torch.dtype, *, unsigned: bool = False) -> int:
    """The ``-inf`` bit pattern of ``dtype``: signed (default) or as an unsigned integer of its width."""
    bits = NINF_BITS[dtype]
    if unsigned:
        return bits & ((1 << torch.finfo(dtype).bits) - 1)
    return bits


def int_view(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` viewed as integers of the same width (same storage, strides and shape)."""
    return logits.view(INT_VIEW[logits.dtype])


# ---- launch metadata --------------------------------------------------------------------------------------


class Extent(NamedTuple):
    """What a launch covers, read from host metadata only (shapes and strides, never tensor values)."""

    rows: int
    """Mask rows (``bitmask.shape[0]``)."""
    width: int
    """Logits columns (``logits.shape[1]``)."""
    limit: int
    """Columns a live row may have written: ``width`` with ``mask_tail``, else ``vocab_size``."""
    row_stride: int
    """The logits row stride in elements; ``width`` for a one-row tensor, whose reported stride may be anything."""


def launch_extent(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int, mask_tail: bool) -> Extent | None:
    """The :class:`Extent` of a launch on normalised arguments, or ``None`` when it has nothing to mask.

    Nothing to mask: no mask rows, no logits rows, or no column to touch
    (``limit == 0``). A one-row tensor's stride is never multiplied by a row
    index above 0, so its reported stride (any value, after slicing) is
    replaced by the width. Reads no tensor value: safe inside a CUDA graph
    capture.
    """
    rows = int(bitmask.shape[0])
    width = int(logits.shape[1])
    limit = width if mask_tail else int(vocab_size)
    if rows == 0 or logits.shape[0] == 0 or limit == 0:
        return None
    row_stride = int(logits.stride(0)) if logits.shape[0] > 1 else width
    return Extent(rows, width, limit, row_stride)


# ---- devices ----------------------------------------------------------------------------------------------


def device_index(device: torch.device) -> int:
    """The CUDA device index ``device`` names (the current device when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=16)
def num_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (cached: asked on every launch)."""
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def cuda_unavailable_reason(device: torch.device) -> str | None:
    """Why no CUDA kernel can run on ``device`` (a ``cuda`` device), or ``None``."""
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    index = device_index(device)
    if index >= torch.cuda.device_count():
        return f"no CUDA device {index}: torch sees {torch.cuda.device_count()}"
    return None


def import_reason(*modules: str) -> str | None:
    """Import ``modules`` in order; ``None`` when all import, else the first failure as ``Type: message``."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # any failure is a reason, never a crash of the caller
            return f"{type(exc).__name__}: {exc}"
    return None


# ---- the backend base -------------------------------------------------------------------------------------


class BackendBase:
    """A :class:`KernelBackend` with a cached availability check.

    Subclasses set ``name`` and ``priority`` and implement :meth:`probe` (why
    the backend cannot run on a device, or ``None``) and :meth:`launcher` (the
    function that masks, for a device ``probe`` accepted). ``probe`` runs once
    per device, under a lock, so it may import, compile or load kernels; the
    answer cannot change within a process.
    """

    name: str
    priority: int

    def __init__(self) -> None:
        self._reasons_lock = threading.Lock()
        self._reasons: dict[torch.device, str | None] = {}

    def probe(self, device: torch.device) -> str | None:
        """``None`` when the backend can run on ``device``, else the precise reason (uncached)."""
        raise NotImplementedError

    def launcher(self, device: torch.device) -> Launcher:
        """The function that masks logits on ``device`` (called only after ``probe`` accepted it)."""
        raise NotImplementedError

    def unavailable_reason(self, device: torch.device) -> str | None:
        """``None`` when the backend can run on ``device``, else the precise reason (cached per device)."""
        # Keyed by the device itself: asked on every apply, and hashing a
        # torch.device is several times cheaper than reading its type and index.
        try:
            return self._reasons[device]
        except KeyError:
            pass
        with self._reasons_lock:
            if device not in self._reasons:
                self._reasons[device] = self.probe(device)
            return self._reasons[device]

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
        """Mask ``logits`` in place (normalised arguments, see :class:`KernelBackend`).

        Raises :class:`maskplug.BackendUnavailable` with the reason, writing
        nothing, where the backend cannot run on the logits device.
        """
        device = logits.device
        why = self.unavailable_reason(device)
        if why is not None:
            raise BackendUnavailable(f"backend: {self.name!r} cannot run on {device}: {why}")
        self.launcher(device)(logits, bitmask, request, position, cu_logits, vocab_size, mask_tail)


# ---- custom ops -------------------------------------------------------------------------------------------


def _fake_apply(*args: Any) -> None:
    """The fake implementation of every ``apply_bitmask`` op: shapes never change and nothing is returned."""
    return None


def define_apply_op(library: str, launch: Launcher, *, cuda_only: bool = False) -> Any:
    """Register ``torch.ops.<library>.apply_bitmask`` running ``launch``, with a fake implementation.

    The op mutates ``logits`` in place and returns nothing; the fake
    implementation says exactly that, which is all ``torch.compile`` needs to
    trace a step that calls it. ``cuda_only`` refuses tensors on other devices
    with :class:`maskplug.BackendUnavailable` (for kernels that cannot run
    anywhere else). Returns the op (a ``torch.library.CustomOpDef``).
    """
    qualname = f"{library}::apply_bitmask"

    def apply_bitmask(
        logits: torch.Tensor,
        bitmask: torch.Tensor,
        request: torch.Tensor,
        position: torch.Tensor,
        cu_logits: torch.Tensor,
        vocab_size: int,
        mask_tail: bool,
    ) -> None:
        if cuda_only and logits.device.type != "cuda":
            raise BackendUnavailable(f"logits: {qualname} runs on CUDA tensors, got a tensor on {logits.device}")
        launch(logits, bitmask, request, position, cu_logits, vocab_size, mask_tail)

    apply_bitmask.__doc__ = f"Mask ``logits`` in place with ``{launch.__module__}.{launch.__name__}``."
    op = torch.library.custom_op(qualname, mutates_args=("logits",))(apply_bitmask)

    op.register_fake(_fake_apply)
    return op
