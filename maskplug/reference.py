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
    "compact",
    "mapping",
    "token_allowed",
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
    surv = sorted((v for row in _survival(conf, layout) for v in row), reverse=True)
    n = layout.n
    ns = n if num_sampling is None else num_sampling
    cap = layout.total_drafts
    if max_logits is not None:
        cap = min(cap, max_logits - n * layout.num_bonus)
    best: BudgetDecision | None = None
    for b in range(cap + 1):
        est = ns + sum(surv[:b])
        c = float(cost.draft_ms(n)) + float(cost.verify_ms(int(layout.num_non_draft.sum()) + b))
        if best is None or est / c > best.expected_tokens / best.cost_ms:
            best = BudgetDecision(b, float(est), c)
    assert best is not None
    return best


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
