"""The invariant checks every simulated step runs, each an independent recomputation.

Each check returns what it found wrong as messages (empty when all holds);
the engine records them as the step's violations. They check:

* the chain layout (:func:`chain_layout_problems`): mapping length, capacity
  a per-request prefix summing to the budget, device offsets against the host
  compaction, allocation and regime against :mod:`maskplug.reference`;
* the tree layout (:func:`tree_mapping_problems`, :func:`tree_layout_problems`):
  mapping, budget, kept nodes, compaction and live mapping against
  :mod:`maskplug.reference` and the host :func:`maskplug.select_subtree`;
* masking (:func:`masking_problems`): ``-inf`` exactly at the disallowed
  tokens of a few rows, nothing else changed;
* emitted tokens (:func:`allowed`): each allowed by its mask row;
* finished outputs (:func:`output_verdict`): valid JSON for the schema, a
  full match of the regex.
"""

from __future__ import annotations

import json

import numpy as np
import numpy.typing as npt
import torch

from .. import reference
from ..budget import CostModel
from ..layout import GrammarRows, RowMapping
from ..trees import select_subtree
from .stages import ChainBatch, ChainBudget, ChainMasks, TreeBatch, TreeBudget, TreeStepMasks
from .workload import RequestSpec

__all__ = [
    "allowed",
    "chain_layout_problems",
    "masking_problems",
    "output_verdict",
    "row_allowed",
    "tree_layout_problems",
    "tree_mapping_problems",
]

I64 = npt.NDArray[np.int64]


def allowed(bitmask_np: npt.NDArray[np.int32], rows: I64, tokens: I64) -> npt.NDArray[np.bool_]:
    """Independent bit test: is ``tokens[i]`` allowed by mask row ``rows[i]``?"""
    words = bitmask_np[rows, tokens >> 5].astype(np.int64) & 0xFFFFFFFF
    return ((words >> (tokens & 31)) & 1).astype(bool)


def row_allowed(bitmask_row: npt.NDArray[np.int32], vocab_size: int) -> npt.NDArray[np.bool_]:
    """The allowed-token vector of one mask row (little-endian bit order, ``docs/design.md`` §2)."""
    bits = np.unpackbits(bitmask_row.astype("<i4").view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def masking_problems(
    before: torch.Tensor, after: torch.Tensor, rows: I64, mrow: I64, bm_np: npt.NDArray[np.int32], vocab_size: int
) -> list[str]:
    """Logits rows ``rows`` (values ``before`` and ``after`` masking) masked exactly by their mask rows ``mrow``."""
    found = []
    for i, row in enumerate(rows.tolist()):
        allowed_row = torch.from_numpy(row_allowed(bm_np[mrow[row]], vocab_size))
        if not torch.equal(torch.where(allowed_row, before[i], float("-inf")), after[i]):
            found.append(f"logits row {row} not masked exactly by mask row {int(mrow[row])}")
    return found


def chain_layout_problems(batch: ChainBatch, masks: ChainMasks, budget: ChainBudget, grammar_aware: bool) -> list[str]:
    """The layout invariants of a chain step's stages 3–4, against :mod:`maskplug.reference` where it has an answer."""
    found = []
    b, cap, cu_np, comp = budget.b, budget.cap, budget.cu_np, budget.comp
    num_drafts, num_bonus = batch.num_drafts, batch.layout.num_bonus
    dm = masks.dm
    if not 0 <= b <= budget.view.cap:
        found.append(f"budget {b} outside [0, {budget.view.cap}]")
    if len(masks.mapping) != masks.num_rows or masks.bitmask.shape[0] != masks.num_rows:
        found.append(
            f"mapping has {len(masks.mapping)} rows, bitmask {masks.bitmask.shape[0]}, producer {masks.num_rows}"
        )
    if int(cap.sum()) != b or np.any(cap < 0) or np.any(cap > num_drafts):
        found.append(f"capacity {cap.tolist()} does not split budget {b} within {num_drafts.tolist()}")
    if not grammar_aware:
        ref_cap = reference.allocate(budget.live.numpy(), num_drafts, b)
        if list(ref_cap) != cap.tolist():
            found.append(f"allocate {cap.tolist()} differs from the reference {list(ref_cap)}")
    elif dm is not None and masks.g_idx.size and np.any(cap[dm.request] > dm.acceptable):
        found.append("grammar-aware allocation admitted drafts the grammar rejects")
    expect_cu = np.concatenate([[0], np.cumsum(cap + num_bonus)])
    if not np.array_equal(cu_np, expect_cu):
        found.append(f"active cu_logits {cu_np.tolist()} != cumsum(capacity + bonus) {expect_cu.tolist()}")
    if comp.num_tokens != int(batch.num_non_draft.sum()) + b:
        found.append(f"compaction keeps {comp.num_tokens} tokens, expected {int(batch.num_non_draft.sum()) + b}")
    if comp.exact and not np.array_equal(comp.cu_logits, cu_np):
        found.append(f"exact host cu_logits {comp.cu_logits.tolist()} != device {cu_np.tolist()}")
    found += _regime_problems(batch, budget.b, comp.regime, budget.regime)
    return found


def _regime_problems(batch: ChainBatch | TreeBatch, b: int, compacted: str, chosen: str) -> list[str]:
    """The compaction's regime and :func:`maskplug.compaction.regime_of`'s, against the reference's."""
    ref_regime = reference.compact(batch.layout, b).regime
    if compacted != chosen or ref_regime != chosen:
        return [f"compaction regime {compacted!r}, regime_of {chosen!r}, reference {ref_regime!r} differ"]
    return []


def tree_mapping_problems(batch: TreeBatch, masks: TreeStepMasks, rows: GrammarRows) -> list[str]:
    """A tree step's row mapping: one entry per mask row, as :func:`maskplug.reference.mapping` builds it."""
    found = []
    mapping, num_rows = masks.mapping, masks.num_rows
    if len(mapping) != num_rows or masks.bitmask.shape[0] != num_rows:
        found.append(f"mapping has {len(mapping)} rows, bitmask {masks.bitmask.shape[0]}, producer {num_rows}")
    ref_map = reference.mapping(rows, batch.layout)
    if not (np.array_equal(mapping.request, ref_map.request) and np.array_equal(mapping.position, ref_map.position)):
        found.append("tree row mapping differs from maskplug.reference.mapping")
    return found


def tree_layout_problems(
    batch: TreeBatch, masks: TreeStepMasks, budget: TreeBudget, cost: CostModel, *, use_grammar: bool, verify_all: bool
) -> list[str]:
    """Budget, kept nodes, compaction and live mapping against :mod:`maskplug.reference` and the host path."""
    found = []
    tree, b, comp = batch.tree, budget.b, budget.comp
    grammar = masks.tm if use_grammar else None
    if not 0 <= b <= budget.cap_max:
        found.append(f"budget {b} outside [0, {budget.cap_max}]")
    if not verify_all:
        ref_b = reference.choose_tree_budget(
            budget.conf, tree, cost, max_logits=budget.max_logits, grammar=grammar
        ).budget
        if ref_b != b:
            found.append(f"tree budget {b} differs from the reference {ref_b}")
    if not np.array_equal(select_subtree(budget.conf, tree, b, grammar), budget.keep):
        found.append("allocate_tree keeps other nodes than select_subtree")
    ref_keep = reference.select_subtree(budget.conf, tree, b, grammar)
    flat_ref = np.asarray([x for row in ref_keep for x in row], dtype=bool)
    if not np.array_equal(flat_ref, budget.keep):
        found.append("allocate_tree keeps other nodes than maskplug.reference.select_subtree")
    ref = reference.compact_tree(tree, ref_keep)
    for name in ("capacity", "cu_logits", "kept_node", "kept_parent", "kept_depth", "live_position"):
        if np.asarray(getattr(comp, name)).tolist() != list(ref[name]):
            found.append(f"compact_tree {name} differs from maskplug.reference.compact_tree")
    if int(comp.capacity.sum()) != b or comp.num_tokens != int(batch.num_non_draft.sum()) + b:
        found.append(f"compaction keeps {comp.num_tokens} tokens for budget {b}")
    found += _regime_problems(batch, b, comp.regime, budget.regime)
    if use_grammar and masks.tm is not None:
        for i, r in enumerate(masks.tm.request.tolist()):
            a, e = int(tree.cu_nodes[r]), int(tree.cu_nodes[r + 1])
            if np.any(budget.keep[a:e] & ~masks.tm.valid[i, : e - a]):
                found.append(
                    f"grammar-aware tree budget kept a node of request {int(batch.rid[r])} the grammar rejects"
                )
    if not _sends_kept_rows_live(batch, masks.mapping, budget):
        found.append("live mapping does not send each kept node's row to its live position")
    return found


def _sends_kept_rows_live(batch: TreeBatch, mapping: RowMapping, budget: TreeBudget) -> bool:
    """The live mapping, rebuilt independently: node j's row goes to 1 + its rank among the kept nodes."""
    tree, lay = batch.tree, batch.layout
    req = mapping.request.astype(np.int64)
    pos = mapping.position.astype(np.int64)
    exp_req, exp_pos = req.copy(), pos.copy()
    for i in range(req.shape[0]):
        r, p = int(req[i]), int(pos[i])
        if r < 0 or p == 0:
            continue
        nd = int(lay.num_drafts[r])
        kept = budget.keep[tree.cu_nodes[r] : tree.cu_nodes[r + 1]]
        if p > nd:
            exp_pos[i] = int(kept.sum()) + p - nd
        elif kept[p - 1]:
            exp_pos[i] = int(kept[: p - 1].sum()) + 1
        else:
            exp_req[i], exp_pos[i] = -1, -1
    lm = budget.live_map
    return np.array_equal(lm.request.astype(np.int64), exp_req) and np.array_equal(
        lm.position.astype(np.int64), exp_pos
    )


def output_verdict(spec: RequestSpec, body: bytes) -> str:
    """A stopped output (``body``: its bytes without the stop token) checked: ``"valid"`` or ``"invalid"``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid"
    if spec.kind == "json":
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), spec.schema or {})
        except (ValueError, jsonschema.ValidationError):
            return "invalid"
        return "valid"
    if spec.kind == "regex":
        import regex

        return "valid" if regex.fullmatch(spec.pattern or "", text) is not None else "invalid"
    return "valid"
