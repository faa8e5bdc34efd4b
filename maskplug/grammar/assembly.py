"""Completing a fill's rows and results once its walks are done.

The walks write the rows the grammar constrains; what is left is common to
the chain and tree producers: a request whose constrained row allows no
token fails (:func:`dead_rows`), rows nothing valid reaches are all-allowed,
a failed request's rows allow only its stop tokens (:func:`write_stop_rows`),
and the single-token flags are read off the rows (:func:`assemble` for
chains).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..draftmasks import DraftMasks
from ..errors import GrammarError
from .rows import stop_row
from .walks import Walk

__all__ = ["assemble", "dead_rows", "empty_row_error", "row_counts", "write_stop_rows"]

IntArray = npt.NDArray[np.int64]


def _sizes(vocabs: Sequence[Any], g_count: int, words: int) -> int | IntArray:
    """Each request's vocabulary size, capped at the row's bits: one int when every request shares a vocabulary."""
    v0 = vocabs[0] if vocabs else None
    if len(vocabs) >= g_count and all(v is v0 for v in vocabs[:g_count]):
        return min(int(getattr(v0, "vocab_size", words * 32)) if v0 is not None else words * 32, words * 32)
    size_of = [
        int(getattr(v, "vocab_size", words * 32)) if v is not None else words * 32
        for v in (vocabs[g] if g < len(vocabs) else None for g in range(g_count))
    ]
    return np.minimum(np.asarray(size_of, dtype=np.int64), words * 32)


def row_counts(
    bitmask: torch.Tensor | npt.NDArray[Any], total: int, rows: IntArray | None, sizes: int | IntArray
) -> tuple[IntArray, IntArray]:
    """Allowed tokens in each listed bitmask row: over the whole row, and over the bits below ``sizes``.

    ``rows`` are distinct rows below ``total`` (``None``: every row below
    it, in order); ``sizes`` is one vocabulary size for all of them or one
    per row (at most the row's bits). One population count over the rows
    (no copy when they are all the rows), one more over the words a
    vocabulary ends inside. ``bitmask`` may be the tensor's numpy view.
    """
    words32 = (bitmask if isinstance(bitmask, np.ndarray) else bitmask.numpy())[:total]
    n_words = words32.shape[1]
    whole = rows is None or (rows.shape[0] == total and (total < 2 or bool((rows[1:] > rows[:-1]).all())))
    sub = words32 if whole else words32[rows]  # type: ignore[index]
    wide = sub.view(np.uint64) if n_words % 2 == 0 else sub.view(np.uint32)
    count = np.bitwise_count(wide).sum(axis=1, dtype=np.int64)
    per_row = not isinstance(sizes, int)
    distinct = np.unique(sizes).tolist() if per_row else [sizes]
    high: IntArray | None = None
    for size in distinct:
        f, r = divmod(int(size), 32)
        if f >= n_words:
            continue
        sel = np.flatnonzero(sizes == size) if per_row else slice(None)
        tail = sub[sel, f:].view(np.uint32).copy()
        if r:
            tail[:, 0] &= np.uint32(0xFFFFFFFF ^ ((1 << r) - 1))
        if high is None:
            high = np.zeros(count.shape[0], dtype=np.int64)
        high[sel] = np.bitwise_count(tail).sum(axis=1, dtype=np.int64)
    return count, (count if high is None else count - high)


def _first_dead(gi: IntArray, pi: IntArray, below: IntArray) -> dict[int, int]:
    """The first listed position ``pi`` of each request ``gi`` whose row allows nothing (``below == 0``)."""
    out: dict[int, int] = {}
    dead = np.flatnonzero(below == 0)
    for g, p in zip(gi[dead].tolist(), pi[dead].tolist(), strict=True):
        out.setdefault(int(g), int(p))
    return out


def dead_rows(
    bitmask: torch.Tensor, row0: IntArray, filled: npt.NDArray[np.bool_], vocabs: Sequence[Any]
) -> dict[int, int]:
    """The first filled row of each request that allows no token of its vocabulary, by grammar request.

    ``filled[g, p]`` says row ``row0[g] + p`` holds request ``g``'s grammar
    mask (rows left all-allowed or blank are not asked). Bits past a
    request's ``vocab_size`` do not count.
    """
    gi, pi = np.nonzero(filled)
    if not gi.size:
        return {}
    rows = row0[gi] + pi
    sizes = _sizes(vocabs, filled.shape[0], int(bitmask.shape[1]))
    _, below = row_counts(bitmask, int(rows.max()) + 1, rows, sizes if isinstance(sizes, int) else sizes[gi])
    return _first_dead(gi, pi, below)


def empty_row_error(g: int, p: int, where: str) -> GrammarError:
    """The failure of request ``g`` whose grammar allows no token, not even a stop token, at row ``p``."""
    return GrammarError(f"matchers[{g}]: its grammar allows no token at {where} {p}, not even a stop token")


def write_stop_rows(
    bm: npt.NDArray[np.int32], failed: Sequence[int], vocabs: Sequence[Any], row0: IntArray, need: IntArray
) -> None:
    """Every row of each failed request (draft, node and bonus rows) allows only its vocabulary's stop tokens.

    Request ``g``'s rows are ``bm[row0[g] : row0[g] + need[g]]``. A matcher
    without a vocabulary takes the batch's first one; with none at all, the
    rows allow nothing.
    """
    fallback = next((v for v in vocabs if v is not None), None)
    rows: dict[int, npt.NDArray[np.int32]] = {}
    for g in failed:
        v = vocabs[g] if g < len(vocabs) and vocabs[g] is not None else fallback
        row = rows.get(id(v))
        if row is None:
            row = stop_row(v).numpy() if v is not None else np.zeros(bm.shape[1], dtype=np.int32)
            rows[id(v)] = row
        r0 = int(row0[g])
        bm[r0 : r0 + int(need[g])] = row


def assemble(walk: Walk, idx: IntArray) -> DraftMasks:
    """The :class:`DraftMasks` of a finished walk (``idx``: the requests' batch indices), its rows completed.

    Requests whose filled rows allow nothing fail (:func:`dead_rows`); rows
    nobody filled become all-allowed; each failed request's rows allow only
    its stop tokens, its ``acceptable`` is 0 and its ``forced`` row False.
    One population count over the filled rows answers both which rows are
    dead and which allow a single token.
    """
    bitmask, row0, total, errors = walk.bitmask, walk.row0, walk.total, walk.errors
    forced = np.zeros(walk.filled.shape, dtype=bool)
    gi, pi = np.nonzero(walk.filled)
    filled_rows = row0[gi] + pi
    count: IntArray | None = None
    if gi.size:
        sizes = _sizes(walk.vocabs, walk.filled.shape[0], int(bitmask.shape[1]))
        count, below = row_counts(bitmask, total, filled_rows, sizes if isinstance(sizes, int) else sizes[gi])
        # A filled row that allows nothing would turn every logit to -inf: its request fails instead.
        if not below.all():
            for g, p in _first_dead(gi, pi, below).items():
                if g not in errors:
                    errors[g] = empty_row_error(g, p, "draft position")
    failed = sorted(errors)
    if failed:
        walk.filled[failed] = False
        walk.acceptable[failed] = 0
        if gi.size:
            keep = walk.filled[gi, pi]
            gi, pi, filled_rows = gi[keep], pi[keep], filled_rows[keep]
            count = None if count is None else count[keep]
    # Rows nobody filled are all-allowed; write only those (the filled ones hold masks).
    if total and filled_rows.shape[0] < total:
        blank = np.ones(total, dtype=bool)
        blank[filled_rows] = False
        # numpy's fancy assignment: torch's index_fill_ is ~80x slower on CPU here.
        bitmask.numpy()[np.flatnonzero(blank)] = -1
    if gi.size and count is not None:
        if walk.reported:
            forced[gi, pi] = np.where(walk.known[filled_rows], walk.row_forced[filled_rows], count == 1)
        else:
            forced[gi, pi] = count == 1
    if not failed:
        return DraftMasks(request=idx.astype(np.int64), acceptable=walk.acceptable.astype(np.int64), forced=forced)
    write_stop_rows(bitmask.numpy(), failed, walk.vocabs, row0, walk.need)
    return DraftMasks(
        request=idx.astype(np.int64),
        acceptable=walk.acceptable.astype(np.int64),
        forced=forced,
        failed=MappingProxyType({int(idx[g]): errors[g] for g in failed}),
    )
