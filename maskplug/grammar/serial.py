"""The serial walk of checked draft windows, for an engine's hot path with a few requests.

:func:`walk_windows` writes the rows :func:`maskplug.fill_draft_masks` with
``strategy="serial"`` writes and returns the same :class:`~maskplug.DraftMasks`,
on windows its caller has checked. It exists for its fixed cost: at one
request the general producer spent most of its time on the bookkeeping
around four matcher calls (the walk's arrays, the plan, the assembly's
passes). Here a step where every request is served keeps its bookkeeping in
Python lists and completes the rows with one population count; the general
bookkeeping (:class:`~maskplug.grammar.walks.Walk`) is built only when a
matcher raises or a row allows nothing, and :func:`~maskplug.grammar.assembly.assemble`
then completes the step exactly as the general producer does.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..draftmasks import DraftMasks, served
from .assembly import assemble, row_counts
from .bases import MatcherBase, plain_matcher_type
from .fillargs import eos_sets
from .protocols import Matcher
from .recovery import restore_after_interrupt
from .walks import Walk, fail_request, rollback_error, walk_calls

__all__ = ["walk_windows"]

IntArray = npt.NDArray[np.int64]

#: A matcher's vocabulary, and a vocabulary's stop ids (read for every request of a walk).
_VOCAB = operator.attrgetter("vocab")
_EOS_IDS = operator.attrgetter("eos_ids")

_ARANGE: dict[int, IntArray] = {}

#: Up to this many bytes of rows, :func:`_complete` counts allowed tokens with Python ints rather than numpy.
_PY_COUNT_BYTES = 4096
#: Rows of at most this many bytes are checked for one that allows nothing as one byte string
#: (:func:`_complete_unforced`); above it the copy costs more than numpy's reduction in place.
_BYTES_SCAN = 1 << 16


def _arange(n: int) -> IntArray:
    """``np.arange(n)`` as int64, read-only and shared (a result's ``request`` field)."""
    a = _ARANGE.get(n)
    if a is None:
        a = np.arange(n, dtype=np.int64)
        a.flags.writeable = False
        if len(_ARANGE) < 1024:
            _ARANGE[n] = a
    return a


_SMALL: dict[tuple[int, ...], IntArray] = {}
_NONE_FORCED: dict[tuple[int, int], npt.NDArray[np.bool_]] = {}
#: Up to this many requests a step's ``acceptable`` counts are shared read-only arrays: a running batch
#: repeats a few patterns, and between forward passes a fresh numpy array costs more than the lookup.
_SHARE_UP_TO = 8


def _small_ints(values: list[int]) -> IntArray:
    """``np.array(values, dtype=np.int64)``, read-only, shared for a few values (a result's ``acceptable``)."""
    if len(values) > _SHARE_UP_TO:
        return np.array(values, dtype=np.int64)
    key = tuple(values)
    a = _SMALL.get(key)
    if a is None:
        a = np.array(values, dtype=np.int64)
        a.flags.writeable = False
        if len(_SMALL) >= 4096:
            _SMALL.clear()
        _SMALL[key] = a
    return a


def _no_forced(g_count: int, width: int) -> npt.NDArray[np.bool_]:
    """An all-False ``(g_count, width)`` ``forced`` matrix, read-only and shared (no row allows just one token)."""
    key = (g_count, width)
    a = _NONE_FORCED.get(key)
    if a is None:
        a = np.zeros(key, dtype=bool)
        a.flags.writeable = False
        if len(_NONE_FORCED) >= 1024:
            _NONE_FORCED.clear()
        _NONE_FORCED[key] = a
    return a


_SERVED: dict[tuple[int, ...], DraftMasks] = {}


def _served_plain(acceptable: list[int], width: int) -> DraftMasks:
    """The result of a step that served every request and forced no token, shared for a few requests.

    A :class:`DraftMasks` is frozen and its arrays are read-only, so steps
    with the same ``acceptable`` counts and ``forced`` width get one object: a
    running batch repeats a few patterns, and between forward passes making
    the result costs more than finding it.
    """
    g_count = len(acceptable)
    key = (width, *acceptable) if g_count <= _SHARE_UP_TO else None
    dm = _SERVED.get(key) if key is not None else None
    if dm is None:
        dm = served(_arange(g_count), _small_ints(acceptable), _no_forced(g_count, width))
        if key is not None:
            if len(_SERVED) >= 4096:
                _SERVED.clear()
            _SERVED[key] = dm
    return dm


def _general(
    matchers: Sequence[Matcher],
    windows: Sequence[Sequence[int]],
    row0: Sequence[int],
    bitmask: torch.Tensor,
    total: int,
    vocabs: Sequence[Any],
) -> Walk:
    """The general producer's bookkeeping for these windows (no matcher is called)."""
    g_count = len(matchers)
    counts = np.fromiter((len(w) for w in windows), dtype=np.int64, count=g_count)
    drafts = np.full((g_count, int(counts.max()) if g_count else 0), -1, dtype=np.int64)
    for g, w in enumerate(windows):
        if len(w):
            drafts[g, : len(w)] = w
    return Walk(
        matchers,
        drafts,
        counts,
        counts + 1,
        np.zeros(g_count, dtype=np.int64),
        np.array(row0, dtype=np.int64),
        eos_sets(vocabs),
        bitmask,
        total,
        vocabs,
        {},
        arg="drafts",
    )


def walk_windows(
    matchers: Sequence[Matcher],
    windows: Sequence[Sequence[int]],
    row0: Sequence[int],
    bitmask: torch.Tensor,
    total: int,
    host: npt.NDArray[Any] | None = None,
    *,
    find_forced: bool = True,
) -> DraftMasks:
    """Walk each request's window serially and complete the step's rows; the matchers end where they started.

    Same inputs, guarantees and result as
    :func:`maskplug.engines.sdk.fill_windows_serially` (which claims the
    matchers and calls this): request ``g``'s rows are ``row0[g]`` to
    ``row0[g] + len(windows[g])``, the rows below ``total`` that no request
    fills come out all-allowed, a request whose matcher raises or whose row
    allows nothing fails alone with the stop-only rows. ``host`` is
    ``bitmask.numpy()`` when the caller keeps it. With ``find_forced=False``
    the result's ``forced`` is all False (the rows are only checked for one
    allowed token each).
    """
    g_count = len(matchers)
    # C-level maps, not comprehensions: each comprehension is a Python frame (3.11), and between an
    # engine's forward passes every frame costs.
    vocabs: list[Any] = list(map(_VOCAB, matchers))
    # Membership in a vocabulary's own stop tuple (one or two ids): the same answer as a set, without making one.
    eos: Sequence[Any] = list(map(_EOS_IDS, vocabs))
    # Per request: the last row position its walk filled (-1: none) and the drafts the grammar accepts.
    last = [-1] * g_count
    acceptable = list(map(len, windows))
    walk: Walk | None = None  # the general bookkeeping, once a request fails
    g, took = 0, 0
    try:
        for g in range(g_count):
            m = matchers[g]
            d, e, r0 = windows[g], eos[g], row0[g]
            nd = len(d)
            took, p, filling, hi = 0, 0, True, -1
            base: MatcherBase | None = m if plain_matcher_type(m.__class__) else None  # type: ignore[assignment]
            try:
                if base is not None and not base._terminated:
                    # A MatcherBase that keeps the public methods and has not stopped: the engine's
                    # own fill and accept, called here with MatcherBase's checks of a checked id
                    # written out (what _fill_row and _accept_id do, without a Python frame per
                    # row: at sixteen requests that frame was a quarter of the walk). The walk
                    # ends at a stop token, so no row is filled after the matcher terminates.
                    fill, accept, rollback = base._fill, base._accept, base._rollback_walked
                    v = vocabs[g]
                    special, known = v.special_ids, len(v.tokens)
                    for p in range(nd + 1):
                        filling = True
                        fill(bitmask, r0 + p)
                        hi = p
                        if p == nd:
                            break
                        t = d[p]
                        filling = False
                        if t in e:
                            if base._is_complete():
                                base._set_terminated(True)
                                took += 1
                                acceptable[g] = p + 1
                            else:
                                acceptable[g] = p
                            break
                        if t in special or t >= known or not accept(t):
                            acceptable[g] = p
                            break
                        took += 1
                else:
                    fill, accept, rollback = walk_calls(m)
                    for p in range(nd + 1):
                        filling = True
                        fill(bitmask, r0 + p)
                        hi = p
                        if p == nd:
                            break
                        t = d[p]
                        filling = False
                        if not accept(t):
                            acceptable[g] = p
                            break
                        took += 1
                        if t in e:
                            acceptable[g] = p + 1
                            break
            except Exception as exc:
                if walk is None:
                    walk = _general(matchers, windows, row0, bitmask, total, vocabs)
                walk.accepted[g] = took
                took = 0
                doing = f"fill of row {p}" if filling else f"accept of drafts[{g}][{p}] = {d[p]}"
                fail_request(walk, g, exc, f"in its {doing}")
                continue
            last[g] = hi
            if took:
                k, took = took, 0
                try:
                    rollback(k)
                except Exception as exc:
                    if walk is None:
                        walk = _general(matchers, windows, row0, bitmask, total, vocabs)
                    walk.alive[g] = False
                    walk.errors[g] = rollback_error(g, k, exc)
    except BaseException as exc:
        # Interrupted: only request g can be advanced (the others were rolled back after their walks).
        advanced = np.zeros(g_count, dtype=np.int64)
        if g_count:
            advanced[g] = took
        restore_after_interrupt(matchers, advanced, exc)
        raise
    if walk is None:
        width = max(map(len, windows)) + 1 if g_count else 0
        bm = bitmask.numpy() if host is None else host
        done = _complete(bm, total, row0, last, acceptable, vocabs, width, find_forced)
        if done is not None:
            return done
        walk = _general(matchers, windows, row0, bitmask, total, vocabs)
    for i, hi in enumerate(last):
        if hi >= 0 and i not in walk.errors:
            walk.filled[i, : hi + 1] = True
    walk.acceptable[:] = acceptable
    dm = assemble(walk, np.arange(g_count, dtype=np.int64))
    if not find_forced and dm.forced.any():
        # The general assembly finds them anyway; the caller asked for none.
        dm = dataclasses.replace(dm, forced=_no_forced(*dm.forced.shape))
    return dm


def _gaps(order: Sequence[int], row0: Sequence[int], last: list[int], total: int) -> list[tuple[int, int]]:
    """The spans of rows below ``total`` that no request filled (``order``: the requests by first row)."""
    pos = 0
    gaps: list[tuple[int, int]] = []
    for g in order:
        hi = last[g]
        if hi < 0:
            continue
        a = row0[g]
        if a > pos:
            gaps.append((pos, a))
        pos = a + hi + 1
    if pos < total:
        gaps.append((pos, total))
    return gaps


def _complete_unforced(
    bm: npt.NDArray[Any],
    total: int,
    gaps: list[tuple[int, int]],
    acceptable: list[int],
    size: int,
    width: int,
    words: int,
) -> DraftMasks | None:
    """:func:`_complete` without ``forced``: whether every row of the step allows a token.

    The rows no request filled are opened first, so every row below
    ``total`` either holds a grammar's mask or allows everything. Rows whose
    every word holds vocabulary tokens (the usual width) are one byte string:
    a row that allows nothing is a run of zero bytes starting on a row
    boundary, found by ``bytes.find`` (a C scan, and no pass over the rows in
    Python; between an engine's forward passes each Python line and numpy call
    costs microseconds), up to :data:`_BYTES_SCAN` bytes of rows. More rows,
    or a narrower vocabulary (each row's last word masked): one reduction per
    row says whether a filled one allows nothing.
    """
    for a, b in gaps:
        bm[a:b] = -1
    rows = bm[:total]
    wb = 4 * words  # words: bm.shape[1], read once by the caller
    if size == 32 * words and total * wb <= _BYTES_SCAN:
        buf = rows.tobytes()
        zero = bytes(wb)
        at = buf.find(zero)
        while at >= 0 and at % wb:
            # A run of zeros across two rows (the end of one mask and the start of the next):
            # an all-zero row can only start at the next row boundary or later.
            at = buf.find(zero, (at // wb + 1) * wb)
        if at >= 0:
            return None  # a row that allows nothing: the general assembly fails its request
        return _served_plain(acceptable, width)
    f, r = divmod(size, 32)
    live = rows[:, :f].any(axis=1)
    if r:
        live |= (rows[:, f] & ((1 << r) - 1)) != 0
    if not live.all():
        return None  # a row that allows nothing: the general assembly fails its request
    return _served_plain(acceptable, width)


def _complete(
    bm: npt.NDArray[Any],
    total: int,
    row0: Sequence[int],
    last: list[int],
    acceptable: list[int],
    vocabs: Sequence[Any],
    width: int,
    find_forced: bool = True,
) -> DraftMasks | None:
    """The result of a walk in which every request was served, its unfilled rows opened.

    ``bm`` is the bitmask's numpy view; ``width`` is the widest window's row
    count (the ``forced`` matrix's columns). Without ``find_forced`` the
    rows are only checked for an allowed token, and ``forced`` is all False.

    ``None`` when the general assembly must decide: a filled row allows no
    token of its vocabulary (that request fails), or the requests'
    vocabularies differ in size. Nothing is written then, except (without
    ``find_forced``) the rows no request filled, opened as the assembly
    opens them.
    """
    # One pass in plain Python: between an engine's forward passes this runs cold, where every numpy
    # call and every comprehension's frame costs microseconds.
    g_count = len(last)
    words = bm.shape[1]
    size = words * 32
    if not find_forced and g_count == 1 and row0[0] == 0 and last[0] + 1 == total:
        # One request that filled every row of the step (one request in flight, a verify-all step):
        # one vocabulary, no order to find, no row left to open.
        return _complete_unforced(bm, total, [], acceptable, min(size, vocabs[0].vocab_size), width, words)
    if g_count:
        v0 = vocabs[0]
        vs = v0.vocab_size
        for v in vocabs:
            if v is not v0 and v.vocab_size != vs:
                return None
        if vs < size:
            size = vs
    wb = 4 * words
    # Requests in row order (the producer's usual order needs no sort).
    in_order = g_count < 2 or all(row0[g] < row0[g + 1] for g in range(g_count - 1))
    order = range(g_count) if in_order else sorted(range(g_count), key=row0.__getitem__)
    if not find_forced:
        return _complete_unforced(bm, total, _gaps(order, row0, last, total), acceptable, size, width, words)
    # A few narrow rows: each filled row read as one Python int (little-endian words: bit t is token t);
    # more: numpy counts every row's allowed tokens at once.
    small = total * wb <= _PY_COUNT_BYTES
    whole: list[int] = []
    below: list[int] = []
    if small:
        frm = int.from_bytes
        buf = bm[:total].tobytes()
        keep = (1 << size) - 1 if size < words * 32 else -1  # x & -1 is x
    else:
        count, below_arr = row_counts(bm, total, None, size)
        below = below_arr.tolist()
        whole = count.tolist() if below_arr is not count else below
    forced: npt.NDArray[np.bool_] | None = None
    for g in order:
        hi = last[g]
        if hi < 0:
            continue
        a = row0[g]
        for p in range(a, a + hi + 1):
            if small:
                x = frm(buf[p * wb : (p + 1) * wb], "little")
                # No allowed token below the vocabulary size; exactly one bit set in the whole row.
                empty, single = not x & keep, find_forced and not x & (x - 1)
            else:
                empty, single = below[p] == 0, whole[p] == 1
            if empty:
                # A filled row that allows nothing makes its request fail: the general assembly's
                # decision (nothing has been written yet).
                return None
            if single:
                # A single-token row (rare: a forced token).
                if forced is None:
                    forced = np.zeros((g_count, width), dtype=bool)
                forced[g, p - a] = True
    # Rows no request filled are all-allowed; the filled ones hold the grammar's masks.
    for a, b in _gaps(order, row0, last, total):
        bm[a:b] = -1
    if forced is None:
        return _served_plain(acceptable, width)
    return served(_arange(g_count), _small_ints(acceptable), forced)
