"""What one engine step passes from stage to stage, and the stages that need nothing but those records.

Chain and tree steps share :class:`StepState` (the running requests and the
scheduled layout), :class:`StepMasks` (the grammar requests' mask rows) and
:class:`StepBudget` (the chosen budget); each adds what its drafts need. The
stages that depend on the engine's parts (scheduler, drafter, target, cost
model) are methods of :class:`~maskplug.sim.Simulation`; verification of a
chain step (:func:`verify_chain`) needs only the records.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..compaction import Compaction
from ..draftmasks import DraftMasks
from ..grammar import Vocab
from ..layout import GrammarRows, RowMapping, ScheduledLayout
from ..schedulers import StepView
from ..trees import DraftTree, TreeCompaction, TreeMasks
from .models import Drafts, Streams, uniform
from .tree_drafter import TreeDrafts
from .workload import PreparedRequest

# The records the engines build on; the chain and tree records beside them are the engines' own.
__all__ = ["StepBudget", "StepMasks", "StepRequests", "StepState", "new_mask_rows", "step_requests", "verify_chain"]

I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


@dataclass
class RunningRequest:
    """A request in a slot: its output so far and whether it still follows its reference."""

    prep: PreparedRequest
    slot: int
    matcher: Any
    output: list[int] = field(default_factory=list)
    on_track: bool = True
    prefilled: bool = False


@dataclass
class StepRequests:
    """The running requests' state at the start of a step, one entry per request (batch order)."""

    rid: I64
    slots: I64
    length: I64
    prefill: Bools
    on_track: Bools
    #: the request's token limit
    limit: I64
    prompt: I64
    skill: npt.NDArray[np.float64]
    sampled: Bools
    has_g: Bools
    #: ``window[r, j]``: the reference token ``j`` places past request ``r``'s output
    window: I64

    def depth(self, most: int) -> I64:
        """Drafts (or tree levels) each request may take: none while prefilling, at most ``most``, within its limit."""
        room = np.clip(np.minimum(most, self.limit - self.length - 1), 0, None)
        return np.where(self.prefill, 0, room).astype(np.int64)

    @property
    def non_draft(self) -> I64:
        """Tokens each request puts in the step besides its drafts: its prompt chunk, or its last token."""
        return np.where(self.prefill, self.prompt, 1).astype(np.int64)


def step_requests(active: list[RunningRequest], width: int) -> StepRequests:
    """The running requests' state and each one's reference window ``width`` tokens wide."""
    n = len(active)
    length = np.fromiter((len(a.output) for a in active), dtype=np.int64, count=n)
    window = np.empty((n, width), dtype=np.int64)
    for r, a in enumerate(active):
        ref = a.prep.ref
        window[r] = ref[np.minimum(length[r] + np.arange(width), ref.shape[0] - 1)]
    return StepRequests(
        rid=np.fromiter((a.prep.spec.index for a in active), dtype=np.int64, count=n),
        slots=np.fromiter((a.slot for a in active), dtype=np.int64, count=n),
        length=length,
        prefill=np.fromiter((not a.prefilled for a in active), dtype=bool, count=n),
        on_track=np.fromiter((a.on_track for a in active), dtype=bool, count=n),
        limit=np.fromiter((a.prep.max_tokens for a in active), dtype=np.int64, count=n),
        prompt=np.fromiter((a.prep.spec.prompt_len for a in active), dtype=np.int64, count=n),
        skill=np.fromiter((a.prep.spec.skill for a in active), dtype=np.float64, count=n),
        sampled=np.fromiter((a.prep.spec.sampled for a in active), dtype=bool, count=n),
        has_g=np.fromiter((a.matcher is not None for a in active), dtype=bool, count=n),
        window=window,
    )


@dataclass
class StepState(StepRequests):
    """One step's running requests and scheduled layout: what chain and tree steps both carry."""

    t: int
    act: list[RunningRequest]
    layout: ScheduledLayout
    #: maskplug's host time in this step so far
    host_s: float = field(default=0.0, kw_only=True)
    #: mask production and, with overlap, the time from the forward pass's launch to the masks ready (seconds)
    mask_s: float = field(default=0.0, kw_only=True)
    ready_s: float | None = field(default=None, kw_only=True)
    #: the mask kernel's time (seconds)
    apply_s: float = field(default=0.0, kw_only=True)

    @property
    def num_drafts(self) -> I64:
        """Drafts (or tree nodes) scheduled per request."""
        return self.layout.num_drafts

    @property
    def num_non_draft(self) -> I64:
        """Non-draft tokens per request (prompt chunk or last token)."""
        return self.layout.num_non_draft


@dataclass
class ChainBatch(StepState):
    """One chain step's running requests (stage 2): their state, the scheduled layout and the drafts."""

    drafts: Drafts
    #: ``live_cols[r, j]``: draft ``j`` of request ``r`` is scheduled
    live_cols: Bools


@dataclass
class TreeBatch(StepState):
    """One tree step's running requests, scheduled layout, draft trees and their node structure.

    Tree steps do not overlap mask production with the forward pass (``ready_s`` stays ``None``).
    """

    drafts: TreeDrafts
    tree: DraftTree


def new_mask_rows(step: StepState, vocab: Vocab) -> tuple[I64, GrammarRows, torch.Tensor]:
    """The step's grammar requests (batch rows), the producer of their rows and an empty bitmask for them."""
    g_idx = np.nonzero(step.has_g)[0]
    rows = GrammarRows(step.rid[g_idx])
    return g_idx, rows, vocab.new_bitmask(rows.num_rows(step.layout))


@dataclass
class StepMasks:
    """Stage 3: the grammar requests (batch rows ``g_idx``), their mask rows and the row mapping."""

    step: InitVar[StepState]
    g_idx: I64
    num_rows: int
    bitmask: torch.Tensor
    mapping: RowMapping
    #: grammar index of each batch row (−1 for unconstrained requests)
    g_of: I64 = field(init=False)
    #: first mask row of each grammar request (its drafts' rows, then its bonus rows)
    g_start: I64 = field(init=False)

    def __post_init__(self, step: StepState) -> None:
        self.g_of = np.full(len(step.act), -1, dtype=np.int64)
        self.g_of[self.g_idx] = np.arange(self.g_idx.size)
        self.g_start = np.zeros(self.g_idx.size + 1, dtype=np.int64)
        np.cumsum(step.num_drafts[self.g_idx] + step.layout.num_bonus, out=self.g_start[1:])


@dataclass
class ChainMasks(StepMasks):
    """A chain step's mask rows and the producer's :class:`~maskplug.DraftMasks` (``None``: no grammar request)."""

    dm: DraftMasks | None


@dataclass
class TreeStepMasks(StepMasks):
    """A tree step's mask rows and the grammar's per-node results (``None``: no grammar request)."""

    tm: TreeMasks | None


@dataclass
class StepBudget:
    """Stage 4, as every step records it: the budget, the largest admissible one, the regime, the logits rows."""

    b: int
    cap_max: int
    regime: str
    logits_rows: int


@dataclass
class ChainBudget(StepBudget):
    """A chain step's budget: the scheduler's view, the live allocation and the compaction."""

    view: StepView
    live: torch.Tensor
    cap: I64
    cu: torch.Tensor
    cu_np: I64
    comp: Compaction


@dataclass
class TreeBudget(StepBudget):
    """A tree step's budget: the confidences it was chosen on, the kept nodes, the compaction, the live mapping."""

    max_logits: int | None
    conf: npt.NDArray[np.float64]
    keep: Bools
    comp: TreeCompaction
    live_map: RowMapping


@dataclass
class ChainRows:
    """Stage 5: the masked logits of the live rows and where each row comes from."""

    logits: torch.Tensor
    row_req: I64
    row_pos: I64
    out_pos: I64
    bm_np: npt.NDArray[np.int32]


def verify_chain(
    batch: ChainBatch, masks: ChainMasks, budget: ChainBudget, rows: ChainRows, *, seed: int, vocab_size: int, eos: int
) -> tuple[I64, I64, str | None]:
    """Stage 6: greedy or rejection-sampling verification on the masked, compacted logits.

    Returns the accepted drafts per request, the token each request emits
    after them (the target's correction or bonus token) and, when
    verification accepted more drafts of a request than its grammar does,
    what went wrong (the count is then cut to the grammar's).
    """
    V = vocab_size
    d, cap, rid, sampled = batch.drafts, budget.cap, batch.rid, batch.sampled
    logits, row_req, row_pos = rows.logits, rows.row_req, rows.row_pos
    n, R, k_all = len(batch.act), int(budget.cu_np[-1]), d.tokens.shape[1]
    tgt = logits.argmax(dim=1).numpy().astype(np.int64)
    draft_row = row_pos < cap[row_req]  # rows whose draft is being verified
    dr = np.nonzero(draft_row)[0]
    dtok = d.tokens[row_req[dr], row_pos[dr]]
    acc_row = np.zeros(R, dtype=bool)
    greedy_dr = ~sampled[row_req[dr]]
    acc_row[dr[greedy_dr]] = dtok[greedy_dr] == tgt[dr[greedy_dr]]
    sdr = dr[~greedy_dr]
    if sdr.size:
        sel = torch.from_numpy(sdr)
        lse = torch.logsumexp(logits[sel], dim=1).double()
        st = dtok[~greedy_dr]
        p_d = torch.exp(logits[sel, torch.from_numpy(st)].double() - lse).numpy()
        conc = d.conc[row_req[sdr]]
        belief = d.belief[row_req[sdr], row_pos[sdr]]
        q_d = (1.0 - conc) / V + conc * (st == belief)
        u = uniform(seed, Streams.ACCEPT, rid[row_req[sdr]], rows.out_pos[sdr])
        acc_row[sdr] = u * q_d < p_d
    # Nothing is accepted after an accepted stop token: the output ends there.
    after_eos = np.zeros_like(d.tokens, dtype=bool)
    if k_all > 1:
        after_eos[:, 1:] = np.cumsum(d.tokens[:, :-1] == eos, axis=1) > 0
    acc_row[dr] &= ~after_eos[row_req[dr], row_pos[dr]]
    ok_mat = np.zeros((n, max(k_all, 1) + 1), dtype=bool)
    ok_mat[row_req[dr], row_pos[dr]] = acc_row[dr]
    n_acc = np.minimum(np.cumprod(ok_mat, axis=1).sum(axis=1), cap)
    # A draft the grammar rejects can never be accepted (its row forbids it),
    # so the accepted prefix never passes the grammar's acceptable count.
    acceptable = batch.num_drafts.copy()
    if masks.g_idx.size and masks.dm is not None:
        acceptable[masks.dm.request] = masks.dm.acceptable
    problem = None
    beyond = n_acc > acceptable
    if np.any(beyond):
        br = int(np.argmax(beyond))
        problem = (
            f"verification accepted {int(n_acc[br])} drafts of request {int(rid[br])} "
            f"({d.tokens[br, : batch.num_drafts[br]].tolist()}) but its grammar accepts {int(acceptable[br])}"
        )
        n_acc = np.minimum(n_acc, acceptable)
    final_row = budget.cu_np[:-1] + n_acc
    final_tok = tgt[final_row].copy()
    s_req = np.nonzero(sampled)[0]
    if s_req.size:
        rows_s = torch.from_numpy(final_row[s_req])
        probs = torch.softmax(logits[rows_s].double(), dim=1)
        rejected = n_acc[s_req] < cap[s_req]
        if np.any(rejected):
            rj = np.nonzero(rejected)[0]
            conc_t = torch.from_numpy(d.conc[s_req[rj]])[:, None]
            resid = probs[rj] - (1.0 - conc_t) / V
            bel = torch.from_numpy(d.belief[s_req[rj], n_acc[s_req[rj]]])
            resid[torch.arange(rj.size), bel] -= conc_t[:, 0]
            resid = resid.clamp_min(0.0)
            good = resid.sum(dim=1) > 0
            probs[torch.from_numpy(rj[good.numpy()])] = resid[good]
        cdf = torch.cumsum(probs, dim=1)
        u_s = uniform(seed, Streams.SAMPLE, rid[s_req], batch.length[s_req] + n_acc[s_req])
        target_mass = torch.from_numpy(u_s)[:, None] * cdf[:, -1:]
        pick = torch.searchsorted(cdf, target_mass, right=True)[:, 0].clamp_max(V - 1)
        final_tok[s_req] = pick.numpy()
    return n_acc, final_tok, problem
