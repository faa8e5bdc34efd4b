"""Producing the mask rows of a speculative step, and committing after verification.

:func:`fill_draft_masks` walks every grammar request's drafts once, writing row
``p`` = the grammar's mask after accepting drafts ``0..p-1``, then rolls the
matchers back to where they started. Matchers whose batch operations offer
``fill_chains`` (below) hand over every request's whole draft chain in one
call; matchers with plain batch operations (:class:`~maskplug.grammar.BatchOps`)
are advanced position by position, all requests of one provider in one call
per position; the others run one request at a time, on a thread pool when
their engine releases the GIL.

The optional chain operation, ``batch_ops.fill_chains(matchers, bitmask,
rows, drafts, threads=n) -> list[int]``: for each live (not terminated)
matcher ``i``, starting from its current state, row ``rows[i] + p`` is the
mask after accepting ``drafts[i][:p]``, for every ``p`` up to the number of
drafts it accepts, ``a_i``, which it returns. The walk stops at the first
draft the matcher refuses (that draft's row is written, later ones are not)
and after an accepted stop token (``a_i`` counts it; row ``rows[i] + a_i`` is
not written). Matchers end in the state they started in, also on error. It
lets an engine do in one native call (or without touching the matcher's
state at all) what the generic walk does with one Python call per row.

Fault isolation. A request fails alone (see :func:`fill_draft_masks` and
:attr:`~maskplug.DraftMasks.failed`); what the walks rely on to keep the
others exact:

* a batch or chain operation that raises is not told apart by request: all
  the requests of that call are walked again one at a time (the generic
  walk, on the calling thread), so only a request whose own walk raises
  fails. The cost falls on that step only: one Python call per row and per
  draft for those requests instead of one call for all of them;
* ``fill_chains`` leaves its matchers where they started, also when it
  raises (its contract above), so they are walked again from there;
* a batch ``accept`` or ``rollback`` that raises is taken to have moved
  none of its matchers, except where a matcher keeps its own count
  (``num_accepted``, as the SDK's matchers on llguidance and outlines-core
  do): then the undo is what the count says it moved. An engine that moves
  some matchers before raising and keeps no count cannot be put back
  exactly; the request whose rollback then raises fails, saying so;
* rows a failing operation wrote are overwritten: by the requests' own
  walks, by the all-allowed rows, and by the stop-only rows of the failed
  requests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt
import torch

from ..draftmasks import DraftMasks
from ..errors import GrammarError, LayoutError
from ..layout import GrammarRows, ScheduledLayout
from .checks import brief_error, check_bitmask
from .jobs import Claim, DraftMasksJob, claim, release
from .pools import spread_tasks
from .protocols import BatchOps, ChainOps, Matcher
from .rows import stop_row

__all__ = ["CommitResult", "DraftMasksJob", "commit", "commit_many", "fill_draft_masks"]

logger = logging.getLogger("maskplug.draft")
logger.addHandler(logging.NullHandler())

IntArray = npt.NDArray[np.int64]
_STRATEGIES = ("auto", "chains", "batch", "threads", "serial")


def _drafts_matrix(
    drafts: Any, layout: ScheduledLayout, idx: IntArray, arg: str = "drafts"
) -> tuple[IntArray, IntArray]:
    """Drafts as a (grammar requests × max drafts) int64 matrix padded with -1, and their counts.

    ``drafts`` is either one sequence per grammar request (rows order) or one
    flat 1-D array of every scheduled draft in batch order; errors name it
    ``arg`` (``tokens`` for the nodes of draft trees).
    """
    what = "node" if arg == "tokens" else "draft"
    nd = layout.num_drafts[idx]
    width = int(nd.max()) if nd.size else 0
    out = np.full((idx.shape[0], width), -1, dtype=np.int64)
    given = type(drafts).__name__
    if isinstance(drafts, torch.Tensor):
        drafts = drafts.detach().cpu().numpy()
    if isinstance(drafts, np.ndarray) and drafts.ndim != 1:
        raise LayoutError(
            f"{arg}: expected one token sequence per grammar request or a flat 1-D array, "
            f"got a {drafts.ndim}-D {given} of shape {drafts.shape}"
        )
    flat = isinstance(drafts, np.ndarray)
    if not flat and isinstance(drafts, Sequence) and not isinstance(drafts, (str, bytes)):
        # A list of ints is the flat form; an empty list is flat only when nothing was drafted.
        flat = (len(drafts) > 0 and isinstance(drafts[0], (int, np.integer))) or (
            len(drafts) == 0 and layout.total_drafts == 0
        )
    if flat:
        arr = np.asarray(drafts)
        if arr.size == 0 and arr.ndim == 1:
            arr = arr.astype(np.int64)  # [] is a float array to numpy
        if arr.dtype.kind not in "iu":
            raise LayoutError(f"{arg}: expected integer token ids, got dtype {arr.dtype}")
        total = layout.total_drafts
        if arr.shape[0] != total:
            raise LayoutError(
                f"{arg}: a flat array must hold every scheduled {what} in batch order, "
                f"expected {total} (sum of num_drafts), got {arr.shape[0]}"
            )
        starts = np.zeros(layout.n + 1, dtype=np.int64)
        np.cumsum(layout.num_drafts, out=starts[1:])
        if width:
            cols = np.arange(width)
            valid = cols[None, :] < nd[:, None]
            src = starts[idx][:, None] + cols[None, :]
            out[valid] = arr[src[valid]]
        return out, nd
    if not isinstance(drafts, Sequence) or isinstance(drafts, (str, bytes)):
        raise LayoutError(f"{arg}: expected one token sequence per grammar request, got {type(drafts).__name__}")
    if len(drafts) != idx.shape[0]:
        raise LayoutError(f"{arg}: expected {idx.shape[0]} sequences (one per grammar request), got {len(drafts)}")
    if width and bool(np.all(nd == width)) and all(isinstance(x, list) for x in drafts):
        # The common case (equal-length lists of ints) converts in one call.
        try:
            block = np.array(drafts)
        except (ValueError, TypeError, OverflowError):
            block = None
        if block is not None and block.shape == out.shape and block.dtype.kind in "iu":
            out[:] = block
            return out, nd
    for g, d in enumerate(drafts):
        a = np.asarray(d.detach().cpu().numpy() if isinstance(d, torch.Tensor) else d)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise LayoutError(f"{arg}[{g}]: expected a 1-D sequence of token ids, got shape {a.shape} {a.dtype}")
        if a.shape[0] != nd[g]:
            raise LayoutError(
                f"{arg}[{g}]: expected num_drafts = {int(nd[g])} tokens for request "
                f"{_plain(layout.req_ids[idx[g]])!r}, got {a.shape[0]}"
            )
        out[g, : a.shape[0]] = a
    return out, nd


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value it holds (messages show ``'a'``, not ``np.str_('a')``)."""
    return value.item() if isinstance(value, np.generic) else value


def _gate(active_from: Any, g: int) -> IntArray:
    if active_from is None:
        return np.zeros(g, dtype=np.int64)
    a = np.asarray(active_from)
    if a.ndim != 1 or a.shape[0] != g or (a.size and a.dtype.kind not in "iu"):
        raise LayoutError(f"active_from: expected {g} integer positions (one per grammar request), got {a.shape}")
    if a.size and int(a.min()) < 0:
        raise LayoutError(f"active_from: expected positions >= 0, got {int(a.min())}")
    return a.astype(np.int64)


def _forced_rows(bitmask: torch.Tensor, total: int, rows: IntArray) -> npt.NDArray[np.bool_]:
    """Whether each listed bitmask row allows exactly one token (vectorised, no copy of the rows).

    A row allows one token iff the OR of its words is a power of two and only
    one word is non-zero. The OR pass is cheap (no temporary the size of the
    rows); the word count runs on the few candidate rows only.
    """
    words = bitmask.numpy()[:total]
    # Wider words halve the scan when the row width allows it.
    words = words.view(np.uint64) if words.shape[1] % 2 == 0 else words.view(np.uint32)
    # Reducing every row in place is cheaper than gathering most of them first.
    ors = (
        np.bitwise_or.reduce(words, axis=1)[rows]
        if 2 * rows.shape[0] >= total
        else np.bitwise_or.reduce(words[rows], axis=1)
    )
    one = ors.dtype.type(1)
    cand = (ors != 0) & ((ors & (ors - one)) == 0)
    if np.any(cand):
        ci = np.flatnonzero(cand)
        cand[ci] = np.count_nonzero(words[rows[ci]], axis=1) == 1
    return cand


# os.cpu_count() is a system call; the answer does not change while running.
_DEFAULT_THREADS = min(8, os.cpu_count() or 1)


@dataclass
class _Walk:
    """One fill: its inputs per grammar request (``rows`` order) and what the walks found.

    Inputs: the matchers, the drafts matrix ``d`` (padded with -1) and draft
    counts ``nd``, the rows each request gets (``need``), its reasoning gate,
    its first bitmask row (``row0``), its stop ids and the bitmask. The
    walks record which requests still advance (``alive``), the drafts each
    matcher accepted (``accepted``, rolled back afterwards), the drafts the
    grammar accepts (``acceptable``), which rows they wrote (``filled``) and
    the single-token flags a chain operation reported per bitmask row
    (``row_forced``, valid where ``known``) and the requests that failed
    (``errors``, by grammar request; a failed request is never touched
    again). ``arg`` is the name the drafts go by in errors (``tokens`` for
    a tree call). Each walker touches only its own requests' entries.
    """

    matchers: Sequence[Matcher]
    d: IntArray
    nd: IntArray
    need: IntArray
    gate: IntArray
    row0: IntArray
    eos: Sequence[frozenset[int]]
    bitmask: torch.Tensor
    total: int
    vocabs: Sequence[Any] = ()
    errors: dict[int, GrammarError] = field(default_factory=dict)
    arg: str = "drafts"
    alive: npt.NDArray[np.bool_] = field(init=False)
    accepted: IntArray = field(init=False)
    acceptable: IntArray = field(init=False)
    filled: npt.NDArray[np.bool_] = field(init=False)
    row_forced: npt.NDArray[np.bool_] = field(init=False)
    known: npt.NDArray[np.bool_] = field(init=False)

    def __post_init__(self) -> None:
        g = self.nd.shape[0]
        self.alive = np.ones(g, dtype=bool)
        self.accepted = np.zeros(g, dtype=np.int64)
        self.acceptable = self.nd.copy()
        self.filled = np.zeros((g, int(self.need.max()) if g else 0), dtype=bool)
        self.row_forced = np.zeros(self.total, dtype=bool)
        self.known = np.zeros(self.total, dtype=bool)
        for g in self.errors:
            self.alive[g] = False


def _walk_batched(w: _Walk, ops: BatchOps, members: IntArray) -> None:
    """Position-major walk: one batch fill and one batch accept per position for all members."""
    matchers, d, nd, need, gate, row0 = w.matchers, w.d, w.nd, w.need, w.gate, w.row0
    horizon = int(need[members].max()) if members.size else 0
    for p in range(horizon):
        live = members[w.alive[members]]
        fill = live[(p < need[live]) & (p >= gate[live])]
        if fill.size:
            ops.fill([matchers[g] for g in fill], w.bitmask, (row0[fill] + p).tolist())
            w.filled[fill, p] = True
        adv = live[(p < nd[live]) & (p >= gate[live])]
        if adv.size == 0:
            continue
        toks = d[adv, p]
        ok = np.asarray(ops.accept([matchers[g] for g in adv], toks.tolist()), dtype=bool)
        took = adv[ok]
        w.accepted[took] += 1
        refused = adv[~ok]
        w.alive[refused] = False
        w.acceptable[refused] = p
        stopped = np.array([int(t) in w.eos[g] for g, t in zip(took.tolist(), d[took, p].tolist(), strict=True)], bool)
        if stopped.size and np.any(stopped):
            s = took[stopped]
            w.alive[s] = False
            w.acceptable[s] = p + 1


def _walk_chains(w: _Walk, ops: ChainOps, members: list[int], threads: int) -> None:
    """One ``fill_chains`` call for all members; the walk's bookkeeping is derived from its counts (vectorised)."""
    d, nd, need, gate, row0, bitmask = w.d, w.nd, w.need, w.gate, w.row0, w.bitmask
    mem = np.asarray(members, dtype=np.int64)
    lo = gate[mem]
    hi_d = np.maximum(nd[mem], lo)  # drafts fed: d[g, lo:hi_d]
    rows_d = d[mem].tolist()
    lo_l, hi_l = lo.tolist(), hi_d.tolist()
    drafts = [r[a:b] for r, a, b in zip(rows_d, lo_l, hi_l, strict=True)]
    starts = (row0[mem] + lo).tolist()
    reports = bool(ops.fills_forced)
    chained = [w.matchers[g] for g in members]
    if reports:
        took_l = ops.fill_chains(chained, bitmask, starts, drafts, threads=threads, forced=w.row_forced)
    else:
        took_l = ops.fill_chains(chained, bitmask, starts, drafts, threads=threads)
    if len(took_l) != len(members):
        raise GrammarError(f"fill_chains: expected {len(members)} accepted counts, got {len(took_l)}")
    took = np.asarray(took_l, dtype=np.int64).reshape(-1)
    count = hi_d - lo
    bad = (took < 0) | (took > count)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise GrammarError(f"fill_chains: expected an accepted count in [0, {int(count[i])}], got {int(took[i])}")
    # Whether the last accepted draft was a stop token (then nothing follows it).
    stopped = np.zeros(mem.shape[0], dtype=bool)
    if d.shape[1]:
        last_tok = d[mem, np.clip(lo + took - 1, 0, d.shape[1] - 1)]
        stopped = np.array(
            [t in e for t, e in zip(last_tok.tolist(), (w.eos[g] for g in members), strict=True)], dtype=bool
        ) & (took > 0)
    cut = stopped | (took < count)
    # Cut short: rows lo .. lo+took (refused draft's row) or lo .. lo+took-1 (after a stop).
    # Every draft taken: rows lo .. need-1, the bonus rows all holding the final state's mask.
    hi = np.where(cut, lo + took - stopped.astype(np.int64), need[mem] - 1)
    w.acceptable[mem[cut]] = (lo + took)[cut]
    cols = np.arange(w.filled.shape[1])
    span = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
    w.filled[mem] |= span
    if reports:
        gi, pi = np.nonzero(span)
        w.known[row0[mem][gi] + pi] = True
    extra = np.flatnonzero(~cut & (need[mem] - 1 > lo + took))
    for i in extra.tolist():  # num_bonus > 1 only
        g = members[i]
        r = int(row0[g] + lo[i] + took[i])
        end = int(row0[g] + need[g])
        bitmask[r + 1 : end] = bitmask[r]
        w.row_forced[r + 1 : end] = w.row_forced[r]


def _walk_one(w: _Walk, g: int) -> None:
    """Request-major walk of one request, rolled back at the end (each thread touches only its own entries).

    An exception from the matcher fails this request alone (:func:`_fail`).
    """
    m, d, eos, bitmask = w.matchers[g], w.d[g], w.eos[g], w.bitmask
    nd, need, gate, row0 = int(w.nd[g]), int(w.need[g]), int(w.gate[g]), int(w.row0[g])
    p, filling = 0, True  # where the walk is, for the error message (formatted only on failure)
    try:
        for p in range(need):
            if p >= gate:
                filling = True
                m.fill(bitmask, row0 + p)
                w.filled[g, p] = True
            if p >= nd or p < gate:
                continue
            t = int(d[p])
            filling = False
            if not m.accept(t):
                w.acceptable[g] = p
                break
            w.accepted[g] += 1
            if t in eos:
                w.acceptable[g] = p + 1
                break
    except Exception as exc:
        doing = f"fill of row {p}" if filling else f"accept of {w.arg}[{g}][{p}] = {int(d[p])}"
        _fail(w, g, exc, f"in its {doing}")
        return
    _rollback_one(w, g)


def _fail(w: _Walk, g: int, exc: BaseException, doing: str) -> None:
    """Fail request ``g`` for ``exc``: roll back what the walk accepted, record the error, never touch it again."""
    w.alive[g] = False
    k = int(w.accepted[g])
    w.accepted[g] = 0
    msg = f"matchers[{g}]: the matcher raised {type(exc).__name__} {doing}: {brief_error(exc)}"
    if k:
        try:
            w.matchers[g].rollback(k)
        except Exception as back:
            msg += (
                f"; rolling back the {k} drafts it had accepted then raised {type(back).__name__} "
                f"({brief_error(back)}): the matcher is not where it started and should be dropped"
            )
    err = GrammarError(msg)
    err.__cause__ = exc
    w.errors[g] = err


def _rollback_one(w: _Walk, g: int, k: int | None = None) -> None:
    """Undo the drafts request ``g`` accepted (``k``, default the walk's count); a failure fails the request."""
    k = int(w.accepted[g]) if k is None else k
    w.accepted[g] = 0
    if k <= 0:
        return
    try:
        w.matchers[g].rollback(k)
    except Exception as exc:
        w.alive[g] = False
        err = GrammarError(
            f"matchers[{g}]: rolling back the {k} drafts it accepted raised {type(exc).__name__} "
            f"({brief_error(exc)}): the matcher is not where it started and should be dropped"
        )
        err.__cause__ = exc
        w.errors[g] = err


def _counts(w: _Walk, members: Sequence[int]) -> list[int | None]:
    """Each member's ``num_accepted`` where its matcher keeps one (None otherwise).

    A member whose ``num_accepted`` raises fails alone (:func:`_fail`: what
    the walk accepted is rolled back, the request is not walked again) and
    counts as None; a failed member is not asked.
    """
    ms = w.matchers
    try:
        # One pass without per-member checks (this runs before every position-major walk).
        raw = [getattr(ms[g], "num_accepted", None) for g in members]
    except Exception:
        raw = []
        for g in members:
            if g in w.errors:
                raw.append(None)
                continue
            try:
                raw.append(getattr(ms[g], "num_accepted", None))
            except Exception as exc:
                _fail(w, g, exc, "in num_accepted")
                raw.append(None)
    if all(type(n) is int for n in raw):
        return raw
    return [int(n) if isinstance(n, (int, np.integer)) and not isinstance(n, bool) else None for n in raw]


def _unwind(w: _Walk, members: Sequence[int], base: Sequence[int | None]) -> None:
    """After a batch operation raised: put each member back where it started, one matcher at a time.

    Where the matcher keeps a count (``num_accepted``) the undo is what it
    has now beyond its count before the walk; otherwise the walk's own count
    (a batch operation that raises is taken to have moved none of the
    matchers it was given).
    """
    now = _counts(w, members)
    for g, b, n in zip(members, base, now, strict=True):
        if g in w.errors:
            continue
        k = n - b if b is not None and n is not None and n >= b else int(w.accepted[g])
        _rollback_one(w, g, k)


def _redo_serially(w: _Walk, members: Sequence[int], what: str, exc: BaseException) -> None:
    """Walk ``members`` again one request at a time after a batch operation over all of them raised ``exc``.

    Their rows and bookkeeping start over; a request whose own walk raises
    fails alone. Costs one serial walk per member (one Python call per row
    and per draft), in this step only.
    """
    logger.warning(
        "%s raised %s for %d grammar requests (%s); walking them one at a time",
        what,
        type(exc).__name__,
        len(members),
        brief_error(exc),
    )
    for g in members:
        if g in w.errors:
            continue
        w.alive[g] = True
        w.accepted[g] = 0
        w.acceptable[g] = w.nd[g]
        w.filled[g] = False
        r0, r1 = int(w.row0[g]), int(w.row0[g] + w.need[g])
        w.known[r0:r1] = False
        w.row_forced[r0:r1] = False
        _walk_one(w, g)


def _eos_sets(vocabs: Sequence[Any]) -> list[frozenset[int]]:
    """Each matcher's stop ids (one set per distinct vocabulary)."""
    sets: dict[int, frozenset[int]] = {}
    out = []
    for v in vocabs:
        e = sets.get(id(v))
        if e is None:
            e = frozenset(v.eos_ids) if v is not None else frozenset()
            sets[id(v)] = e
        out.append(e)
    return out


class _MatcherTypes:
    """Whether a type satisfies :class:`Matcher` (asked once per type: the protocol check is slow)."""

    def __init__(self) -> None:
        self._known: dict[type, bool] = {}

    def ok(self, m: object) -> bool:
        t = type(m)
        known = self._known.get(t)
        if known is None:
            known = self._known[t] = isinstance(m, Matcher)
        return known


_MATCHER_TYPES = _MatcherTypes()


def _check_matchers(matchers: Any, g_count: int) -> tuple[list[Matcher], list[int]]:
    """The matchers as a list and their ids: one live :class:`Matcher` object per grammar request."""
    if isinstance(matchers, (str, bytes)) or not hasattr(matchers, "__iter__"):
        raise GrammarError(f"matchers: expected a sequence of matchers (one per grammar request), got {matchers!r:.80}")
    ms = list(matchers)
    if len(ms) != g_count:
        raise LayoutError(f"matchers: expected {g_count} (one per grammar request), got {len(ms)}")
    ok = _MATCHER_TYPES.ok
    # One check per distinct type (usually one); the first bad matcher is named.
    if not all(ok(m) for m in {type(m): m for m in ms}.values()):
        g = next(g for g, m in enumerate(ms) if not ok(m))
        raise GrammarError(f"matchers[{g}]: expected a Matcher, got {type(ms[g]).__name__}")
    keys = list(map(id, ms))
    if len(set(keys)) != len(keys):
        first: dict[int, int] = {}
        for g, k in enumerate(keys):
            if k in first:
                raise GrammarError(
                    f"matchers[{g}]: expected one matcher per grammar request, got the same matcher "
                    f"as matchers[{first[k]}]"
                )
            first[k] = g
    return ms, keys


def _check_threads(threads: Any) -> int:
    if threads is None:
        return _DEFAULT_THREADS
    if isinstance(threads, bool) or not hasattr(threads, "__index__") or int(threads) < 0:
        raise LayoutError(f"threads: expected None or an int >= 0, got {threads!r:.80}")
    return int(threads)


@dataclass
class FillArgs:
    """Checked arguments of a fill, shared by :func:`fill_draft_masks` and :func:`maskplug.fill_tree_masks`.

    Taken from the arguments by :func:`check_fill_args` before any row is
    written or any matcher is touched: the matchers (a list of distinct
    :class:`Matcher` objects) and their ids, the grammar requests' batch
    indices (``idx``), their tokens as a matrix padded with -1 (``d``) and
    counts (``nd``), each request's first bitmask row (``row0``), the rows in
    all (``total``), each matcher's vocabulary (or None), the requests that
    fail before any walk (``errors``: a token id outside the vocabulary,
    naming ``arg``), the pool size and the argument name the tokens go by.
    """

    matchers: list[Matcher]
    keys: list[int]
    layout: ScheduledLayout
    idx: IntArray
    d: IntArray
    nd: IntArray
    row0: IntArray
    total: int
    vocabs: list[Any]
    errors: dict[int, GrammarError]
    n_threads: int
    bitmask: torch.Tensor
    arg: str


def check_fill_args(
    matchers: Any, tokens: Any, bitmask: Any, rows: Any, layout: Any, threads: Any, *, arg: str = "drafts"
) -> FillArgs:
    """Check the arguments every fill takes, in one place for chains and trees (no matcher state is read).

    ``rows`` a :class:`GrammarRows`, ``layout`` a :class:`ScheduledLayout`,
    ``threads`` None or an int >= 0, ``matchers`` one distinct
    :class:`Matcher` per grammar request, ``tokens`` (named ``arg`` in the
    errors) one sequence per grammar request or one flat array in batch
    order, of integer ids and the scheduled lengths, and ``bitmask`` a
    contiguous CPU int32 tensor with the rows and the vocabulary's width.
    A bad one raises :class:`LayoutError` or :class:`GrammarError` naming
    it. A request whose token ids fall outside its vocabulary (or are
    negative) is not refused: it is recorded in ``errors`` and fails alone.
    """
    if not isinstance(rows, GrammarRows):
        raise LayoutError(f"rows: expected a GrammarRows, got {type(rows).__name__}")
    if not isinstance(layout, ScheduledLayout):
        raise LayoutError(f"layout: expected a ScheduledLayout, got {type(layout).__name__}")
    n_threads = _check_threads(threads)
    idx = rows.batch_indices(layout)
    per = rows.rows_per_request(layout)
    g_count = int(idx.shape[0])
    ms, keys = _check_matchers(matchers, g_count)
    d, nd = _drafts_matrix(tokens, layout, idx, arg)
    total = int(per.sum())
    row0 = np.zeros(g_count, dtype=np.int64)
    if g_count > 1:
        np.cumsum(per[:-1], out=row0[1:])

    vocabs = [getattr(m, "vocab", None) for m in ms]
    v0 = next((v for v in vocabs if v is not None), None)
    if total:
        if v0 is not None:
            check_bitmask(bitmask, total - 1, v0)
        elif (
            not isinstance(bitmask, torch.Tensor)
            or bitmask.dtype != torch.int32
            or bitmask.device.type != "cpu"
            or bitmask.dim() != 2
            or bitmask.shape[0] < total
            or not bitmask.is_contiguous()
        ):
            raise GrammarError(
                f"bitmask: expected a contiguous 2-D CPU int32 tensor with at least {total} rows, "
                f"got {type(bitmask).__name__} {getattr(bitmask, 'shape', '')}"
            )
    # One vectorised range check per distinct vocabulary (usually one): a
    # request with a token id outside its vocabulary fails alone.
    errors: dict[int, GrammarError] = {}
    if total:
        by_vocab: dict[int, tuple[Any, list[int]]] = {}
        for g, v in enumerate(vocabs):
            if v is not None:
                by_vocab.setdefault(id(v), (v, []))[1].append(g)
        cols = np.arange(d.shape[1])
        for v, members in by_vocab.values():
            mem = np.asarray(members, dtype=np.int64)
            if v0 is not None and v.mask_words != v0.mask_words:
                raise GrammarError(
                    f"matchers[{members[0]}]: expected a vocabulary of {v0.mask_words} mask words like the others, "
                    f"got {v.mask_words}"
                )
            sub = d[mem]
            bad = (cols[None, :] < nd[mem][:, None]) & ((sub < 0) | (sub >= v.vocab_size))
            if np.any(bad):
                for i in np.flatnonzero(bad.any(axis=1)).tolist():
                    p = int(np.argmax(bad[i]))  # the first bad position of this request
                    errors[int(mem[i])] = GrammarError(
                        f"{arg}[{int(mem[i])}][{p}]: expected a token id in [0, {v.vocab_size}), got {int(sub[i, p])}"
                    )
    return FillArgs(
        ms, keys, layout, idx, d, nd, row0, total, vocabs, dict(sorted(errors.items())), n_threads, bitmask, arg
    )


@dataclass
class _Plan:
    """A checked fill: everything the walks need, taken from the arguments before anything is written."""

    walk: _Walk
    keys: list[int]
    idx: IntArray
    row0: IntArray
    strategy: str
    n_threads: int


def _plan(
    matchers: Any,
    drafts: Any,
    bitmask: Any,
    rows: Any,
    layout: Any,
    threads: Any,
    active_from: Any,
    strategy: Any,
) -> _Plan:
    """Check every argument of :func:`fill_draft_masks` (no matcher state is read, nothing is written)."""
    if not isinstance(strategy, str) or strategy not in _STRATEGIES:
        raise LayoutError(f"strategy: expected one of {_STRATEGIES}, got {strategy!r:.80}")
    args = check_fill_args(matchers, drafts, bitmask, rows, layout, threads)
    gate = _gate(active_from, len(args.matchers))
    return plan_of(args, gate, strategy)


def plan_of(args: FillArgs, gate: IntArray | None = None, strategy: str = "auto") -> _Plan:
    """The walk plan of checked arguments (``gate``: the reasoning gate, default none)."""
    g_count = len(args.matchers)
    gate = np.zeros(g_count, dtype=np.int64) if gate is None else gate
    need = args.nd + args.layout.num_bonus
    walk = _Walk(
        args.matchers,
        args.d,
        args.nd,
        need,
        gate,
        args.row0,
        _eos_sets(args.vocabs),
        args.bitmask,
        args.total,
        args.vocabs,
        dict(args.errors),
        arg=args.arg,
    )
    return _Plan(walk, args.keys, args.idx, args.row0, strategy, args.n_threads)


def fill_checked(args: FillArgs) -> DraftMasks:
    """:func:`fill_draft_masks` (``strategy="auto"``, no gate) on arguments :func:`check_fill_args` checked.

    The matchers are claimed for the call, as by :func:`fill_draft_masks`.
    """
    plan = plan_of(args)
    held = claim(plan.walk.matchers, plan.keys, "matchers")
    try:
        return _produce(plan)
    finally:
        release(held)


def _produce(plan: _Plan) -> DraftMasks:
    """Walk the checked plan: write the rows, restore the matchers (the caller holds them).

    A request that fails (see :func:`fill_draft_masks`) gets the stop-only
    rows and is reported in ``failed``; nothing raises for the batch.
    """
    walk, strategy, n_threads, row0 = plan.walk, plan.strategy, plan.n_threads, plan.row0
    ms, gate, need, bitmask, total = walk.matchers, walk.gate, walk.need, walk.bitmask, walk.total
    g_count = len(ms)
    errors = walk.errors

    # Group requests by their provider's batch operations; "threads" (or a
    # provider without batch operations) walks request by request instead.
    # Chains take live matchers whose window reaches the grammar; the rest
    # (terminated, or gated past the window) cost nothing on the generic walk.
    groups: dict[int, tuple[BatchOps, list[int]]] = {}
    chains: dict[int, tuple[ChainOps, list[int]]] = {}
    single: list[int] = []
    # Whether each distinct batch_ops object is a ChainOps (asked once per object: the protocol check is slow).
    chain_ops: dict[int, bool] = {}
    for g, m in enumerate(ms):
        if errors and g in errors:
            continue
        try:
            ops = getattr(m, "batch_ops", None) if strategy in ("auto", "chains", "batch") else None
        except Exception as exc:
            _fail(walk, g, exc, "in batch_ops")
            continue
        if ops is None:
            single.append(g)
            continue
        can_chain = chain_ops.get(id(ops))
        if can_chain is None:
            can_chain = chain_ops[id(ops)] = strategy != "batch" and isinstance(ops, ChainOps)
        # A chain operation also fills the row after the last draft: without a bonus row
        # (need == nd) that row is the next request's, or past this call's rows.
        if can_chain and gate[g] < need[g] and need[g] > walk.nd[g]:
            try:
                live = not m.is_terminated()
            except Exception as exc:
                _fail(walk, g, exc, "in is_terminated()")
                continue
            if live:
                chains.setdefault(id(ops), (ops, []))[1].append(g)
                continue
        groups.setdefault(id(ops), (ops, []))[1].append(g)

    try:
        for cops, members in chains.values():
            try:
                _walk_chains(walk, cops, members, n_threads)
            except Exception as exc:
                # The chain operation leaves its matchers where they started, also on error.
                _redo_serially(walk, members, f"{type(cops).__name__}.fill_chains", exc)
        for ops, members in groups.values():
            base = _counts(walk, members)
            try:
                _walk_batched(walk, ops, np.asarray(members, dtype=np.int64))
            except Exception as exc:
                _unwind(walk, members, base)
                _redo_serially(walk, members, f"{type(ops).__name__} (position-major walk)", exc)
                continue
            back = [g for g in members if walk.accepted[g]]
            if back:
                try:
                    ops.rollback([ms[g] for g in back], walk.accepted[back].tolist())
                except Exception:
                    where = {g: i for i, g in enumerate(members)}
                    _unwind(walk, back, [base[where[g]] for g in back])
                else:
                    walk.accepted[back] = 0
        if single:
            pooled = (
                strategy != "serial"
                and n_threads > 1
                and len(single) > 1
                and all(getattr(ms[g], "releases_gil", False) for g in single)
            )

            # Each worker takes the next request when free (grammars differ in cost). The
            # pool's walks are all done before spread_tasks returns or raises, so an
            # interrupt never leaves a walker running on matchers this call gives back.
            spread_tasks(lambda i: _walk_one(walk, single[i]), len(single), n_threads if pooled else 1)
    except BaseException as exc:
        # Interrupted (or a bug): every walk has ended; restore every matcher still advanced.
        restore_after_interrupt(walk.matchers, walk.accepted, exc)
        raise

    # A filled row that allows nothing would turn every logit to -inf: its request fails instead.
    for g, p in dead_rows(bitmask, row0, walk.filled, walk.vocabs).items():
        if g not in errors:
            errors[g] = empty_row_error(g, p, "draft position")
    failed = sorted(errors)
    if failed:
        walk.filled[failed] = False
        walk.acceptable[failed] = 0
    # Rows nobody filled are all-allowed; write only those (the filled ones hold masks).
    width = walk.filled.shape[1]
    forced = np.zeros((g_count, width), dtype=bool)
    gi, pi = np.nonzero(walk.filled)
    filled_rows = row0[gi] + pi
    if total:
        blank = np.ones(total, dtype=bool)
        blank[filled_rows] = False
        if blank.any():
            # numpy's fancy assignment: torch's index_fill_ is ~80x slower on CPU here.
            bitmask.numpy()[np.flatnonzero(blank)] = -1
    if gi.size:
        known = walk.known[filled_rows]
        flags = walk.row_forced[filled_rows] & known
        if not np.all(known):
            unknown = np.flatnonzero(~known)
            flags[unknown] = _forced_rows(bitmask, total, filled_rows[unknown])
        forced[gi, pi] = flags
    if not failed:
        return DraftMasks(request=plan.idx.astype(np.int64), acceptable=walk.acceptable.astype(np.int64), forced=forced)
    _write_stop_rows(walk, failed)
    return DraftMasks(
        request=plan.idx.astype(np.int64),
        acceptable=walk.acceptable.astype(np.int64),
        forced=forced,
        failed=MappingProxyType({int(plan.idx[g]): errors[g] for g in failed}),
    )


def undo_after_interrupt(matcher: Matcher, g: int, k: int, exc: BaseException, what: str = "drafts") -> None:
    """Roll ``matcher`` (request ``g``) back by the ``k`` tokens a walk stopped by ``exc`` left it advanced by.

    ``exc`` (an interrupt, or a bug) is about to be raised for the whole call,
    so a rollback that raises cannot fail its request in a result: it is
    logged as an error and added to ``exc`` as a note naming ``matchers[g]``
    (the matcher is not where it started and should be dropped), and ``exc``
    is still what the call raises.
    """
    if k <= 0:
        return
    try:
        matcher.rollback(k)
    except Exception as back:
        msg = (
            f"matchers[{g}]: rolling back the {k} {what} it had accepted, after the fill was stopped by "
            f"{type(exc).__name__}, raised {type(back).__name__} ({brief_error(back)}): the matcher is not "
            "where it started and should be dropped"
        )
        logger.error(msg)
        add_note = getattr(exc, "add_note", None)  # Python 3.11+
        if add_note is not None:
            add_note(msg)


def restore_after_interrupt(matchers: Sequence[Matcher], accepted: IntArray, exc: BaseException) -> None:
    """:func:`undo_after_interrupt` for every matcher a stopped walk left advanced (``accepted`` is zeroed)."""
    for g in np.flatnonzero(accepted).tolist():
        k = int(accepted[g])
        accepted[g] = 0
        undo_after_interrupt(matchers[g], g, k, exc)


def dead_rows(
    bitmask: torch.Tensor, row0: IntArray, filled: npt.NDArray[np.bool_], vocabs: Sequence[Any]
) -> dict[int, int]:
    """The first filled row of each request that allows no token of its vocabulary, by grammar request.

    ``filled[g, p]`` says row ``row0[g] + p`` holds request ``g``'s grammar
    mask (rows left all-allowed or blank are not asked). Bits past a
    request's ``vocab_size`` do not count. One vectorised ``any`` over the
    filled rows.
    """
    gi, pi = np.nonzero(filled)
    if not gi.size:
        return {}
    bm = bitmask.numpy()
    rows = bm[row0[gi] + pi]
    words = bm.shape[1]
    size_of = [
        int(getattr(v, "vocab_size", words * 32)) if v is not None else words * 32
        for v in (vocabs[g] if g < len(vocabs) else None for g in range(filled.shape[0]))
    ]
    sizes = np.minimum(np.asarray(size_of, dtype=np.int64)[gi], words * 32)
    # Whole words below vocab_size, then the low bits of the partial last word.
    full, rem = sizes // 32, sizes % 32
    cols = np.arange(words)[None, :]
    alive = ((rows != 0) & (cols < full[:, None])).any(axis=1)
    part = np.flatnonzero(rem > 0)
    if part.size:
        last = rows[part, full[part]].astype(np.int64) & ((np.int64(1) << rem[part]) - 1)
        alive[part] |= last != 0
    dead = ~alive
    out: dict[int, int] = {}
    for g, p in zip(gi[dead].tolist(), pi[dead].tolist(), strict=True):
        out.setdefault(int(g), int(p))
    return out


def empty_row_error(g: int, p: int, where: str) -> GrammarError:
    """The failure of request ``g`` whose grammar allows no token, not even a stop token, at row ``p``."""
    return GrammarError(f"matchers[{g}]: its grammar allows no token at {where} {p}, not even a stop token")


def _write_stop_rows(w: _Walk, failed: Sequence[int]) -> None:
    """Every row of each failed request (draft and bonus rows) allows only its vocabulary's stop tokens.

    A matcher without a vocabulary takes the batch's first one; with none at
    all, the rows allow nothing.
    """
    bm = w.bitmask.numpy()
    fallback = next((v for v in w.vocabs if v is not None), None)
    rows: dict[int, npt.NDArray[np.int32]] = {}
    for g in failed:
        v = w.vocabs[g] if g < len(w.vocabs) and w.vocabs[g] is not None else fallback
        row = rows.get(id(v))
        if row is None:
            row = stop_row(v).numpy() if v is not None else np.zeros(bm.shape[1], dtype=np.int32)
            rows[id(v)] = row
        r0 = int(w.row0[g])
        bm[r0 : r0 + int(w.need[g])] = row


def _produce_restoring(plan: _Plan, held: Claim) -> DraftMasks:
    """:func:`_produce` on a job thread: on failure the rows go back to what they held; the claim is released."""
    try:
        total = plan.walk.total
        saved = plan.walk.bitmask[:total].clone() if total else None
        try:
            return _produce(plan)
        except BaseException:
            if saved is not None:
                plan.walk.bitmask[:total].copy_(saved)
            raise
    finally:
        release(held)


@overload
def fill_draft_masks(
    matchers: Sequence[Matcher],
    drafts: Any,
    bitmask: torch.Tensor,
    rows: GrammarRows,
    layout: ScheduledLayout,
    *,
    threads: int | None = ...,
    active_from: Any = ...,
    strategy: str = ...,
    wait: Literal[True] = ...,
) -> DraftMasks: ...


@overload
def fill_draft_masks(
    matchers: Sequence[Matcher],
    drafts: Any,
    bitmask: torch.Tensor,
    rows: GrammarRows,
    layout: ScheduledLayout,
    *,
    threads: int | None = ...,
    active_from: Any = ...,
    strategy: str = ...,
    wait: Literal[False],
) -> DraftMasksJob: ...


@overload
def fill_draft_masks(
    matchers: Sequence[Matcher],
    drafts: Any,
    bitmask: torch.Tensor,
    rows: GrammarRows,
    layout: ScheduledLayout,
    *,
    threads: int | None = ...,
    active_from: Any = ...,
    strategy: str = ...,
    wait: bool,
) -> DraftMasks | DraftMasksJob: ...


def fill_draft_masks(
    matchers: Sequence[Matcher],
    drafts: Any,
    bitmask: torch.Tensor,
    rows: GrammarRows,
    layout: ScheduledLayout,
    *,
    threads: int | None = None,
    active_from: Any = None,
    strategy: str = "auto",
    wait: bool = True,
) -> DraftMasks | DraftMasksJob:
    """Fill every grammar request's mask rows for this step's scheduled drafts.

    For grammar request ``g`` (in ``rows`` order) with ``k = num_drafts[r]``
    drafts, row ``p`` (``0 <= p <= k - 1 + num_bonus``) is the grammar's mask
    after accepting drafts ``0..p-1``; the rows follow ``rows``' producer
    layout (ragged or fixed stride; unused fixed rows are all-allowed). At the
    first draft the grammar refuses, advancing stops: that draft's row is
    still constrained (the verifier samples a replacement from it) and every
    later row is all-allowed. After an accepted stop token, later rows are
    all-allowed too. The matchers end exactly where they started.

    Every argument's structure is checked before the first row is written
    or a matcher is touched (the bitmask's type, shape and width, the layout
    and rows, the number of matchers and draft sequences, the drafts' dtype
    and lengths, ``active_from``, ``threads``, ``strategy``); a bad one
    raises a :class:`~maskplug.MaskplugError` naming it and leaves the
    bitmask and the matchers as they were.

    Fault isolation: one bad request never fails the batch. A request with a
    draft id outside its vocabulary (or negative) is not walked at all; a
    request whose matcher raises (in ``fill``, ``accept``,
    ``is_terminated`` or ``rollback``, or from a sticky error state) is
    rolled back and not touched again in this call. Either way only that
    request fails: every one of its rows (draft and bonus rows) allows only
    its stop tokens, its ``acceptable`` is 0, its ``forced`` row is False,
    and :attr:`DraftMasks.failed` maps its batch index to a
    :class:`~maskplug.GrammarError` (``drafts[g][p]: ...`` or
    ``matchers[g]: ...``, the matcher's exception as ``__cause__``; the
    message says when the matcher could not be rolled back and should be
    dropped). Every other request's rows and fields are exactly those of the
    same batch without the failed requests. When a provider's batch or chain
    operation raises for many requests at once, those requests are walked
    again one at a time (one Python call per row, in that step only), so that
    only the request at fault fails.

    Threading contract: a matcher serves one call at a time. This call (and
    :func:`commit`) holds its matchers while it runs; a matcher that a call
    on another thread is using is refused with
    :class:`~maskplug.MatcherInUse` before anything is written, and one that
    an unfinished ``wait=False`` job holds is waited for (the job was started
    first). Distinct matchers, even of one compiled grammar, may be used from
    different threads at once. The matcher's own methods (``accept``,
    ``fill``, ``rollback``, ...) are not guarded: do not call them on a
    matcher while a call or an unfinished job holds it. The bitmask is not
    guarded either: calls running at once must be given different rows.
    A call stopped as a whole (``KeyboardInterrupt``, or any exception that
    is not a request's own failure) raises only after every walk it started
    on the pool has ended and every matcher is back where it started, so
    nothing touches the matchers once the call has raised; a rollback that
    raises then is logged (logger ``maskplug.draft``) and added to the
    exception as a note naming ``matchers[g]``, and the interrupt is still
    what the call raises.

    Args:
        matchers: one matcher per grammar request, in ``rows`` order (each
            a distinct object).
        drafts: one token sequence per grammar request (rows order, length
            ``num_drafts[r]`` each), or one flat 1-D array of all scheduled
            drafts in batch order (length ``Σ num_drafts``; ``[]`` when
            nothing was drafted).
        bitmask: CPU int32 tensor, at least ``rows.num_rows(layout)`` rows of
            ``ceil(vocab_size/32)`` words.
        rows: the producer layout (grammar requests and their order).
        layout: this step's scheduled layout.
        threads: thread pool size for matchers without batch operations
            (default: the CPU count, at most 8; ``0`` or ``1``: no pool).
        active_from: optional reasoning gate, one position per grammar
            request: the grammar is not active before it (those rows are
            all-allowed and those drafts are not fed to the matcher, they
            are not grammar text) and active from it (row ``active_from`` is
            the matcher's current mask). A value past the window leaves every
            row all-allowed.
        strategy: ``"auto"`` (a provider's chain operation where it has
            one, else its batch operations, else request by request on a
            thread pool when the engine releases the GIL), ``"chains"`` (the
            same), ``"batch"`` (position-major batch operations even where a
            chain operation exists), ``"threads"`` (request by request on the
            pool even where batch operations exist) or ``"serial"`` (request
            by request on the calling thread). Every strategy writes the same
            rows.
        wait: ``False`` returns at once with a :class:`DraftMasksJob` that
            produces the rows on a job thread (the providers' parallel work
            on the shared grammar pools) while the caller runs its forward
            pass; its ``result()`` returns the :class:`DraftMasks`. The
            arguments are checked (and refused) by this call itself; a
            request that fails during production is reported in the result's
            ``failed`` exactly as by the synchronous call; production stopped
            as a whole (``KeyboardInterrupt`` and the like) is raised by
            ``result()``, with the bitmask rows restored to what they held
            and the matchers where they started. Until the job is done its rows and matchers are its own:
            a :func:`commit` or a fill on one of its matchers waits for it.

    Returns:
        :class:`DraftMasks` with the batch index, the drafts the grammar
        accepts (a prefix length; gated drafts count as accepted), which
        rows allow exactly one token and the requests that failed; with
        ``wait=False``, the :class:`DraftMasksJob` that returns it.
    """
    plan = _plan(matchers, drafts, bitmask, rows, layout, threads, active_from, strategy)
    if not wait:
        job = DraftMasksJob()
        held = claim(plan.walk.matchers, plan.keys, "matchers", job)
        job._start(lambda: _produce_restoring(plan, held))
        return job
    held = claim(plan.walk.matchers, plan.keys, "matchers")
    try:
        return _produce(plan)
    finally:
        release(held)


def _token_array(tokens: Any, arg: str) -> IntArray:
    """``tokens`` as a 1-D int64 array (an empty sequence included), else a :class:`GrammarError` naming ``arg``."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().tolist()
    if isinstance(tokens, (str, bytes)) or tokens is None:
        raise GrammarError(f"{arg}: expected a 1-D sequence of token ids, got {type(tokens).__name__}")
    try:
        toks = np.asarray(tokens)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{arg}: expected a 1-D sequence of token ids, got {type(tokens).__name__}") from exc
    if toks.ndim == 1 and toks.size == 0:
        toks = toks.astype(np.int64)
    if toks.ndim != 1 or toks.dtype.kind not in "iu":
        raise GrammarError(f"{arg}: expected a 1-D sequence of token ids, got shape {toks.shape} {toks.dtype}")
    return toks.astype(np.int64, copy=False)


def _bad_token(matcher: Matcher, toks: IntArray, arg: str) -> GrammarError | None:
    """The error for the first token id outside ``matcher``'s vocabulary, or None."""
    vocab = getattr(matcher, "vocab", None)
    if vocab is None or not toks.size:
        return None
    bad = (toks < 0) | (toks >= vocab.vocab_size)
    if not np.any(bad):
        return None
    p = int(np.argmax(bad))
    return GrammarError(f"{arg}[{p}]: expected a token id in [0, {vocab.vocab_size}), got {int(toks[p])}")


def _advance(matcher: Matcher, toks: IntArray, arg: str) -> int:
    """Feed ``toks`` to a held matcher up to termination or the first refusal; return how many it took.

    An exception from the matcher becomes a :class:`GrammarError` naming
    ``arg`` (the exception chained), after the tokens this call had taken are
    rolled back; the message says when that rollback failed too.
    """
    taken = 0
    doing = "is_terminated()"
    try:
        for t in toks.tolist():
            doing = "is_terminated()"
            if matcher.is_terminated():
                break
            doing = f"accept of tokens[{taken}] = {t}"
            if not matcher.accept(int(t)):
                break
            taken += 1
        return taken
    except Exception as exc:
        msg = f"{arg}: the matcher raised {type(exc).__name__} in its {doing}: {brief_error(exc)}"
        if taken:
            try:
                matcher.rollback(taken)
            except Exception as back:
                msg += (
                    f"; rolling back the {taken} tokens it had taken then raised {type(back).__name__} "
                    f"({brief_error(back)}): the matcher is not where it started and should be dropped"
                )
            else:
                msg += f"; the {taken} tokens it had taken were rolled back"
        raise GrammarError(msg) from exc


def commit(matcher: Matcher, tokens: Sequence[int] | Any) -> int:
    """Advance ``matcher`` by the tokens the step emitted; return how many it took.

    ``tokens`` are the accepted drafts followed by the bonus (or recovered)
    token. Advancing stops at termination (a stop token) and at the first
    token the grammar refuses (which a correctly masked step never emits);
    the tokens after that point are not taken. Arguments are checked before
    the matcher is touched (a bad one raises :class:`GrammarError` naming
    it). An exception from inside the matcher (an engine failure) is raised
    as a :class:`GrammarError` naming ``matcher``, with the engine's
    exception as its ``__cause__``, after the tokens this call had taken are
    rolled back (the message says when that was not possible). The matcher
    is held while it advances (see :func:`fill_draft_masks`): one in use by
    a call on another thread is refused with :class:`~maskplug.MatcherInUse`,
    and an unfinished ``wait=False`` fill that holds it is waited for, so a
    step's commit never races that step's fill. :func:`commit_many` commits
    a whole batch, failing only the requests that go wrong.
    """
    if not _MATCHER_TYPES.ok(matcher):
        raise GrammarError(f"matcher: expected a Matcher, got {type(matcher).__name__}")
    toks = _token_array(tokens, "tokens")
    bad = _bad_token(matcher, toks, "tokens")
    if bad is not None:
        raise bad
    held = claim((matcher,), [id(matcher)], "matcher")
    try:
        return _advance(matcher, toks, "matcher")
    finally:
        release(held)


@dataclass(frozen=True)
class CommitResult:
    """What :func:`commit_many` did, per request (in the order of the matchers given).

    Attributes:
        taken: tokens each matcher took (0 for a failed request).
        failed: the requests that could not be committed, by index into the
            matchers given, each with the :class:`GrammarError` saying why
            (``tokens_per_request[i][p]: ...`` for a token id outside the
            vocabulary, ``matchers[i]: ...`` for an exception from the
            matcher). A failed request's matcher is where it was before the
            call, unless the error says that rolling it back failed.
    """

    taken: tuple[int, ...]
    failed: Mapping[int, GrammarError] = field(default_factory=lambda: MappingProxyType({}))


def commit_many(matchers: Sequence[Matcher], tokens_per_request: Sequence[Any]) -> CommitResult:
    """:func:`commit` for a batch: ``matchers[i]`` advances by ``tokens_per_request[i]``.

    Every request advances exactly as a single :func:`commit` would; one
    whose tokens hold an id outside its vocabulary (or negative) is not
    touched, and one whose matcher raises is rolled back to where it was
    (where the matcher allows): either fails alone, reported in
    :attr:`CommitResult.failed`, and the others are committed all the same.
    Structural mistakes raise :class:`GrammarError` before any matcher is
    touched: ``matchers`` not a sequence of distinct matchers, a different
    number of token sequences, a token sequence that is not a 1-D sequence of
    integers. All the matchers are held for the call (see
    :func:`fill_draft_masks`).
    """
    if isinstance(matchers, (str, bytes)) or not isinstance(matchers, Sequence):
        raise GrammarError(f"matchers: expected a sequence of matchers, got {type(matchers).__name__}")
    if isinstance(tokens_per_request, (str, bytes, torch.Tensor)) or not isinstance(tokens_per_request, Sequence):
        raise GrammarError(
            f"tokens_per_request: expected one token sequence per matcher, got {type(tokens_per_request).__name__}"
        )
    ms, keys = _check_matchers(matchers, len(matchers))
    if len(tokens_per_request) != len(ms):
        raise GrammarError(
            f"tokens_per_request: expected {len(ms)} token sequences (one per matcher), got {len(tokens_per_request)}"
        )
    toks = [_token_array(t, f"tokens_per_request[{i}]") for i, t in enumerate(tokens_per_request)]
    errors: dict[int, GrammarError] = {}
    for i, (m, t) in enumerate(zip(ms, toks, strict=True)):
        bad = _bad_token(m, t, f"tokens_per_request[{i}]")
        if bad is not None:
            errors[i] = bad
    taken = [0] * len(ms)
    held = claim(ms, keys, "matchers")
    try:
        for i, (m, t) in enumerate(zip(ms, toks, strict=True)):
            if i in errors:
                continue
            try:
                taken[i] = _advance(m, t, f"matchers[{i}]")
            except GrammarError as err:
                errors[i] = err
    finally:
        release(held)
    return CommitResult(tuple(taken), MappingProxyType(dict(sorted(errors.items()))))
