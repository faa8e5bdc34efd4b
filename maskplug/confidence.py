"""The confidence pipeline: device-side draft confidences, host copies two steps old.

A confidence-scheduled budget (``docs/design.md``, "Confidences across
steps") is chosen on the host *before* a step runs, while the drafter's
confidences for that step (and, with asynchronous scheduling, for the previous
one) are still being computed on the device. Waiting for them would stall the engine, so the budget reads the
confidences recorded two steps earlier, and only the device-side allocation
sees the live ones.

:class:`ConfidenceHistory` keeps that bookkeeping in one place:

* the latest confidences of every request *slot* (the engine's persistent
  per-request index, stable while batch order changes) live on the device;
* each :meth:`~ConfidenceHistory.record` scatters the step's live confidences
  into those slots and starts a copy of the whole table into one of two host
  buffers (double buffering: step ``t`` writes buffer ``t % 2``, so the buffer
  step ``t + 1`` is writing is never the one read);
* :meth:`~ConfidenceHistory.stale` at step ``t`` returns the rows recorded at
  step ``t − 2``. On CUDA it waits only for the event recorded after *that*
  copy, never for the current step's work; on the CPU the copies are plain
  synchronous copies and no waiting is needed;
* :meth:`~ConfidenceHistory.reset` marks slots taken by new requests: until a
  recording made after the reset is two steps old, those slots read as
  confidence 1 (a new request is assumed to draft well; the live allocation
  corrects the guess at once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ._checks import check_unit_interval, host_int, host_ints
from .errors import BudgetError, LayoutError

__all__ = ["ConfidenceHistory"]

# How many steps old the host copy is: the budget of step t reads step t-2.
_LAG = 2
# The most cells (slots × drafts) a history holds: 256 MiB of float32 per copy.
_MAX_CELLS = 1 << 26


def _as_slots(slots: Any, num_slots: int, arg: str = "slots") -> npt.NDArray[np.int64]:
    if num_slots == 0:
        arr = host_ints(arg, slots, LayoutError, expected="slot indices in [0, 0)")
        if arr.size:
            raise LayoutError(f"{arg}: expected slot indices in [0, 0), got {int(arr[0])}")
        return arr
    arr = host_ints(arg, slots, LayoutError, hi=num_slots - 1, expected=f"slot indices in [0, {num_slots})")
    if arr.size > 1 and np.unique(arr).size != arr.size:
        s = np.sort(arr)
        raise LayoutError(f"{arg}: expected unique slots, got {int(s[1:][s[1:] == s[:-1]][0])} twice")
    return arr


class ConfidenceHistory:
    """Per-slot draft confidences on the device, with host copies exactly two steps old.

    Args:
        num_slots: request slots the engine can hold at once (rows of the table).
        max_drafts: the most drafts any request gets per step (columns).
        device: where the live confidences are produced (``"cpu"`` or a CUDA device).

    Typical use, once per engine step::

        hist.reset(new_slots)                       # requests that joined this step
        stale = hist.stale(slots)                   # host, recorded two steps ago
        decision = scheduler.budget(StepView(layout, cost, confidences=stale, ...))
        ...                                         # drafter produces live confidences
        capacity = allocate(live, num_drafts, decision.budget)
        hist.record(slots, live)                    # ends the step

    The step counter advances on every :meth:`record`. Values are float32 on
    the device; the host copy is float64.
    """

    def __init__(self, num_slots: int, max_drafts: int, device: str | torch.device = "cpu") -> None:
        num_slots = host_int("num_slots", num_slots, BudgetError)
        max_drafts = host_int("max_drafts", max_drafts, BudgetError)
        if num_slots * max_drafts > _MAX_CELLS:  # the table and its two host copies: a size check, not a MemoryError
            raise BudgetError(
                f"max_drafts: expected num_slots × max_drafts <= {_MAX_CELLS}, got {num_slots} × {max_drafts}"
            )
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise BudgetError(f"device: expected a torch device, got {device!r}") from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise BudgetError(f"device: expected an available device, got {dev} but CUDA is not available")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.num_slots = int(num_slots)
        self.max_drafts = int(max_drafts)
        self.device = dev
        self._cuda = dev.type == "cuda"
        shape = (self.num_slots, self.max_drafts)
        self._table = torch.ones(shape, dtype=torch.float32, device=dev)
        # Two host buffers; pinned on CUDA so the device-to-host copy is truly asynchronous.
        self._host = [torch.ones(shape, dtype=torch.float32, pin_memory=self._cuda) for _ in range(_LAG)]
        self._events: list[Any] = [None] * _LAG
        # Step at which each buffer was written (-1: never), and the step each
        # slot was last reset at: a recording older than the reset belongs to
        # the slot's previous occupant.
        self._written_at = [-1] * _LAG
        self._reset_at = np.full(self.num_slots, -1, dtype=np.int64)
        self._step = 0

    def _index(self, idx: npt.NDArray[np.int64]) -> torch.Tensor:
        t = torch.from_numpy(idx)
        if self._cuda:
            # A pageable host-to-device copy would synchronise the stream;
            # a pinned one is queued like any kernel.
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    @property
    def step(self) -> int:
        """The current step: the number of :meth:`record` calls so far."""
        return self._step

    def reset(self, slots: Sequence[int] | npt.NDArray[Any] | torch.Tensor) -> None:
        """Mark ``slots`` as taken by new requests: they read as confidence 1 until their own data is old enough."""
        idx = _as_slots(slots, self.num_slots)
        if idx.size == 0:
            return
        self._reset_at[idx] = self._step
        # The device row too, so a later recording that does not cover this
        # slot (a prefill step, no drafts) carries 1s rather than old values.
        self._table.index_fill_(0, self._index(idx), 1.0)

    def record(self, slots: Sequence[int] | npt.NDArray[Any] | torch.Tensor, confidences: torch.Tensor) -> None:
        """Store this step's live confidences for ``slots`` and start the host copy; ends the step.

        ``confidences`` is a floating tensor of shape ``(len(slots), k)`` with
        ``k <= max_drafts`` on this history's device; columns past ``k`` are
        set to 1 (no data yet, treated like a new request). No host sync.

        Every value must be a probability in ``[0, 1]``: on the CPU a NaN or
        an out-of-range value raises :class:`BudgetError` and nothing is
        recorded; a CUDA tensor is not read here (that would be a host sync),
        so its values are checked when :meth:`stale` reads them back.
        """
        idx = _as_slots(slots, self.num_slots)
        if not isinstance(confidences, torch.Tensor) or confidences.ndim != 2 or not confidences.is_floating_point():
            got = f"{type(confidences).__name__} {getattr(confidences, 'dtype', '')} {tuple(getattr(confidences, 'shape', ()))}"
            raise BudgetError(f"confidences: expected a 2-D floating tensor (len(slots), k), got {got}")
        if confidences.shape[0] != idx.shape[0] or confidences.shape[1] > self.max_drafts:
            raise BudgetError(
                f"confidences: expected shape ({idx.shape[0]}, <= {self.max_drafts}), got {tuple(confidences.shape)}"
            )
        if confidences.device != self.device:
            raise BudgetError(f"confidences: expected a tensor on {self.device}, got one on {confidences.device}")
        if not self._cuda and confidences.numel():
            vals = confidences.detach()
            if vals.dtype not in (torch.float32, torch.float64):
                vals = vals.float()
            check_unit_interval("confidences", vals.numpy(), BudgetError)
        if idx.size:
            rows = torch.ones((idx.shape[0], self.max_drafts), dtype=torch.float32, device=self.device)
            rows[:, : confidences.shape[1]] = confidences
            self._table.index_copy_(0, self._index(idx), rows)
        buf = self._step % _LAG
        if self._cuda:
            # Stream order puts this copy after the one of step t-2 into the
            # same buffer, and stale() already copied that one out.
            self._host[buf].copy_(self._table, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self._events[buf] = ev
        else:
            self._host[buf].copy_(self._table)
        self._written_at[buf] = self._step
        self._step += 1

    def stale(
        self, slots: Sequence[int] | npt.NDArray[Any] | torch.Tensor, num_columns: int | None = None
    ) -> npt.NDArray[np.float64]:
        """Host confidences of ``slots`` as recorded two steps ago (a fresh float64 array).

        Rows of slots reset after that recording, and everything before the
        first two recordings, read as 1. ``num_columns`` (default
        ``max_drafts``) trims the columns. Waits at most for the copy made
        two steps ago, never for the current step.
        """
        idx = _as_slots(slots, self.num_slots)
        cols = (
            self.max_drafts
            if num_columns is None
            else host_int("num_columns", num_columns, BudgetError, hi=self.max_drafts)
        )
        want = self._step - _LAG
        out = np.ones((idx.shape[0], int(cols)), dtype=np.float64)
        if want < 0 or idx.size == 0:
            return out
        buf = want % _LAG
        if self._written_at[buf] != want:  # pragma: no cover - guarded by the step counter
            raise BudgetError(f"internal: host buffer holds step {self._written_at[buf]}, expected {want}")
        ev = self._events[buf]
        if ev is not None:
            ev.synchronize()
        host = self._host[buf].numpy()
        fresh = self._reset_at[idx] <= want
        out[fresh] = host[idx[fresh], : int(cols)]
        if self._cuda:
            # Recorded on the device without being read: checked now that the host has them.
            check_unit_interval("confidences", out, BudgetError)
        return out
