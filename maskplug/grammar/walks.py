"""The walks that fill a chain fill's rows, and what they do when a matcher or a batch call raises.

:class:`Walk` holds one fill's inputs and findings. Three walks write rows
into it, each touching only its own requests' entries:

* :func:`walk_chains`: one ``fill_chains`` call per provider (:class:`~maskplug.grammar.ChainOps`);
* :func:`walk_batched`: position-major, one batch ``fill`` and ``accept`` per
  position for all of a provider's requests (:class:`~maskplug.grammar.BatchOps`);
* :func:`walk_one`: request-major with the matcher protocol, one request at
  a time (on a pool, or after a batch call raised).

A request whose matcher raises fails alone (:func:`fail_request`); after a
batch or chain call raised for many requests at once, :func:`unwind` puts
them back and :func:`redo_serially` walks them again one at a time (see
:mod:`maskplug.grammar.draft` for what that relies on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

from ..errors import GrammarError
from .bases import MatcherBase, plain_matcher_type
from .checks import brief_error
from .protocols import BatchOps, ChainOps, Matcher
from .recovery import logger, roll_back

__all__ = [
    "Walk",
    "accepted_counts",
    "fail_request",
    "redo_serially",
    "rollback_error",
    "rollback_request",
    "rollback_walked",
    "unwind",
    "walk_batched",
    "walk_calls",
    "walk_chains",
    "walk_one",
]

IntArray = npt.NDArray[np.int64]


@dataclass
class Walk:
    """One fill: its inputs per grammar request (``rows`` order) and what the walks found.

    Inputs: the matchers, the drafts matrix ``d`` (padded with -1) and draft
    counts ``nd``, the rows each request gets (``need``), its reasoning gate,
    its first bitmask row (``row0``), its stop ids and the bitmask. The
    walks record which requests still advance (``alive``), the drafts each
    matcher accepted (``accepted``, rolled back afterwards), the drafts the
    grammar accepts (``acceptable``), which rows they wrote (``filled``) and
    the single-token flags a chain operation reported per bitmask row
    (``row_forced``, valid where ``known``; ``reported`` once any is) and the requests that failed
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
    reported: bool = field(init=False, default=False)

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


def walk_batched(w: Walk, ops: BatchOps, members: IntArray) -> None:
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


def walk_chains(w: Walk, ops: ChainOps, members: list[int], threads: int) -> None:
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
        w.reported = True
    extra = np.flatnonzero(~cut & (need[mem] - 1 > lo + took))
    for i in extra.tolist():  # num_bonus > 1 only
        g = members[i]
        r = int(row0[g] + lo[i] + took[i])
        end = int(row0[g] + need[g])
        bitmask[r + 1 : end] = bitmask[r]
        w.row_forced[r + 1 : end] = w.row_forced[r]


def walk_one(w: Walk, g: int) -> None:
    """Request-major walk of one request, rolled back at the end (each thread touches only its own entries).

    An exception from the matcher fails this request alone (:func:`fail_request`).
    The walk's inputs are checked (the bitmask and every draft id), so a
    :class:`~maskplug.grammar.MatcherBase` that keeps the public methods is
    driven through their unchecked forms (:func:`~maskplug.grammar.bases.plain_matcher_type`).
    """
    m = w.matchers[g]
    fill, accept, _ = walk_calls(m)
    eos, bitmask = w.eos[g], w.bitmask
    nd, need, gate, row0 = int(w.nd[g]), int(w.need[g]), int(w.gate[g]), int(w.row0[g])
    d: list[int] = w.d[g, :nd].tolist() if nd else []
    # Kept in locals and written back once (numpy scalar writes cost more than the walk's calls).
    p, filling, took, hi, acceptable = 0, True, 0, -1, nd
    try:
        for p in range(need):
            if p >= gate:
                filling = True
                fill(bitmask, row0 + p)
                hi = p
            if p >= nd or p < gate:
                continue
            t = d[p]
            filling = False
            if not accept(t):
                acceptable = p
                break
            took += 1
            if t in eos:
                acceptable = p + 1
                break
    except Exception as exc:
        w.accepted[g] = took
        doing = f"fill of row {p}" if filling else f"accept of {w.arg}[{g}][{p}] = {d[p]}"
        fail_request(w, g, exc, f"in its {doing}")
        return
    except BaseException:
        # Interrupted: the caller restores every matcher by what the walk recorded.
        w.accepted[g] = took
        raise
    if hi >= gate:
        w.filled[g, gate : hi + 1] = True
    if acceptable != nd:
        w.acceptable[g] = acceptable
    if took:
        rollback_request(w, g, took)


def fail_request(w: Walk, g: int, exc: BaseException, doing: str) -> None:
    """Fail request ``g`` for ``exc``: roll back what the walk accepted, record the error, never touch it again."""
    w.alive[g] = False
    k = int(w.accepted[g])
    w.accepted[g] = 0
    msg = f"matchers[{g}]: the matcher raised {type(exc).__name__} {doing}: {brief_error(exc)}"
    msg += roll_back(w.matchers[g], k, "drafts it had accepted")
    err = GrammarError(msg)
    err.__cause__ = exc
    w.errors[g] = err


def rollback_request(w: Walk, g: int, k: int | None = None) -> None:
    """Undo the drafts request ``g`` accepted (``k``, default the walk's count); a failure fails the request."""
    k = int(w.accepted[g]) if k is None else k
    w.accepted[g] = 0
    if k <= 0:
        return
    try:
        rollback_walked(w.matchers[g], k)
    except Exception as exc:
        w.alive[g] = False
        w.errors[g] = rollback_error(g, k, exc)


def walk_calls(m: Matcher) -> tuple[Any, Any, Any]:
    """The ``fill``, ``accept`` and ``rollback`` a walk calls on checked inputs.

    The unchecked forms (``rollback`` of what the walk accepted: see
    :func:`rollback_walked`) where the class keeps the public ones; the
    matcher's type is asked once for all three.
    """
    if plain_matcher_type(type(m)):
        base = cast(MatcherBase, m)
        return base._fill_row, base._accept_id, base._rollback_walked
    return m.fill, m.accept, m.rollback


def rollback_walked(m: Matcher, k: int) -> None:
    """Undo the ``k`` drafts a walk accepted (an int, at most what it accepted), unchecked where the class allows."""
    if plain_matcher_type(type(m)):
        cast(MatcherBase, m)._rollback_walked(k)
    else:
        m.rollback(k)


def rollback_error(g: int, k: int, exc: Exception) -> GrammarError:
    """The failure of request ``g`` whose rollback of the ``k`` drafts its walk accepted raised ``exc``."""
    err = GrammarError(
        f"matchers[{g}]: rolling back the {k} drafts it accepted raised {type(exc).__name__} "
        f"({brief_error(exc)}): the matcher is not where it started and should be dropped"
    )
    err.__cause__ = exc
    return err


def accepted_counts(w: Walk, members: Sequence[int]) -> list[int | None]:
    """Each member's ``num_accepted`` where its matcher keeps one (None otherwise).

    A member whose ``num_accepted`` raises fails alone (:func:`fail_request`: what
    the walk accepted is rolled back, the request is not walked again) and
    counts as None; a failed member is not asked.
    """
    ms, errors = w.matchers, w.errors
    raw: list[Any] = []
    for g in members:
        if g in errors:
            raw.append(None)
            continue
        try:
            raw.append(getattr(ms[g], "num_accepted", None))
        except Exception as exc:
            fail_request(w, g, exc, "in num_accepted")
            raw.append(None)
    if all(type(n) is int for n in raw):
        return raw
    return [int(n) if isinstance(n, (int, np.integer)) and not isinstance(n, bool) else None for n in raw]


def unwind(w: Walk, members: Sequence[int], base: Sequence[int | None]) -> None:
    """After a batch operation raised: put each member back where it started, one matcher at a time.

    Where the matcher keeps a count (``num_accepted``) the undo is what it
    has now beyond its count before the walk; otherwise the walk's own count
    (a batch operation that raises is taken to have moved none of the
    matchers it was given).
    """
    now = accepted_counts(w, members)
    for g, b, n in zip(members, base, now, strict=True):
        if g in w.errors:
            continue
        k = n - b if b is not None and n is not None and n >= b else int(w.accepted[g])
        rollback_request(w, g, k)


def redo_serially(w: Walk, members: Sequence[int], what: str, exc: BaseException) -> None:
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
        walk_one(w, g)
