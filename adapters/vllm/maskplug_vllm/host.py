"""Host-side translation from vLLM's per-step batch description to maskplug's layouts.

vLLM hands its workers the batch as lists and dicts keyed by request id. These
helpers turn them into a :class:`maskplug.ScheduledLayout` and the row mapping
with numpy, once per step; nothing here loops over positions, and the only
per-request work is reading vLLM's own dict of draft lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from maskplug import GrammarRows, LayoutError, RowMapping, ScheduledLayout

__all__ = ["StepRows", "draft_counts", "step_rows"]


def draft_counts(req_ids: Sequence[str], spec_tokens: Mapping[str, Sequence[int]]) -> npt.NDArray[np.int64]:
    """Scheduled drafts per request, in ``req_ids`` order (padding ``-1`` drafts included: they have logits rows)."""
    get = spec_tokens.get
    return np.fromiter((len(get(r, ())) for r in req_ids), dtype=np.int64, count=len(req_ids))


@dataclass(frozen=True)
class StepRows:
    """One step's scheduled layout and the mask-row mapping built from it.

    Attributes:
        layout: the scheduled layout over the batch, followed by any grammar
            request the batch does not hold (see :func:`step_rows`).
        mapping: one entry per bitmask row (producer order).
        num_batch: requests actually in the batch; entries past it in
            ``layout`` have no logits rows.
    """

    layout: ScheduledLayout
    mapping: RowMapping
    num_batch: int

    def pad_cu_logits(self, cu_logits: npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
        """Extend the batch's ``n + 1`` offsets with zero-width entries for absent grammar requests."""
        cu = np.asarray(cu_logits, dtype=np.int64)
        extra = self.layout.n - self.num_batch
        if extra == 0:
            return cu
        return np.concatenate([cu, np.full(extra, cu[-1], dtype=np.int64)])


def step_rows(
    req_ids: Sequence[str],
    grammar_req_ids: Sequence[str],
    num_drafts: npt.NDArray[np.integer] | Sequence[int],
    num_bonus: int,
    grammar_num_drafts: Mapping[str, Sequence[int]] | None = None,
    stride: int | None = None,
) -> StepRows:
    """Build the scheduled layout and the row mapping for one step.

    Ragged rows (vLLM 0.32) by default; with ``stride``, fixed blocks of
    ``stride`` rows per grammar request (vLLM 0.33's producer layout).

    Args:
        req_ids: the batch in logits order.
        grammar_req_ids: the structured-output requests in the order the
            scheduler emitted their mask rows.
        num_drafts: scheduled drafts per batch request.
        num_bonus: logits rows per request besides its drafts.
        grammar_num_drafts: the scheduler's draft lists; only consulted for
            grammar requests that the batch does not hold (vLLM still emits
            rows for them; they are mapped to a request with no logits rows,
            so they are never applied).
        stride: rows per grammar request in the fixed layout; None: ragged.

    Raises:
        LayoutError: duplicate ids, bad counts, or an absent grammar request
            whose drafts are unknown.
    """
    # Lists and a set, not numpy string arrays: converting a few hundred
    # Python strings to numpy costs more than the whole lookup.
    ids = list(req_ids)
    gids = list(grammar_req_ids)
    nd = np.asarray(num_drafts, dtype=np.int64)
    n = len(ids)
    if nd.shape != (n,):
        raise LayoutError(f"num_drafts: expected {n} counts (one per batch request), got shape {nd.shape}")
    present = set(ids)
    missing = [g for g in gids if g not in present]
    if missing:
        if grammar_num_drafts is None:
            raise LayoutError(
                f"grammar_req_ids: request {missing[0]!r} is not in the batch and its drafts are unknown "
                "(pass grammar_num_drafts)"
            )
        ids = ids + missing
        nd = np.concatenate([nd, draft_counts(missing, grammar_num_drafts)])
    layout = ScheduledLayout(ids, nd, np.ones(len(ids), dtype=np.int64), num_bonus=num_bonus)
    rows = GrammarRows(gids) if stride is None else GrammarRows(gids, "fixed", stride)
    return StepRows(layout, rows.mapping(layout), n)
