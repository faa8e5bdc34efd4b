"""The slow, obviously-correct oracle of every public computation.

Plain Python loops over requests, rows and bits; no vectorisation tricks. Every
fast path in maskplug is tested bit for bit against these functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .budget import BudgetDecision, CostModel
from .compaction import Compaction
from .draftmasks import DraftMasks
from .layout import GrammarRows, RowMapping, ScheduledLayout

__all__ = [
    "allocate",
    "apply_grammar_bitmask",
    "choose_budget",
    "choose_tree_budget",
    "compact",
    "compact_tree",
    "mapping",
    "select_subtree",
    "token_allowed",
    "tree_mask_rows",
    "tree_node_values",
]


def token_allowed(bitmask_row: Any, token: int) -> bool:
    """Bit ``token & 31`` of word ``token >> 5``."""
    word = int(bitmask_row[token >> 5]) & 0xFFFFFFFF
    return bool((word >> (token & 31)) & 1)


def mapping(rows: GrammarRows, layout: ScheduledLayout) -> RowMapping:
    """Row → (request, position), one request at a time."""
    req: list[int] = []
    pos: list[int] = []
    for rid in rows.grammar_req_ids.tolist():
        r = next(i for i, x in enumerate(layout.req_ids.tolist()) if x == rid)
        need = int(layout.num_drafts[r]) + layout.num_bonus
        total = need if rows.mode == "ragged" else int(rows.stride or 0)
        for p in range(total):
            if p < need:
                req.append(r)
                pos.append(p)
            else:
                req.append(-1)
                pos.append(-1)
    return RowMapping(np.array(req, dtype=np.int32), np.array(pos, dtype=np.int32))


def apply_grammar_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    mapping: RowMapping | tuple[Any, Any],
    cu_logits: Any,
    *,
    vocab_size: int | None = None,
    tail: str = "mask",
) -> None:
    """Row by row, token by token, in place (inputs assumed valid)."""
    if isinstance(mapping, RowMapping):
        req, pos = mapping.request, mapping.position
    else:
        req, pos = mapping
    reqs = [int(v) for v in np.asarray(req.cpu() if isinstance(req, torch.Tensor) else req).tolist()]
    poss = [int(v) for v in np.asarray(pos.cpu() if isinstance(pos, torch.Tensor) else pos).tolist()]
    cu = [int(v) for v in (cu_logits.tolist() if hasattr(cu_logits, "tolist") else list(cu_logits))]
    width = logits.shape[1]
    words = bitmask.shape[1]
    vs = min(width, 32 * words) if vocab_size is None else vocab_size
    bm = bitmask.cpu().numpy()
    out = logits.detach().cpu().clone()
    for i, (r, p) in enumerate(zip(reqs, poss, strict=True)):
        if r < 0 or p >= cu[r + 1] - cu[r]:
            continue
        row = cu[r] + p
        mask_row = bm[i].tolist()
        # Collect the row's disallowed columns token by token, then write them
        # in one assignment (one tensor write per token made the oracle too
        # slow for thousands of property-test examples).
        drop = [t for t in range(width) if (t >= vs and tail == "mask") or (t < vs and not token_allowed(mask_row, t))]
        if drop:
            out[row, drop] = float("-inf")
    logits.copy_(out.to(logits.device))


def _survival(confidences: Any, layout: ScheduledLayout) -> list[list[float]]:
    conf = np.asarray(confidences, dtype=np.float64)
    s: list[list[float]] = []
    for r in range(layout.n):
        run, row = 1.0, []
        for k in range(int(layout.num_drafts[r])):
            run *= float(conf[r, k])
            row.append(run)
        s.append(row)
    return s


def _best_budget(
    values: list[list[float]],
    layout: ScheduledLayout,
    cost: CostModel,
    num_sampling: int | None,
    max_logits: int | None,
) -> BudgetDecision:
    """Try every budget ``b``, admitting the ``b`` largest ``values``; keep the first best ``est/cost``.

    ``values`` are per request, per draft (or node): what admitting it adds to
    the expected tokens. The answer of :func:`choose_budget` and
    :func:`choose_tree_budget` alike.
    """
    vals = sorted((v for row in values for v in row), reverse=True)
    n = layout.n
    ns = n if num_sampling is None else num_sampling
    cap = layout.total_drafts
    if max_logits is not None:
        cap = min(cap, max_logits - n * layout.num_bonus)
    best: BudgetDecision | None = None
    for b in range(cap + 1):
        est = ns + sum(vals[:b])
        c = float(cost.draft_ms(n)) + float(cost.verify_ms(int(layout.num_non_draft.sum()) + b))
        if best is None or est / c > best.expected_tokens / best.cost_ms:
            best = BudgetDecision(b, float(est), c)
    assert best is not None
    return best


def choose_budget(
    confidences: Any,
    layout: ScheduledLayout,
    cost: CostModel,
    *,
    num_sampling: int | None = None,
    max_logits: int | None = None,
    grammar: DraftMasks | None = None,
) -> BudgetDecision:
    """Try every budget; keep the first best ``est/cost``."""
    conf = np.array(confidences, dtype=np.float64, copy=True)
    if grammar is not None:
        for g, r in enumerate(grammar.request.tolist()):
            for k in range(conf.shape[1]):
                if k >= int(grammar.acceptable[g]):
                    conf[r, k] = 0.0
                elif k < grammar.forced.shape[1] and grammar.forced[g, k]:
                    conf[r, k] = 1.0
    return _best_budget(_survival(conf, layout), layout, cost, num_sampling, max_logits)


def allocate(confidences: Any, num_drafts: Any, budget: int) -> list[int]:
    """Greedy: repeatedly admit the best remaining (survival, -position, -request)."""
    conf = np.asarray(torch.as_tensor(confidences).cpu().double())
    nd = [int(v) for v in np.asarray(num_drafts).tolist()]
    layout = ScheduledLayout(list(range(len(nd))), nd, [1] * len(nd))
    surv = _survival(conf, layout)
    cand = [(surv[r][k], -k, -r, r) for r in range(len(nd)) for k in range(nd[r])]
    cand.sort(reverse=True)
    cap = [0] * len(nd)
    for item in cand[:budget]:
        cap[item[3]] += 1
    return cap


def compact(layout: ScheduledLayout, budget: int, capacity: Any = None) -> Compaction:
    """The compaction table, request by request."""
    total = layout.total_drafts
    regime = "full" if budget == total else ("zero" if budget == 0 else "partial")
    nb = layout.num_bonus
    if capacity is not None:
        cap = [int(c) for c in np.asarray(capacity).tolist()]
        exact = True
    elif regime == "full":
        cap = [int(d) for d in layout.num_drafts.tolist()]
        exact = True
    elif regime == "zero":
        cap = [0] * layout.n
        exact = True
    else:
        cap, left = [], budget
        for d in layout.num_drafts.tolist():
            take = min(int(d), left)
            cap.append(take)
            left -= take
        exact = False
    tokens = [int(layout.num_non_draft[r]) + cap[r] for r in range(layout.n)]
    cu = [0]
    for r in range(layout.n):
        rows = cap[r] + nb if exact else int(layout.num_drafts[r]) + nb
        cu.append(cu[-1] + rows)
    return Compaction(regime, np.array(tokens, dtype=np.int64), np.array(cu, dtype=np.int64), exact)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Draft trees (maskplug.trees): node by node, path by path.


def _tree_paths(parents: list[int]) -> list[list[int]]:
    """For each node, the nodes from the root's child down to it (following parent links)."""
    paths: list[list[int]] = []
    for j in range(len(parents)):
        path, q = [], j
        while q >= 0:
            path.append(q)
            q = parents[q]
        paths.append(path[::-1])
    return paths


def tree_node_values(confidences: Any, tree: Any, grammar: Any = None) -> list[list[float]]:
    """Per request, per node: the product of (grammar-corrected) confidences along its path."""
    conf = np.asarray(confidences, dtype=np.float64)
    lay = tree.layout
    valid: dict[int, list[bool]] = {}
    forced: dict[int, list[bool]] = {}
    if grammar is not None:
        for g, r in enumerate(grammar.request.tolist()):
            valid[r] = [bool(x) for x in grammar.valid[g].tolist()]
            forced[r] = [bool(x) for x in grammar.forced[g].tolist()]
    out: list[list[float]] = []
    for r in range(lay.n):
        parents = [int(p) for p in tree.parents_of(r).tolist()]
        row: list[float] = []
        for path in _tree_paths(parents):
            v = 1.0
            for q in path:
                c = float(conf[r, q])
                if r in valid:
                    if not valid[r][q]:
                        c = 0.0
                    elif forced[r][q]:
                        c = 1.0
                v *= c
            row.append(v)
        out.append(row)
    return out


def choose_tree_budget(
    confidences: Any,
    tree: Any,
    cost: CostModel,
    *,
    num_sampling: int | None = None,
    max_logits: int | None = None,
    grammar: Any = None,
) -> BudgetDecision:
    """Try every budget over the tree's node values; keep the first best ``est/cost``."""
    values = tree_node_values(confidences, tree, grammar)
    return _best_budget(values, tree.layout, cost, num_sampling, max_logits)


def select_subtree(confidences: Any, tree: Any, budget: int, grammar: Any = None) -> list[list[bool]]:
    """Greedy growth: admit, ``budget`` times, the best node whose parent is in (or is the root).

    Best is (value, shallower, lower request, lower node). Returns keep flags per request.
    """
    lay = tree.layout
    values = tree_node_values(confidences, tree, grammar)
    parents = [[int(p) for p in tree.parents_of(r).tolist()] for r in range(lay.n)]
    depth = [[len(path) for path in _tree_paths(parents[r])] for r in range(lay.n)]
    keep = [[False] * len(parents[r]) for r in range(lay.n)]
    for _ in range(budget):
        best: tuple[float, int, int, int] | None = None
        for r in range(lay.n):
            for j, p in enumerate(parents[r]):
                if keep[r][j] or (p >= 0 and not keep[r][p]):
                    continue
                key = (values[r][j], -depth[r][j], -r, -j)
                if best is None or key > best:
                    best = key
        assert best is not None
        keep[-best[2]][-best[3]] = True
    return keep


def compact_tree(tree: Any, keep: list[list[bool]]) -> dict[str, list[Any]]:
    """Request by request: kept nodes in scheduled order, their parents among the kept, depths, offsets."""
    lay = tree.layout
    nb = lay.num_bonus
    cu = [0]
    capacity: list[int] = []
    kept_node: list[int] = []
    kept_parent: list[int] = []
    kept_depth: list[int] = []
    live: list[int] = []
    for r in range(lay.n):
        parents = [int(p) for p in tree.parents_of(r).tolist()]
        paths = _tree_paths(parents)
        order = [j for j in range(len(parents)) if keep[r][j]]
        for j in range(len(parents)):
            live.append(order.index(j) + 1 if keep[r][j] else -1)
        for j in order:
            kept_node.append(j)
            kept_parent.append(order.index(parents[j]) if parents[j] >= 0 else -1)
            kept_depth.append(len(paths[j]))
        capacity.append(len(order))
        cu.append(cu[-1] + len(order) + nb)
    return {
        "capacity": capacity,
        "cu_logits": cu,
        "kept_node": kept_node,
        "kept_parent": kept_parent,
        "kept_depth": kept_depth,
        "live_position": live,
    }


def tree_mask_rows(
    matcher: Any, mask_words: int, eos_ids: Any, tokens: list[int], parents: list[int], num_bonus: int
) -> tuple[list[np.ndarray], list[bool], list[bool]]:
    """One request's tree rows replayed from scratch, with each node's valid and forced flags.

    Position 0: the mask now; position ``j + 1``: accept the path to node ``j``
    token by token, fill, roll back (all-allowed when the path is refused or
    passes a stop token before ``j``); past the nodes: the last node's row.
    Uses only the matcher protocol (accept, fill, rollback).
    """
    eos = {int(t) for t in eos_ids}
    full = np.full(mask_words, -1, dtype=np.int32)
    paths = _tree_paths(parents)

    def row_after(path: list[int]) -> np.ndarray | None:
        took = 0
        ok = True
        for q in path:
            if took and tokens[path[took - 1]] in eos:
                ok = False
                break
            if not matcher.accept(int(tokens[q])):
                ok = False
                break
            took += 1
        row = None
        if ok:
            bm = torch.zeros((1, mask_words), dtype=torch.int32)
            matcher.fill(bm, 0)
            row = bm[0].numpy().copy()
        if took:
            matcher.rollback(took)
        return row

    def reachable(path: list[int]) -> bool:
        """Every token of the path accepted, no stop token before its last node."""
        took, ok = 0, True
        for i, q in enumerate(path):
            if i and tokens[path[i - 1]] in eos:
                ok = False
                break
            if not matcher.accept(int(tokens[q])):
                ok = False
                break
            took += 1
        if took:
            matcher.rollback(took)
        return ok

    root = row_after([])
    assert root is not None
    rows: list[np.ndarray] = [root]
    valid = [reachable(paths[j]) for j in range(len(parents))]
    for j in range(len(parents)):
        r = row_after(paths[j]) if valid[j] and tokens[j] not in eos else None
        rows.append(full.copy() if r is None else r)
    for _ in range(num_bonus - 1):
        rows.append(rows[-1].copy())
    rows = rows[: len(parents) + num_bonus]
    forced: list[bool] = []
    for j in range(len(parents)):
        check = rows[parents[j] + 1] if parents[j] + 1 < len(rows) else None
        if check is None:
            # Only with num_bonus == 0 can the checking row be cut off; replay it.
            check = row_after(paths[parents[j]]) if parents[j] >= 0 else root
            assert check is not None
        bits = sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in check.tolist())
        forced.append(valid[j] and bits == 1)
    return rows, valid, forced
