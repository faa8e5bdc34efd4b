"""Tree verification in the simulated engine: the same loop as :mod:`.engine`, with draft trees.

A :class:`TreeSimulation` serves the workload with one tree scheduler,
``tree:INNER``, for ``INNER`` one of :data:`TREE_INNER`:

* ``dspark``: the budget maximising expected accepted tokens per unit cost
  over the tree nodes (:func:`maskplug.choose_tree_budget`), grammar-blind;
* ``grammar-aware:dspark``: the same with the grammar's per-node results
  (rejected nodes worth 0, forced nodes certain: :class:`maskplug.TreeMasks`);
* ``verify-all``: every scheduled node, as far as the engine's token limit allows.

Each step, through maskplug's real code: draft one tree per decoding request
(:mod:`.tree_drafter`), fill the grammar requests' tree rows
(:func:`maskplug.fill_tree_masks`), choose the budget on the same
:class:`~maskplug.CostModel` and ``max_logits`` as chain schedulers, keep the
best subtree on the live confidences (:func:`maskplug.allocate_tree`),
compact it (:func:`maskplug.compact_tree`), build the target's logits for
the live rows only, apply the masks with the rows moved to their live
positions (:meth:`maskplug.TreeCompaction.live_mapping`, kernels unchanged),
verify, commit and validate.

Verification on trees is greedy for every request: from the root, follow
the kept child whose token is the target's argmax at the current node, then
emit the argmax after the last accepted node. Rejection sampling over trees
is not simulated: requests that sample in chain runs are verified greedily
in tree runs, so tree rows compare greedy verification throughout.

Every step is checked as chain steps are: the mapping has one entry per
mask row and matches :func:`maskplug.reference.mapping`; the budget, the
kept nodes and the compaction match :mod:`maskplug.reference`
(``choose_tree_budget``, ``select_subtree``, ``compact_tree``) and the host
:func:`maskplug.select_subtree`; the live mapping sends each kept node's row
to its live position; grammar-aware runs keep no node the grammar rejects;
sampled rows are masked exactly, column by column; every emitted token is
allowed by its mask row and accepted by its matcher; finished outputs are
validated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from .. import reference
from ..budget import CostModel
from ..compaction import regime_of
from ..dispatch import apply_grammar_bitmask
from ..errors import BudgetError
from ..grammar_trees import fill_tree_masks
from ..layout import GrammarRows, RowMapping, ScheduledLayout
from ..trees import DraftTree, TreeCompaction, TreeMasks, allocate_tree, choose_tree_budget, compact_tree
from ..trees import select_subtree as host_select_subtree
from .engine import RunResult, SimConfig, Simulation, Workload, _Step
from .models import TargetModel
from .tree_drafter import TreeConfig, TreeDrafts, draft_trees

__all__ = ["TREE_INNER", "TREE_PREFIX", "TREE_SCHEDULERS", "TreeSimulation", "is_tree_scheduler"]

I64 = npt.NDArray[np.int64]

#: Prefix of a tree scheduler's name.
TREE_PREFIX = "tree:"
#: The budget choices tree runs support, after the prefix.
TREE_INNER = ("dspark", "grammar-aware:dspark", "verify-all")
#: The tree schedulers ``maskplug demo --tree`` adds to the table, in order.
TREE_SCHEDULERS = ("tree:dspark", "tree:grammar-aware:dspark")


def is_tree_scheduler(name: str) -> bool:
    """Whether ``name`` names a tree scheduler (``tree:INNER``)."""
    return isinstance(name, str) and name.startswith(TREE_PREFIX)


@dataclass
class _TreeBatch(_Step):
    """One tree step's running requests, scheduled layout, draft trees and their node structure.

    Tree steps do not overlap mask production with the forward pass (``ready_s`` stays ``None``).
    """

    drafts: TreeDrafts
    tree: DraftTree


@dataclass
class _TreeMasks:
    g_idx: I64
    num_rows: int
    bitmask: torch.Tensor
    tm: TreeMasks | None
    mapping: RowMapping
    #: first scheduled mask row of each grammar request (ragged rows)
    g_start: I64


@dataclass
class _TreeBudget:
    b: int
    cap_max: int
    max_logits: int | None
    conf: npt.NDArray[np.float64]
    keep: npt.NDArray[np.bool_]
    comp: TreeCompaction
    live_map: RowMapping
    regime: str


class TreeSimulation(Simulation):
    """One tree scheduler (``tree:INNER``) serving the workload for ``config.steps`` steps.

    Arguments as :class:`~maskplug.sim.Simulation`, plus ``tree``: the tree
    drafter's shape (default :class:`TreeConfig`, depth = ``config.drafts``).
    """

    def __init__(
        self,
        config: SimConfig,
        scheduler: str,
        workload: Workload,
        target: TargetModel,
        cost: CostModel,
        on_step: Callable[[int, RunResult], None] | None = None,
        structural: npt.NDArray[np.bool_] | None = None,
        tree: TreeConfig | None = None,
    ) -> None:
        inner = scheduler[len(TREE_PREFIX) :] if is_tree_scheduler(scheduler) else ""
        if inner not in TREE_INNER:
            names = ", ".join(TREE_PREFIX + s for s in TREE_INNER)
            raise BudgetError(f"scheduler: expected a tree scheduler ({names}), got {scheduler!r}")
        super().__init__(config, inner, workload, target, cost, on_step, structural)
        self.name = scheduler
        self.result = RunResult(scheduler)
        self.tree_cfg = tree if tree is not None else TreeConfig()
        if not isinstance(self.tree_cfg, TreeConfig):
            raise BudgetError(f"tree: expected a TreeConfig, got {type(tree).__name__}")
        self.levels = self.tree_cfg.levels(config.drafts)
        self.use_grammar = inner.startswith("grammar-aware:")
        self.verify_all = inner == "verify-all"
        self._apply_s = 0.0

    def step(self, t: int) -> None:
        """Run engine step ``t`` with draft trees, every part checked."""
        self._admit()
        batch = self._tree_draft(t)
        masks = self._tree_masks(batch)
        budget = self._tree_budget(batch, masks)
        self._tree_check(batch, masks, budget)
        logits = self._tree_logits(batch, masks, budget)
        paths, final = self._tree_verify(batch, masks, budget, logits)
        emitted, finished = self._tree_commit(batch, masks, paths, final)
        self._retire(batch, finished)
        self._tree_account(batch, masks, budget, paths, emitted, len(finished))

    # ------------------------------------------------------------------ stages
    def _tree_draft(self, t: int) -> _TreeBatch:
        q = self._requests(self.levels + 2)
        rid, length, prefill, on_track, window = q.rid, q.length, q.prefill, q.on_track, q.window
        levels = np.where(prefill, 0, np.clip(np.minimum(self.levels, q.limit - length - 1), 0, None)).astype(np.int64)
        d = draft_trees(
            self.cfg.seed, rid, length, window, levels, on_track, q.skill, self.structural, self.first_token, self.V,
            self.eos, self.tree_cfg,
        )  # fmt: skip
        num_drafts = d.num_nodes
        num_non_draft = np.where(prefill, q.prompt, 1).astype(np.int64)
        h0 = time.perf_counter()
        layout = ScheduledLayout(rid, num_drafts, num_non_draft)
        tree = DraftTree(layout, d.parents)
        host = time.perf_counter() - h0
        return _TreeBatch(
            **vars(q), t=t, act=self.active, num_drafts=num_drafts, num_non_draft=num_non_draft, layout=layout,
            drafts=d, tree=tree, host_s=host,
        )  # fmt: skip

    def _tree_masks(self, batch: _TreeBatch) -> _TreeMasks:
        h0 = time.perf_counter()
        g_idx = np.nonzero(batch.has_g)[0]
        rows = GrammarRows(batch.rid[g_idx])
        num_rows = rows.num_rows(batch.layout)
        bitmask = self.vocab.new_bitmask(num_rows)
        tm = None
        if g_idx.size:
            tm = fill_tree_masks(
                [batch.act[g].matcher for g in g_idx], batch.drafts.flat_tokens(), bitmask, rows, batch.tree
            )
        mapping = batch.tree.mapping(rows)
        spent = time.perf_counter() - h0
        batch.host_s += spent
        batch.mask_s = spent
        g_start = np.zeros(g_idx.size + 1, dtype=np.int64)
        np.cumsum(batch.num_drafts[g_idx] + batch.layout.num_bonus, out=g_start[1:])
        if len(mapping) != num_rows or bitmask.shape[0] != num_rows:
            self._fail(batch.t, f"mapping has {len(mapping)} rows, bitmask {bitmask.shape[0]}, producer {num_rows}")
        ref_map = reference.mapping(rows, batch.layout)
        if not (
            np.array_equal(mapping.request, ref_map.request) and np.array_equal(mapping.position, ref_map.position)
        ):
            self._fail(batch.t, "tree row mapping differs from maskplug.reference.mapping")
        return _TreeMasks(g_idx, num_rows, bitmask, tm, mapping, g_start)

    def _tree_budget(self, batch: _TreeBatch, masks: _TreeMasks) -> _TreeBudget:
        n, lay = len(batch.act), batch.layout
        h0 = time.perf_counter()
        room = self._token_room(batch.t, batch.num_non_draft)
        max_logits = None if room is None else n * lay.num_bonus + room
        cap_max = lay.total_drafts if room is None else min(lay.total_drafts, room)
        # The live confidences as the device holds them (fp32), read back for the host-side choices.
        live = torch.from_numpy(batch.drafts.conf_matrix().astype(np.float32))
        conf = live.numpy().astype(np.float64)
        grammar = masks.tm if self.use_grammar else None
        if self.verify_all:
            b = cap_max
        else:
            b = int(choose_tree_budget(conf, batch.tree, self.cost, max_logits=max_logits, grammar=grammar).budget)
        keep = allocate_tree(live, batch.tree, b, grammar).numpy()
        comp = compact_tree(batch.tree, keep)
        live_map = comp.live_mapping(masks.mapping, batch.tree)
        batch.host_s += time.perf_counter() - h0
        return _TreeBudget(b, cap_max, max_logits, conf, keep, comp, live_map, regime_of(lay, b))

    def _tree_check(self, batch: _TreeBatch, masks: _TreeMasks, budget: _TreeBudget) -> None:
        """Budget, kept nodes, compaction and live mapping against :mod:`maskplug.reference` and the host path."""
        t, tree, lay, b, comp = batch.t, batch.tree, batch.layout, budget.b, budget.comp
        grammar = masks.tm if self.use_grammar else None
        if not 0 <= b <= budget.cap_max:
            self._fail(t, f"budget {b} outside [0, {budget.cap_max}]")
        if not self.verify_all:
            ref_b = reference.choose_tree_budget(
                budget.conf, tree, self.cost, max_logits=budget.max_logits, grammar=grammar
            ).budget
            if ref_b != b:
                self._fail(t, f"tree budget {b} differs from the reference {ref_b}")
        host_keep = host_select_subtree(budget.conf, tree, b, grammar)
        if not np.array_equal(host_keep, budget.keep):
            self._fail(t, "allocate_tree keeps other nodes than select_subtree")
        ref_keep = reference.select_subtree(budget.conf, tree, b, grammar)
        flat_ref = np.asarray([x for row in ref_keep for x in row], dtype=bool)
        if not np.array_equal(flat_ref, budget.keep):
            self._fail(t, "allocate_tree keeps other nodes than maskplug.reference.select_subtree")
        ref = reference.compact_tree(tree, ref_keep)
        for name in ("capacity", "cu_logits", "kept_node", "kept_parent", "kept_depth", "live_position"):
            if np.asarray(getattr(comp, name)).tolist() != list(ref[name]):
                self._fail(t, f"compact_tree {name} differs from maskplug.reference.compact_tree")
        if int(comp.capacity.sum()) != b or comp.num_tokens != int(batch.num_non_draft.sum()) + b:
            self._fail(t, f"compaction keeps {comp.num_tokens} tokens for budget {b}")
        ref_regime = reference.compact(lay, b).regime
        if comp.regime != budget.regime or ref_regime != budget.regime:
            self._fail(t, f"compaction regime {comp.regime!r}, regime_of {budget.regime!r}, reference {ref_regime!r}")
        if self.use_grammar and masks.tm is not None:
            for i, r in enumerate(masks.tm.request.tolist()):
                a, e = int(tree.cu_nodes[r]), int(tree.cu_nodes[r + 1])
                if np.any(budget.keep[a:e] & ~masks.tm.valid[i, : e - a]):
                    self._fail(
                        t, f"grammar-aware tree budget kept a node of request {int(batch.rid[r])} the grammar rejects"
                    )
        # The live mapping, rebuilt independently: node j's row goes to 1 + its rank among the kept nodes.
        req = masks.mapping.request.astype(np.int64)
        pos = masks.mapping.position.astype(np.int64)
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
        if not (
            np.array_equal(lm.request.astype(np.int64), exp_req)
            and np.array_equal(lm.position.astype(np.int64), exp_pos)
        ):
            self._fail(t, "live mapping does not send each kept node's row to its live position")

    def _tree_logits(self, batch: _TreeBatch, masks: _TreeMasks, budget: _TreeBudget) -> torch.Tensor:
        """The target's logits for the live rows (root, kept nodes), masked through the live mapping."""
        cfg, V, t, n = self.cfg, self.V, batch.t, len(batch.act)
        comp, tree, rid = budget.comp, batch.tree, batch.rid
        cap = comp.capacity
        cu_np = comp.cu_logits
        R = int(cu_np[-1])
        row_req = np.repeat(np.arange(n), cap + batch.layout.num_bonus)
        row_pos = np.arange(R) - cu_np[row_req]
        is_node = (row_pos >= 1) & (row_pos <= cap[row_req])
        kidx = np.where(is_node, comp.cu_kept[row_req] + row_pos - 1, 0)
        node = np.full(R, -1, dtype=np.int64)  # request-local node of each row, -1: the root
        node[is_node] = comp.kept_node[kidx[is_node]]
        flat = np.where(is_node, tree.cu_nodes[row_req] + node, 0)
        depth = np.zeros(R, dtype=np.int64)
        on_ref = batch.on_track[row_req].copy()
        if tree.depth.size:
            on_ref_all = np.concatenate(batch.drafts.on_ref)
            depth = np.where(is_node, tree.depth[flat], 0)
            on_ref = np.where(is_node, on_ref_all[flat], on_ref)
        preferred = np.where(on_ref, batch.window[row_req, depth], self.eos)
        out_pos = batch.length[row_req] + depth
        g_of = np.full(n, -1, dtype=np.int64)
        g_of[masks.g_idx] = np.arange(masks.g_idx.size)
        gr = g_of[row_req]
        mrow = np.where(gr >= 0, masks.g_start[np.maximum(gr, 0)] + node + 1, -1)
        bm_np = masks.bitmask.numpy()
        tempt = self._tempting_tokens(bm_np, mrow, on_ref, rid[row_req], out_pos)
        logits = self.target.logits(rid[row_req], out_pos, preferred, tempt)

        def apply() -> None:
            if masks.num_rows:
                apply_grammar_bitmask(logits, masks.bitmask, budget.live_map, cu_np, vocab_size=V, backend=cfg.backend)

        self._apply_s = self._apply_checked(t, 98, logits, mrow, bm_np, apply)
        return logits

    def _tree_verify(
        self, batch: _TreeBatch, masks: _TreeMasks, budget: _TreeBudget, logits: torch.Tensor
    ) -> tuple[list[list[int]], I64]:
        """Greedy tree verification: per request the accepted path (request-local nodes) and the token after it."""
        comp, t = budget.comp, batch.t
        tgt = logits.argmax(dim=1).numpy().astype(np.int64)
        n = len(batch.act)
        tokens = batch.drafts.tokens
        paths: list[list[int]] = []
        final = np.zeros(n, dtype=np.int64)
        g_of = {int(r): i for i, r in enumerate(masks.g_idx.tolist())}
        for r in range(n):
            a, e = int(comp.cu_kept[r]), int(comp.cu_kept[r + 1])
            kept_node = comp.kept_node[a:e]
            kept_parent = comp.kept_parent[a:e]
            base = int(comp.cu_logits[r])
            cur = -1  # kept index of the current node, -1: the root
            path: list[int] = []
            while cur < 0 or int(tokens[r][kept_node[cur]]) != self.eos:
                want = int(tgt[base + cur + 1])
                # The kept child whose token is the target's argmax here (siblings are distinct tokens).
                kids = np.nonzero((kept_parent == cur) & (tokens[r][kept_node] == want))[0]
                if kids.size == 0:
                    break
                cur = int(kids[0])
                path.append(int(kept_node[cur]))
            final[r] = tgt[base + cur + 1]
            if r in g_of and masks.tm is not None and path and not masks.tm.valid[g_of[r], path].all():
                self._fail(
                    t, f"tree verification accepted nodes {path} of request {int(batch.rid[r])} the grammar rejects"
                )
            paths.append(path)
        return paths, final

    def _tree_commit(
        self, batch: _TreeBatch, masks: _TreeMasks, paths: list[list[int]], final: I64
    ) -> tuple[int, list[tuple[int, bool]]]:
        finished: list[tuple[int, bool]] = []
        emitted_total = 0
        bm_np = masks.bitmask.numpy()
        g_of = {int(r): i for i, r in enumerate(masks.g_idx.tolist())}
        for r, a in enumerate(batch.act):
            path = paths[r]
            toks = [int(batch.drafts.tokens[r][j]) for j in path] + [int(final[r])]
            # The row that checks each emitted token: the root's, then the row after each accepted node.
            checkers = [0] + [j + 1 for j in path]
            if self.eos in toks:
                cut = toks.index(self.eos) + 1
                toks, checkers = toks[:cut], checkers[:cut]
            keep_n = max(0, a.prep.max_tokens - len(a.output))
            toks, checkers = toks[:keep_n], checkers[:keep_n]
            mask_rows = masks.g_start[g_of[r]] + np.asarray(checkers, dtype=np.int64) if a.matcher is not None else None
            done, stopped = self._emit(batch, a, toks, mask_rows, bm_np)
            emitted_total += len(toks)
            if done:
                finished.append((r, stopped))
        return emitted_total, finished

    def _tree_account(
        self,
        batch: _TreeBatch,
        masks: _TreeMasks,
        budget: _TreeBudget,
        paths: list[list[int]],
        emitted: int,
        finished: int,
    ) -> None:
        """Simulated time, counters and the ``step_end`` hook, as chain steps record them.

        The forward-pass cost is the chain steps' (verify the kept tokens, plus
        the drafter when it drafted); mask production is not overlapped with it.
        """
        decode = ~batch.prefill
        self._record(
            batch,
            budget.b,
            budget.regime,
            budget.cap_max,
            accepted=sum(len(p) for r, p in enumerate(paths) if decode[r]),
            emitted=emitted,
            finished=finished,
            grammar_requests=int(masks.g_idx.size),
            mask_rows=masks.num_rows,
            logits_rows=int(budget.comp.cu_logits[-1]),
            apply_s=self._apply_s,
        )
