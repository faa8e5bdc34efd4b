"""Draft trees: layout, per-node grammar results, the tree verify budget and compaction.

A request's drafts may form a tree (EAGLE-style top-k branching). Node ``j``
of request ``r`` (``0 <= j < num_drafts[r]``) hangs off node ``parents[j]``,
or off the request's last verified token (the *root*) when ``parents[j] ==
-1``. Parents come before their children (``parents[j] < j``), so a tree is
acyclic by construction; a chain is the tree ``parents[j] = j - 1``.

Rows and positions. A request keeps ``num_drafts + num_bonus`` mask rows, as
for chains, so :class:`~maskplug.GrammarRows` maps rows to ``(request,
position)`` from the scheduled layout exactly as it does for chains, in both
producer layouts. Position ``0`` is the root, position ``j + 1`` is node
``j`` (the token positions an engine's tree attention computes logits at):

* the row at position ``0`` holds the grammar's mask after the verified
  prefix; every node with ``parents[j] == -1`` is checked against it;
* the row at position ``j + 1`` holds the mask after the path to node ``j``
  (the root's children first, down to ``j``); node ``j``'s children and the
  bonus token after ``j`` are checked against it. So the row that checks a
  node holds the grammar's mask after the path to that node's parent;
* positions past ``num_drafts`` (``num_bonus > 1`` only) repeat the row of
  the last node, as chains repeat the row after their last draft.

For a chain these are exactly the rows of :func:`~maskplug.fill_draft_masks`.

Budget. A node's value is the product of the confidences along its path
(``conf[r, j]`` is the probability that node ``j`` is accepted once its
parent is); a node the grammar rejects is worth 0 and a forced node keeps
its parent's value. The expected accepted tokens of a verified subtree is
the sum of its nodes' values; :func:`choose_tree_budget` picks the budget
``b`` maximising ``est(b) / cost(b)`` as :func:`~maskplug.choose_budget`
does for chains, and :func:`select_subtree` keeps the ``b`` best nodes over
the batch, which always form a subtree (a value never exceeds its parent's,
and ties go to the shallower node); :func:`allocate_tree` keeps the same
nodes from the live confidences on their device, without a host sync.

Compaction. :func:`compact_tree` returns the kept subtree per request with
what tree attention needs (kept nodes, their parents among the kept nodes,
their depths) and the active ``cu_logits``; :meth:`TreeCompaction.live_mapping`
sends each scheduled row to its live position (dropped nodes' rows unused), so
the mask kernels run unchanged; :meth:`TreeCompaction.attention_mask` gives
each request's tree attention among its live positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ._checks import INT32_MAX, host_int
from .budget import BudgetDecision, CostModel, best_budget, budget_bounds, host_confidences
from .compaction import Regime, TokenTotal, regime_of
from .draftmasks import frozen, host_field, host_requests
from .errors import BudgetError, GrammarError, LayoutError
from .layout import GrammarRows, RowMapping, ScheduledLayout

__all__ = [
    "DraftTree",
    "TreeCompaction",
    "TreeMasks",
    "allocate_tree",
    "check_tree_masks",
    "choose_tree_budget",
    "compact_tree",
    "node_values",
    "select_subtree",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def _flat_parents(parents: Any, layout: ScheduledLayout) -> IntArray:
    """``parents`` (one sequence per request, or one flat array in batch order) as one flat int64 array."""
    total = layout.total_drafts
    if isinstance(parents, torch.Tensor):
        if parents.device.type != "cpu":
            raise LayoutError(f"parents: expected host values, got a tensor on {parents.device}")
        parents = parents.detach().numpy()
    if isinstance(parents, np.ndarray) and parents.ndim == 1:
        flat = parents
    elif isinstance(parents, Sequence) and not isinstance(parents, (str, bytes)):
        if len(parents) != layout.n:
            raise LayoutError(
                f"parents: expected one sequence per request ({layout.n}) or a flat array of {total} "
                f"parent indices, got {len(parents)} entries"
            )
        parts: list[IntArray] = []
        for r, p in enumerate(parents):
            if isinstance(p, torch.Tensor):
                p = p.detach().cpu().numpy()
            try:
                a = np.asarray(p)
            except (TypeError, ValueError, OverflowError) as err:
                raise LayoutError(f"parents[{r}]: expected a 1-D sequence of parent indices") from err
            if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
                raise LayoutError(f"parents[{r}]: expected a 1-D sequence of integer parent indices, got {a.dtype}")
            if a.shape[0] != int(layout.num_drafts[r]):
                raise LayoutError(
                    f"parents[{r}]: expected num_drafts = {int(layout.num_drafts[r])} parent indices, got {a.shape[0]}"
                )
            parts.append(a.astype(np.int64, copy=False))
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    else:
        raise LayoutError(f"parents: expected one sequence per request or a flat array, got {type(parents).__name__}")
    if flat.size and flat.dtype.kind not in "iu":
        raise LayoutError(f"parents: expected integer parent indices, got dtype {flat.dtype}")
    if flat.shape[0] != total:
        raise LayoutError(f"parents: expected {total} parent indices (Σ num_drafts), got {flat.shape[0]}")
    return flat.astype(np.int64, copy=True)


def _depths(up: IntArray, local: IntArray, chain: BoolArray) -> IntArray:
    """Each node's depth (1 for the root's children) from its flat parent index ``up`` (-1: the root).

    Chains (every node's parent the node before it) lie at ``local + 1``.
    Otherwise pointer doubling: every node keeps the hops to an ancestor it
    points at; each pass adds that ancestor's hops and jumps to its
    ancestor, so ``ceil(log2(max depth))`` vectorised passes, each over the
    nodes not yet pointing at the root (one pass per tree level made a
    32,000-deep chain quadratic).
    """
    if bool(chain.all()):
        return (local + 1).astype(np.int64)
    hops = np.ones(up.shape[0], dtype=np.int64)
    anc = up.copy()
    live = np.flatnonzero(anc >= 0)
    while live.size:
        a = anc[live]
        # Both right-hand sides are read before anything is written: one synchronous jump.
        hops[live] += hops[a]
        anc[live] = anc[a]
        live = live[anc[live] >= 0]
    return hops


class DraftTree:
    """The draft trees of one step: a :class:`~maskplug.ScheduledLayout` and one parent index per draft node.

    Args:
        layout: the scheduled layout (``num_drafts[r]`` nodes per request).
        parents: per request, one parent index per node (``-1`` for a node
            hanging off the root), or one flat array of every node's parent
            in batch order. Parents come before their children
            (``-1 <= parents[j] < j``), which also makes every tree acyclic.

    Attributes:
        parents: flat int64 parent indices (request-local), batch order.
        cu_nodes: offsets of each request's nodes in the flat arrays.
        depth: flat depth of every node (1 for the root's children): its
            position offset from the root.
        up: flat index of every node's parent (``-1``: the root).
        is_chain: per request, whether its nodes form a chain.
    """

    __slots__ = ("cu_nodes", "depth", "is_chain", "layout", "parents", "up")

    def __init__(self, layout: ScheduledLayout, parents: Any) -> None:
        if not isinstance(layout, ScheduledLayout):
            raise LayoutError(f"layout: expected a ScheduledLayout, got {type(layout).__name__}")
        flat = _flat_parents(parents, layout)
        cu = np.zeros(layout.n + 1, dtype=np.int64)
        np.cumsum(layout.num_drafts, out=cu[1:])
        local = np.arange(flat.shape[0], dtype=np.int64) - np.repeat(cu[:-1], layout.num_drafts)
        bad = (flat < -1) | (flat >= local)
        if bad.any():
            i = int(np.argmax(bad))
            r = int(np.searchsorted(cu, i, side="right") - 1)
            raise LayoutError(
                f"parents[{r}][{int(local[i])}]: expected a parent index in [-1, {int(local[i])}) "
                f"(parents before children), got {int(flat[i])}"
            )
        # Parents as flat indices (-1: the root).
        up = np.where(flat >= 0, flat + np.repeat(cu[:-1], layout.num_drafts), -1)
        chain = flat == local - 1
        reqs = np.repeat(np.arange(layout.n, dtype=np.int64), layout.num_drafts)
        self.layout = layout
        self.parents: IntArray = frozen(flat)
        self.cu_nodes: IntArray = frozen(cu)
        self.depth: IntArray = frozen(_depths(up, local, chain))
        self.is_chain: BoolArray = frozen(np.bincount(reqs[~chain], minlength=layout.n) == 0)
        self.up: IntArray = frozen(up)

    @classmethod
    def chain(cls, layout: ScheduledLayout) -> DraftTree:
        """Every request's drafts as a chain (``parents[j] = j - 1``)."""
        if not isinstance(layout, ScheduledLayout):
            raise LayoutError(f"layout: expected a ScheduledLayout, got {type(layout).__name__}")
        return cls(layout, [np.arange(int(k), dtype=np.int64) - 1 for k in layout.num_drafts])

    @property
    def n(self) -> int:
        """Number of requests."""
        return self.layout.n

    def parents_of(self, r: int) -> IntArray:
        """Parent indices of request ``r``'s nodes."""
        return self.parents[self.cu_nodes[r] : self.cu_nodes[r + 1]]

    def depths_of(self, r: int) -> IntArray:
        """Depths of request ``r``'s nodes (1 for the root's children)."""
        return self.depth[self.cu_nodes[r] : self.cu_nodes[r + 1]]

    def mapping(self, rows: GrammarRows) -> RowMapping:
        """Row → (request, position), from the scheduled layout only: position 0 the root, ``j + 1`` node ``j``."""
        if not isinstance(rows, GrammarRows):
            raise LayoutError(f"rows: expected a GrammarRows, got {type(rows).__name__}")
        return rows.mapping(self.layout)

    def row_nodes(self, rows: GrammarRows) -> npt.NDArray[np.int32]:
        """For each mask row, the node whose path its mask follows: ``-1`` the root, ``-2`` an unused row.

        Positions past ``num_drafts`` (extra bonus rows) name the last node,
        as chains repeat the row after their last draft.
        """
        m = self.mapping(rows)
        out = np.full(len(m), -2, dtype=np.int32)
        used = m.request >= 0
        nd = self.layout.num_drafts[m.request[used]]
        out[used] = np.minimum(m.position[used].astype(np.int64), nd) - 1
        return out

    def __repr__(self) -> str:
        return f"DraftTree(n={self.n}, num_drafts={self.layout.num_drafts.tolist()}, chains={self.is_chain.tolist()})"


@dataclass(frozen=True)
class TreeMasks:
    """What the grammar producer learned about every draft node (per grammar request, producer order).

    Attributes:
        request: batch index of each grammar request.
        valid: ``valid[g, j]``: node ``j`` lies on a path the grammar accepts
            (every token from the root down to ``j`` accepted, no stop token
            before ``j``); False past a request's nodes.
        forced: ``forced[g, j]``: the row that checks node ``j`` (its
            parent's row) allows exactly one token; False past a request's
            nodes and below nodes the grammar rejects.
        failed: the grammar requests this step could not serve, by batch
            index (the numbers of ``request``), each with the
            :class:`~maskplug.errors.GrammarError` saying what went wrong (a
            node id outside the vocabulary, an exception inside the
            request's matcher, a matcher that could not be rolled back). A
            failed request's rows allow only its stop tokens and none of its
            nodes is valid or forced, so its nodes are worth nothing to the
            tree budget; the other requests are served as if it were not in
            the batch. Empty (a read-only mapping) when every request was
            served.
    """

    request: npt.NDArray[np.int64]
    valid: npt.NDArray[np.bool_]
    forced: npt.NDArray[np.bool_]
    failed: Mapping[int, GrammarError] = field(default_factory=lambda: _NO_FAILURES)

    @property
    def num_valid(self) -> IntArray:
        """Nodes on grammar-valid paths, per grammar request (for a chain: the accepted prefix)."""
        return np.asarray(self.valid, dtype=bool).sum(axis=1).astype(np.int64)


_NO_FAILURES: Mapping[int, GrammarError] = MappingProxyType({})


def check_tree_masks(grammar: Any, tree: DraftTree, arg: str = "grammar") -> TreeMasks:
    """``grammar`` checked against ``tree``: a read-only :class:`TreeMasks` of int64/bool arrays.

    ``request`` unique batch indices, ``valid`` and ``forced`` 2-D bool arrays
    with one row per grammar request and at least as many columns as the
    request has nodes; a valid node's parent must be valid too; ``failed``
    a mapping from batch indices of ``request`` to
    :class:`~maskplug.GrammarError`, none of a failed request's nodes valid.
    Anything else raises :class:`~maskplug.BudgetError` naming the field.
    """
    if not isinstance(grammar, TreeMasks):
        raise BudgetError(f"{arg}: expected TreeMasks or None, got {type(grammar).__name__}")
    if not isinstance(tree, DraftTree):
        raise BudgetError(f"tree: expected a DraftTree, got {type(tree).__name__}")
    lay = tree.layout
    req = host_requests(f"{arg}.request", grammar.request, lay.n)
    g = req.shape[0]
    need = int(lay.num_drafts[req].max()) if g else 0
    out: list[BoolArray] = []
    for name in ("valid", "forced"):
        a = host_field(f"{arg}.{name}", getattr(grammar, name), "b", f"a bool array of shape ({g}, nodes)")
        if a.ndim != 2 or a.shape[0] != g or a.shape[1] < need:
            raise BudgetError(
                f"{arg}.{name}: expected a bool array of shape ({g}, >= {need}) (one row per grammar request), "
                f"got shape {a.shape}"
            )
        out.append(a.astype(bool, copy=False))
    valid, forced = out
    for i, r in enumerate(req.tolist()):
        p = tree.parents_of(r)
        v = valid[i, : p.shape[0]]
        orphan = v & (p >= 0) & ~v[np.maximum(p, 0)]
        if orphan.any():
            j = int(np.argmax(orphan))
            raise BudgetError(
                f"{arg}.valid: expected a valid node's parent to be valid, got node {j} of request {r} valid "
                f"under invalid node {int(p[j])}"
            )
    failed = _check_failed(grammar.failed, req, valid, arg)
    return TreeMasks(frozen(req), frozen(valid), frozen(forced), failed)


def _check_failed(failed: Any, req: IntArray, valid: BoolArray, arg: str) -> Mapping[int, GrammarError]:
    """``failed`` as a read-only mapping of batch index to error, checked against ``request`` and ``valid``."""
    if not isinstance(failed, Mapping):
        raise BudgetError(
            f"{arg}.failed: expected a mapping of batch index to GrammarError, got {type(failed).__name__}"
        )
    if not failed:
        return _NO_FAILURES
    where = {r: i for i, r in enumerate(req.tolist())}
    out: dict[int, GrammarError] = {}
    for key, err in failed.items():
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or int(key) not in where:
            raise BudgetError(f"{arg}.failed: expected batch indices of {arg}.request as keys, got {key!r:.80}")
        if not isinstance(err, GrammarError):
            raise BudgetError(f"{arg}.failed: expected a GrammarError for request {int(key)}, got {type(err).__name__}")
        if valid[where[int(key)]].any():
            raise BudgetError(
                f"{arg}.valid: expected no valid node in failed request {int(key)}, got "
                f"{int(valid[where[int(key)]].sum())}"
            )
        out[int(key)] = err
    return MappingProxyType(out)


def _tree_conf(confidences: Any, tree: DraftTree, grammar: TreeMasks | None) -> FloatArray:
    """Per-node conditional confidences, grammar-corrected (rejected 0, forced valid 1), flat in batch order."""
    lay = tree.layout
    conf = host_confidences(confidences, lay)
    cu = tree.cu_nodes
    local = np.arange(lay.total_drafts, dtype=np.int64) - np.repeat(cu[:-1], lay.num_drafts)
    reqs = np.repeat(np.arange(lay.n, dtype=np.int64), lay.num_drafts)
    flat = conf[reqs, local].astype(np.float64, copy=True) if lay.total_drafts else np.zeros(0)
    if grammar is not None:
        gm = check_tree_masks(grammar, tree)
        for i, r in enumerate(gm.request.tolist()):
            a, b = int(cu[r]), int(cu[r + 1])
            k = b - a
            v = gm.valid[i, :k]
            f = gm.forced[i, :k]
            seg = flat[a:b]
            seg[v & f] = 1.0
            seg[~v] = 0.0
    return flat


def _path_products(conf: FloatArray, tree: DraftTree) -> FloatArray:
    """Products of ``conf`` along each node's path, root side first (as ``cumprod`` runs along a chain).

    A node's value is its parent's times its own confidence, computed one of
    two ways, whichever takes fewer passes (both multiply in the same order,
    so the values are bit-identical): one vectorised pass per tree level, or
    one ``cumprod`` per run of chain links (a run starts at a node whose
    parent is not the node before it and continues from that parent's value,
    already computed since parents come first). Deep chains take the runs
    (one pass per request), wide trees the levels.
    """
    out = conf.copy()
    if not out.size:
        return out
    depth = tree.depth
    up = tree.up
    starts = up != np.arange(-1, up.shape[0] - 1, dtype=np.int64)  # parent is not the node before
    starts[0] = True  # node 0 hangs off the root (up == -1 == its index - 1)
    heads = np.flatnonzero(starts)  # run starts: node 0 of every request among them
    levels = int(depth.max())
    if heads.shape[0] < levels:
        ends = np.append(heads[1:], up.shape[0])
        for a, b in zip(heads.tolist(), ends.tolist(), strict=True):
            p = int(up[a])
            if p < 0:
                out[a:b] = np.cumprod(conf[a:b])
            else:
                out[a:b] = np.cumprod(np.concatenate(([out[p]], conf[a:b])))[1:]
        return out
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(2, levels + 2))
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        idx = order[lo:hi]
        out[idx] = out[up[idx]] * conf[idx]
    return out


def node_values(confidences: Any, tree: DraftTree, grammar: TreeMasks | None = None) -> FloatArray:
    """Each node's probability of acceptance: the product of confidences along its path, flat in batch order.

    ``confidences`` has shape ``(n, >= max num_drafts)``; column ``j`` is
    node ``j``'s acceptance probability given its parent was accepted (stale
    values are fine; NaN or values outside ``[0, 1]`` raise
    :class:`~maskplug.BudgetError`). With ``grammar``, rejected nodes are
    worth 0 and forced valid nodes keep their parent's value.
    """
    if not isinstance(tree, DraftTree):
        raise BudgetError(f"tree: expected a DraftTree, got {type(tree).__name__}")
    return _path_products(_tree_conf(confidences, tree, grammar), tree)


def _order(values: FloatArray, tree: DraftTree) -> IntArray:
    """Flat node indices best first: value descending, then depth, then request, then node (deterministic).

    The flat index already orders by request, then node; a stable sort on the
    values over the (depth, flat index) order keeps those ties in place.
    """
    total = values.shape[0]
    tie = np.argsort(tree.depth * (total + 1) + np.arange(total, dtype=np.int64))
    return tie[np.argsort(-values[tie], kind="stable")].astype(np.int64)


def choose_tree_budget(
    confidences: Any,
    tree: DraftTree,
    cost: CostModel,
    *,
    num_sampling: int | None = None,
    max_logits: int | None = None,
    grammar: TreeMasks | None = None,
) -> BudgetDecision:
    """Pick ``b`` maximising ``est(b) / cost(b)`` over draft trees; ties go to the smallest ``b``.

    ``est(b) = num_sampling + Σ top-b node values`` (:func:`node_values`)
    and ``cost(b) = draft_ms(n) + verify_ms(Σ num_non_draft + b)``, over
    ``0 <= b <= min(Σ num_drafts, max_logits - n·num_bonus)``. The top ``b``
    nodes always form a subtree (:func:`select_subtree` returns it). For a
    chain this is :func:`~maskplug.choose_budget` exactly.
    """
    if not isinstance(tree, DraftTree):
        raise BudgetError(f"tree: expected a DraftTree, got {type(tree).__name__}")
    if not isinstance(cost, CostModel):
        raise BudgetError(f"cost: expected a CostModel, got {type(cost).__name__}")
    lay = tree.layout
    values = node_values(confidences, tree, grammar)
    ns, cap = budget_bounds(lay, num_sampling, max_logits)
    return best_budget(np.sort(values)[::-1][:cap], ns, lay, cost)


def select_subtree(
    confidences: Any, tree: DraftTree, budget: int, grammar: TreeMasks | None = None
) -> npt.NDArray[np.bool_]:
    """The ``budget`` best nodes over the batch, a flat keep flag per node (batch order).

    Best by :func:`node_values`; ties go to the shallower node, then the
    lower request, then the lower node index, so the result is deterministic
    and every kept node's parent is kept. ``budget`` lies in ``[0, Σ
    num_drafts]``.
    """
    if not isinstance(tree, DraftTree):
        raise BudgetError(f"tree: expected a DraftTree, got {type(tree).__name__}")
    total = tree.layout.total_drafts
    b = host_int("budget", budget, BudgetError, hi=total, expected=f"0 <= budget <= Σ num_drafts = {total}")
    values = node_values(confidences, tree, grammar)
    keep = np.zeros(total, dtype=bool)
    keep[_order(values, tree)[:b]] = True
    return keep


def allocate_tree(
    confidences: torch.Tensor, tree: DraftTree, budget: int | torch.Tensor, grammar: TreeMasks | None = None
) -> torch.Tensor:
    """:func:`select_subtree` on the live confidences, on their device, without a host sync.

    ``confidences`` is a 2-D floating tensor ``(n, >= max num_drafts)`` (a
    CPU tensor's scheduled values are checked to lie in ``[0, 1]``; on a
    device NaN counts as 0 and others are clamped); ``budget`` an int in
    ``[0, Σ num_drafts]`` or a 0-d integer tensor on the same device (its
    value is not read). Returns the flat keep flags (bool, ``Σ num_drafts``)
    on the confidences' device: the same nodes :func:`select_subtree` keeps
    for the same values.
    """
    if not isinstance(tree, DraftTree):
        raise BudgetError(f"tree: expected a DraftTree, got {type(tree).__name__}")
    lay = tree.layout
    if not isinstance(confidences, torch.Tensor) or confidences.ndim != 2 or not confidences.is_floating_point():
        got = f"{type(confidences).__name__} {getattr(confidences, 'dtype', '')} {tuple(getattr(confidences, 'shape', ()))}"
        raise BudgetError(f"confidences: expected a 2-D floating tensor (n, max_drafts), got {got}")
    k = int(lay.num_drafts.max()) if lay.n else 0
    if confidences.shape[0] != lay.n or confidences.shape[1] < k:
        raise BudgetError(f"confidences: expected shape ({lay.n}, >= {k}), got {tuple(confidences.shape)}")
    dev = confidences.device
    total = lay.total_drafts
    if isinstance(budget, torch.Tensor) and budget.device.type != "cpu":
        if budget.device != dev or budget.ndim != 0 or budget.is_floating_point() or budget.dtype == torch.bool:
            raise BudgetError(f"budget: expected a 0-d integer tensor on {dev}, got {budget.dtype} on {budget.device}")
        b: int | torch.Tensor = budget
    else:
        b = host_int("budget", budget, BudgetError, hi=total, expected=f"0 <= budget <= Σ num_drafts = {total}")
    reqs = np.repeat(np.arange(lay.n, dtype=np.int64), lay.num_drafts)
    local = np.arange(total, dtype=np.int64) - np.repeat(tree.cu_nodes[:-1], lay.num_drafts)
    if dev.type == "cpu" and total:
        host_confidences(confidences.detach().to(torch.float64), lay)  # the value checks
    override = np.full(total, np.nan, dtype=np.float64)
    if grammar is not None:
        gm = check_tree_masks(grammar, tree)
        for i, r in enumerate(gm.request.tolist()):
            a, e = int(tree.cu_nodes[r]), int(tree.cu_nodes[r + 1])
            v, f = gm.valid[i, : e - a], gm.forced[i, : e - a]
            seg = override[a:e]
            seg[v & f] = 1.0
            seg[~v] = 0.0
    if total == 0:
        return torch.zeros(0, dtype=torch.bool, device=dev)
    idx_r = torch.from_numpy(reqs).to(dev)
    idx_l = torch.from_numpy(local).to(dev)
    c = confidences.detach()[idx_r, idx_l].to(torch.float64)
    if dev.type != "cpu":
        c = torch.nan_to_num(c.clamp(0.0, 1.0), nan=0.0)
    over = torch.from_numpy(override).to(dev)
    c = torch.where(torch.isnan(over), c, over)
    # Products root side first, one level per pass (the host's order: bit-identical values).
    vals = c.clone()
    depth = tree.depth
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(2, int(depth.max()) + 2))
    up = torch.from_numpy(np.array(tree.up)).to(dev)
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        idx = torch.from_numpy(order[lo:hi]).to(dev)
        vals[idx] = vals[up[idx]] * c[idx]
    tie = torch.from_numpy(np.argsort(depth * (total + 1) + np.arange(total, dtype=np.int64))).to(dev)
    ranked = tie[torch.sort(vals[tie], descending=True, stable=True).indices]
    rank = torch.empty_like(ranked)
    rank[ranked] = torch.arange(total, device=dev)
    return rank < b


@dataclass(frozen=True)
class TreeCompaction(TokenTotal):
    """The kept subtree of every request and the compacted batch.

    Attributes:
        regime: ``"full"``, ``"partial"`` or ``"zero"`` (as for chains).
        keep: flat keep flag of every scheduled node (batch order).
        capacity: kept nodes per request.
        num_tokens_per_req: tokens per request after trimming.
        cu_logits: active logits-row offsets, ``cumsum(capacity + num_bonus)``.
        cu_kept: offsets of each request's kept nodes in the ``kept_*`` arrays.
        kept_node: scheduled (request-local) index of each kept node.
        kept_parent: its parent among the request's kept nodes (``-1``: the root).
        kept_depth: its depth (1 for the root's children): the position offset
            from the root for rotary embeddings.
        live_position: for every scheduled node, its live logits position in
            its request (``1 +`` rank among kept nodes), ``-1`` if dropped.
    """

    regime: Regime
    keep: npt.NDArray[np.bool_]
    capacity: npt.NDArray[np.int64]
    num_tokens_per_req: npt.NDArray[np.int64]
    cu_logits: npt.NDArray[np.int64]
    cu_kept: npt.NDArray[np.int64]
    kept_node: npt.NDArray[np.int64]
    kept_parent: npt.NDArray[np.int64]
    kept_depth: npt.NDArray[np.int64]
    live_position: npt.NDArray[np.int64]
    num_bonus: int

    def attention_mask(self, r: int) -> npt.NDArray[np.bool_]:
        """Request ``r``'s tree attention among its live positions: ``(1 + c, 1 + c)`` bool, ``c`` its kept nodes.

        Position 0 is the root, position ``i + 1`` kept node ``i``; a position
        sees the root, its kept ancestors and itself (the verified prefix
        before the root is visible to all and not part of this mask).
        """
        r = host_int("r", r, LayoutError, hi=self.capacity.shape[0] - 1)
        a, b = int(self.cu_kept[r]), int(self.cu_kept[r + 1])
        par = self.kept_parent[a:b]
        c = b - a
        out = np.zeros((c + 1, c + 1), dtype=bool)
        out[:, 0] = True
        out[np.arange(1, c + 1), np.arange(1, c + 1)] = True
        # Parents come first among the kept nodes: a node sees what its parent sees.
        for i in range(c):
            if par[i] >= 0:
                out[i + 1] |= out[par[i] + 1]
        return out

    def live_mapping(self, mapping: RowMapping, tree: DraftTree) -> RowMapping:
        """The scheduled ``mapping`` with each row sent to its live position; dropped nodes' rows unused.

        Root rows stay at position 0, node ``j``'s row moves to
        ``live_position[j]`` and positions past ``num_drafts`` (extra bonus
        rows, ``num_bonus > 1``) follow the kept nodes, still holding the
        scheduled row after the last node. Feed it, with :attr:`cu_logits`, to
        :func:`~maskplug.apply_grammar_bitmask` (its kernels are unchanged).
        """
        if not isinstance(mapping, RowMapping):
            raise LayoutError(f"mapping: expected a RowMapping, got {type(mapping).__name__}")
        if not isinstance(tree, DraftTree):
            raise LayoutError(f"tree: expected a DraftTree, got {type(tree).__name__}")
        if tree.layout.total_drafts != self.keep.shape[0] or tree.n != self.capacity.shape[0]:
            raise LayoutError("tree: expected the tree this compaction was built from")
        req = mapping.request.astype(np.int64)
        pos = mapping.position.astype(np.int64)
        used = req >= 0
        if used.any() and (int(req.max()) >= tree.n or int(pos[used].min()) < 0):
            raise LayoutError("mapping: expected a mapping of this tree's scheduled layout")
        nd = np.zeros_like(req)
        nd[used] = tree.layout.num_drafts[req[used]]
        if used.any() and int((pos - nd)[used].max()) >= tree.layout.num_bonus:
            raise LayoutError("mapping: expected a mapping of this tree's scheduled layout")
        new_req = req.copy()
        new_pos = pos.copy()
        node = used & (pos >= 1) & (pos <= nd)
        flat = np.zeros_like(req)
        flat[node] = tree.cu_nodes[req[node]] + pos[node] - 1
        lp = self.live_position[flat[node]] if node.any() else np.zeros(0, dtype=np.int64)
        new_pos[node] = lp
        dropped = np.zeros_like(used)
        dropped[node] = lp < 0
        extra = used & (pos > nd)
        new_pos[extra] = self.capacity[req[extra]] + (pos[extra] - nd[extra])
        new_req[dropped] = -1
        new_pos[dropped] = -1
        return RowMapping(new_req.astype(np.int32), new_pos.astype(np.int32))


def compact_tree(tree: DraftTree, keep: Any) -> TreeCompaction:
    """The kept subtree per request from a flat keep flag per node (every kept node's parent kept).

    ``keep`` is a bool array of ``Σ num_drafts`` flags in batch order (as
    :func:`select_subtree` returns). A kept node whose parent is dropped
    raises :class:`~maskplug.BudgetError`.
    """
    if not isinstance(tree, DraftTree):
        raise BudgetError(f"tree: expected a DraftTree, got {type(tree).__name__}")
    lay = tree.layout
    total = lay.total_drafts
    if isinstance(keep, torch.Tensor):
        if keep.device.type != "cpu":
            raise BudgetError(f"keep: expected host values, got a tensor on {keep.device}")
        keep = keep.detach().numpy()
    k = np.asarray(keep)
    if k.ndim != 1 or (k.size and k.dtype != np.bool_) or k.shape[0] != total:
        raise BudgetError(f"keep: expected {total} bool flags (one per scheduled node), got {k.dtype} {k.shape}")
    k = k.astype(bool, copy=True)
    cu = tree.cu_nodes
    par = tree.parents
    parent_flat = np.where(par >= 0, np.repeat(cu[:-1], lay.num_drafts) + par, -1)
    orphan = k & (par >= 0) & ~k[np.maximum(parent_flat, 0)] if total else k
    if orphan.any():
        i = int(np.argmax(orphan))
        r = int(np.searchsorted(cu, i, side="right") - 1)
        j = i - int(cu[r])
        raise BudgetError(f"keep: expected every kept node's parent kept, got node {j} of request {r} without {par[i]}")
    reqs = np.repeat(np.arange(lay.n, dtype=np.int64), lay.num_drafts)
    cap = np.bincount(reqs[k], minlength=lay.n).astype(np.int64)
    nb = lay.num_bonus
    cu_logits = np.zeros(lay.n + 1, dtype=np.int64)
    np.cumsum(cap + nb, out=cu_logits[1:])
    if int(cu_logits[-1]) > INT32_MAX:
        raise BudgetError(f"keep: expected offsets that fit in int32, got {int(cu_logits[-1])}")
    cu_kept = np.zeros(lay.n + 1, dtype=np.int64)
    np.cumsum(cap, out=cu_kept[1:])
    # Rank of each kept node among its request's kept nodes (scheduled order keeps parents first).
    run = np.cumsum(k.astype(np.int64)) - 1
    rank = run - np.repeat(cu_kept[:-1], lay.num_drafts)
    live = np.where(k, rank + 1, -1).astype(np.int64)
    idx = np.flatnonzero(k)
    local = idx - np.repeat(cu[:-1], lay.num_drafts)[idx]
    pidx = parent_flat[idx]
    kept_parent = np.where(pidx >= 0, live[np.maximum(pidx, 0)] - 1, -1).astype(np.int64)
    budget = int(cap.sum())
    return TreeCompaction(
        regime=regime_of(lay, budget),
        keep=frozen(k),
        capacity=frozen(cap),
        num_tokens_per_req=frozen(lay.num_non_draft + cap),
        cu_logits=frozen(cu_logits),
        cu_kept=frozen(cu_kept),
        kept_node=frozen(local.astype(np.int64)),
        kept_parent=frozen(kept_parent),
        kept_depth=frozen(tree.depth[idx].astype(np.int64)),
        live_position=frozen(live),
        num_bonus=nb,
    )
