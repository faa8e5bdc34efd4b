"""Producing the mask rows of a speculative step, and committing after verification.

:func:`fill_draft_masks` walks every grammar request's drafts once, writing row
``p`` = the grammar's mask after accepting drafts ``0..p-1``, then rolls the
matchers back to where they started. Matchers whose batch operations offer
``fill_chains`` (below) hand over every request's whole draft chain in one
call; matchers with plain batch operations (:class:`~maskplug.grammar.BatchOps`)
are advanced position by position, all requests of one provider in one call
per position; the others run one request at a time, on a thread pool when
their engine releases the GIL.

The optional chain operation, ``batch_ops.fill_chains(matchers, bitmask,
rows, drafts, threads=n) -> list[int]``: for each live (not terminated)
matcher ``i``, starting from its current state, row ``rows[i] + p`` is the
mask after accepting ``drafts[i][:p]``, for every ``p`` up to the number of
drafts it accepts, ``a_i``, which it returns. The walk stops at the first
draft the matcher refuses (that draft's row is written, later ones are not)
and after an accepted stop token (``a_i`` counts it; row ``rows[i] + a_i`` is
not written). Matchers end in the state they started in, also on error. It
lets an engine do in one native call (or without touching the matcher's
state at all) what the generic walk does with one Python call per row.

Fault isolation. A request fails alone (see :func:`fill_draft_masks` and
:attr:`~maskplug.DraftMasks.failed`); what the walks rely on to keep the
others exact:

* a batch or chain operation that raises is not told apart by request: all
  the requests of that call are walked again one at a time (the generic
  walk, on the calling thread), so only a request whose own walk raises
  fails. The cost falls on that step only: one Python call per row and per
  draft for those requests instead of one call for all of them;
* ``fill_chains`` leaves its matchers where they started, also when it
  raises (its contract above), so they are walked again from there;
* a batch ``accept`` or ``rollback`` that raises is taken to have moved
  none of its matchers, except where a matcher keeps its own count
  (``num_accepted``, as the SDK's matchers on llguidance and outlines-core
  do): then the undo is what the count says it moved. An engine that moves
  some matchers before raising and keeps no count cannot be put back
  exactly; the request whose rollback then raises fails, saying so;
* rows a failing operation wrote are overwritten: by the requests' own
  walks, by the all-allowed rows, and by the stop-only rows of the failed
  requests.

This module groups the requests by provider and strategy and runs the fill;
its parts live beside it: :mod:`~maskplug.grammar.fillargs` (the argument
checks, shared with the tree producer :mod:`~maskplug.grammar.trees`),
:mod:`~maskplug.grammar.walks` (the three walks and their fault handling),
:mod:`~maskplug.grammar.recovery` (rolling matchers back),
:mod:`~maskplug.grammar.assembly` (the all-allowed and stop-only rows, the
results) and :mod:`~maskplug.grammar.commits` (:func:`commit` and
:func:`commit_many`, re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt
import torch

from ..draftmasks import DraftMasks
from ..errors import LayoutError
from ..layout import GrammarRows, ScheduledLayout
from .assembly import assemble
from .assembly import dead_rows as dead_rows
from .assembly import empty_row_error as empty_row_error
from .checks import brief_error
from .commits import CommitResult, commit, commit_many
from .fillargs import FillArgs as FillArgs
from .fillargs import check_fill_args as check_fill_args
from .fillargs import check_gate, eos_sets
from .jobs import Claim, DraftMasksJob, claim, release
from .pools import spread_tasks
from .protocols import BatchOps, ChainOps, Matcher
from .recovery import logger
from .recovery import restore_after_interrupt as restore_after_interrupt
from .recovery import undo_after_interrupt as undo_after_interrupt
from .walks import Walk, accepted_counts, fail_request, redo_serially, unwind, walk_batched, walk_chains, walk_one

__all__ = ["CommitResult", "DraftMasksJob", "commit", "commit_many", "fill_draft_masks"]

IntArray = npt.NDArray[np.int64]
_STRATEGIES = ("auto", "chains", "batch", "threads", "serial")


@dataclass
class _Plan:
    """A checked fill: everything the walks need, taken from the arguments before anything is written."""

    walk: Walk
    keys: list[int]
    idx: IntArray
    row0: IntArray
    strategy: str
    n_threads: int


def _plan(
    matchers: Any,
    drafts: Any,
    bitmask: Any,
    rows: Any,
    layout: Any,
    threads: Any,
    active_from: Any,
    strategy: Any,
) -> _Plan:
    """Check every argument of :func:`fill_draft_masks` (no matcher state is read, nothing is written)."""
    if not isinstance(strategy, str) or strategy not in _STRATEGIES:
        raise LayoutError(f"strategy: expected one of {_STRATEGIES}, got {strategy!r:.80}")
    args = check_fill_args(matchers, drafts, bitmask, rows, layout, threads)
    gate = check_gate(active_from, len(args.matchers))
    return plan_of(args, gate, strategy)


def plan_of(args: FillArgs, gate: IntArray | None = None, strategy: str = "auto") -> _Plan:
    """The walk plan of checked arguments (``gate``: the reasoning gate, default none)."""
    g_count = len(args.matchers)
    gate = np.zeros(g_count, dtype=np.int64) if gate is None else gate
    need = args.nd + args.layout.num_bonus
    walk = Walk(
        args.matchers,
        args.d,
        args.nd,
        need,
        gate,
        args.row0,
        eos_sets(args.vocabs),
        args.bitmask,
        args.total,
        args.vocabs,
        dict(args.errors),
        arg=args.arg,
    )
    return _Plan(walk, args.keys, args.idx, args.row0, strategy, args.n_threads)


def fill_checked(args: FillArgs) -> DraftMasks:
    """:func:`fill_draft_masks` (``strategy="auto"``, no gate) on arguments :func:`check_fill_args` checked.

    The matchers are claimed for the call, as by :func:`fill_draft_masks`.
    """
    plan = plan_of(args)
    held = claim(plan.walk.matchers, plan.keys, "matchers")
    try:
        return _produce(plan)
    finally:
        release(held)


def _produce(plan: _Plan) -> DraftMasks:
    """Walk the checked plan: write the rows, restore the matchers (the caller holds them).

    A request that fails (see :func:`fill_draft_masks`) gets the stop-only
    rows and is reported in ``failed``; nothing raises for the batch.
    """
    walk, strategy, n_threads = plan.walk, plan.strategy, plan.n_threads
    ms, gate, need = walk.matchers, walk.gate, walk.need
    errors = walk.errors

    # Group requests by their provider's batch operations; "threads" (or a
    # provider without batch operations) walks request by request instead.
    # Chains take live matchers whose window reaches the grammar; the rest
    # (terminated, or gated past the window) cost nothing on the generic walk.
    groups: dict[int, tuple[BatchOps, list[int]]] = {}
    chains: dict[int, tuple[ChainOps, list[int]]] = {}
    single: list[int] = []
    # Whether each distinct batch_ops object is a ChainOps (asked once per object: the protocol check is slow).
    chain_ops: dict[int, bool] = {}
    for g, m in enumerate(ms):
        if errors and g in errors:
            continue
        try:
            ops = getattr(m, "batch_ops", None) if strategy in ("auto", "chains", "batch") else None
        except Exception as exc:
            fail_request(walk, g, exc, "in batch_ops")
            continue
        if ops is None:
            single.append(g)
            continue
        can_chain = chain_ops.get(id(ops))
        if can_chain is None:
            can_chain = chain_ops[id(ops)] = strategy != "batch" and isinstance(ops, ChainOps)
        # A chain operation also fills the row after the last draft: without a bonus row
        # (need == nd) that row is the next request's, or past this call's rows.
        if can_chain and gate[g] < need[g] and need[g] > walk.nd[g]:
            try:
                live = not m.is_terminated()
            except Exception as exc:
                fail_request(walk, g, exc, "in is_terminated()")
                continue
            if live:
                chains.setdefault(id(ops), (ops, []))[1].append(g)
                continue
        groups.setdefault(id(ops), (ops, []))[1].append(g)

    try:
        for cops, members in chains.values():
            try:
                walk_chains(walk, cops, members, n_threads)
            except Exception as exc:
                # The chain operation leaves its matchers where they started, also on error.
                redo_serially(walk, members, f"{type(cops).__name__}.fill_chains", exc)
        for ops, members in groups.values():
            base = accepted_counts(walk, members)
            try:
                walk_batched(walk, ops, np.asarray(members, dtype=np.int64))
            except Exception as exc:
                unwind(walk, members, base)
                redo_serially(walk, members, f"{type(ops).__name__} (position-major walk)", exc)
                continue
            back = [g for g in members if walk.accepted[g]]
            if back:
                try:
                    ops.rollback([ms[g] for g in back], walk.accepted[back].tolist())
                except Exception as exc:
                    # Taken to have moved none of them (or what their counts say): undone one at a time.
                    logger.warning(
                        "%s.rollback raised %s for %d grammar requests (%s); rolling them back one at a time",
                        type(ops).__name__,
                        type(exc).__name__,
                        len(back),
                        brief_error(exc),
                    )
                    where = {g: i for i, g in enumerate(members)}
                    unwind(walk, back, [base[where[g]] for g in back])
                else:
                    walk.accepted[back] = 0
        if single:
            pooled = (
                strategy != "serial"
                and n_threads > 1
                and len(single) > 1
                and all(getattr(ms[g], "releases_gil", False) for g in single)
            )

            # Each worker takes the next request when free (grammars differ in cost). The
            # pool's walks are all done before spread_tasks returns or raises, so an
            # interrupt never leaves a walker running on matchers this call gives back.
            spread_tasks(lambda i: walk_one(walk, single[i]), len(single), n_threads if pooled else 1)
    except BaseException as exc:
        # Interrupted (or a bug): every walk has ended; restore every matcher still advanced.
        restore_after_interrupt(walk.matchers, walk.accepted, exc)
        raise

    return assemble(walk, plan.idx)


def _produce_restoring(plan: _Plan, held: Claim) -> DraftMasks:
    """:func:`_produce` on a job thread: on failure the rows go back to what they held; the claim is released."""
    try:
        total = plan.walk.total
        saved = plan.walk.bitmask[:total].clone() if total else None
        try:
            return _produce(plan)
        except BaseException:
            if saved is not None:
                plan.walk.bitmask[:total].copy_(saved)
            raise
    finally:
        release(held)


@overload
def fill_draft_masks(
    matchers: Sequence[Matcher],
    drafts: Any,
    bitmask: torch.Tensor,
    rows: GrammarRows,
    layout: ScheduledLayout,
    *,
    threads: int | None = ...,
    active_from: Any = ...,
    strategy: str = ...,
    wait: Literal[True] = ...,
) -> DraftMasks: ...


@overload
def fill_draft_masks(
    matchers: Sequence[Matcher],
    drafts: Any,
    bitmask: torch.Tensor,
    rows: GrammarRows,
    layout: ScheduledLayout,
    *,
    threads: int | None = ...,
    active_from: Any = ...,
    strategy: str = ...,
    wait: Literal[False],
) -> DraftMasksJob: ...


@overload
def fill_draft_masks(
    matchers: Sequence[Matcher],
    drafts: Any,
    bitmask: torch.Tensor,
    rows: GrammarRows,
    layout: ScheduledLayout,
    *,
    threads: int | None = ...,
    active_from: Any = ...,
    strategy: str = ...,
    wait: bool,
) -> DraftMasks | DraftMasksJob: ...


def fill_draft_masks(
    matchers: Sequence[Matcher],
    drafts: Any,
    bitmask: torch.Tensor,
    rows: GrammarRows,
    layout: ScheduledLayout,
    *,
    threads: int | None = None,
    active_from: Any = None,
    strategy: str = "auto",
    wait: bool = True,
) -> DraftMasks | DraftMasksJob:
    """Fill every grammar request's mask rows for this step's scheduled drafts.

    For grammar request ``g`` (in ``rows`` order) with ``k = num_drafts[r]``
    drafts, row ``p`` (``0 <= p <= k - 1 + num_bonus``) is the grammar's mask
    after accepting drafts ``0..p-1``; the rows follow ``rows``' producer
    layout (ragged or fixed stride; unused fixed rows are all-allowed). At the
    first draft the grammar refuses, advancing stops: that draft's row is
    still constrained (the verifier samples a replacement from it) and every
    later row is all-allowed. After an accepted stop token, later rows are
    all-allowed too. The matchers end exactly where they started.

    Every argument's structure is checked before the first row is written
    or a matcher is touched (the bitmask's type, shape and width, the layout
    and rows, the number of matchers and draft sequences, the drafts' dtype
    and lengths, ``active_from``, ``threads``, ``strategy``); a bad one
    raises a :class:`~maskplug.MaskplugError` naming it and leaves the
    bitmask and the matchers as they were.

    Fault isolation: one bad request never fails the batch. A request with a
    draft id outside its vocabulary (or negative) is not walked at all; a
    request whose matcher raises (in ``fill``, ``accept``,
    ``is_terminated`` or ``rollback``, or from a sticky error state) is
    rolled back and not touched again in this call. Either way only that
    request fails: every one of its rows (draft and bonus rows) allows only
    its stop tokens, its ``acceptable`` is 0, its ``forced`` row is False,
    and :attr:`DraftMasks.failed` maps its batch index to a
    :class:`~maskplug.GrammarError` (``drafts[g][p]: ...`` or
    ``matchers[g]: ...``, the matcher's exception as ``__cause__``; the
    message says when the matcher could not be rolled back and should be
    dropped). Every other request's rows and fields are exactly those of the
    same batch without the failed requests. When a provider's batch or chain
    operation raises for many requests at once, those requests are walked
    again one at a time (one Python call per row, in that step only), so that
    only the request at fault fails.

    Threading contract: a matcher serves one call at a time. This call (and
    :func:`commit`) holds its matchers while it runs; a matcher that a call
    on another thread is using is refused with
    :class:`~maskplug.MatcherInUse` before anything is written, and one that
    an unfinished ``wait=False`` job holds is waited for (the job was started
    first). Distinct matchers, even of one compiled grammar, may be used from
    different threads at once. The matcher's own methods (``accept``,
    ``fill``, ``rollback``, ...) are not guarded: do not call them on a
    matcher while a call or an unfinished job holds it. The bitmask is not
    guarded either: calls running at once must be given different rows.
    A call stopped as a whole (``KeyboardInterrupt``, or any exception that
    is not a request's own failure) raises only after every walk it started
    on the pool has ended and every matcher is back where it started, so
    nothing touches the matchers once the call has raised; a rollback that
    raises then is logged (logger ``maskplug.draft``) and added to the
    exception as a note naming ``matchers[g]``, and the interrupt is still
    what the call raises.

    Args:
        matchers: one matcher per grammar request, in ``rows`` order (each
            a distinct object).
        drafts: one token sequence per grammar request (rows order, length
            ``num_drafts[r]`` each), or one flat 1-D array of all scheduled
            drafts in batch order (length ``Σ num_drafts``; ``[]`` when
            nothing was drafted).
        bitmask: CPU int32 tensor, at least ``rows.num_rows(layout)`` rows of
            ``ceil(vocab_size/32)`` words.
        rows: the producer layout (grammar requests and their order).
        layout: this step's scheduled layout.
        threads: thread pool size for matchers without batch operations
            (default: the CPU count, at most 8; ``0`` or ``1``: no pool).
        active_from: optional reasoning gate, one position per grammar
            request: the grammar is not active before it (those rows are
            all-allowed and those drafts are not fed to the matcher, they
            are not grammar text) and active from it (row ``active_from`` is
            the matcher's current mask). A value past the window leaves every
            row all-allowed.
        strategy: ``"auto"`` (a provider's chain operation where it has
            one, else its batch operations, else request by request on a
            thread pool when the engine releases the GIL), ``"chains"`` (the
            same), ``"batch"`` (position-major batch operations even where a
            chain operation exists), ``"threads"`` (request by request on the
            pool even where batch operations exist) or ``"serial"`` (request
            by request on the calling thread). Every strategy writes the same
            rows.
        wait: ``False`` returns at once with a :class:`DraftMasksJob` that
            produces the rows on a job thread (the providers' parallel work
            on the shared grammar pools) while the caller runs its forward
            pass; its ``result()`` returns the :class:`DraftMasks`. The
            arguments are checked (and refused) by this call itself; a
            request that fails during production is reported in the result's
            ``failed`` exactly as by the synchronous call; production stopped
            as a whole (``KeyboardInterrupt`` and the like) is raised by
            ``result()``, with the bitmask rows restored to what they held
            and the matchers where they started. Until the job is done its rows and matchers are its own:
            a :func:`commit` or a fill on one of its matchers waits for it.

    Returns:
        :class:`DraftMasks` with the batch index, the drafts the grammar
        accepts (a prefix length; gated drafts count as accepted), which
        rows allow exactly one token and the requests that failed; with
        ``wait=False``, the :class:`DraftMasksJob` that returns it.
    """
    plan = _plan(matchers, drafts, bitmask, rows, layout, threads, active_from, strategy)
    if not wait:
        job = DraftMasksJob()
        held = claim(plan.walk.matchers, plan.keys, "matchers", job)
        job._start(lambda: _produce_restoring(plan, held))
        return job
    held = claim(plan.walk.matchers, plan.keys, "matchers")
    try:
        return _produce(plan)
    finally:
        release(held)
