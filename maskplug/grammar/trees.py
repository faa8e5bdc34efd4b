"""Filling the mask rows of draft trees (see :mod:`maskplug.trees` for the row layout).

:func:`fill_tree_masks` writes, for every grammar request, the row at position
0 (the mask after the verified prefix) and the row at position ``j + 1`` (the
mask after the path to node ``j``), and reports per node whether it lies on a
grammar-valid path and whether the row that checks it allows exactly one
token. Three ways to get there, all writing the same rows:

* when every grammar request's drafts form a chain, the call is
  :func:`maskplug.fill_draft_masks` (its fast paths and results);
* a matcher whose batch operations walk whole draft trees in the engine
  (:class:`~maskplug.grammar.protocols.TreeOps`) fills its request in one call,
  without Python per node;
* every other matcher is walked depth first with the matcher protocol:
  accept a node's token, fill its row, visit its children, roll back one.

Rows below a node the grammar refuses, and the row after an accepted stop
token, are all-allowed (nothing valid reaches them), as for chains. The
matchers end exactly where they started, also on error. The arguments are
checked, and the failed requests' stop-only rows written, by the code the
chain producer uses (:mod:`~maskplug.grammar.fillargs`,
:mod:`~maskplug.grammar.assembly`).

Fault isolation, as for chains: one request's bad node ids (outside its
vocabulary, or negative) or its matcher raising (in ``fill``, ``accept``,
``rollback``, ``is_terminated``, the engine's tree walk, once or from a
sticky error state) fail that request alone. Its rows allow only its stop
tokens, none of its nodes is valid or forced, and
:attr:`~maskplug.TreeMasks.failed` maps its batch index to the
:class:`~maskplug.GrammarError`; every other request is served exactly as
in the same batch without it. The depth-first walk rolls a failed matcher
back by the tokens it had accepted (the error says when that raised too:
the matcher should then be dropped); the engine's own tree walk leaves its
matcher where it started, also when it raises (its contract).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..draftmasks import DraftMasks
from ..errors import GrammarError, LayoutError
from ..layout import GrammarRows
from ..trees import DraftTree, TreeMasks
from .assembly import dead_rows, empty_row_error, write_stop_rows
from .checks import brief_error
from .draft import fill_checked
from .fillargs import FillArgs, KnownTypes, check_fill_args, eos_sets
from .jobs import claim, release
from .pools import spread_tasks
from .protocols import Matcher, TreeOps
from .recovery import roll_back, undo_after_interrupt

__all__ = ["fill_tree_masks", "native_tree_walker"]

IntArray = npt.NDArray[np.int64]
_STRATEGIES = ("auto", "native", "walk")
_TREE_OPS = KnownTypes(TreeOps)


def native_tree_walker(matcher: Any) -> Callable[..., Any] | None:
    """The engine's own draft-tree walk of ``matcher``, or None.

    The walk is called as ``walk(next_child, next_sibling, tokens, bitmask)``
    and fills one row per tree node, node 0 being the current state, ending
    where it started: the matcher's batch operations' ``fill_tree`` for it,
    where they are a :class:`~maskplug.grammar.protocols.TreeOps`. A provider
    that declares none but whose matcher exposes its engine as ``raw`` with
    xgrammar's ``traverse_draft_tree`` (the same call, which ``fill_tree``
    stands for) gets that.
    """
    ops = getattr(matcher, "batch_ops", None)
    if ops is not None and _TREE_OPS.ok(ops):
        return functools.partial(ops.fill_tree, matcher)
    raw = getattr(matcher, "raw", None)
    fn = getattr(raw, "traverse_draft_tree", None)
    return fn if callable(fn) else None


def _links(parents: IntArray) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child and next-sibling links over nodes ``0..D`` (0 the root, ``j + 1`` draft node ``j``)."""
    d = parents.shape[0]
    child = np.full(d + 1, -1, dtype=np.int64)
    sibling = np.full(d + 1, -1, dtype=np.int64)
    last = np.full(d + 1, -1, dtype=np.int64)
    for j in range(d):
        p = int(parents[j]) + 1
        if child[p] < 0:
            child[p] = j + 1
        else:
            sibling[last[p]] = j + 1
        last[p] = j + 1
    return torch.from_numpy(child), torch.from_numpy(sibling)


def _bit(words: npt.NDArray[np.int32], token: int) -> bool:
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


@dataclass
class _TreeFill:
    """One tree fill, per grammar request ``g``: its matcher, node tokens and parents, rows and findings.

    Request ``g``'s node tokens are ``d[g, :nd[g]]`` with parents
    ``parents[g]``; its rows are ``row0[g] .. row0[g] + need[g] - 1`` of the
    bitmask. The walks record which nodes are on a grammar-valid path
    (``valid[g]``) and which rows hold its masks (``filled[g]``, position
    ``j + 1`` for node ``j``); each walker writes only its own request's.
    """

    matchers: Sequence[Matcher]
    d: IntArray
    nd: IntArray
    parents: list[IntArray]
    bitmask: torch.Tensor
    row0: IntArray
    need: IntArray
    eos: Sequence[frozenset[int]]
    valid: npt.NDArray[np.bool_]
    filled: npt.NDArray[np.bool_]


def _walk_native(t: _TreeFill, g: int, walk: Callable[..., Any]) -> None:
    """One request through the engine's tree walk; validity read back from the rows it wrote.

    An exception from the engine propagates (its walk ends where it started, also then).
    """
    k, row0, need, eos = int(t.nd[g]), int(t.row0[g]), int(t.need[g]), t.eos[g]
    toks, parents, bitmask, valid, filled = t.d[g, :k], t.parents[g], t.bitmask, t.valid[g], t.filled[g]
    child, sibling = _links(parents)
    tokens = torch.zeros(k + 1, dtype=torch.int64)
    tokens[1:] = torch.from_numpy(toks)
    if need >= k + 1:
        walk(child, sibling, tokens, bitmask[row0 : row0 + k + 1])
        rows = bitmask.numpy()[row0 : row0 + k + 1]
    else:  # no bonus row: the last node's row has no place in the bitmask
        scratch = torch.zeros((k + 1, bitmask.shape[1]), dtype=torch.int32)
        walk(child, sibling, tokens, scratch)
        bitmask[row0 : row0 + need] = scratch[:need]
        rows = scratch.numpy()
    filled[0] = True
    for j in range(k):
        p = int(parents[j])
        reach = p < 0 or (valid[p] and int(toks[p]) not in eos)
        valid[j] = reach and _bit(rows[p + 1], int(toks[j]))
        filled[j + 1] = valid[j] and int(toks[j]) not in eos


# What the depth-first walk was doing when its matcher raised (formatted only on failure).
_FILL, _ACCEPT, _ROLLBACK = 0, 1, 2


def _walk_dfs(t: _TreeFill, g: int) -> GrammarError | None:
    """Depth first with the matcher protocol: accept, fill, children, roll back one.

    An exception from the matcher ends the walk: the tokens it had accepted
    are rolled back (where the matcher allows) and the request's error is
    returned. Anything that is not an ``Exception`` (an interrupt) rolls
    back and propagates.
    """
    m, k, row0, need, eos = t.matchers[g], int(t.nd[g]), int(t.row0[g]), int(t.need[g]), t.eos[g]
    toks, parents, bitmask, valid, filled = t.d[g, :k], t.parents[g], t.bitmask, t.valid[g], t.filled[g]
    children: list[list[int]] = [[] for _ in range(k + 1)]
    for j in range(k):
        children[int(parents[j]) + 1].append(j)
    depth = 0
    doing, node = _FILL, -1
    try:
        if need >= 1:
            m.fill(bitmask, row0)
        filled[0] = True
        # Entries: node to enter (>= 0), or ~node to leave it (roll back one).
        stack = [c for c in reversed(children[0])]
        while stack:
            e = stack.pop()
            if e < 0:
                doing, node = _ROLLBACK, ~e
                m.rollback(1)
                depth -= 1
                continue
            tok = int(toks[e])
            doing, node = _ACCEPT, e
            if not m.accept(tok):
                continue
            depth += 1
            valid[e] = True
            stack.append(~e)
            if tok in eos:
                continue  # nothing follows a stop token: its row and subtree stay unfilled
            if e + 1 < need:
                doing = _FILL
                m.fill(bitmask, row0 + e + 1)
            filled[e + 1] = True
            stack.extend(reversed(children[e + 1]))
    except Exception as exc:
        if doing == _FILL:
            what = f"fill of row {node + 1}"
        elif doing == _ACCEPT:
            what = f"accept of tokens[{g}][{node}] = {int(toks[node])}"
        else:
            what = f"rollback(1) leaving node {node}"
        return _matcher_failed(m, g, exc, f"in its {what}", depth)
    except BaseException as exc:
        # Stopped as a whole (an interrupt): undo this walk, and say so where that fails too.
        undo_after_interrupt(m, g, depth, exc, "tokens")
        raise
    return None


def _matcher_failed(m: Matcher, g: int, exc: BaseException, doing: str, depth: int) -> GrammarError:
    """Request ``g``'s error for ``exc``, after rolling back the ``depth`` tokens its matcher had accepted."""
    msg = f"matchers[{g}]: the matcher raised {type(exc).__name__} {doing}: {brief_error(exc)}"
    msg += roll_back(m, depth, "tokens it had accepted")
    err = GrammarError(msg)
    err.__cause__ = exc
    return err


def fill_tree_masks(
    matchers: Sequence[Matcher],
    tokens: Any,
    bitmask: torch.Tensor,
    rows: GrammarRows,
    tree: DraftTree,
    *,
    threads: int | None = None,
    strategy: str = "auto",
) -> TreeMasks:
    """Fill every grammar request's tree rows for this step's draft trees.

    Args:
        matchers: one matcher per grammar request, in ``rows`` order.
        tokens: each node's token: one sequence per grammar request (rows
            order, ``num_drafts[r]`` tokens each), or one flat 1-D array of
            every scheduled node in batch order.
        bitmask: CPU int32 tensor, at least ``rows.num_rows(tree.layout)``
            rows of ``ceil(vocab_size/32)`` words.
        rows: the producer layout (ragged or fixed); unused rows are all-allowed.
        tree: the step's draft trees.
        threads: thread pool size for walks whose engine releases the GIL
            (default: the CPU count, at most 8; ``0`` or ``1``: no pool).
        strategy: ``"auto"`` (chains through :func:`~maskplug.fill_draft_masks`,
            native tree walks where the engine has one, else depth-first
            walks), ``"native"`` (the same without the chain shortcut) or
            ``"walk"`` (depth-first walks everywhere). Every strategy writes
            the same rows.

    Returns:
        :class:`~maskplug.TreeMasks`: per node, on a grammar-valid path or
        not, forced or not, and the requests that failed. Structural
        mistakes raise :class:`~maskplug.LayoutError` or
        :class:`~maskplug.GrammarError` before any row or matcher is
        touched, checked by the code :func:`~maskplug.fill_draft_masks` uses
        (:func:`maskplug.grammar.fillargs.check_fill_args`), so both refuse and
        accept the same arguments: ``matchers`` one distinct
        :class:`~maskplug.grammar.Matcher` per grammar request, ``tokens``
        (the number of sequences, their lengths, integer dtypes; host or
        device tensors), the bitmask, ``rows``, ``tree``, ``threads`` (None
        or an int >= 0) and ``strategy``. The matchers are held for the call
        as :func:`~maskplug.fill_draft_masks` holds them (one a call on
        another thread is using raises :class:`~maskplug.MatcherInUse`; one
        an unfinished ``wait=False`` job holds is waited for). A call
        stopped as a whole (``KeyboardInterrupt``) raises only after every
        walk it started has ended and its matchers are back where they
        started (a rollback that fails then is logged and added to the
        exception as a note). What goes wrong with one
        request only fails that request (:attr:`TreeMasks.failed
        <maskplug.TreeMasks.failed>`, ``tokens[g][j]: ...`` for a node id
        outside its vocabulary, ``matchers[g]: ...`` for an exception from its
        matcher, with the exception as ``__cause__``): its rows (node and
        bonus rows) allow only its stop tokens, none of its nodes is valid or
        forced, and the other requests get exactly the rows and flags of the
        same batch without it. Nothing raises for the batch.
    """
    if not isinstance(strategy, str) or strategy not in _STRATEGIES:
        raise LayoutError(f"strategy: expected one of {_STRATEGIES}, got {strategy!r:.80}")
    if not isinstance(rows, GrammarRows):
        raise LayoutError(f"rows: expected a GrammarRows, got {type(rows).__name__}")
    if not isinstance(tree, DraftTree):
        raise LayoutError(f"tree: expected a DraftTree, got {type(tree).__name__}")
    layout = tree.layout
    # The checks fill_draft_masks makes, in the same code (the tokens named as this call's argument).
    args = check_fill_args(matchers, tokens, bitmask, rows, layout, threads, arg="tokens")
    # Chains take fill_draft_masks' fast paths (its chain operations fill the row after the last
    # draft, so only layouts with a bonus row qualify).
    if strategy == "auto" and layout.num_bonus >= 1 and bool(tree.is_chain[args.idx].all()):
        return _from_chain(fill_checked(args), args.nd)
    held = claim(args.matchers, args.keys, "matchers")
    try:
        return _fill_tree(args, tree, strategy)
    finally:
        release(held)


def _fill_tree(args: FillArgs, tree: DraftTree, strategy: str) -> TreeMasks:
    """Walk every grammar request's tree (the caller holds the matchers) and write its rows."""
    layout = tree.layout
    ms, idx, nd, row0, total, vocabs = args.matchers, args.idx, args.nd, args.row0, args.total, args.vocabs
    g_count = len(ms)
    # One slot per grammar request (each walker writes only its own): a request that fails, and why.
    errors: list[GrammarError | None] = [args.errors.get(g) for g in range(g_count)]
    width = int(nd.max()) if g_count else 0
    need = nd + layout.num_bonus
    t = _TreeFill(
        ms,
        args.d,
        nd,
        [np.asarray(tree.parents_of(int(r))) for r in idx.tolist()],
        args.bitmask,
        row0,
        need,
        eos_sets(vocabs),
        np.zeros((g_count, width), dtype=bool),
        np.zeros((g_count, width + 1), dtype=bool),
    )
    valid, filled = t.valid, t.filled

    def one(g: int) -> None:
        if errors[g] is not None:
            return
        m = ms[g]
        try:
            walk = native_tree_walker(m) if strategy != "walk" and nd[g] > 0 else None
        except Exception as exc:
            errors[g] = _matcher_failed(m, g, exc, "when asked for its engine's tree walk", 0)
            return
        if walk is not None:
            try:
                live = not m.is_terminated()
            except Exception as exc:
                errors[g] = _matcher_failed(m, g, exc, "in is_terminated()", 0)
                return
            if live:
                try:
                    _walk_native(t, g, walk)
                except Exception as exc:
                    errors[g] = _matcher_failed(m, g, exc, "in its engine's tree walk", 0)
                return
        errors[g] = _walk_dfs(t, g)

    pooled = args.n_threads > 1 and g_count > 1 and all(getattr(m, "releases_gil", False) for m in ms)
    # Every walk has ended when spread_tasks returns or raises (an interrupt included): the
    # claim on the matchers is given back only after that.
    spread_tasks(one, g_count, args.n_threads if pooled else 1)

    # A filled row that allows nothing would turn every logit to -inf: its request fails instead.
    live_rows = filled & (np.arange(width + 1)[None, :] < np.minimum(nd + 1, need)[:, None])
    for g, p in dead_rows(t.bitmask, row0, live_rows, vocabs).items():
        if errors[g] is None:
            errors[g] = empty_row_error(g, p, "tree row")
    found = {g: e for g, e in enumerate(errors) if e is not None}
    failed = list(found)
    if failed:
        valid[failed] = False
        filled[failed] = False
    # Rows nothing valid reaches are all-allowed; extra bonus rows repeat the last node's row.
    bm = t.bitmask.numpy()
    if total:
        blank = np.ones(total, dtype=bool)
        for g in range(g_count):
            k, n_rows = int(nd[g]), int(need[g])
            live = np.flatnonzero(filled[g, : min(k + 1, n_rows)])
            blank[int(row0[g]) + live] = False
        bm[np.flatnonzero(blank)] = -1
        for g in range(g_count):
            k, n_rows, a = int(nd[g]), int(need[g]), int(row0[g])
            if n_rows > k + 1:
                bm[a + k + 1 : a + n_rows] = bm[a + k]
        write_stop_rows(bm, failed, vocabs, row0, need)
    forced = np.zeros((g_count, width), dtype=bool)
    for g in range(g_count):
        k = int(nd[g])
        if not k:
            continue
        check = bm[int(row0[g]) + t.parents[g] + 1].view(np.uint8)
        ones = np.unpackbits(check, axis=1).sum(axis=1)
        forced[g, :k] = valid[g, :k] & (ones == 1)
    request = idx.astype(np.int64)
    if not failed:
        return TreeMasks(request=request, valid=valid, forced=forced)
    report: Mapping[int, GrammarError] = MappingProxyType({int(idx[g]): e for g, e in found.items()})
    return TreeMasks(request=request, valid=valid, forced=forced, failed=report)


def _from_chain(dm: DraftMasks, nd: IntArray) -> TreeMasks:
    """A chain's :class:`DraftMasks` as per-node flags (node ``j`` valid below the accepted prefix).

    A failed request keeps its error (errors about token ids already name
    them ``tokens``: the chain fill was given this call's checked arguments).
    """
    g = nd.shape[0]
    width = int(nd.max()) if g else 0
    cols = np.arange(width)[None, :]
    valid = cols < np.asarray(dm.acceptable, dtype=np.int64)[:, None]
    forced = np.zeros((g, width), dtype=bool)
    w = min(width, dm.forced.shape[1])
    forced[:, :w] = dm.forced[:, :w]
    request = np.asarray(dm.request, dtype=np.int64)
    if not dm.failed:
        return TreeMasks(request=request, valid=valid, forced=forced & valid)
    report = {int(r): err for r, err in dm.failed.items()}
    return TreeMasks(request=request, valid=valid, forced=forced & valid, failed=MappingProxyType(report))
