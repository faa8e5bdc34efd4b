"""SGLang's EAGLE draft-tree windows through maskplug's tree API.

SGLang lays a speculative step out per request as a window of ``W`` nodes:
node 0 is the last verified token (never fed to the grammar), nodes
``1..W-1`` the drafts, linked by ``retrieve_next_token`` (first child) and
``retrieve_next_sibling`` (next sibling); mask row ``i*W + q`` is the
grammar's mask after the path to node ``q``. :func:`fill_draft_trees` turns
every grammar request's window into a :class:`maskplug.DraftTree` (nodes in
depth-first order, so parents come first), fills the rows with
:func:`maskplug.fill_tree_masks` for the whole batch in one call, and puts
each row back at its node's place in SGLang's mask. The bits are those
SGLang's own ``traverse_tree`` writes: rows of nodes the grammar refuses,
below them, after an accepted stop token, of nodes no link reaches, and of
requests without a live grammar stay as they were (all-allowed). Drafts at
or past ``vocab_size`` are refused, as SGLang refuses them.

The returned :class:`TreeWindows` carries the tree and the per-node grammar
flags, ready for :func:`maskplug.choose_tree_budget` and
:func:`maskplug.select_subtree`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from maskplug import DraftTree, GrammarRows, LayoutError, ScheduledLayout, TreeMasks, fill_tree_masks

from .backend import MaskplugGrammar, _window_batch, fail_grammars

__all__ = ["TreeWindows", "fill_draft_trees", "window_tree"]


@dataclass(frozen=True)
class TreeWindows:
    """What :func:`fill_draft_trees` built and learned.

    Attributes:
        requests: batch index of each request whose grammar was walked.
        nodes: per walked request, the SGLang node (``1..W-1``) of each
            maskplug tree node (depth-first order).
        tree: the walked requests' draft trees (one request per entry of
            ``requests``, in that order).
        masks: per-node grammar flags of those trees.
        valid: ``(batch, W)``: SGLang node ``q`` of request ``i`` lies on a
            grammar-valid path (node 0 of a walked request is valid; every
            node of a request without a live grammar is False).
    """

    requests: npt.NDArray[np.int64]
    nodes: list[npt.NDArray[np.int64]]
    tree: DraftTree
    masks: TreeMasks
    valid: npt.NDArray[np.bool_]


def window_tree(
    next_token: Any, next_sibling: Any, tokens: Any, vocab_size: int | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """One window as (SGLang node of each tree node, parent of each tree node), nodes in depth-first order.

    Only nodes the links reach from node 0 are kept; a draft at or past
    ``vocab_size`` is dropped with everything below it (the grammar never
    allows it).
    """
    nt = np.asarray(next_token.tolist() if isinstance(next_token, torch.Tensor) else next_token, dtype=np.int64)
    ns = np.asarray(next_sibling.tolist() if isinstance(next_sibling, torch.Tensor) else next_sibling, dtype=np.int64)
    tk = np.asarray(tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens, dtype=np.int64)
    w = nt.shape[0]
    nodes: list[int] = []
    parents: list[int] = []
    seen = np.zeros(w, dtype=bool)
    seen[0] = True
    # (SGLang node, its parent's maskplug index); children pushed in reverse to visit them in order.
    stack: list[tuple[int, int]] = []

    def push_children(q: int, me: int) -> None:
        kids = []
        c = int(nt[q])
        while c != -1:
            if not 0 < c < w or seen[c]:
                raise LayoutError(f"retrieve_next_token: expected links forming a tree over nodes 1..{w - 1}, got {c}")
            seen[c] = True
            kids.append(c)
            c = int(ns[c])
        stack.extend((k, me) for k in reversed(kids))

    push_children(0, -1)
    while stack:
        q, par = stack.pop()
        if vocab_size is not None and int(tk[q]) >= vocab_size:
            continue
        me = len(nodes)
        nodes.append(q)
        parents.append(par)
        push_children(q, me)
    return np.asarray(nodes, dtype=np.int64), np.asarray(parents, dtype=np.int64)


def fill_draft_trees(
    grammars: Sequence[MaskplugGrammar | None],
    draft_tokens: Any,
    retrieve_next_token: Any,
    retrieve_next_sibling: Any,
    vocab_mask: torch.Tensor,
    vocab_size: int | None = None,
    *,
    strategy: str = "auto",
) -> TreeWindows:
    """Mask rows of SGLang's draft-tree windows, all requests at once, with :func:`maskplug.fill_tree_masks`.

    Args:
        grammars: one entry per request (``None`` without a grammar).
        draft_tokens: ``(batch, W)`` node tokens (column 0 the verified token).
        retrieve_next_token: ``(batch, W)`` first-child links (``-1``: none).
        retrieve_next_sibling: ``(batch, W)`` next-sibling links.
        vocab_mask: at least ``batch × W`` rows; request ``i`` owns rows
            ``i*W .. i*W+W-1``. Rows nothing valid reaches are left as they are.
        vocab_size: drafts at or past it are refused (SGLang's rule).
        strategy: :func:`maskplug.fill_tree_masks`' strategy (``"auto"``:
            the provider's native tree walk where it has one).

    A grammar that fails (``TreeMasks.failed``: its matcher raised, say) gets
    the stop-only root row and no valid node, and is failed
    (:meth:`~maskplug_sglang.backend.MaskplugGrammar.fail`: its request is
    aborted with the error at its next committed token); the other requests'
    rows are those of the batch without it.

    Raises:
        LayoutError: shapes or links that do not describe windows (nothing written).
    """
    arrs = []
    for name, v in (
        ("draft_tokens", draft_tokens),
        ("retrieve_next_token", retrieve_next_token),
        ("retrieve_next_sibling", retrieve_next_sibling),
    ):
        a = v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
        if a.ndim != 2 or (a.size and a.dtype.kind not in "iu"):
            raise LayoutError(f"{name}: expected a 2-D integer array (batch, W), got shape {a.shape} {a.dtype}")
        arrs.append(a.astype(np.int64))
    dt, nt, ns = arrs
    if nt.shape != dt.shape or ns.shape != dt.shape:
        raise LayoutError(
            f"retrieve_next_token, retrieve_next_sibling: expected the shape of draft_tokens {dt.shape}, "
            f"got {nt.shape} and {ns.shape}"
        )
    batch, width, gs, active = _window_batch(grammars, dt, vocab_mask)
    for i in active:
        if not isinstance(gs[i], MaskplugGrammar):
            raise LayoutError(f"grammars[{i}]: expected a MaskplugGrammar or None, got {type(gs[i]).__name__}")
    shapes = [window_tree(nt[i], ns[i], dt[i], vocab_size) for i in active] if width else []
    n = len(shapes)
    nodes = [s[0] for s in shapes]
    layout = ScheduledLayout(list(range(n)), [s[0].shape[0] for s in shapes], [1] * n, num_bonus=1)
    tree = DraftTree(layout, [s[1] for s in shapes])
    valid = np.zeros((batch, width), dtype=bool)
    if n == 0:
        masks = TreeMasks(np.zeros(0, np.int64), np.zeros((0, 0), bool), np.zeros((0, 0), bool))
        return TreeWindows(np.asarray(active, dtype=np.int64), nodes, tree, masks, valid)
    rows = GrammarRows(list(range(n)))
    scratch = torch.empty((rows.num_rows(layout), int(vocab_mask.shape[1])), dtype=torch.int32)
    matchers = [gs[i].producer_matcher() for i in active]  # type: ignore[union-attr]
    toks = [dt[i][q] for i, q in zip(active, nodes, strict=True)]
    masks = fill_tree_masks(matchers, toks, scratch, rows, tree, strategy=strategy)
    if masks.failed:
        # Only those requests fail (the producer's batch indices are positions in ``active``).
        fail_grammars([gs[i] for i in active], masks.failed)
    # Put back only the rows SGLang's traversal writes: the root, and each valid node that is not a stop token.
    src: list[int] = []
    dest: list[int] = []
    row0 = 0
    for g, i in enumerate(active):
        eos = set(gs[i].vocab.eos_ids)  # type: ignore[union-attr]
        q = nodes[g]
        k = q.shape[0]
        ok = masks.valid[g, :k]
        valid[i, 0] = True
        valid[i, q[ok]] = True
        src.append(row0)
        dest.append(i * width)
        for j in np.flatnonzero(ok).tolist():
            if int(dt[i, q[j]]) not in eos:
                src.append(row0 + j + 1)
                dest.append(i * width + int(q[j]))
        row0 += k + 1
    d = torch.tensor(dest, dtype=torch.int64, device=vocab_mask.device)
    vocab_mask[d] = scratch[torch.tensor(src, dtype=torch.int64)].to(vocab_mask.device)
    return TreeWindows(np.asarray(active, dtype=np.int64), nodes, tree, masks, valid)
