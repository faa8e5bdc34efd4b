"""Shared strategies and slow, obviously-correct oracles for the scheduler tests.

The oracles below are written with plain Python loops, independently of the
vectorised code in maskplug.budget and maskplug.schedulers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

import maskplug as mp
from maskplug import DraftMasks, ScheduledLayout

# Confidence values that exercise the edges (certain, impossible, ties) as well as the middle.
CONF = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.9]), st.floats(0.0, 1.0, allow_nan=False))


@dataclass
class Case:
    """One random step: the view plus what the generator chose."""

    view: mp.StepView
    live: np.ndarray  # live confidences, (n, k)


def corrected(conf: Any, layout: ScheduledLayout, grammar: DraftMasks | None) -> list[list[float]]:
    """Per-position confidences after the grammar: rejected (and later) 0, forced-and-accepted 1."""
    arr = np.asarray(conf, dtype=np.float64)
    out = [[float(arr[r, k]) for k in range(int(layout.num_drafts[r]))] for r in range(layout.n)]
    if grammar is None:
        return out
    for g, r in enumerate(np.asarray(grammar.request).tolist()):
        acc = int(grammar.acceptable[g])
        for k in range(len(out[r])):
            if k >= acc:
                out[r][k] = 0.0
            elif k < grammar.forced.shape[1] and bool(grammar.forced[g, k]):
                out[r][k] = 1.0
    return out


def survivals(conf_rows: list[list[float]]) -> list[float]:
    """Every survival of every scheduled draft, flattened."""
    out: list[float] = []
    for row in conf_rows:
        run = 1.0
        for c in row:
            run *= c
            out.append(run)
    return out


def oracle_rate(view: mp.StepView, conf_rows: list[list[float]], budget: int) -> tuple[float, float]:
    """(expected tokens, cost in ms) of ``budget`` under per-position confidences ``conf_rows``."""
    lay = view.layout
    surv = sorted(survivals(conf_rows), reverse=True)
    sampling = lay.n if view.num_sampling is None else view.num_sampling
    est = sampling + sum(surv[:budget])
    cost = float(view.cost.draft_ms(lay.n)) + float(view.cost.verify_ms(int(lay.num_non_draft.sum()) + budget))
    return est, cost


def oracle_cap(view: mp.StepView) -> int:
    """``min(Σ num_drafts, max_logits − n·num_bonus)``, by hand."""
    lay = view.layout
    cap = sum(int(v) for v in lay.num_drafts)
    if view.max_logits is not None:
        cap = min(cap, view.max_logits - lay.n * lay.num_bonus)
    return cap


@st.composite
def cost_models(draw: st.DrawFn) -> mp.CostModel:
    """Linear models, and profiled curves with a graph-capture step function."""
    if draw(st.booleans()):
        return mp.CostModel.linear(
            draft_base_ms=draw(st.floats(0.0, 3.0)),
            draft_per_req_ms=draw(st.floats(0.0, 0.5)),
            verify_base_ms=draw(st.floats(0.5, 10.0)),
            verify_per_token_ms=draw(st.floats(0.0, 1.0)),
        )
    sizes = sorted(set(draw(st.lists(st.integers(0, 64), min_size=1, max_size=5))))
    vy = sorted(draw(st.lists(st.floats(0.5, 20.0), min_size=len(sizes), max_size=len(sizes))))
    dy = sorted(draw(st.lists(st.floats(0.0, 5.0), min_size=len(sizes), max_size=len(sizes))))
    return mp.CostModel.from_curves(
        list(zip(sizes, dy, strict=True)),
        list(zip(sizes, vy, strict=True)),
        max_reqs=64,
        max_tokens=256,
        graph_limit=draw(st.sampled_from([0, 8, 32])),
    )


@st.composite
def steps(
    draw: st.DrawFn,
    max_n: int = 6,
    max_drafts: int = 6,
    with_grammar: bool | None = None,
    with_confidences: bool = True,
) -> Case:
    """A random step: possibly empty, possibly without drafts, with or without draft masks."""
    n = draw(st.integers(1 if with_grammar else 0, max_n))  # a grammar step needs a request
    no_drafts = draw(st.booleans()) if n else True
    nd = (
        [0] * n
        if no_drafts and draw(st.booleans())
        else draw(st.lists(st.integers(0, max_drafts), min_size=n, max_size=n))
    )
    nnd = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    bonus = draw(st.integers(0, 2))
    ids = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n, unique=True))
    layout = ScheduledLayout(ids, nd, nnd, num_bonus=bonus)
    k = max(nd, default=0) + draw(st.integers(0, 2))  # extra columns past the drafts are ignored
    stale = np.array(draw(st.lists(CONF, min_size=n * k, max_size=n * k)), dtype=np.float64).reshape(n, k)
    live = np.array(draw(st.lists(CONF, min_size=n * k, max_size=n * k)), dtype=np.float64).reshape(n, k)
    total = sum(nd)
    max_logits = None
    if draw(st.booleans()):
        max_logits = n * bonus + draw(st.integers(0, total + 2))
    num_sampling = draw(st.one_of(st.none(), st.integers(0, 2 * n + 1)))
    use_grammar = draw(st.booleans()) if with_grammar is None else with_grammar
    grammar = None
    if use_grammar and n:
        members = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
        if with_grammar:
            members = members or [0]
        acc = [draw(st.integers(0, nd[r])) for r in members]
        width = max(nd, default=0) + bonus
        forced = np.array(
            draw(st.lists(st.booleans(), min_size=len(members) * width, max_size=len(members) * width)), dtype=bool
        ).reshape(len(members), width)
        grammar = DraftMasks(
            request=np.array(members, dtype=np.int64),
            acceptable=np.array(acc, dtype=np.int64),
            forced=forced,
        )
    view = mp.StepView(
        layout,
        draw(cost_models()),
        confidences=stale if with_confidences else None,
        grammar=grammar,
        max_logits=max_logits,
        num_sampling=num_sampling,
    )
    return Case(view=view, live=live)
