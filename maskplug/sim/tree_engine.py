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
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..compaction import regime_of
from ..dispatch import apply_grammar_bitmask
from ..errors import BudgetError
from ..grammar_trees import fill_tree_masks
from ..layout import ScheduledLayout
from ..trees import DraftTree, allocate_tree, choose_tree_budget, compact_tree
from .checks import tree_layout_problems, tree_mapping_problems
from .engine import Simulation
from .stages import TreeBatch, TreeBudget, TreeStepMasks, new_mask_rows, step_requests
from .tree_drafter import TreeConfig, draft_trees

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


class TreeSimulation(Simulation):
    """One tree scheduler (``tree:INNER``) serving the workload for ``config.steps`` steps.

    Arguments as :class:`~maskplug.sim.Simulation`, plus ``tree`` (by keyword):
    the tree drafter's shape (default :class:`TreeConfig`, depth = ``config.drafts``).
    """

    def __init__(self, *args: Any, tree: TreeConfig | None = None, **kwargs: Any) -> None:
        self.tree_cfg = tree if tree is not None else TreeConfig()
        if not isinstance(self.tree_cfg, TreeConfig):
            raise BudgetError(f"tree: expected a TreeConfig, got {type(tree).__name__}")
        super().__init__(*args, **kwargs)
        self.levels = self.tree_cfg.levels(self.cfg.drafts)

    def _use_scheduler(self, scheduler: str) -> None:
        """The inner scheduler of ``tree:INNER`` drives the shared parts; the tree budget is chosen here."""
        inner = scheduler[len(TREE_PREFIX) :] if is_tree_scheduler(scheduler) else ""
        if inner not in TREE_INNER:
            names = ", ".join(TREE_PREFIX + s for s in TREE_INNER)
            raise BudgetError(f"scheduler: expected a tree scheduler ({names}), got {scheduler!r}")
        super()._use_scheduler(inner)
        self.use_grammar = inner.startswith("grammar-aware:")
        self.verify_all = inner == "verify-all"

    def step(self, t: int) -> None:
        """Run engine step ``t`` with draft trees, every part checked."""
        self._admit()
        batch = self._tree_draft(t)
        masks = self._tree_masks(batch)
        budget = self._tree_budget(batch, masks)
        self._fail(
            t,
            tree_layout_problems(
                batch, masks, budget, self.cost, use_grammar=self.use_grammar, verify_all=self.verify_all
            ),
        )
        logits = self._tree_logits(batch, masks, budget)
        paths, final = self._tree_verify(batch, masks, budget, logits)
        emitted, finished = self._tree_commit(batch, masks, paths, final)
        self._retire(batch, finished)
        # The forward-pass cost is the chain steps' (verify the kept tokens, plus the drafter when
        # it drafted); mask production is not overlapped with it.
        decode = ~batch.prefill
        accepted = sum(len(p) for r, p in enumerate(paths) if decode[r])
        self._record(batch, masks, budget, accepted=accepted, emitted=emitted, finished=len(finished))

    # ------------------------------------------------------------------ stages
    def _tree_draft(self, t: int) -> TreeBatch:
        q = step_requests(self.active, self.levels + 2)
        d = draft_trees(
            self.cfg.seed, q.rid, q.length, q.window, q.depth(self.levels), q.on_track, q.skill, self.structural,
            self.first_token, self.V, self.eos, self.tree_cfg,
        )  # fmt: skip
        h0 = time.perf_counter()
        layout = ScheduledLayout(q.rid, d.num_nodes, q.non_draft)
        tree = DraftTree(layout, d.parents)
        host = time.perf_counter() - h0
        return TreeBatch(**vars(q), t=t, act=self.active, layout=layout, drafts=d, tree=tree, host_s=host)

    def _tree_masks(self, batch: TreeBatch) -> TreeStepMasks:
        h0 = time.perf_counter()
        g_idx, rows, bitmask = new_mask_rows(batch, self.vocab)
        tm = None
        if g_idx.size:
            tm = fill_tree_masks(
                [batch.act[g].matcher for g in g_idx], batch.drafts.flat_tokens(), bitmask, rows, batch.tree
            )
        mapping = batch.tree.mapping(rows)
        spent = time.perf_counter() - h0
        batch.host_s += spent
        batch.mask_s = spent
        masks = TreeStepMasks(batch, g_idx, rows.num_rows(batch.layout), bitmask, mapping, tm)
        self._fail(batch.t, tree_mapping_problems(batch, masks, rows))
        return masks

    def _tree_budget(self, batch: TreeBatch, masks: TreeStepMasks) -> TreeBudget:
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
        regime = regime_of(lay, b)
        return TreeBudget(b, cap_max, regime, int(comp.cu_logits[-1]), max_logits, conf, keep, comp, live_map)

    def _tree_logits(self, batch: TreeBatch, masks: TreeStepMasks, budget: TreeBudget) -> torch.Tensor:
        """The target's logits for the live rows (root, kept nodes), masked through the live mapping."""
        cfg, V, n = self.cfg, self.V, len(batch.act)
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
        gr = masks.g_of[row_req]
        mrow = np.where(gr >= 0, masks.g_start[np.maximum(gr, 0)] + node + 1, -1)
        bm_np = masks.bitmask.numpy()
        tempt = self._tempting_tokens(bm_np, mrow, on_ref, rid[row_req], out_pos)
        logits = self.target.logits(rid[row_req], out_pos, preferred, tempt)

        def apply() -> None:
            if masks.num_rows:
                apply_grammar_bitmask(logits, masks.bitmask, budget.live_map, cu_np, vocab_size=V, backend=cfg.backend)

        self._apply_checked(batch, 98, logits, mrow, bm_np, apply)
        return logits

    def _tree_verify(
        self, batch: TreeBatch, masks: TreeStepMasks, budget: TreeBudget, logits: torch.Tensor
    ) -> tuple[list[list[int]], I64]:
        """Greedy tree verification: per request the accepted path (request-local nodes) and the token after it."""
        comp, t = budget.comp, batch.t
        tgt = logits.argmax(dim=1).numpy().astype(np.int64)
        n = len(batch.act)
        tokens = batch.drafts.tokens
        paths: list[list[int]] = []
        final = np.zeros(n, dtype=np.int64)
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
            g = int(masks.g_of[r])
            if g >= 0 and masks.tm is not None and path and not masks.tm.valid[g, path].all():
                self._fail(
                    t, [f"tree verification accepted nodes {path} of request {int(batch.rid[r])} the grammar rejects"]
                )
            paths.append(path)
        return paths, final

    def _tree_commit(
        self, batch: TreeBatch, masks: TreeStepMasks, paths: list[list[int]], final: I64
    ) -> tuple[int, list[tuple[int, bool]]]:
        finished: list[tuple[int, bool]] = []
        emitted_total = 0
        bm_np = masks.bitmask.numpy()
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
            mask_rows = (
                masks.g_start[masks.g_of[r]] + np.asarray(checkers, dtype=np.int64) if a.matcher is not None else None
            )
            done, stopped = self._emit(batch, a, toks, mask_rows, bm_np)
            emitted_total += len(toks)
            if done:
                finished.append((r, stopped))
        return emitted_total, finished
