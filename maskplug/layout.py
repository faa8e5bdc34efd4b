"""The scheduled layout, the producer layout and the row mapping.

maskplug's rule: the mapping from mask rows to (request, position) is built from
the **scheduled** layout only. Compaction never rewrites it; the active layout
(``cu_logits``) only decides, at apply time, which mapped rows are live.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

from ._checks import INT32_MAX, host_int, host_ints
from .errors import LayoutError

__all__ = ["GrammarRows", "RowMapping", "ScheduledLayout"]

IntArray = npt.NDArray[np.int64]


def _as_counts(name: str, values: Any, n: int | None = None) -> IntArray:
    """Per-request counts: integers in ``[0, 2**31 - 1]`` (whole-number floats accepted), one per request.

    Always an array of the layout's own: the checks hand an int64 array or a
    host int64 tensor on as it is, and a layout that kept the caller's buffer
    would change when the engine refills it (while ``total_drafts`` and
    ``cu_scheduled``, computed once, would not).
    """
    out = host_ints(name, values, LayoutError, n=n, integral_floats=True)
    # A fresh array (converted from a list, or from another dtype) has no base and is not the input.
    if out is values or out.base is not None:
        out = out.copy()
    return out


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value it holds, so messages show ``7``, not ``np.int64(7)``."""
    return value.item() if isinstance(value, np.generic) else value


def _id_list(name: str, ids: Any) -> list[Any]:
    """Request ids as a Python list of hashable values.

    Ids are matched with a dict, not by sorting a numpy array: converting a
    list of strings to a numpy array costs more than the whole lookup, and a
    dict keeps ``"1"`` and ``1`` apart where a numpy array would not.
    """
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise LayoutError(f"{name}: expected a 1-D sequence of request ids, got shape {ids.shape}")
        return ids.tolist()  # type: ignore[no-any-return]
    if hasattr(ids, "device"):  # a tensor: ids are host data
        if str(ids.device) != "cpu" or ids.ndim != 1:
            raise LayoutError(f"{name}: expected a 1-D host sequence of request ids, got {ids.ndim}-D on {ids.device}")
        return ids.tolist()  # type: ignore[no-any-return]
    try:
        out = list(ids)
    except TypeError as exc:
        raise LayoutError(f"{name}: expected a 1-D sequence of request ids, got {type(ids).__name__}") from exc
    return out


def _id_array(ids: list[Any]) -> npt.NDArray[Any]:
    """``ids`` as a 1-D numpy array, one element per id (object dtype when ids are tuples)."""
    arr = np.asarray(ids)
    if arr.ndim != 1:  # e.g. tuple ids: keep one object per request
        arr = np.empty(len(ids), dtype=object)
        arr[:] = ids
    return arr


def _first_duplicate(ids: list[Any]) -> Any:
    seen: set[Any] = set()
    for x in ids:
        if x in seen:
            return x
        seen.add(x)
    return None  # pragma: no cover - only called when a duplicate exists


def _unhashable(name: str, ids: list[Any], exc: TypeError) -> LayoutError:
    bad = next((x for x in ids if not isinstance(x, Hashable)), None)
    return LayoutError(f"{name}: expected a 1-D sequence of hashable request ids, got {type(bad).__name__} {bad!r}")


class ScheduledLayout:
    """What the scheduler scheduled this step, in batch order.

    Args:
        req_ids: one unique id per request (ints or strings), in batch order.
        num_drafts: drafts scheduled per request (0 for prefill chunks and
            plain decodes).
        num_non_draft: scheduled tokens per request that are not drafts (1 for
            a decode, the chunk length for a prefill).
        num_bonus: logits rows every request gets besides its drafts.

    Counts may be sequences, numpy arrays or host tensors (``num_bonus`` an
    int or a 0-d tensor), each a whole number in ``[0, 2**31 - 1]``; all
    forms go through the same checks, so sums never wrap.
    """

    __slots__ = (
        "_ids",
        "_index",
        "_req_ids",
        "cu_scheduled",
        "num_bonus",
        "num_drafts",
        "num_non_draft",
        "total_drafts",
    )

    def __init__(
        self,
        req_ids: Sequence[Any] | npt.NDArray[Any],
        num_drafts: Sequence[int] | npt.NDArray[Any] | torch.Tensor,
        num_non_draft: Sequence[int] | npt.NDArray[Any] | torch.Tensor,
        num_bonus: int | np.integer[Any] | torch.Tensor = 1,
    ) -> None:
        ids = _id_list("req_ids", req_ids)
        n = len(ids)
        try:
            index = dict(zip(ids, range(n), strict=True))
        except TypeError as exc:
            raise _unhashable("req_ids", ids, exc) from exc
        if len(index) != n:
            raise LayoutError(f"req_ids: expected unique ids, got {_plain(_first_duplicate(ids))!r} twice")
        self.num_drafts = _as_counts("num_drafts", num_drafts, n)
        self.num_non_draft = _as_counts("num_non_draft", num_non_draft, n)
        self.num_bonus = host_int("num_bonus", num_bonus, LayoutError)
        self._ids = ids
        self._index = index
        self._req_ids: npt.NDArray[Any] | None = req_ids if isinstance(req_ids, np.ndarray) else None
        #: Drafts scheduled this step, ``Σ num_drafts``: the largest budget.
        self.total_drafts = int(self.num_drafts.sum())
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.num_drafts + self.num_bonus, out=cu[1:])
        self.cu_scheduled = cu

    def _with_counts(
        self,
        num_drafts: IntArray,
        num_non_draft: IntArray,
        total_drafts: int,
        cu_scheduled: IntArray,
    ) -> ScheduledLayout:
        """A layout of the same requests (sharing this one's id index) with counts the caller already checked.

        For maskplug's own callers that checked the counts the constructor's way
        (:class:`~maskplug.StepPlanner`): nothing is validated or copied.
        ``num_drafts`` and ``num_non_draft`` must be 1-D int64 arrays of
        ``n`` values in ``[0, 2**31 - 1]``, ``total_drafts`` their draft sum
        and ``cu_scheduled`` ``[0, cumsum(num_drafts + num_bonus)]``, all of
        them the new layout's own (no other holder writes into them).
        """
        out = ScheduledLayout.__new__(ScheduledLayout)
        out._ids = self._ids
        out._index = self._index
        out._req_ids = self._req_ids
        out.num_drafts = num_drafts
        out.num_non_draft = num_non_draft
        out.num_bonus = self.num_bonus
        out.total_drafts = total_drafts
        out.cu_scheduled = cu_scheduled
        return out

    @property
    def req_ids(self) -> npt.NDArray[Any]:
        """The request ids in batch order, as a 1-D numpy array (built on first use)."""
        if self._req_ids is None:
            self._req_ids = _id_array(self._ids)
        return self._req_ids

    @property
    def n(self) -> int:
        """Number of requests in the batch."""
        return len(self._ids)

    @property
    def num_tokens(self) -> int:
        """Scheduled tokens this step, drafts included."""
        return int(self.num_drafts.sum() + self.num_non_draft.sum())

    def index_of(self, req_id: Any) -> int:
        """Batch index of one request id; :class:`LayoutError` if unknown."""
        return int(self.indices_of([req_id])[0])

    def indices_of(self, req_ids: Sequence[Any] | npt.NDArray[Any], arg: str = "req_ids") -> IntArray:
        """Batch indices of many request ids at once; :class:`LayoutError` names the first unknown one."""
        q = _id_list(arg, req_ids)
        try:
            return np.fromiter(map(self._index.__getitem__, q), dtype=np.int64, count=len(q))
        except KeyError as exc:
            empty = " (the batch is empty)" if self.n == 0 else ""
            raise LayoutError(
                f"{arg}: expected ids of the layout, got unknown request id {_plain(exc.args[0])!r}{empty}"
            ) from None
        except TypeError as exc:
            raise _unhashable(arg, q, exc) from exc

    def __repr__(self) -> str:
        return f"ScheduledLayout(n={self.n}, num_drafts={self.num_drafts.tolist()}, num_bonus={self.num_bonus})"


@dataclass(frozen=True)
class RowMapping:
    """For each bitmask row ``i``: the batch request ``request[i]`` and its position ``position[i]``.

    ``request == -1`` marks an unused row (fixed-stride padding); such a row is
    never applied. ``len(mapping)`` always equals the number of bitmask rows.
    """

    request: npt.NDArray[np.int32]
    position: npt.NDArray[np.int32]

    @classmethod
    def _checked(cls, request: npt.NDArray[np.int32], position: npt.NDArray[np.int32], needs: int) -> RowMapping:
        """A mapping built by maskplug from a checked layout, marked so that the apply trusts it.

        ``request`` and ``position`` are C-contiguous int32 arrays of equal
        length no one else holds, with every ``request`` in ``[-1, needs)`` and
        every ``position`` of a used row ``>= 0``. The mapping shows read-only
        views of them (so the values the apply skips checking cannot change
        afterwards) and records ``needs``, the fewest requests its offsets must
        cover.
        """
        out = cls.__new__(cls)
        views = []
        for arr in (request, position):
            view = arr.view()
            view.flags.writeable = False
            views.append(view)
        object.__setattr__(out, "request", views[0])
        object.__setattr__(out, "position", views[1])
        object.__setattr__(out, "_needs", needs)
        object.__setattr__(out, "_owners", (request, position))
        return out

    def _trusted_needs(self) -> int | None:
        """The fewest requests the offsets must cover when the values need no check, else ``None``.

        Only a mapping from :meth:`_checked` whose arrays are still its own
        read-only views qualifies.
        """
        needs: int | None = self.__dict__.get("_needs")
        if needs is None or self.request.flags.writeable or self.position.flags.writeable:
            return None
        return needs

    def _lists(self) -> tuple[list[int], list[int]]:
        """``request`` and ``position`` as Python lists (made once; checked mappings only, whose values cannot change)."""
        t: tuple[list[int], list[int]] | None = self.__dict__.get("_host_lists")
        if t is None:
            t = (self.request.tolist(), self.position.tolist())
            object.__setattr__(self, "_host_lists", t)
        return t

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``request`` and ``position`` as host int32 tensors over the same memory (made once; checked mappings only)."""
        t: tuple[torch.Tensor, torch.Tensor] | None = self.__dict__.get("_host_tensors")
        if t is None:
            import torch

            # Over the writable owners: torch warns about tensors over read-only memory.
            owners = self.__dict__["_owners"]
            t = (torch.from_numpy(owners[0]), torch.from_numpy(owners[1]))
            object.__setattr__(self, "_host_tensors", t)
        return t

    def __post_init__(self) -> None:
        for name in ("request", "position"):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != np.int32:
                got = f"{type(arr).__name__} {getattr(arr, 'dtype', '')} {getattr(arr, 'shape', '')}"
                raise LayoutError(f"mapping.{name}: expected a 1-D int32 numpy array, got {got}")
        if self.request.shape != self.position.shape:
            raise LayoutError(
                f"mapping: expected request and position of equal length, got {self.request.shape[0]} "
                f"and {self.position.shape[0]}"
            )

    def __len__(self) -> int:
        return int(self.request.shape[0])


class GrammarRows:
    """How the producer emitted mask rows.

    Args:
        grammar_req_ids: the grammar requests, in the order the producer
            visited them (may differ from batch order; requests without a
            grammar are simply absent).
        mode: ``"ragged"`` — ``num_drafts[r] + num_bonus`` rows per grammar
            request; ``"fixed"`` — ``stride`` rows per grammar request, the
            rows past ``num_drafts[r] + num_bonus`` unused.
        stride: rows per grammar request in fixed mode.
    """

    def __init__(
        self,
        grammar_req_ids: Sequence[Any] | npt.NDArray[Any],
        mode: Literal["ragged", "fixed"] = "ragged",
        stride: int | None = None,
    ) -> None:
        if mode not in ("ragged", "fixed"):
            raise LayoutError(f"mode: expected 'ragged' or 'fixed', got {mode!r}")
        if mode == "fixed":
            if stride is None:
                raise LayoutError("stride: expected an int >= 1 in fixed mode, got None")
            stride = host_int("stride", stride, LayoutError, lo=1)
        elif stride is not None:
            raise LayoutError(
                f"stride: expected None in ragged mode (a stride is only meaningful in fixed mode), got {stride!r}"
            )
        ids = _id_list("grammar_req_ids", grammar_req_ids)
        try:
            unique = len(set(ids)) == len(ids)
        except TypeError as exc:
            raise _unhashable("grammar_req_ids", ids, exc) from exc
        if not unique:
            raise LayoutError(f"grammar_req_ids: expected unique ids, got {_plain(_first_duplicate(ids))!r} twice")
        self._ids = ids
        self._arr: npt.NDArray[Any] | None = grammar_req_ids if isinstance(grammar_req_ids, np.ndarray) else None
        self.mode = mode
        self.stride = None if stride is None else int(stride)

    @property
    def grammar_req_ids(self) -> npt.NDArray[Any]:
        """The grammar requests in producer order, as a 1-D numpy array (built on first use)."""
        if self._arr is None:
            self._arr = _id_array(self._ids)
        return self._arr

    def batch_indices(self, layout: ScheduledLayout) -> IntArray:
        """Batch index of each grammar request, in grammar order."""
        if not isinstance(layout, ScheduledLayout):
            raise LayoutError(f"layout: expected a ScheduledLayout, got {type(layout).__name__}")
        return layout.indices_of(self._ids, "grammar_req_ids")

    def _rows(self, layout: ScheduledLayout, idx: IntArray) -> IntArray:
        need = layout.num_drafts[idx] + layout.num_bonus
        if self.mode == "ragged":
            return need
        assert self.stride is not None
        if need.size and int(need.max()) > self.stride:
            g = int(np.argmax(need > self.stride))
            raise LayoutError(
                f"stride: expected >= num_drafts + num_bonus of every grammar request, got stride "
                f"{self.stride} but request {_plain(self._ids[g])!r} needs {int(need[g])} rows"
            )
        return np.full(idx.shape[0], self.stride, dtype=np.int64)

    def rows_per_request(self, layout: ScheduledLayout) -> IntArray:
        """Rows the producer emits per grammar request, in grammar order."""
        return self._rows(layout, self.batch_indices(layout))

    def num_rows(self, layout: ScheduledLayout) -> int:
        """Bitmask rows the producer emits for this layout."""
        return int(self.rows_per_request(layout).sum())

    def mapping(self, layout: ScheduledLayout) -> RowMapping:
        """Row → (request, position), built from the scheduled layout only (vectorised; arrays read-only)."""
        idx = self.batch_indices(layout)
        return self._mapping_at(layout, idx, idx.astype(np.int32))

    def _mapping_at(
        self,
        layout: ScheduledLayout,
        idx: IntArray,
        idx32: npt.NDArray[np.int32],
        rows: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.bool_]] | None = None,
        needs: int | None = None,
        most_rows: int | None = None,
    ) -> RowMapping:
        """:meth:`mapping` once the grammar requests' batch indices ``idx`` (and as int32, ``idx32``) are known.

        For a caller that maps the same grammar requests step after step
        (:class:`~maskplug.StepPlanner`), which may also pass:

        * ``rows``: ``(request, position, mask)``; the tables of shape
          ``(len(idx), ≥ w)``, row ``i`` all ``idx[i]`` and ``0, 1, ...``, and
          ``mask`` of shape ``(n, w)`` in batch order, ``mask[r, p]`` whether
          ``p < num_drafts[r] + num_bonus``. Ragged rows are then picked with one
          mask (a third of the time of the two repeats below at 8 requests,
          about the same at 1024);
        * ``needs``: ``max(idx) + 1`` (0 when empty);
        * ``most_rows``: a bound on the rows (the batch's drafts plus its bonus
          rows); at most ``2**31 - 1``, the rows need not be counted.
        """
        ragged = self.mode == "ragged"
        if needs is None:
            needs = int(idx.max()) + 1 if idx.size else 0
        if rows is not None and ragged and most_rows is not None and most_rows <= INT32_MAX:
            req_t, pos_t, mask = rows
            w = mask.shape[1]
            keep = mask[idx]
            return RowMapping._checked(req_t[:, :w][keep], pos_t[:, :w][keep], needs)
        per = self._rows(layout, idx)
        total = int(per.sum())
        if total > INT32_MAX:
            raise LayoutError(f"layout: expected at most 2**31 - 1 mask rows (int32 row indices), got {total}")
        # Each row's position is its index minus the first row of its request.
        starts = np.zeros(per.shape[0], dtype=np.int32)
        if per.shape[0] > 1:
            np.cumsum(per[:-1], out=starts[1:])
        request = np.repeat(idx32, per)
        position = np.arange(total, dtype=np.int32)
        position -= np.repeat(starts, per)
        if self.mode == "fixed":
            unused = position >= np.repeat((layout.num_drafts[idx] + layout.num_bonus).astype(np.int32), per)
            request[unused] = -1
            position[unused] = -1
        return RowMapping._checked(request, position, needs)

    def __repr__(self) -> str:
        return f"GrammarRows({self.grammar_req_ids.tolist()!r}, mode={self.mode!r}, stride={self.stride})"
