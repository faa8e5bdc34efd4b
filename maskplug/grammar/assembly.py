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

__all__ = ["assemble", "dead_rows", "empty_row_error", "write_stop_rows"]

IntArray = npt.NDArray[np.int64]


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
    """
    bitmask, row0, total, errors = walk.bitmask, walk.row0, walk.total, walk.errors
    # A filled row that allows nothing would turn every logit to -inf: its request fails instead.
    for g, p in dead_rows(bitmask, row0, walk.filled, walk.vocabs).items():
        if g not in errors:
            errors[g] = empty_row_error(g, p, "draft position")
    failed = sorted(errors)
    if failed:
        walk.filled[failed] = False
        walk.acceptable[failed] = 0
    # Rows nobody filled are all-allowed; write only those (the filled ones hold masks).
    forced = np.zeros(walk.filled.shape, dtype=bool)
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
        return DraftMasks(request=idx.astype(np.int64), acceptable=walk.acceptable.astype(np.int64), forced=forced)
    write_stop_rows(bitmask.numpy(), failed, walk.vocabs, row0, walk.need)
    return DraftMasks(
        request=idx.astype(np.int64),
        acceptable=walk.acceptable.astype(np.int64),
        forced=forced,
        failed=MappingProxyType({int(idx[g]): errors[g] for g in failed}),
    )
