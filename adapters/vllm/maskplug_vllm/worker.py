"""The two places vLLM 0.32 applies grammar masks, reimplemented on maskplug.

* :func:`apply_scatter` replaces ``vllm.v1.structured_output.utils.apply_grammar_bitmask``,
  called by the model runner that vLLM's CPU build uses (``CPUModelRunner``,
  a ``GPUModelRunner`` subclass). vLLM scatters the mask rows into a
  full-size, logits-shaped buffer and hands it to xgrammar's kernel; maskplug
  applies the rows in place through the row mapping instead, with no
  full-size buffer.
* :func:`apply_compacted` replaces ``StructuredOutputsWorker.apply_grammar_bitmask``
  of the newer model runner (``vllm.v1.worker.gpu``), whose logits adaptive
  verification may have compacted on the device. The mapping comes from the
  scheduled layout; the device ``cu_num_logits`` only decides which rows are
  live, so every budget regime is handled and the host never waits.

Both keep vLLM's calling conventions exactly, so they are drop-in replacements.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from maskplug import RowMapping
from maskplug.engines.sdk import ragged_mapping

from .common import apply_rows, make_apply_compacted
from .host import StepRows, draft_counts, step_rows

__all__ = ["SCHEDULED_SPEC_ATTR", "apply_compacted", "apply_scatter"]

SCHEDULED_SPEC_ATTR = "maskplug_scheduled_spec_decode_tokens"
"""Attribute of a scheduler output that maskplug's budget compacted: the drafts as scheduled.

The mask rows were produced for these; the output's own
``scheduled_spec_decode_tokens`` holds the drafts kept for verification.
"""


_ROWS_CACHE_SIZE = 256
#: A step's row mapping, its padded logits offsets and the grammar requests it maps beyond the batch.
_Hit = tuple[RowMapping, np.ndarray, int]
_rows_cache: dict[tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]], _Hit] = {}


def _scheduled_rows(
    req_ids: list[str], gids: list[str], spec: Mapping[str, list[int]]
) -> tuple[RowMapping, np.ndarray]:
    """The row mapping and padded row offsets of a step's scheduled drafts (:func:`_scheduled_step`)."""
    mapping, cu, _ = _scheduled_step(req_ids, gids, spec)
    return mapping, cu


def _scheduled_step(req_ids: list[str], gids: list[str], spec: Mapping[str, list[int]]) -> _Hit:
    """The row mapping, padded row offsets and absent grammar requests of a step, reused while the step repeats.

    A running batch sees the same few draft-count patterns step after step,
    so the mapping and offsets of a recent step with the same batch, grammar
    requests and counts are handed back instead of rebuilt (they are only
    read). The key is plain tuples: at a few requests, numpy arrays cost more
    to make than the lookup saves. A new step whose grammar requests are all
    in the batch, each once, is mapped directly from the counts
    (:func:`~maskplug.engines.sdk.ragged_mapping`: what :func:`step_rows`
    maps, without the layout, as the batch changes nearly every step under
    load); anything else goes through :func:`step_rows` and its checks, and
    steps with grammar requests outside the batch are never kept.
    """
    get = spec.get
    counts = tuple([len(get(r, ())) for r in req_ids])
    key = (tuple(req_ids), tuple(gids), counts)
    hit = _rows_cache.get(key)
    if hit is not None:
        return hit
    n = len(req_ids)
    index = {r: i for i, r in enumerate(req_ids)}
    idx = [index.get(g, -1) for g in gids]
    if len(index) == n and -1 not in idx and len(set(idx)) == len(idx):
        cu_list = [0] * (n + 1)
        acc = 0
        for i, c in enumerate(counts):
            acc += c + 1
            cu_list[i + 1] = acc
        hit = (ragged_mapping(idx, [counts[b] + 1 for b in idx], n), np.array(cu_list, dtype=np.int64), 0)
    else:
        rows = step_rows(req_ids, gids, np.array(counts, dtype=np.int64), 1, spec)
        hit = (rows.mapping, rows.pad_cu_logits(rows.layout.cu_scheduled[: rows.num_batch + 1]), rows.layout.n - n)
        if rows.num_batch != rows.layout.n:
            return hit
    if len(_rows_cache) >= _ROWS_CACHE_SIZE:
        _rows_cache.clear()
    _rows_cache[key] = hit
    return hit


def apply_scatter(scheduler_output: Any, grammar_output: Any, input_batch: Any, logits: torch.Tensor) -> None:
    """Drop-in for vLLM's ``apply_grammar_bitmask(scheduler_output, grammar_output, input_batch, logits)``.

    The logits hold ``1 + len(scheduled_spec_decode_tokens[r])`` rows per
    request in ``input_batch.req_ids`` order; mask rows come ragged in
    ``structured_output_request_ids`` order. When maskplug's budget compacted
    the step, the scheduler output carries the drafts as scheduled
    (:data:`SCHEDULED_SPEC_ATTR`): the row mapping is built from those, the
    live row offsets from the kept drafts, so rows of trimmed drafts are
    never applied.
    """
    bitmask_np = grammar_output.grammar_bitmask
    gids = list(grammar_output.structured_output_request_ids)
    if not gids or logits.shape[0] == 0:
        return
    req_ids = list(input_batch.req_ids)
    active = scheduler_output.scheduled_spec_decode_tokens
    spec = getattr(scheduler_output, SCHEDULED_SPEC_ATTR, None)
    if spec is None:
        spec = active
    mapping, cu, absent = _scheduled_step(req_ids, gids, spec)
    if spec is not active:
        live = np.zeros(len(req_ids) + 1 + absent, dtype=np.int64)
        np.cumsum(draft_counts(req_ids, active) + 1, out=live[1 : len(req_ids) + 1])
        live[len(req_ids) + 1 :] = live[len(req_ids)]  # absent grammar requests: no logits rows
        cu = live
    apply_rows(logits, bitmask_np, mapping, cu)


def _compacted_rows(worker: Any, input_batch: Any, grammar_req_ids: list[str], grammar_bitmask: np.ndarray) -> StepRows:
    """The ragged rows of one step: each request's scheduled drafts and ``worker.num_bonus_tokens`` rows."""
    num_bonus = int(worker.num_bonus_tokens)
    req_ids = list(input_batch.req_ids)
    n = len(req_ids)
    nd = input_batch.num_draft_tokens_per_req
    if nd is None:
        # No drafts scheduled: every request has just its bonus rows.
        nd = np.maximum(np.diff(np.asarray(input_batch.cu_num_logits_np[: n + 1], dtype=np.int64)) - num_bonus, 0)
    return step_rows(req_ids, grammar_req_ids, np.asarray(nd, dtype=np.int64)[:n], num_bonus)


apply_compacted = make_apply_compacted(_compacted_rows)
"""Drop-in for ``StructuredOutputsWorker.apply_grammar_bitmask(self, logits, input_batch, ids, bitmask)``.

The bitmask's rows are ragged (:func:`_compacted_rows`); see
:func:`maskplug_vllm.common.make_apply_compacted`.
"""
