"""The scheduler side: maskplug's grammar backend and mask-row producer inside vLLM's ``StructuredOutputManager``.

Two methods of vLLM's manager are wrapped (see :mod:`maskplug_vllm.patches`):

* ``grammar_init`` creates a :class:`~maskplug_vllm.backend.MaskplugBackend`
  the first time a structured-output request arrives, so every grammar of the
  engine is compiled and matched by a maskplug provider;
* ``grammar_bitmask`` fills the step's mask rows with
  :func:`maskplug.fill_draft_masks` (ragged: ``len(drafts) + 1`` rows per
  grammar request, in the scheduler's order, exactly the rows vLLM's workers
  expect), batching the fills of all requests of a provider per position;
  below :data:`SERIAL_BELOW` grammar requests :func:`few_rows` binds, checks
  and walks the step in one pass first (the usual step at low concurrency,
  where each Python call between forward passes counts).

Steps this producer does not cover fall back to vLLM's own loop, which drives
the same maskplug grammars through vLLM's grammar interface: a reasoning
parser that gates the grammar inside the draft window, and diffusion models.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from maskplug import DraftMasks, GrammarRows, ScheduledLayout, fill_draft_masks
from maskplug.engines.sdk import fill_windows_serially
from maskplug.grammar.sdk import Matcher

from . import common
from .backend import MaskplugGrammar, producer_matcher
from .host import draft_counts

__all__ = [
    "DRAFT_MASKS_ATTR",
    "WANT_DRAFT_MASKS_ATTR",
    "few_rows",
    "fill_step_bitmask",
    "fill_step_rows",
    "make_grammar_bitmask",
    "make_grammar_init",
]

DRAFT_MASKS_ATTR = "_maskplug_draft_masks"
"""Attribute of vLLM's ``StructuredOutputManager`` holding the last step's ``(grammar_req_ids, DraftMasks)``
(``None`` when vLLM's own loop produced the rows, or :data:`WANT_DRAFT_MASKS_ATTR` was not set); adaptive
verification reads it."""

WANT_DRAFT_MASKS_ATTR = "_maskplug_want_draft_masks"
"""Attribute of vLLM's ``StructuredOutputManager``: true while its caller reads the step's draft masks from
:data:`DRAFT_MASKS_ATTR` (adaptive verification sets it around the rows it asks for before the budget). Without
it nothing is recorded, and a step of few requests is only checked for rows that allow nothing: looking for
the single-token rows a budget reads costs a count of every row's allowed tokens."""


def _cu(counts: np.ndarray) -> np.ndarray:
    cu = np.zeros(counts.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    return cu


def fill_step_bitmask(
    bitmask: torch.Tensor,
    grammars: list[Any],
    grammar_req_ids: list[str],
    spec_tokens: dict[str, list[int]],
) -> int:
    """Fill the rows of one step into ``bitmask``; returns how many rows were written.

    ``grammars`` are the requests' :class:`~maskplug_vllm.backend.MaskplugGrammar`
    objects in ``grammar_req_ids`` order. Each request gets ``len(drafts) + 1``
    rows. vLLM pads missing drafts with ``-1``; its rows up to the first ``-1``
    are constrained and the rest are open. maskplug produces that by filling
    the window cut at the first ``-1`` (its last row is the cut window's
    always-constrained bonus row) and leaving the rows after it all-allowed.
    """
    return fill_step_rows(bitmask, grammars, grammar_req_ids, spec_tokens)[0]


#: Below this many grammar requests the rows are produced request by request on the calling
#: thread (``strategy="serial"``); from it on, the providers' chain and batch operations are used
#: (``"auto"``). Every strategy writes the same rows: with a few requests the per-call setup of
#: the batched operations costs more than it saves (on vLLM's CPU engine, about half of the
#: producer's time at one request).
SERIAL_BELOW = 32


def _strategy(num_grammar: int) -> str:
    return "serial" if num_grammar < SERIAL_BELOW else "auto"


#: Matcher types known to satisfy :class:`~maskplug.grammar.protocols.Matcher` (the protocol check is slow).
_MATCHER_TYPES: set[type] = set()


def _fill_few(
    bitmask: torch.Tensor,
    matchers: list[Any],
    grammar_req_ids: list[str],
    spec_tokens: dict[str, list[int]],
    find_forced: bool = True,
    requests: Mapping[str, Any] | None = None,
    grammars: list[Any] | None = None,
) -> tuple[int, DraftMasks, np.ndarray] | None:
    """The rows of a step with few grammar requests, by :func:`maskplug.fill_draft_masks`'s own serial walk.

    The same walk, fault handling and result as ``fill_draft_masks(...,
    strategy="serial")`` on the windows cut at the first ``-1`` (the walk
    and its tail are the producer's own code, run by
    :func:`maskplug.engines.sdk.fill_windows_serially`), without what that call
    spends on general input: no layout, row mapping or draft matrix checks
    (the windows come straight from vLLM's lists), one bitmask check. The
    cut windows are walked in place in the full windows' rows (the rows after
    a cut are left unfilled, so they come out all-allowed, as in the general
    path's copy); the rows written, the draft masks and the buffer's numpy
    view (with ``find_forced`` false, ``forced`` all False). ``None`` when
    the step needs the general path's handling:
    a matcher that is not a :class:`Matcher`, the same matcher twice, a
    matcher without a vocabulary or with another width, a draft id outside
    the vocabulary, or a bitmask the check refuses (the general path then
    raises or fails those requests, with its own messages).

    With ``requests`` (vLLM's map of the scheduler's requests) the matchers
    are those of the requests' grammars, taken in the same pass and appended
    to ``matchers`` (given empty), each grammar bound to its request and
    appended to ``grammars``; ``None`` as soon as one is not a
    :class:`~maskplug_vllm.backend.MaskplugGrammar` or has failed.
    """
    g_count = len(grammar_req_ids)
    if g_count == 0 or (requests is None and len(matchers) != g_count):
        return None
    # One pass: each matcher's type and vocabulary, its window cut at the first -1, its first row
    # (with ``requests`` also each request's grammar bound and its matcher taken: at one request in
    # flight each pass over the requests between forward passes costs microseconds).
    v0 = None
    size = 0
    windows: list[Sequence[int]] = []
    row0: list[int] = []
    total = 0
    get = spec_tokens.get
    for g in range(g_count):
        if requests is None:
            m = matchers[g]
        else:
            req = requests[grammar_req_ids[g]]
            gr = req.structured_output_request.grammar
            if not isinstance(gr, MaskplugGrammar) or gr.error is not None:
                return None
            if gr._request is None or gr._request() is not req:
                gr.bind(req)
            if grammars is not None:
                grammars.append(gr)
            m = gr.matcher
            matchers.append(m)
        cls = m.__class__
        if cls not in _MATCHER_TYPES:
            if not isinstance(m, Matcher):
                return None
            _MATCHER_TYPES.add(cls)
        v = getattr(m, "vocab", None)
        if v is None:
            return None
        if v0 is None:
            v0 = v
            size = v.vocab_size
        elif v is not v0 and v.vocab_size != size:
            return None  # (the same size is the same row width)
        d = get(grammar_req_ids[g], ())
        n = len(d)
        k = n
        for p in range(n):
            t = d[p]
            if t.__class__ is not int or t >= size:
                return None
            if t < 0:
                k = p
                break
        # The walk only reads its window: vLLM's own list serves when nothing is cut.
        windows.append(d if k == n else d[:k])
        row0.append(total)
        total += n + 1
    if g_count > 1 and len(set(map(id, matchers))) != g_count:
        return None
    buf = common.checked_buffer(bitmask, v0)
    if buf is None or total > buf[0]:
        return None
    # No claim: a request's grammar lives in vLLM's scheduler, whose thread makes every call on its
    # matcher (vLLM's own accept, validate and rollback included, which no claim guards either).
    dm = fill_windows_serially(
        matchers, windows, row0, bitmask, total, buf[1], claim_matchers=False, find_forced=find_forced
    )
    return total, dm, buf[1]


def few_rows(
    manager: Any,
    requests: Mapping[str, Any],
    grammar_req_ids: list[str],
    spec_tokens: dict[str, list[int]],
    find_forced: bool = True,
) -> common.FewResult | None:
    """:func:`fill_step_rows` of a step with few grammar requests, on the manager's buffer, binding as it goes.

    What the wrapped ``grammar_bitmask`` would do for the step, with the
    grammars bound and their matchers taken in one pass: ``None`` when a
    grammar is not maskplug's or has failed, or :func:`_fill_few` declines
    (the buffer too small or not yet checked among them); the general path
    then produces the step. With ``find_forced`` false the draft masks'
    ``forced`` is all False (:func:`maskplug.engines.sdk.fill_windows_serially`).
    """
    grammars: list[Any] = []
    done = _fill_few(manager._grammar_bitmask, [], grammar_req_ids, spec_tokens, find_forced, requests, grammars)
    if done is None:
        return None
    return done[0], done[1], grammars, done[2]


def fill_step_rows(
    bitmask: torch.Tensor,
    grammars: list[Any],
    grammar_req_ids: list[str],
    spec_tokens: dict[str, list[int]],
) -> tuple[int, DraftMasks]:
    """:func:`fill_step_bitmask`, also returning the producer's :class:`~maskplug.DraftMasks`.

    The draft masks are indexed in ``grammar_req_ids`` order (``request[g] == g``);
    with ``-1`` padding, ``acceptable`` counts within the window cut at the first
    ``-1`` (a padded draft is never acceptable). A request whose grammar fails
    (``DraftMasks.failed``, or a grammar that had already failed, whose
    matcher is not called again) gets the stop-only rows; the others' rows
    are those of the same step without it. Failing the grammars is the
    caller's (:func:`~maskplug_vllm.backend.fail_requests`).
    """
    g = len(grammar_req_ids)
    matchers = [producer_matcher(gr) for gr in grammars]
    if g < SERIAL_BELOW:
        few = _fill_few(bitmask, matchers, list(grammar_req_ids), spec_tokens)
        if few is not None:
            return few[0], few[1]
    return _fill_general(bitmask, matchers, grammar_req_ids, spec_tokens)


def _fill_general(
    bitmask: torch.Tensor, matchers: list[Any], grammar_req_ids: list[str], spec_tokens: dict[str, list[int]]
) -> tuple[int, DraftMasks]:
    """:func:`fill_step_rows` through :func:`maskplug.fill_draft_masks` (every batch size, every input)."""
    g = len(grammar_req_ids)
    nd = draft_counts(grammar_req_ids, spec_tokens)
    flat = np.fromiter(
        itertools.chain.from_iterable(spec_tokens.get(r, ()) for r in grammar_req_ids),
        dtype=np.int64,
        count=int(nd.sum()),
    )
    ones = np.ones(g, dtype=np.int64)
    rows = GrammarRows(grammar_req_ids)
    total = int(nd.sum()) + g
    pad = flat < 0
    if not pad.any():
        dm = fill_draft_masks(
            matchers, flat, bitmask, rows, ScheduledLayout(grammar_req_ids, nd, ones), strategy=_strategy(g)
        )
        return total, dm
    owner = np.repeat(np.arange(g), nd)
    pos = np.arange(flat.shape[0]) - _cu(nd)[owner]
    cut = nd.copy()
    np.minimum.at(cut, owner[pad], pos[pad])
    keep = pos < cut[owner]
    scratch = torch.empty((int(cut.sum()) + g, bitmask.shape[1]), dtype=torch.int32)
    dm = fill_draft_masks(
        matchers, flat[keep], scratch, rows, ScheduledLayout(grammar_req_ids, cut, ones), strategy=_strategy(g)
    )
    # Move the cut windows' rows to their places in the full windows; the rest stay open.
    src_owner = np.repeat(np.arange(g), cut + 1)
    dest = _cu(nd + 1)[src_owner] + np.arange(scratch.shape[0]) - _cu(cut + 1)[src_owner]
    bitmask[:total].fill_(-1)
    bitmask.index_copy_(0, torch.from_numpy(dest), scratch)
    return total, dm


def make_grammar_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``StructuredOutputManager.grammar_init`` so the engine's backend is maskplug's."""
    return common.make_grammar_init(orig, record_backend_name=False, ready_when_compiled=True)


def make_grammar_bitmask(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``StructuredOutputManager.grammar_bitmask`` so rows come from :func:`maskplug.fill_draft_masks`.

    ``len(drafts) + 1`` rows per grammar request (:func:`fill_step_rows`); the
    step's ``(grammar_req_ids, DraftMasks)`` is kept in :data:`DRAFT_MASKS_ATTR`
    while :data:`WANT_DRAFT_MASKS_ATTR` is set on the manager.
    """
    return common.make_grammar_bitmask(
        orig,
        rows=lambda ids, spec, stride: len(ids) + sum(len(spec.get(r, ())) for r in ids),
        # Looked up at each step, so fill_step_rows can be instrumented in place.
        fill=lambda bitmask, grammars, ids, spec, stride: fill_step_rows(bitmask, grammars, ids, spec),
        record=DRAFT_MASKS_ATTR,
        few=few_rows,
        few_below=SERIAL_BELOW,
        wanted=WANT_DRAFT_MASKS_ATTR,
    )
