"""maskplug's budget and mask rows in SGLang's DSpark verify path.

A DSpark decode step in SGLang 0.5.23 verifies, for each request, a linear
chain ``verify_ids`` of shape ``(bs, W)``: column 0 the last committed token,
columns ``1..W-1`` the drafts (``W = gamma + 1``). The planner picks a budget
(extra verify tokens above one per request), SGLang's
``schedule_verify_lens_topk`` turns it into per-request verify lengths
``verify_lens`` (``1 <= verify_lens[i] <= W``: the committed token plus the
first ``verify_lens[i] - 1`` drafts), the grammar mask has one row per chain
column (row ``i*W + k`` = the mask after accepting drafts ``1..k``), and
``accept_greedy`` / ``cap_correct_len`` accept at most ``verify_lens[i] - 1``
drafts.

This module provides the two pieces maskplug changes in that step:

* :class:`DSparkBudgetPlanner` chooses the budget with any registered maskplug
  scheduler (:func:`maskplug.get_scheduler`), ``grammar-aware:*`` included,
  fed by the step's :class:`maskplug.DraftMasks`, and hands it, with the
  drafter's live confidences corrected by the grammar (a draft the grammar
  refuses, and all after it, is worth nothing; an accepted draft the grammar
  forces is certain), to SGLang's own ``ScheduleVerifyLensTopk``: the verify
  lengths are computed by SGLang's code, unchanged.
* :func:`fill_verify_rows` / :func:`build_verify_mask` produce the grammar
  mask in SGLang's layout but fill only the rows the verify layout keeps:
  rows past a request's verify length are never computed (they stay
  all-allowed; ``cap_correct_len`` never lets an acceptance reach them).

Both run on the host, on the same tensors SGLang hands its own code.
"""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

import maskplug
from maskplug import (
    BudgetDecision,
    BudgetError,
    CostModel,
    DraftMasks,
    GrammarRows,
    LayoutError,
    PluginError,
    ScheduledLayout,
    Scheduler,
    StepOutcome,
    StepView,
)

from .plugin import TESTED_SGLANG

__all__ = [
    "DSparkBudgetPlanner",
    "VerifyPlan",
    "blank_rows_past",
    "build_verify_mask",
    "chain_layout",
    "check_sglang_version",
    "cost_from_sps_table",
    "fill_verify_rows",
    "grammar_corrected_confidence",
    "sglang_version",
]

IntArray = npt.NDArray[np.int64]


# -- versions -----------------------------------------------------------------------
def sglang_version() -> str:
    """The installed SGLang's release (its distribution metadata, else ``sglang.__version__``)."""
    try:
        return md.version("sglang")
    except md.PackageNotFoundError:
        pass
    try:
        import sglang
    except ImportError as exc:
        raise PluginError(f"sglang: expected an installed SGLang {', '.join(TESTED_SGLANG)}, got none ({exc})") from exc
    return str(getattr(sglang, "__version__", "unknown"))


def check_sglang_version(version: str | None = None) -> str:
    """Refuse an SGLang release the DSpark integration was not tested with; returns the version.

    The DSpark pieces call SGLang internals (the planner's top-k, the verify
    layout, the grammar-mask convention), which change between releases.

    Raises:
        PluginError: the version is not one of :data:`~maskplug_sglang.TESTED_SGLANG`.
    """
    v = sglang_version() if version is None else str(version)
    if v not in TESTED_SGLANG:
        raise PluginError(
            f"sglang version: maskplug-sglang's DSpark integration uses SGLang internals and was tested "
            f"with SGLang {', '.join(TESTED_SGLANG)}, got {v}; install a tested SGLang release, or leave "
            "the DSpark integration off (the grammar backend alone needs only SGLang's public registry)"
        )
    return v


# -- layout ---------------------------------------------------------------------------
def _int_vector(name: str, value: Any, n: int | None = None) -> IntArray:
    a = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise LayoutError(f"{name}: expected a 1-D integer sequence, got {a.dtype} {a.shape}")
    if n is not None and a.shape[0] != n:
        raise LayoutError(f"{name}: expected {n} entries (one per request), got {a.shape[0]}")
    return a.astype(np.int64)


def _verify_ids(verify_ids: Any) -> IntArray:
    ids = verify_ids.detach().cpu().numpy() if isinstance(verify_ids, torch.Tensor) else np.asarray(verify_ids)
    if ids.ndim != 2 or ids.shape[1] < 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise LayoutError(f"verify_ids: expected a 2-D integer array (bs, W >= 1), got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64)


def _verify_lens(verify_lens: Any, bs: int, width: int) -> IntArray:
    if verify_lens is None:
        return np.full(bs, width, dtype=np.int64)
    vl = _int_vector("verify_lens", verify_lens, bs)
    if vl.size and (int(vl.min()) < 1 or int(vl.max()) > width):
        raise LayoutError(f"verify_lens: expected lengths in [1, {width}] (the chain width), got {vl.tolist()}")
    return vl


def chain_layout(req_ids: Sequence[Any], num_drafts: Any) -> ScheduledLayout:
    """maskplug's layout of a DSpark chain step: ``num_drafts`` per request, one committed token, one bonus row."""
    nd = _int_vector("num_drafts", num_drafts, len(req_ids))
    return ScheduledLayout(list(req_ids), nd.tolist(), [1] * len(req_ids), num_bonus=1)


# -- mask rows -----------------------------------------------------------------------
def _is_maskplug(grammar: Any) -> bool:
    from .backend import MaskplugGrammar

    return isinstance(grammar, MaskplugGrammar)


def fill_verify_rows(
    grammars: Sequence[Any],
    verify_ids: Any,
    vocab_mask: torch.Tensor,
    verify_lens: Any = None,
) -> DraftMasks:
    """Fill the grammar rows of a DSpark chain step that the verify layout keeps.

    Row ``i*W + k`` of ``vocab_mask`` (SGLang's layout, ``W`` the chain width)
    becomes request ``i``'s mask after accepting drafts ``1..k``, for ``k <
    verify_lens[i]`` only; the rows past each request's verify length, and the
    rows of requests without a live grammar, are set all-allowed and no
    grammar work is spent on them. Within the kept rows the bits are those
    SGLang's ``traverse_tree`` writes for the chain (rows after the first
    refused draft, or after an accepted stop token, all-allowed). maskplug
    grammars are filled all at once with :func:`maskplug.fill_draft_masks`;
    any other ``BaseGrammarObject`` (SGLang's xgrammar backend, say) with
    SGLang's own ``traverse_tree`` on the chain cut to its verify length. The
    grammars end in the state they started in. A maskplug grammar that fails
    (its matcher raises, a draft outside the vocabulary) gets the stop-only
    rows and is failed (``DraftMasks.failed`` names it by batch index); the
    other requests' rows are those of the batch without it. Its request is
    aborted by :func:`build_verify_mask` (or at its next committed token).

    Args:
        grammars: one grammar object (or None) per request.
        verify_ids: ``(bs, W)`` chain, column 0 the committed token.
        vocab_mask: int32 host bitmask with at least ``bs*W`` rows.
        verify_lens: per-request verify lengths in ``[1, W]``; None keeps
            every row (the whole chain).

    Returns:
        :class:`maskplug.DraftMasks` over the batch (``request`` = batch
        indices of the maskplug grammars filled, ``acceptable`` = drafts their
        grammar accepts among the kept ones, ``forced`` per kept row).

    Raises:
        LayoutError: shapes or lengths disagree (nothing written).
    """
    ids = _verify_ids(verify_ids)
    bs, width = ids.shape
    gs = list(grammars)
    if len(gs) != bs:
        raise LayoutError(f"grammars: expected one entry per request ({bs}), got {len(gs)}")
    vl = _verify_lens(verify_lens, bs, width)
    if not isinstance(vocab_mask, torch.Tensor) or vocab_mask.ndim != 2 or vocab_mask.shape[0] < bs * width:
        got = tuple(vocab_mask.shape) if isinstance(vocab_mask, torch.Tensor) else type(vocab_mask).__name__
        raise LayoutError(f"vocab_mask: expected a 2-D tensor with at least bs × W = {bs * width} rows, got {got}")
    live = [i for i, g in enumerate(gs) if g is not None and not g.is_terminated()]
    ours = np.asarray([i for i in live if _is_maskplug(gs[i])], dtype=np.int64)
    others = [i for i in live if not _is_maskplug(gs[i])]
    vocab_mask[: bs * width].fill_(-1)
    empty = DraftMasks(
        request=np.zeros(0, dtype=np.int64),
        acceptable=np.zeros(0, dtype=np.int64),
        forced=np.zeros((0, 0), dtype=bool),
    )
    masks = empty
    if ours.size:
        layout = chain_layout(list(range(bs)), vl - 1)
        rows = GrammarRows(ours.tolist())
        keep = vl[ours]
        scratch = torch.empty((int(keep.sum()), int(vocab_mask.shape[1])), dtype=torch.int32)
        drafts = [ids[i, 1 : vl[i]] for i in ours.tolist()]
        masks = maskplug.fill_draft_masks(
            [gs[i].producer_matcher() for i in ours.tolist()], drafts, scratch, rows, layout
        )
        if masks.failed:
            from .backend import fail_grammars

            # Only those requests fail: they got the stop-only rows (keys are batch indices).
            fail_grammars(gs, masks.failed)
        # Each request's kept rows go to the head of its W-row block of SGLang's mask.
        start = np.repeat(ours * width, keep)
        offset = np.arange(int(keep.sum())) - np.repeat(np.cumsum(keep) - keep, keep)
        dest = torch.from_numpy(start + offset).to(vocab_mask.device)
        vocab_mask[dest] = scratch.to(vocab_mask.device)
    if others:
        from sglang.srt.speculative.spec_utils import traverse_tree

        for i in others:
            k = int(vl[i])
            nt = torch.full((k,), -1, dtype=torch.int64)
            nt[:-1] = torch.arange(1, k, dtype=torch.int64)
            ns = torch.full((k,), -1, dtype=torch.int64)
            block = vocab_mask[i * width : i * width + k]
            traverse_tree(nt, ns, torch.from_numpy(ids[i, :k].copy()), gs[i], block, vocab_size=32 * block.shape[1])
    return masks


def blank_rows_past(vocab_mask: torch.Tensor, verify_lens: Any, width: int) -> None:
    """Set the rows of a ``(bs × W)``-row chain mask past each request's verify length all-allowed."""
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
        raise LayoutError(f"width: expected the chain width (an int >= 1), got {width!r}")
    if not isinstance(vocab_mask, torch.Tensor) or vocab_mask.ndim != 2 or vocab_mask.shape[0] % int(width):
        got = tuple(vocab_mask.shape) if isinstance(vocab_mask, torch.Tensor) else type(vocab_mask).__name__
        raise LayoutError(f"vocab_mask: expected a 2-D tensor of bs × W rows (W = {width}), got {got}")
    bs = int(vocab_mask.shape[0]) // int(width)
    vl = _verify_lens(verify_lens, bs, int(width))
    past = np.arange(int(width))[None, :] >= vl[:, None]
    rows = np.flatnonzero(past.reshape(-1))
    if rows.size:
        vocab_mask[torch.from_numpy(rows).to(vocab_mask.device)] = -1


def build_verify_mask(
    *,
    reqs: Sequence[Any],
    tree: Any,
    sampling_info: Any,
    device: Any,
    barrier: Any = None,
    verify_lens: Any = None,
) -> Any:
    """SGLang's ``build_grammar_vocab_mask`` for a DSpark chain, filling only the kept rows.

    Same arguments and result as SGLang's (a ``GrammarMask`` staged on
    ``device``, or None when no request has a grammar), plus ``verify_lens``:
    the step's verify lengths (None: the whole chain). ``barrier`` (the
    previous batch's grammar advance) runs first; the chain ids come from
    ``tree`` (a ``GrammarTree.from_linear_chain``), so the mask keeps SGLang's
    row mapping (``bs × W`` rows, one per logits row). A request whose
    grammar fails while its rows are produced gets the stop-only rows and is
    aborted with the error (:func:`maskplug_sglang.backend.abort_failed_requests`);
    the others go on as in the batch without it.
    """
    from sglang.srt.constrained.base_grammar_backend import GrammarMask

    if barrier is not None:
        barrier()
    grammars = [getattr(r, "grammar", None) for r in reqs]
    first = next((g for g in grammars if g is not None), None)
    if first is None:
        return None
    ids = tree.resolve()[2]
    bs, width = int(ids.shape[0]), int(ids.shape[1])
    vocab_mask = first.allocate_vocab_mask(vocab_size=sampling_info.vocab_size, batch_size=bs * width, device="cpu")
    if fill_verify_rows(grammars, ids, vocab_mask, verify_lens).failed:
        from .backend import abort_failed_requests

        abort_failed_requests(reqs)
    vocab_mask = vocab_mask.to(device, non_blocking=True)
    sampling_info.grammar_mask = None
    return GrammarMask(first, vocab_mask)


# -- budget ----------------------------------------------------------------------------
def grammar_corrected_confidence(confidence: torch.Tensor, grammar: DraftMasks | None) -> torch.Tensor:
    """The drafter's conditional confidences ``(bs, gamma)`` with what the grammar knows.

    For each grammar request: positions at or past ``acceptable`` (the first
    draft the grammar refuses, and everything after it; past an accepted stop
    token) become 0, accepted positions whose row the grammar forces to one
    token become 1. Other requests and positions keep the drafter's value.
    Returns a new tensor on the confidence's device (the input is not changed).
    """
    if not isinstance(confidence, torch.Tensor) or confidence.ndim != 2 or not confidence.is_floating_point():
        got = (
            f"{type(confidence).__name__} {getattr(confidence, 'dtype', '')} {tuple(getattr(confidence, 'shape', ()))}"
        )
        raise BudgetError(f"confidence: expected a 2-D floating tensor (bs, gamma), got {got}")
    out = confidence.clone()
    if grammar is None or np.asarray(grammar.request).size == 0:
        return out
    bs, k = confidence.shape
    req = np.asarray(grammar.request, dtype=np.int64)
    if int(req.min()) < 0 or int(req.max()) >= bs:
        raise BudgetError(f"grammar.request: expected batch indices in [0, {bs}), got {req.tolist()}")
    acc = np.asarray(grammar.acceptable, dtype=np.int64)[:, None]
    cols = np.arange(k)[None, :]
    forced = np.zeros((req.shape[0], k), dtype=bool)
    f = np.asarray(grammar.forced, dtype=bool)
    w = min(k, f.shape[1]) if f.ndim == 2 else 0
    forced[:, :w] = f[:, :w]
    over = np.full((bs, k), np.nan, dtype=np.float64)
    sub = over[req]
    sub[forced & (cols < acc)] = 1.0
    sub[cols >= acc] = 0.0
    over[req] = sub
    t = torch.from_numpy(over).to(device=confidence.device, dtype=confidence.dtype)
    return torch.where(torch.isnan(t), out, t)


def cost_from_sps_table(table: Any, max_reqs: int, max_tokens: int) -> CostModel:
    """maskplug's :class:`~maskplug.CostModel` from SGLang's profiled DSpark cost table.

    ``SpsCostTable`` (steps per second by batch tokens) becomes a verify cost
    of ``1000 / sps`` ms per step and no separate draft cost;
    ``SpsAdditiveCostTable`` (``bias + alpha(bs) + theta(tokens)`` seconds)
    becomes a draft cost ``bias + alpha`` and a verify cost ``theta``.

    Raises:
        BudgetError: the table is neither kind.
    """
    from sglang.srt.speculative.dspark_components.dspark_sps import SpsAdditiveCostTable, SpsCostTable

    if isinstance(table, SpsAdditiveCostTable):
        draft = [
            (int(b), 1000.0 * (table.bias_seconds + a))
            for b, a in zip(table.bs_probes, table.alpha_seconds, strict=True)
        ]
        verify = [(int(m), 1000.0 * t) for m, t in zip(table.m_probes, table.theta_seconds, strict=True)]
        return CostModel.from_curves(draft, verify, max_reqs, max_tokens)
    if isinstance(table, SpsCostTable):
        verify = [
            (int(t), 1000.0 / s if s > 0 else 1e9)
            for t, s in zip(table.sample_batch_tokens, table.sample_steps_per_sec, strict=True)
        ]
        return CostModel.from_curves([(0, 0.0), (1, 0.0)], verify, max_reqs, max_tokens)
    raise BudgetError(f"table: expected SGLang's SpsCostTable or SpsAdditiveCostTable, got {type(table).__name__}")


@dataclass(frozen=True)
class VerifyPlan:
    """One step's plan: the scheduler's decision and SGLang's verify lengths for it.

    Attributes:
        req_ids: the requests, in batch order.
        decision: the maskplug scheduler's budget decision (drafts verified
            beyond one token per request).
        confidence: the confidences handed to SGLang's top-k (grammar-corrected).
        verify_lens: SGLang's ``schedule_verify_lens_topk`` result, int32, one
            per request (the committed token plus the drafts verified).
        grammar: the step's :class:`maskplug.DraftMasks`, or None.
    """

    req_ids: tuple[Any, ...]
    decision: BudgetDecision
    confidence: torch.Tensor
    verify_lens: torch.Tensor
    grammar: DraftMasks | None

    @property
    def budget(self) -> int:
        """The verify-token budget handed to SGLang."""
        return self.decision.budget


class DSparkBudgetPlanner:
    """Chooses DSpark's verify lengths with a maskplug scheduler; SGLang's top-k places them.

    Args:
        scheduler: a registered scheduler name (``"goodput"``,
            ``"grammar-aware"``, …), a scheduler object, or None for
            ``MASKPLUG_SCHEDULER`` / maskplug's default. ``"grammar-aware:X"``
            is ``grammar-aware`` wrapping ``X``.
        gamma: drafts per request (DSpark's block size minus one).
        cost: the step cost model (default: :meth:`maskplug.CostModel.linear`).
        max_verify_len: SGLang's ``max_verify_len`` (0: ``gamma + 1``).
        **config: passed to :func:`maskplug.get_scheduler` with a name.

    Raises:
        PluginError: the scheduler name is not registered.
        BudgetError: ``gamma`` or ``max_verify_len`` is out of range, or the
            scheduler refuses ``config``.
    """

    def __init__(
        self,
        scheduler: str | Scheduler | None = None,
        *,
        gamma: int,
        cost: CostModel | None = None,
        max_verify_len: int = 0,
        **config: Any,
    ) -> None:
        if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
            raise BudgetError(f"gamma: expected an int >= 1 (drafts per request), got {gamma!r}")
        if (
            isinstance(max_verify_len, bool)
            or not isinstance(max_verify_len, (int, np.integer))
            or not 0 <= max_verify_len <= gamma + 1
        ):
            raise BudgetError(
                f"max_verify_len: expected an int in [0, gamma + 1 = {gamma + 1}], got {max_verify_len!r}"
            )
        if cost is not None and not isinstance(cost, CostModel):
            raise BudgetError(f"cost: expected a maskplug.CostModel or None, got {type(cost).__name__}")
        if scheduler is None or isinstance(scheduler, str):
            # maskplug's own spec parser reads names and MASKPLUG_SCHEDULER alike ("grammar-aware:X" included).
            self.scheduler: Scheduler = maskplug.get_scheduler(scheduler, **config)
        else:
            if config:
                raise BudgetError(f"config: expected none with a scheduler object, got {sorted(config)}")
            if not (callable(getattr(scheduler, "budget", None)) and callable(getattr(scheduler, "observe", None))):
                raise PluginError(
                    f"scheduler: expected an object with callable 'budget' and 'observe', got {type(scheduler).__name__}"
                )
            self.scheduler = scheduler
        self.gamma = int(gamma)
        self.cost = cost if cost is not None else CostModel.linear()
        from sglang.srt.speculative.dspark_components.dspark_planner import DSparkScheduleConfig

        self.cfg = DSparkScheduleConfig(gamma=self.gamma, max_verify_len=int(max_verify_len))
        self.cfg.validate()

    @property
    def reads_grammar(self) -> bool:
        """Whether the scheduler uses the step's draft masks (its ``uses_grammar`` flag, as ``grammar-aware`` sets)."""
        return bool(getattr(self.scheduler, "uses_grammar", False))

    @property
    def max_drafts(self) -> int:
        """The most drafts one request can verify (``max_verify_len - 1``)."""
        return self.cfg.resolved_max_verify_len() - 1

    def view(
        self,
        req_ids: Sequence[Any],
        *,
        confidence: torch.Tensor | None = None,
        stale_confidence: Any = None,
        grammar: DraftMasks | None = None,
        max_logits: int | None = None,
    ) -> StepView:
        """The scheduler's read-only view of a DSpark step.

        ``stale_confidence`` (host, usually the planner's lagged values) is
        what the scheduler sees; without it, the live ``confidence`` copied
        to the host.
        """
        n = len(req_ids)
        layout = chain_layout(list(req_ids), np.full(n, self.max_drafts, dtype=np.int64))
        conf = stale_confidence
        if conf is None and confidence is not None:
            conf = confidence.detach().to("cpu", torch.float64).numpy()
        if conf is not None:
            c = np.asarray(conf.detach().cpu().numpy() if isinstance(conf, torch.Tensor) else conf, dtype=np.float64)
            if c.ndim != 2 or c.shape[0] != n or c.shape[1] < self.max_drafts:
                raise BudgetError(
                    f"confidence: expected shape ({n}, >= {self.max_drafts}) (requests × drafts), got {c.shape}"
                )
            conf = c[:, : self.max_drafts]
        if grammar is not None and self.max_drafts < self.gamma:
            # SGLang's max_verify_len keeps the drafts past it out of every step.
            grammar = DraftMasks(
                request=np.asarray(grammar.request),
                acceptable=np.minimum(np.asarray(grammar.acceptable), self.max_drafts),
                forced=np.asarray(grammar.forced)[:, : self.max_drafts + 1],
            )
        return StepView(layout, self.cost, confidences=conf, grammar=grammar, max_logits=max_logits)

    def plan(
        self,
        req_ids: Sequence[Any],
        confidence: torch.Tensor,
        *,
        grammar: DraftMasks | None = None,
        stale_confidence: Any = None,
        max_logits: int | None = None,
    ) -> VerifyPlan:
        """The step's budget (maskplug's scheduler) and verify lengths (SGLang's top-k on it).

        Args:
            req_ids: one id per request, batch order (schedulers that learn
                follow requests by id).
            confidence: the drafter's live conditional confidences ``(bs, gamma)``
                (DSpark's confidence head output) on any device.
            grammar: the step's :class:`maskplug.DraftMasks` (from
                :func:`fill_verify_rows` over the whole chain), or None.
            stale_confidence: what the scheduler sees instead of ``confidence``.
            max_logits: the most logits rows this step may take, or None.
        """
        if not isinstance(confidence, torch.Tensor) or confidence.ndim != 2:
            raise BudgetError(f"confidence: expected a 2-D tensor (bs, gamma), got {type(confidence).__name__}")
        if confidence.shape[0] != len(req_ids) or confidence.shape[1] != self.gamma:
            raise BudgetError(
                f"confidence: expected shape ({len(req_ids)}, {self.gamma}) (requests × gamma), "
                f"got {tuple(confidence.shape)}"
            )
        step = self.view(
            req_ids, confidence=confidence, stale_confidence=stale_confidence, grammar=grammar, max_logits=max_logits
        )
        decision = self.scheduler.budget(step)
        if not isinstance(decision, BudgetDecision) or not 0 <= decision.budget <= step.cap:
            raise BudgetError(
                f"scheduler: expected a BudgetDecision with a budget in [0, {step.cap}], got {decision!r}"
            )
        conf = grammar_corrected_confidence(confidence, grammar)
        from sglang.kernels.ops.speculative.dspark.dspark_schedule import ScheduleVerifyLensTopk

        lens = ScheduleVerifyLensTopk.execute(confidence=conf, budget=int(decision.budget), cfg=self.cfg)
        return VerifyPlan(tuple(req_ids), decision, conf, lens.to(torch.int32), grammar)

    def observe(self, plan: VerifyPlan, correct_len: Any, finished: Sequence[Any] = ()) -> None:
        """Tell the scheduler what verification accepted (SGLang's capped ``correct_len``)."""
        if not isinstance(plan, VerifyPlan):
            raise BudgetError(f"plan: expected a VerifyPlan, got {type(plan).__name__}")
        n = len(plan.req_ids)
        acc = _int_vector("correct_len", correct_len, n)
        verified = plan.verify_lens.detach().cpu().numpy().astype(np.int64) - 1
        ids = np.asarray(plan.req_ids)
        self.scheduler.observe(StepOutcome(ids, verified, acc, finished=np.asarray(list(finished))))
