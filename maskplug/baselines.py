"""Peers for benchmarks: the straightforward per-request Python an engine would write.

``maskplug bench`` and ``benchmarks/host_path.py`` time maskplug's host path
against :func:`python_step`, which does the same work (layout checks, budget
choice, compaction, row mapping) one request at a time in plain Python.
"""

from __future__ import annotations

__all__ = ["PythonCost", "python_step"]


class PythonCost:
    """The same linear cost model as the maskplug run, evaluated in plain Python."""

    def __init__(self, draft_base: float, draft_per_req: float, verify_base: float, verify_per_tok: float) -> None:
        self.db, self.dr, self.vb, self.vt = draft_base, draft_per_req, verify_base, verify_per_tok

    def draft_ms(self, n: int) -> float:
        return self.db + self.dr * n

    def verify_ms(self, t: int) -> float:
        return self.vb + self.vt * t


def python_step(
    req_ids: list[str],
    num_drafts: list[int],
    num_non_draft: list[int],
    conf: list[list[float]],
    grammar_ids: list[str],
    cost: PythonCost,
    num_bonus: int = 1,
) -> tuple[int, list[int], list[int], list[int]]:
    """Layout, budget, compaction and mapping, one request at a time."""
    # Layout: index by id, check, prefix sums of scheduled rows.
    index: dict[str, int] = {}
    cu_sched = [0]
    for i, rid in enumerate(req_ids):
        if rid in index:
            raise ValueError(f"duplicate id {rid}")
        if num_drafts[i] < 0 or num_non_draft[i] < 0:
            raise ValueError("negative count")
        index[rid] = i
        cu_sched.append(cu_sched[-1] + num_drafts[i] + num_bonus)
    # Budget: survivals, best budget by expected tokens per millisecond.
    surv: list[float] = []
    for i in range(len(req_ids)):
        run = 1.0
        for k in range(num_drafts[i]):
            c = conf[i][k]
            if not 0.0 <= c <= 1.0:
                raise ValueError("bad confidence")
            run *= c
            surv.append(run)
    surv.sort(reverse=True)
    n = len(req_ids)
    base = sum(num_non_draft)
    draft = cost.draft_ms(n)
    est = float(n)
    best_b, best_ratio = 0, est / (draft + cost.verify_ms(base))
    for b, s in enumerate(surv, start=1):
        est += s
        ratio = est / (draft + cost.verify_ms(base + b))
        if ratio > best_ratio:
            best_b, best_ratio = b, ratio
    # Compaction: the host view of the trimmed batch.
    total = sum(num_drafts)
    cu_logits = [0]
    if best_b == total or best_b == 0:
        for i in range(n):
            rows = (num_drafts[i] if best_b == total else 0) + num_bonus
            cu_logits.append(cu_logits[-1] + rows)
    else:
        cu_logits = cu_sched[:]
    # Mapping: one entry per mask row, from the scheduled layout.
    request: list[int] = []
    position: list[int] = []
    for rid in grammar_ids:
        r = index[rid]
        for p in range(num_drafts[r] + num_bonus):
            request.append(r)
            position.append(p)
    return best_b, cu_logits, request, position
