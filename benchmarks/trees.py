"""Tree against chain verification at equal verify cost, on random drafter confidences.

A synthetic top-k drafter: at every node the target's next token is one of
the drafter's ``--branch`` candidates with probabilities ``q_1 >= q_2 >= ...``
(a random split of a per-node mass ``m ~ U(0.5, 1)``: the drafter's top-1 is
right with probability ``q_1``, its second choice with ``q_2`` and so on, and
none of them with ``1 - m``). Every request drafts

* a **chain**: the top-1 child at every level, ``--nodes`` drafts deep;
* a **tree**: the ``--nodes`` nodes a best-first expansion of the top-k tree
  picks (EAGLE-2's dynamic tree: always expand the node with the highest
  path probability), so both scheduled the same number of drafts.

For each verify budget ``b`` (drafts verified over the batch, the verify
cost) the table gives the expected accepted drafts per step when the
``b`` best chain drafts (:func:`maskplug.choose_budget`'s order) or the
``b`` best tree nodes (:func:`maskplug.select_subtree`) are verified, and a
Monte-Carlo check of the tree figure (sampling the target's path through the
tree). It then runs both budget choices on a linear cost model
(:func:`maskplug.choose_budget` and :func:`maskplug.choose_tree_budget`) and
reports the chosen budget, the expected emitted tokens and tokens per ms.

``--timing`` adds the host time of the tree budget's parts (building the
:class:`maskplug.DraftTree`, :func:`maskplug.choose_tree_budget`,
:func:`maskplug.select_subtree`, :func:`maskplug.compact_tree`) beside
:func:`maskplug.choose_budget` on the chains, median of ``--repeat`` runs.

``--grammar`` times :func:`maskplug.fill_tree_masks` on the SentencePiece
vocabulary (32,000 tokens) for every installed provider: each request a JSON
regex grammar and a best-first tree of ``--nodes`` nodes whose tokens follow
the grammar (top-``--branch`` allowed tokens per node), filled natively
(``strategy="native"``: xgrammar's own tree walk) and depth first
(``"walk"``), against :func:`maskplug.fill_draft_masks` on chains of the same
size.

Run: ``.venv/bin/python benchmarks/trees.py [--requests 16] [--nodes 8] [--branch 3] [--seed 0] [--samples 2000] [--timing] [--grammar] [--json]``
"""

from __future__ import annotations

import argparse
import heapq
import json

import numpy as np

from maskplug import CostModel, DraftTree, ScheduledLayout, choose_budget, choose_tree_budget, select_subtree


def _split(rng: np.random.Generator, branch: int) -> np.ndarray:
    """Probabilities that the target's next token is the drafter's 1st, 2nd, ... candidate (descending)."""
    mass = rng.uniform(0.5, 1.0)
    w = np.sort(rng.dirichlet(np.full(branch, 0.6)))[::-1]
    return mass * w


def _request(rng: np.random.Generator, nodes: int, branch: int) -> tuple[list[int], list[float], list[float]]:
    """One request's best-first tree (parents, conditional confidences) and its top-1 chain's confidences."""
    parents: list[int] = []
    conf: list[float] = []
    # Children splits are drawn lazily per expanded node, the same ones the chain follows.
    splits: dict[int, np.ndarray] = {}

    def split_of(node: int) -> np.ndarray:
        if node not in splits:
            splits[node] = _split(rng, branch)
        return splits[node]

    # Heap of candidate children: (-path value, parent, rank, conditional confidence).
    root = split_of(-1)
    heap = [(-float(root[i]), -1, i, float(root[i])) for i in range(branch)]
    heapq.heapify(heap)
    value: list[float] = []
    while len(parents) < nodes and heap:
        neg, par, _rank, q = heapq.heappop(heap)
        j = len(parents)
        parents.append(par)
        conf.append(q)
        value.append(-neg)
        s = split_of(j)
        for i in range(branch):
            heapq.heappush(heap, (-(value[j] * float(s[i])), j, i, float(s[i])))
    # The chain: the top-1 child at every level (the same draws where the tree expanded them).
    chain: list[float] = []
    node = -1
    for _ in range(nodes):
        q = float(split_of(node)[0])
        chain.append(q)
        kids = [j for j, p in enumerate(parents) if p == node and conf[j] == q]
        if kids:
            node = kids[0]
        else:
            node = -(len(splits) + 10)  # off the tree: fresh draws from here on
    return parents, conf, chain


def _sample_tree(
    rng: np.random.Generator, parents: list[int], conf: list[float], keep: np.ndarray, branch_of: dict[int, list[int]]
) -> int:
    """Accepted drafts when the target walks the kept tree: at each node, one child with its probability."""
    node, got = -1, 0
    while True:
        kids = [j for j in branch_of.get(node, []) if keep[j]]
        if not kids:
            return got
        u = rng.random()
        acc = 0.0
        nxt = None
        for j in kids:  # children are disjoint events (different tokens)
            acc += conf[j]
            if u < acc:
                nxt = j
                break
        if nxt is None:
            return got
        node, got = nxt, got + 1


def _timing(
    layout: ScheduledLayout,
    parents: list[list[int]],
    tconf: np.ndarray,
    cconf: np.ndarray,
    cost: CostModel,
    repeat: int,
) -> dict[str, float]:
    """Median host milliseconds of each part of the tree budget and of the chain budget."""
    import time

    from maskplug import compact_tree

    parts: dict[str, list[float]] = {
        k: [] for k in ("DraftTree", "choose_tree_budget", "select_subtree", "compact_tree", "choose_budget (chain)")
    }
    for _ in range(repeat):
        t0 = time.perf_counter()
        tree = DraftTree(layout, parents)
        t1 = time.perf_counter()
        d = choose_tree_budget(tconf, tree, cost)
        t2 = time.perf_counter()
        keep = select_subtree(tconf, tree, d.budget)
        t3 = time.perf_counter()
        compact_tree(tree, keep)
        t4 = time.perf_counter()
        choose_budget(cconf, layout, cost)
        t5 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            parts[k].append(v * 1e3)
    return {k: round(float(np.median(v)), 4) for k, v in parts.items()}


def _grammar_timing(
    layout: ScheduledLayout, parents: list[list[int]], repeat: int, seed: int
) -> dict[str, dict[str, float]]:
    """Median milliseconds of one batch fill per provider: trees native and depth first, chains of the same size."""
    import random
    import time
    from functools import partial

    import torch

    from maskplug import (
        GrammarRows,
        GrammarSpec,
        fill_draft_masks,
        fill_tree_masks,
        grammar_provider,
        grammar_providers,
    )
    from maskplug.grammar.vocabs import mistral_sentencepiece

    v = mistral_sentencepiece()
    rng = random.Random(seed)
    regex = r"\{\"id\": [0-9]{1,6}, \"name\": \"[a-z ]{1,24}\", \"tags\": \[(\"[a-z]{1,8}\"(, )?){0,4}\]\}"
    rows = GrammarRows(layout.req_ids.tolist())
    tree = DraftTree(layout, parents)
    chain = DraftTree.chain(layout)
    out: dict[str, dict[str, float]] = {}
    bm = torch.zeros((rows.num_rows(layout), v.mask_words), dtype=torch.int32)
    one = v.new_bitmask(1)
    for prov in grammar_providers():
        compiled = grammar_provider(prov, v).compile(GrammarSpec("regex", regex))
        ms = [compiled.matcher() for _ in range(layout.n)]

        def tokens_for(par: list[int], m) -> list[int]:  # type: ignore[no-untyped-def]
            # Each node: an allowed token after its path (a random one among the allowed).
            toks: list[int] = []
            paths: list[list[int]] = []
            for p in par:
                path = [] if p < 0 else [*paths[p], p]
                for q in path:
                    m.accept(toks[q])
                m.fill(one, 0)
                bits = np.unpackbits(one[0].numpy().view(np.uint8), bitorder="little")[: v.vocab_size]
                ids = [int(t) for t in np.flatnonzero(bits) if int(t) not in v.eos_ids]
                toks.append(rng.choice(ids) if ids else 0)
                if path:
                    m.rollback(len(path))
                paths.append(path)
            return toks

        ttoks = [tokens_for(parents[r], ms[r]) for r in range(layout.n)]
        ctoks = [tokens_for([j - 1 for j in range(len(parents[r]))], ms[r]) for r in range(layout.n)]
        runs = {
            "tree native": partial(fill_tree_masks, ms, ttoks, bm, rows, tree, strategy="native"),
            "tree walk": partial(fill_tree_masks, ms, ttoks, bm, rows, tree, strategy="walk"),
            "chain fill_draft_masks": partial(fill_draft_masks, ms, ctoks, bm, rows, layout),
            "chain as tree": partial(fill_tree_masks, ms, ctoks, bm, rows, chain),
        }
        res: dict[str, float] = {}
        for name, fn in runs.items():
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            res[name] = round(float(np.median(times)), 3)
        out[prov] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--nodes", type=int, default=8, help="drafts scheduled per request (chain depth = tree size)")
    ap.add_argument("--branch", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=2000, help="Monte-Carlo steps per budget for the tree check")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timing", action="store_true", help="also time the host side of both budgets")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--grammar", action="store_true", help="also time fill_tree_masks per provider")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    n, k = a.requests, a.nodes
    reqs = [_request(rng, k, a.branch) for _ in range(n)]
    layout = ScheduledLayout(list(range(n)), [k] * n, [1] * n)
    tree = DraftTree(layout, [p for p, _, _ in reqs])
    tconf = np.array([c for _, c, _ in reqs])
    cconf = np.array([c for _, _, c in reqs])
    chain_surv = np.sort(np.cumprod(cconf, axis=1).ravel())[::-1]
    rows = []
    mc = np.random.default_rng(a.seed + 1)
    kids: list[dict[int, list[int]]] = []
    for p, _, _ in reqs:
        d: dict[int, list[int]] = {}
        for j, q in enumerate(p):
            d.setdefault(q, []).append(j)
        kids.append(d)
    from maskplug import node_values

    vals = node_values(tconf, tree)
    for b in sorted({0, n // 2, n, 2 * n, 3 * n, 4 * n, n * k}):
        keep = select_subtree(tconf, tree, b)
        tree_est = float(vals[keep].sum())
        chain_est = float(chain_surv[:b].sum())
        per = keep.reshape(n, k)
        sampled = 0
        for _ in range(a.samples):
            r = int(mc.integers(n))
            sampled += _sample_tree(mc, reqs[r][0], reqs[r][1], per[r], kids[r])
        rows.append(
            {
                "budget": b,
                "chain_expected": round(chain_est, 3),
                "tree_expected": round(tree_est, 3),
                "tree_sampled": round(sampled / a.samples * n, 3),
                "gain": round(tree_est / chain_est, 3) if chain_est else None,
            }
        )
    cost = CostModel.linear()
    cd = choose_budget(cconf, layout, cost)
    td = choose_tree_budget(tconf, tree, cost)
    budgets = {
        "cost_model": "CostModel.linear() (verify 5 ms + 0.02 ms/token, draft 1 ms + 0.01 ms/request)",
        "chain": {
            "budget": cd.budget,
            "tokens": round(cd.expected_tokens, 3),
            "tokens_per_ms": round(cd.expected_tokens / cd.cost_ms, 4),
        },
        "tree": {
            "budget": td.budget,
            "tokens": round(td.expected_tokens, 3),
            "tokens_per_ms": round(td.expected_tokens / td.cost_ms, 4),
        },
    }
    timing = _timing(layout, [p for p, _, _ in reqs], tconf, cconf, cost, a.repeat) if a.timing else None
    grammar = _grammar_timing(layout, [p for p, _, _ in reqs], a.repeat // 5 or 1, a.seed) if a.grammar else None
    if a.json:
        out = {"args": vars(a), "equal_cost": rows, "choose_budget": budgets}
        if timing is not None:
            out["timing_ms"] = timing
        if grammar is not None:
            out["fill_ms"] = grammar
        print(json.dumps(out, indent=2))
        return
    print(f"{n} requests, {k} drafts each (chain depth {k} / tree of {k} nodes, branch {a.branch}), seed {a.seed}")
    print("expected accepted drafts per step at equal verify budget (drafts verified over the batch):")
    print(f"{'budget':>7} {'chain':>9} {'tree':>9} {'tree (MC)':>10} {'tree/chain':>11}")
    for r in rows:
        g = "" if r["gain"] is None else f"{r['gain']:.3f}"
        print(
            f"{r['budget']:>7} {r['chain_expected']:>9.3f} {r['tree_expected']:>9.3f} {r['tree_sampled']:>10.3f} {g:>11}"
        )
    print(f"budget choice on {budgets['cost_model']}:")
    for name in ("chain", "tree"):
        d = budgets[name]
        print(f"  {name:5} b={d['budget']:>4}  expected tokens {d['tokens']:.3f}  tokens/ms {d['tokens_per_ms']:.4f}")
    if grammar is not None:
        print(f"mask fill for the batch, median of {a.repeat // 5 or 1} (ms):")
        for prov, d in grammar.items():
            print(f"  {prov:14} " + ", ".join(f"{k} {v:.3f}" for k, v in d.items()))
    if timing is not None:
        print(f"host time, median of {a.repeat} (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in timing.items()))


if __name__ == "__main__":
    main()
