"""Checking a fill's arguments, in one place for the chain and the tree producers.

:func:`check_fill_args` takes what :func:`maskplug.fill_draft_masks` and
:func:`maskplug.fill_tree_masks` are given and returns it checked
(:class:`FillArgs`) before any row is written or any matcher is touched: the
matchers, the tokens as a padded matrix, each request's first row, the
vocabularies, the pool size (:data:`DEFAULT_THREADS` when not given) and the
requests that fail before any walk (token ids outside their vocabulary).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..errors import GrammarError, LayoutError
from ..layout import GrammarRows, ScheduledLayout
from .checks import check_bitmask
from .protocols import Matcher

__all__ = [
    "DEFAULT_THREADS",
    "MATCHER_TYPES",
    "FillArgs",
    "KnownTypes",
    "check_fill_args",
    "check_gate",
    "check_matchers",
    "check_threads",
    "eos_sets",
]

IntArray = npt.NDArray[np.int64]


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


def check_gate(active_from: Any, g: int) -> IntArray:
    """The reasoning gate ``active_from`` as ``g`` positions >= 0 (all 0 when None), else a :class:`LayoutError`."""
    if active_from is None:
        return np.zeros(g, dtype=np.int64)
    a = np.asarray(active_from)
    if a.ndim != 1 or a.shape[0] != g or (a.size and a.dtype.kind not in "iu"):
        raise LayoutError(f"active_from: expected {g} integer positions (one per grammar request), got {a.shape}")
    if a.size and int(a.min()) < 0:
        raise LayoutError(f"active_from: expected positions >= 0, got {int(a.min())}")
    return a.astype(np.int64)


#: The producers' pool size when ``threads`` is None: the CPU count, at most 8 (``os.cpu_count()``
#: is a system call; the answer does not change while running).
DEFAULT_THREADS = min(8, os.cpu_count() or 1)


def eos_sets(vocabs: Sequence[Any]) -> list[frozenset[int]]:
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


class KnownTypes:
    """Whether an object's type satisfies a runtime-checkable protocol (asked once per type: the check is slow)."""

    def __init__(self, protocol: type) -> None:
        self._protocol = protocol
        self._known: dict[type, bool] = {}

    def ok(self, m: object) -> bool:
        t = type(m)
        known = self._known.get(t)
        if known is None:
            known = self._known[t] = isinstance(m, self._protocol)
        return known


#: Which types are :class:`~maskplug.grammar.Matcher` types.
MATCHER_TYPES = KnownTypes(Matcher)


def check_matchers(matchers: Any, g_count: int) -> tuple[list[Matcher], list[int]]:
    """The matchers as a list and their ids: one live :class:`Matcher` object per grammar request."""
    if isinstance(matchers, (str, bytes)) or not hasattr(matchers, "__iter__"):
        raise GrammarError(f"matchers: expected a sequence of matchers (one per grammar request), got {matchers!r:.80}")
    ms = list(matchers)
    if len(ms) != g_count:
        raise LayoutError(f"matchers: expected {g_count} (one per grammar request), got {len(ms)}")
    ok = MATCHER_TYPES.ok
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


def check_threads(threads: Any) -> int:
    """``threads`` as a pool size (:data:`DEFAULT_THREADS` for None), else a :class:`LayoutError`."""
    if threads is None:
        return DEFAULT_THREADS
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
    n_threads = check_threads(threads)
    idx = rows.batch_indices(layout)
    per = rows.rows_per_request(layout)
    g_count = int(idx.shape[0])
    ms, keys = check_matchers(matchers, g_count)
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
