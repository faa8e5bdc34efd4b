"""The simulated engine loop: continuous batching through maskplug's real code, checked every step.

One :class:`Simulation` serves a request stream with one budget scheduler.
Each step it does what a speculative-decoding engine with structured outputs
does, calling maskplug for every part that maskplug owns:

1. admit new requests into free slots (their first step is a prefill chunk);
2. draft up to ``K`` tokens per decoding request (:mod:`.models`);
3. fill the grammar requests' mask rows for the scheduled drafts
   (:func:`maskplug.fill_draft_masks`, real grammar provider);
4. choose the verify budget (the scheduler, on two-step-old confidences from
   :class:`maskplug.confidence.ConfidenceHistory`) and allocate it on the live
   confidences (:func:`maskplug.allocate`, or
   :func:`maskplug.schedulers.allocate_step` for schedulers that read the
   draft masks, those whose ``uses_grammar`` is true);
5. compact (:func:`maskplug.compact`, :func:`maskplug.active_cu_logits`),
   build the target's logits for the live rows only and apply the masks
   (:func:`maskplug.apply_grammar_bitmask` with the mapping from the
   *scheduled* layout);
6. verify, greedy or by rejection sampling, on the masked compacted logits;
7. commit the emitted tokens (:func:`maskplug.commit`), retire finished
   requests and validate their outputs.

With ``SimConfig.overlap``, stage 3 runs while the accelerator would run
its forward pass, for schedulers that choose the budget without the draft
masks (``uses_grammar`` false): the budget is chosen, the forward pass is
launched (it is stood in for by the cost model's time for the step, during
which the host thread is free, as while an accelerator computes), the rows
are started as a job (``fill_draft_masks(..., wait=False)``) and collected
before sampling. Each step records the simulated forward time, the mask
production time and the step's time from the forward pass's launch to the
masks being ready: measured with overlap, and without it as production +
forward (schedulers that read the masks always take that path).

Each stage is one method of :class:`Simulation` (``_admit``, ``_draft``,
``_fill_masks``, ``_choose_budget``, ``_masked_logits``, ``_commit`` and
``_retire``; verification is :func:`.stages.verify_chain`), passing the
records of :mod:`.stages` (``ChainBatch``, ``ChainMasks``, ``ChainBudget``,
``ChainRows``) from one to the next. A step's budget regime is
:func:`maskplug.compaction.regime_of`'s: a step without drafts is ``"full"``.

Every step is checked (:mod:`.checks`): the layout invariants (mapping
length, capacity a per-request prefix summing to the budget, device offsets
against the host compaction, allocation against :mod:`maskplug.reference`),
that every emitted token is allowed by its mask row and accepted by its
matcher, and, on a few rows per step, that masking wrote ``-inf`` exactly at
the disallowed tokens and changed nothing else.

The run's configuration is :mod:`.config`'s, the request stream
:mod:`.workload`'s and the result :mod:`.results`'; this module re-exports
their public names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt
import torch

from ..budget import CostModel, allocate
from ..compaction import active_cu_logits, compact, regime_of
from ..confidence import ConfidenceHistory
from ..dispatch import apply_grammar_bitmask
from ..errors import GrammarError
from ..grammar import commit, fill_draft_masks
from ..layout import ScheduledLayout
from ..plugins import get_registry
from ..schedulers import StepOutcome, StepView, allocate_step
from .checks import allowed, chain_layout_problems, masking_problems, output_verdict
from .config import DEFAULT_SCHEDULERS, SimConfig, default_cost_model, make_scheduler
from .models import Streams, TargetModel, draft, hash64, structural_tokens, uniform
from .results import RunResult
from .stages import (
    ChainBatch,
    ChainBudget,
    ChainMasks,
    ChainRows,
    RunningRequest,
    StepBudget,
    StepMasks,
    StepState,
    new_mask_rows,
    step_requests,
    verify_chain,
)
from .workload import Workload

__all__ = [
    "DEFAULT_SCHEDULERS",
    "RunResult",
    "SimConfig",
    "Simulation",
    "Workload",
    "default_cost_model",
    "make_scheduler",
]

I64 = npt.NDArray[np.int64]

#: Requests failing one after another before the run stops (every grammar failing would never fill a slot).
_MAX_FAILED_IN_A_ROW = 1000


class Simulation:
    """One scheduler serving the workload for ``config.steps`` steps.

    Args:
        config: the run's configuration.
        scheduler: a scheduler spec (see :func:`make_scheduler`).
        workload: the shared request stream.
        target: the shared synthetic target model.
        cost: the cost model for budgets and simulated time.
        on_step: called after every step with ``(step, result)`` (progress).
        structural: the vocabulary's structural tokens (default :func:`.models.structural_tokens`).
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
    ) -> None:
        self.cfg = config
        self.name = scheduler
        self.work = workload
        self.target = target
        self.cost = cost
        self.on_step = on_step
        vocab = workload.tok.vocab
        self.vocab = vocab
        self.V = vocab.vocab_size
        self.eos = workload.tok.eos
        self.first_token = max(vocab.special_ids) + 1
        self.structural = structural if structural is not None else structural_tokens(vocab)
        self._use_scheduler(scheduler)
        self.K = 0 if self.spec_off else int(config.drafts)
        self.hist = ConfidenceHistory(config.concurrency, max(self.K, 1))
        self.active: list[RunningRequest] = []
        self.free_slots = list(range(config.concurrency))[::-1]
        self.next_index = 0
        self.result = RunResult(scheduler)
        self.registry = get_registry()

    def _use_scheduler(self, scheduler: str) -> None:
        """Build the scheduler of spec ``scheduler`` and note how the engine must drive it."""
        self.sched = make_scheduler(scheduler)
        self.spec_off = scheduler == "no-spec"
        # Schedulers that read the draft masks get an allocation that respects them.
        self.grammar_aware = bool(getattr(self.sched, "uses_grammar", False))

    # ------------------------------------------------------------------ helpers
    def _fail(self, step: int, problems: Iterable[str]) -> None:
        for what in problems:
            self.result.violation(step, what)

    def _admit(self) -> None:
        new_slots = []
        failed_in_a_row = 0
        while len(self.active) < self.cfg.concurrency:
            prep = self.work.get(self.next_index)
            self.next_index += 1
            if prep.error is not None:
                # The request fails alone (its error is in the workload's failures); the next one takes the slot.
                self.result.failed += 1
                failed_in_a_row += 1
                if failed_in_a_row >= _MAX_FAILED_IN_A_ROW:
                    raise GrammarError(f"workload: {failed_in_a_row} requests in a row failed; the last: {prep.error}")
                continue
            failed_in_a_row = 0
            slot = self.free_slots.pop()
            matcher = prep.compiled.matcher() if prep.compiled is not None else None
            self.active.append(RunningRequest(prep, slot, matcher))
            new_slots.append(slot)
            self.result.admitted += 1
        if new_slots:
            self.hist.reset(new_slots)

    def _finish(self, req: RunningRequest, stopped: bool) -> str:
        """Classify a finished output: ``valid``, ``invalid`` or ``cut_off``."""
        if not stopped:
            return "cut_off"
        return output_verdict(req.prep.spec, self.work.tok.decode(req.output[:-1]))

    def _token_room(self, t: int, num_non_draft: I64) -> int | None:
        """Draft tokens the engine's token limit leaves room for in step ``t`` (``None``: no limit)."""
        cfg = self.cfg
        room = None
        if cfg.max_batch_tokens is not None:
            room = max(0, int(cfg.max_batch_tokens) - int(num_non_draft.sum()))
        if cfg.squeeze_every and t % cfg.squeeze_every == cfg.squeeze_every - 1:
            room = 0
        return room

    def _apply_checked(
        self,
        step: StepState,
        stream: int,
        logits: torch.Tensor,
        mrow: I64,
        bm_np: npt.NDArray[np.int32],
        apply: Callable[[], None],
    ) -> None:
        """Run ``apply`` (the masking), timed into ``step.apply_s``, and check a few masked rows column by column.

        ``mrow[i]`` is the mask row of logits row ``i`` (-1: unmasked); up to
        ``check_rows`` of the masked rows are drawn from the seeded ``stream``.
        """
        cfg, t = self.cfg, step.t
        # Keep a few masked rows' raw values to check the kernel column by column.
        check = np.nonzero(mrow >= 0)[0]
        if check.size > cfg.check_rows:
            pick = hash64(cfg.seed, stream, t, np.arange(cfg.check_rows)) % np.uint64(check.size)
            check = check[pick.astype(np.int64)]
        before = logits[torch.from_numpy(check)].clone() if check.size else None
        a0 = time.perf_counter()
        apply()
        step.apply_s = time.perf_counter() - a0
        if before is not None:
            self._fail(t, masking_problems(before, logits[torch.from_numpy(check)], check, mrow, bm_np, self.V))

    def _emit(
        self, batch: StepState, a: RunningRequest, toks: list[int], mask_rows: I64 | None, bm_np: npt.NDArray[np.int32]
    ) -> tuple[bool, bool]:
        """Emit ``toks`` for request ``a``: check them against their mask rows, commit them, extend the output.

        ``mask_rows[i]`` is the mask row that allowed ``toks[i]`` (grammar
        requests). Returns ``(finished, stopped)``: the request ended, on its
        stop token or at its token limit.
        """
        t = batch.t
        if a.matcher is not None and mask_rows is not None:
            if not np.all(allowed(bm_np, mask_rows, np.asarray(toks, dtype=np.int64))):
                self._fail(t, [f"request {a.prep.spec.index} emitted a token its mask row forbids: {toks}"])
            c0 = time.perf_counter()
            took = commit(a.matcher, toks)
            batch.host_s += time.perf_counter() - c0
            if took != len(toks):
                self._fail(t, [f"request {a.prep.spec.index}: the grammar took {took} of emitted {toks}"])
        start = len(a.output)
        if a.on_track:
            seg = a.prep.ref[start : start + len(toks)]
            a.on_track = seg.shape[0] == len(toks) and bool(np.array_equal(seg, toks))
        a.output.extend(toks)
        a.prefilled = True
        stopped = bool(toks) and toks[-1] == self.eos
        finished = stopped or len(a.output) >= a.prep.max_tokens
        if finished and a.matcher is not None and stopped and not a.matcher.is_terminated():
            self._fail(t, [f"request {a.prep.spec.index} stopped but its matcher is not terminated"])
        return finished, stopped

    def _tempting_tokens(
        self, bm_np: npt.NDArray[np.int32], mrow: I64, eligible: npt.NDArray[np.bool_], rids: I64, out_pos: I64
    ) -> I64:
        """Per logits row, a token the target is tempted by that its mask row forbids (-1: none).

        A row is tempted (seeded per request and position) when it has a mask
        row, ``eligible`` holds and the draw falls under ``tempt_rate``; the
        token is the first of four seeded candidates the mask disallows.
        """
        cfg, V = self.cfg, self.V
        tempt = np.full(mrow.shape[0], -1, dtype=np.int64)
        want = (mrow >= 0) & eligible & (uniform(cfg.seed, Streams.TEMPT, rids, out_pos) < cfg.tempt_rate)
        if np.any(want):
            w = np.nonzero(want)[0]
            cand = self.first_token + (
                hash64(cfg.seed, Streams.TEMPT_TOKEN, rids[w][:, None], out_pos[w][:, None], np.arange(4)[None, :])
                % np.uint64(V - self.first_token)
            ).astype(np.int64)
            ok_bits = allowed(bm_np, np.repeat(mrow[w], 4).reshape(-1, 4), cand)
            first_bad = np.argmax(~ok_bits, axis=1)
            ok = ~ok_bits[np.arange(w.size), first_bad]
            tempt[w[ok]] = cand[ok, first_bad[ok]]
            self.result.tempted_rows += int(ok.sum())
        return tempt

    # -------------------------------------------------------------------- stages
    def step(self, t: int) -> None:
        """Run engine step ``t``: the seven stages of the module docstring, each checked."""
        self._admit()
        batch = self._draft(t)
        if self.cfg.overlap and not self.grammar_aware:
            masks, budget = self._overlapped(batch)
        else:
            masks = self._fill_masks(batch)
            budget = self._choose_budget(batch, masks)
        self._fail(t, chain_layout_problems(batch, masks, budget, self.grammar_aware))
        rows = self._masked_logits(batch, masks, budget)
        n_acc, final_tok, problem = verify_chain(
            batch, masks, budget, rows, seed=self.cfg.seed, vocab_size=self.V, eos=self.eos
        )
        self._fail(t, [problem] if problem is not None else [])
        emitted, finished = self._commit(batch, masks, budget, rows, n_acc, final_tok)
        self._retire(batch, finished)
        decode = ~batch.prefill
        self._record(batch, masks, budget, accepted=int(n_acc[decode].sum()), emitted=emitted, finished=len(finished))

    def _draft(self, t: int) -> ChainBatch:
        """Stage 2: the running requests' state, the scheduled layout and up to ``K`` drafts each."""
        cfg, K = self.cfg, self.K
        q = step_requests(self.active, K + 2)
        num_drafts = q.depth(K)
        layout = ScheduledLayout(q.rid, num_drafts, q.non_draft)
        d = draft(
            cfg.seed, q.rid, q.length, q.window, num_drafts, q.skill, q.sampled, self.structural, self.first_token,
            self.V, max(K, 1),
        )  # fmt: skip
        live_cols = np.arange(d.tokens.shape[1])[None, :] < num_drafts[:, None]
        return ChainBatch(**vars(q), t=t, act=self.active, layout=layout, drafts=d, live_cols=live_cols)

    def _fill_masks(self, batch: ChainBatch) -> ChainMasks:
        """Stage 3: the grammar requests' mask rows for the scheduled drafts (:func:`maskplug.fill_draft_masks`)."""
        h0 = time.perf_counter()
        g_idx, rows, bitmask = new_mask_rows(batch, self.vocab)
        flat_drafts = batch.drafts.tokens[batch.live_cols]  # batch order, Σ num_drafts entries
        dm = fill_draft_masks([batch.act[g].matcher for g in g_idx], flat_drafts, bitmask, rows, batch.layout)
        mapping = rows.mapping(batch.layout)
        spent = time.perf_counter() - h0
        batch.host_s += spent
        batch.mask_s = spent
        return ChainMasks(batch, g_idx, rows.num_rows(batch.layout), bitmask, mapping, dm)

    def _forward_ms(self, batch: StepState, b: int) -> float:
        """The cost model's time for the step's forward passes: verify, plus the drafter when drafts were made."""
        ms = float(self.cost.verify_ms(int(batch.num_non_draft.sum()) + b))
        if batch.layout.total_drafts:
            ms += float(self.cost.draft_ms(int((~batch.prefill).sum())))
        return ms

    def _overlapped(self, batch: ChainBatch) -> tuple[ChainMasks, ChainBudget]:
        """Stages 4 then 3: the budget (without the masks), the forward pass launched, the rows as a job meanwhile."""
        budget = self._choose_budget(batch, None)
        # The accelerator's forward pass starts now and ends at its simulated time; the host thread
        # prepares and starts the rows' job, then only waits (a late wake-up is not the accelerator's).
        forward_s = self._forward_ms(batch, budget.b) / 1e3
        f0 = time.perf_counter()
        g_idx, rows, bitmask = new_mask_rows(batch, self.vocab)
        flat_drafts = batch.drafts.tokens[batch.live_cols]
        c0 = time.perf_counter()
        job = fill_draft_masks(
            [batch.act[g].matcher for g in g_idx], flat_drafts, bitmask, rows, batch.layout, wait=False
        )
        c1 = time.perf_counter()
        time.sleep(max(0.0, f0 + forward_s - c1))
        h1 = time.perf_counter()
        dm = job.result()
        mapping = rows.mapping(batch.layout)
        batch.host_s += (c1 - f0) + (time.perf_counter() - h1)
        batch.mask_s = (c0 - f0) + (job.elapsed() or 0.0)
        batch.ready_s = max(forward_s, (job.finished_at() or h1) - f0)
        return ChainMasks(batch, g_idx, rows.num_rows(batch.layout), bitmask, mapping, dm), budget

    def _choose_budget(self, batch: ChainBatch, masks: ChainMasks | None) -> ChainBudget:
        """Stage 4: the scheduler's budget on stale confidences, its allocation on live ones, the compaction.

        ``masks`` is None when the rows are still being produced (schedulers that do not read them).
        """
        K, t, n = self.K, batch.t, len(batch.act)
        h0 = time.perf_counter()
        stale = self.hist.stale(batch.slots)[:, : max(K, 1)]
        room = self._token_room(t, batch.num_non_draft)
        max_logits = None if room is None else n * batch.layout.num_bonus + room
        view = StepView(
            batch.layout,
            self.cost,
            confidences=stale,
            grammar=masks.dm if masks is not None and masks.g_idx.size else None,
            max_logits=max_logits,
        )
        decision = self.sched.budget(view)
        b = int(decision.budget)
        live = torch.from_numpy(batch.drafts.conf.astype(np.float32))
        if self.grammar_aware:
            capacity = allocate_step(view, live, b)
        else:
            capacity = allocate(live, batch.num_drafts, b)
        cu = active_cu_logits(capacity, batch.layout.num_bonus)
        comp = compact(batch.layout, b)
        batch.host_s += time.perf_counter() - h0
        cap = capacity.numpy().astype(np.int64)
        cu_np = cu.numpy().astype(np.int64)
        regime = regime_of(batch.layout, b)
        return ChainBudget(b, int(view.cap), regime, int(cu_np[-1]), view, live, cap, cu, cu_np, comp)

    def _masked_logits(self, batch: ChainBatch, masks: ChainMasks, budget: ChainBudget) -> ChainRows:
        """Stage 5: the target's logits for the live (compacted) rows only, masked by the mapped grammar rows."""
        cfg, V, n = self.cfg, self.V, len(batch.act)
        cap, cu_np, rid = budget.cap, budget.cu_np, batch.rid
        d, width = batch.drafts, batch.window.shape[1]
        R = int(cu_np[-1])
        row_req = np.repeat(np.arange(n), cap + 1)
        row_pos = np.arange(R) - cu_np[row_req]
        k_all = d.tokens.shape[1]
        match = (d.tokens == batch.window[:, :k_all]) & batch.live_cols
        lead = np.cumprod(match, axis=1).sum(axis=1)  # drafts that follow the reference
        prefix_ok = batch.on_track[row_req] & (row_pos <= lead[row_req])
        pos_c = np.minimum(row_pos, width - 1)
        preferred = np.where(prefix_ok, batch.window[row_req, pos_c], self.eos)
        # Mask row of each live logits row (−1 for unconstrained requests).
        gr = masks.g_of[row_req]
        mrow = np.where(gr >= 0, masks.g_start[np.maximum(gr, 0)] + row_pos, -1)
        bm_np = masks.bitmask.numpy()
        out_pos = batch.length[row_req] + row_pos
        tempt = self._tempting_tokens(bm_np, mrow, prefix_ok, rid[row_req], out_pos)
        logits = self.target.logits(rid[row_req], out_pos, preferred, tempt)

        def apply() -> None:
            if masks.num_rows:
                apply_grammar_bitmask(
                    logits, masks.bitmask, masks.mapping, budget.cu, vocab_size=V, backend=cfg.backend
                )

        self._apply_checked(batch, 99, logits, mrow, bm_np, apply)
        return ChainRows(logits, row_req, row_pos, out_pos, bm_np)

    def _commit(
        self, batch: ChainBatch, masks: ChainMasks, budget: ChainBudget, rows: ChainRows, n_acc: I64, final_tok: I64
    ) -> tuple[int, list[tuple[int, bool]]]:
        """Stage 7a: emit, check against the mask rows, commit to the matchers, tell the scheduler.

        Returns the tokens emitted and the finished requests as ``(batch row, stopped)``.
        """
        d = batch.drafts
        finished: list[tuple[int, bool]] = []
        emitted_total = 0
        for r, a in enumerate(batch.act):
            toks = [int(x) for x in d.tokens[r, : n_acc[r]]] + [int(final_tok[r])]
            if self.eos in toks:
                toks = toks[: toks.index(self.eos) + 1]
            toks = toks[: max(0, a.prep.max_tokens - len(a.output))]
            mask_rows = masks.g_start[masks.g_of[r]] + np.arange(len(toks)) if a.matcher is not None else None
            done, stopped = self._emit(batch, a, toks, mask_rows, rows.bm_np)
            emitted_total += len(toks)
            if done:
                finished.append((r, stopped))

        decode = ~batch.prefill
        rid, cap = batch.rid, budget.cap
        o0 = time.perf_counter()
        fin_ids = rid[[r for r, _ in finished]] if finished else np.zeros(0, dtype=np.int64)
        self.sched.observe(
            StepOutcome(req_ids=rid[decode], verified=cap[decode], accepted=n_acc[decode], finished=fin_ids)
        )
        self.hist.record(batch.slots, budget.live if self.K else torch.zeros(len(batch.act), 1))
        batch.host_s += time.perf_counter() - o0
        return emitted_total, finished

    def _retire(self, batch: StepState, finished: list[tuple[int, bool]]) -> None:
        """Stage 7b: validate the finished outputs and free their slots."""
        res = self.result
        for r, stopped in finished:
            a = batch.act[r]
            verdict = self._finish(a, stopped)
            res.finished_tokens += len(a.output)
            if verdict == "valid":
                res.valid += 1
            elif verdict == "cut_off":
                res.cut_off += 1
            else:
                res.invalid += 1
                if len(res.invalid_samples) < 5:
                    res.invalid_samples.append(f"{a.prep.spec.name}: {self.work.tok.decode(a.output)[:200]!r}")
            self.free_slots.append(a.slot)
        done = {r for r, _ in finished}
        self.active = [a for r, a in enumerate(batch.act) if r not in done]

    def _record(
        self, batch: StepState, masks: StepMasks, budget: StepBudget, *, accepted: int, emitted: int, finished: int
    ) -> None:
        """Add one step to the result (simulated time, counters) and tell the ``step_end`` hook."""
        res, total, b = self.result, batch.layout.total_drafts, budget.b
        step_ms = self._forward_ms(batch, b)
        mask_ms = 1e3 * batch.mask_s
        serial = mask_ms + step_ms
        res.steps += 1
        res.tokens += emitted
        res.sim_ms += step_ms
        res.mask_ms += mask_ms
        res.serial_ms += serial
        res.overlap_ms += serial if batch.ready_s is None else 1e3 * batch.ready_s
        res.bound_ms += max(step_ms, mask_ms)
        res.regimes[budget.regime] += 1
        res.zero_trimmed += int(b == 0 and total > 0)
        res.verified += b
        res.accepted += accepted
        res.verify_events += int((~batch.prefill).sum())
        res.host_s += batch.host_s
        res.apply_s += batch.apply_s
        res.budgets.append(b)
        res.max_budgets.append(budget.cap_max)
        self.registry.step_end(
            {
                "step": batch.t,
                "scheduler": self.name,
                "num_requests": len(batch.act),
                "num_grammar_requests": int(masks.g_idx.size),
                "scheduled_drafts": total,
                "budget": b,
                "regime": budget.regime,
                "mask_rows": masks.num_rows,
                "logits_rows": budget.logits_rows,
                "emitted": emitted,
                "finished": finished,
                "sim_ms": step_ms,
                "host_us": batch.host_s * 1e6,
                "apply_us": batch.apply_s * 1e6,
            }
        )

    def run(self) -> RunResult:
        """Run ``config.steps`` steps; the result also counts requests still in flight."""
        for t in range(self.cfg.steps):
            self.step(t)
            if self.on_step is not None:
                self.on_step(t, self.result)
        self.result.in_flight = len(self.active)
        return self.result
