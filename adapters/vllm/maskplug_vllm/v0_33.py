"""vLLM 0.33's structured-output code, served by maskplug with the fixed producer layout.

vLLM 0.33 gives every grammar request a fixed-width block of
``mask_stride = num_speculative_tokens + 1`` mask rows: its producer
(``StructuredOutputManager.grammar_bitmask``) writes request ``g``'s rows at
``g * mask_stride`` and both consumers read them that way. The scatter path
(``structured_output.utils.apply_grammar_bitmask``) steps through the bitmask
``mask_stride`` rows at a time; the newer runner's ``StructuredOutputsWorker``
maps row ``g * mask_stride + p`` to ``(request, p)`` and applies it only where
``p`` is below the request's width in the device ``cu_num_logits``. The rows
past a request's ``len(drafts) + 1`` are unused (vLLM leaves whatever was
there before).

maskplug speaks this layout as :class:`maskplug.GrammarRows` in fixed mode:

* :func:`make_grammar_bitmask` fills each block with
  :func:`maskplug.fill_draft_masks` (unused rows all-allowed);
* :func:`apply_scatter` and :func:`apply_compacted` build the row mapping from
  the scheduled layout with the same stride, so rows of trimmed drafts and
  unused rows never write;
* :func:`make_grammar_init` installs maskplug's backend and records its name
  in ``backend_name``, so vLLM's one-backend-per-engine check still runs
  (vLLM only records the name when it creates the backend itself).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from maskplug import DraftMasks, GrammarRows, LayoutError, ScheduledLayout, fill_draft_masks

from . import common
from .backend import producer_matcher
from .common import apply_rows
from .host import StepRows, draft_counts, step_rows

__all__ = [
    "NUM_BONUS",
    "apply_compacted",
    "apply_scatter",
    "fill_step_bitmask",
    "fill_step_rows",
    "fixed_step_rows",
    "make_grammar_bitmask",
    "make_grammar_init",
    "mask_stride_of",
]

NUM_BONUS = 1
"""Logits rows per request besides its drafts in vLLM 0.33 (``ModelState.num_new_sampled_tokens_per_step``)."""


def mask_stride_of(bitmask_rows: int, num_grammar_requests: int) -> int:
    """The block width of a fixed-layout bitmask, as vLLM 0.33's consumers derive it (rows ÷ requests)."""
    if num_grammar_requests <= 0:
        raise LayoutError(f"grammar_req_ids: expected at least one grammar request, got {num_grammar_requests}")
    stride, rest = divmod(int(bitmask_rows), num_grammar_requests)
    if rest or stride < 1:
        raise LayoutError(
            f"grammar_bitmask: expected a whole block of rows per grammar request (fixed layout), got "
            f"{bitmask_rows} rows for {num_grammar_requests} requests"
        )
    return stride


def fixed_step_rows(
    req_ids: Sequence[str],
    grammar_req_ids: Sequence[str],
    num_drafts: npt.NDArray[np.integer] | Sequence[int],
    num_bonus: int,
    stride: int,
    grammar_num_drafts: Mapping[str, Sequence[int]] | None = None,
) -> StepRows:
    """The scheduled layout and the fixed-stride row mapping for one step.

    Like :func:`maskplug_vllm.host.step_rows`, but ``stride`` rows per grammar
    request; a row past the request's ``num_drafts + num_bonus`` maps to
    ``-1`` (never applied). A grammar request the batch does not hold is
    appended with its scheduled drafts and no logits rows.

    Raises:
        LayoutError: duplicate ids, bad counts, a request that needs more rows
            than ``stride``, or an absent grammar request whose drafts are
            unknown.
    """
    return step_rows(req_ids, grammar_req_ids, num_drafts, num_bonus, grammar_num_drafts, stride=stride)


# ------------------------------------------------------------------ workers --


def apply_scatter(scheduler_output: Any, grammar_output: Any, input_batch: Any, logits: torch.Tensor) -> None:
    """Drop-in for vLLM 0.33's ``apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits)``.

    The logits hold ``1 + len(scheduled_spec_decode_tokens[r])`` rows per
    request in ``input_batch.req_ids`` order; the bitmask holds one block of
    ``rows ÷ len(structured_output_request_ids)`` rows per grammar request.
    """
    bitmask_np = grammar_output.grammar_bitmask
    gids = list(grammar_output.structured_output_request_ids)
    if not gids or logits.shape[0] == 0:
        return
    stride = mask_stride_of(bitmask_np.shape[0], len(gids))
    req_ids = list(input_batch.req_ids)
    spec = scheduler_output.scheduled_spec_decode_tokens
    rows = fixed_step_rows(req_ids, gids, draft_counts(req_ids, spec), NUM_BONUS, stride, spec)
    cu = rows.pad_cu_logits(rows.layout.cu_scheduled[: rows.num_batch + 1])
    apply_rows(logits, bitmask_np, rows.mapping, cu)


def _scheduled_drafts(input_batch: Any, n: int) -> npt.NDArray[np.int64]:
    """Drafts scheduled per request, checked against the host offsets vLLM 0.33 keeps.

    ``num_draft_tokens_per_req`` is None when nothing was drafted. The host
    ``cu_num_logits_np`` holds the scheduled widths (``drafts + 1``) or, when
    adaptive verification chose budget 0, one row per request; anything else
    means the batch is not what this adapter was written for.
    """
    nd_in = input_batch.num_draft_tokens_per_req
    cu_np = np.asarray(input_batch.cu_num_logits_np[: n + 1], dtype=np.int64)
    widths = np.diff(cu_np)
    if nd_in is None:
        nd = np.zeros(n, dtype=np.int64)
    else:
        nd = np.asarray(nd_in, dtype=np.int64)[:n]
    if not (np.array_equal(widths, nd + NUM_BONUS) or np.all(widths == NUM_BONUS)):
        raise LayoutError(
            f"input_batch.cu_num_logits_np: expected {NUM_BONUS} + drafts rows per request (or {NUM_BONUS} "
            f"after budget 0), got widths {widths.tolist()} for drafts {nd.tolist()}"
        )
    return nd


def _compacted_rows(worker: Any, input_batch: Any, grammar_req_ids: list[str], grammar_bitmask: np.ndarray) -> StepRows:
    """The fixed rows of one step: ``worker.mask_stride`` rows per grammar request, checked against the bitmask."""
    stride = int(worker.mask_stride)
    if grammar_bitmask.shape[0] != stride * len(grammar_req_ids):
        raise LayoutError(
            f"grammar_bitmask: expected {stride} rows (mask_stride) per grammar request, "
            f"{stride * len(grammar_req_ids)} in all, got {grammar_bitmask.shape[0]}"
        )
    req_ids = list(input_batch.req_ids)
    return fixed_step_rows(req_ids, grammar_req_ids, _scheduled_drafts(input_batch, len(req_ids)), NUM_BONUS, stride)


apply_compacted = common.make_apply_compacted(_compacted_rows)
"""Drop-in for vLLM 0.33's ``StructuredOutputsWorker.apply_grammar_bitmask(self, logits, input_batch, ids, bitmask)``.

The bitmask has ``worker.mask_stride`` rows per grammar request (:func:`_compacted_rows`); see
:func:`maskplug_vllm.common.make_apply_compacted`.
"""


# ---------------------------------------------------------------- scheduler --


def fill_step_bitmask(
    bitmask: torch.Tensor,
    grammars: list[Any],
    grammar_req_ids: list[str],
    spec_tokens: Mapping[str, Sequence[int]],
    stride: int,
) -> int:
    """Fill one step's fixed-layout rows into ``bitmask``; returns how many rows were written.

    :func:`fill_step_rows` without the draft masks.
    """
    return fill_step_rows(bitmask, grammars, grammar_req_ids, spec_tokens, stride)[0]


def fill_step_rows(
    bitmask: torch.Tensor,
    grammars: list[Any],
    grammar_req_ids: list[str],
    spec_tokens: Mapping[str, Sequence[int]],
    stride: int,
) -> tuple[int, DraftMasks]:
    """Fill one step's fixed-layout rows into ``bitmask``; returns how many rows were written and the draft masks.

    Request ``g`` (``grammar_req_ids`` order) owns rows ``g * stride`` to
    ``(g + 1) * stride - 1``. vLLM pads missing drafts with ``-1``: the rows up
    to the first ``-1`` are constrained, the rest open. In the fixed layout
    that is exactly the window cut at the first ``-1``: its last row is the
    cut window's bonus row, and every row past it is an unused (all-allowed)
    row of the block. A request whose grammar fails (``DraftMasks.failed``,
    indexed in ``grammar_req_ids`` order, or a grammar that had already
    failed) gets the stop-only rows; the others are unaffected.
    """
    g = len(grammar_req_ids)
    nd = draft_counts(grammar_req_ids, spec_tokens)
    if nd.size and int(nd.max()) + 1 > stride:
        worst = int(np.argmax(nd))
        raise LayoutError(
            f"scheduled_spec_decode_tokens: expected at most {stride - 1} drafts per request (mask_stride "
            f"{stride}), got {int(nd[worst])} for request {grammar_req_ids[worst]!r}"
        )
    cut = nd.copy()
    drafts: list[Sequence[int]] = []
    for i, r in enumerate(grammar_req_ids):
        toks = spec_tokens.get(r, ())
        for j, t in enumerate(toks):
            if t < 0:
                cut[i] = j
                break
        drafts.append(toks[: int(cut[i])])
    flat = np.fromiter((t for d in drafts for t in d), dtype=np.int64, count=int(cut.sum()))
    layout = ScheduledLayout(grammar_req_ids, cut, np.ones(g, dtype=np.int64))
    matchers = [producer_matcher(gr) for gr in grammars]
    dm = fill_draft_masks(matchers, flat, bitmask, GrammarRows(grammar_req_ids, "fixed", stride), layout)
    return g * stride, dm


def make_grammar_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM 0.33's ``StructuredOutputManager.grammar_init`` so the engine's backend is maskplug's.

    vLLM records ``backend_name`` only when it creates the backend itself;
    this wrapper records it alongside maskplug's backend, so a later request
    that resolved to another vLLM backend is still refused by vLLM's own
    one-backend-per-engine check.
    """
    return common.make_grammar_init(orig, record_backend_name=True)


def make_grammar_bitmask(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM 0.33's ``StructuredOutputManager.grammar_bitmask`` so rows come from :func:`maskplug.fill_draft_masks`.

    Each grammar request gets its block of ``num_speculative_tokens + 1``
    rows (:func:`fill_step_rows`), whatever its drafts.
    """
    return common.make_grammar_bitmask(
        orig,
        rows=lambda ids, spec, stride: len(ids) * stride,
        # Looked up at each step, so fill_step_rows can be instrumented in place.
        fill=lambda bitmask, grammars, ids, spec, stride: fill_step_rows(bitmask, grammars, ids, spec, stride),
    )
