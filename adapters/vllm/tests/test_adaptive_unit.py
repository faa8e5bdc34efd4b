"""The adaptive-verification step, piece by piece, on vLLM's own scheduler-output types (no engine).

* planning: the budget's split into kept drafts and the compacted scheduler
  output the model runner gets (token counts, draft prefixes, totals), against
  :func:`maskplug.reference.allocate` and :func:`maskplug.compaction.regime_of`,
  with vLLM's output left as scheduled;
* grammar-aware budgets never keep a draft the step's draft masks reject;
* the outcome reported after sampling, the counters and ``maskplug_step_end``;
* the mask apply of a compacted step: rows mapped from the scheduled layout,
  live rows from the kept drafts, against a row-by-row oracle;
* the cost file, scheduler names and the release check.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from maskplug_vllm import adaptive, patches, worker
from maskplug_vllm.host import draft_counts, step_rows
from maskplug_vllm.worker import SCHEDULED_SPEC_ATTR, apply_scatter
from vllm.v1.core.sched.output import CachedRequestData, GrammarOutput, SchedulerOutput

from maskplug import (
    BudgetDecision,
    BudgetError,
    CostModel,
    DraftMasks,
    PluginError,
    StepOutcome,
    StepView,
    allocate_step,
    get_registry,
    hookimpl,
    reference,
)
from maskplug.compaction import regime_of
from maskplug.schedulers import GoodputScheduler, GrammarAwareScheduler


class FixedBudget:
    """A scheduler that returns a preset budget (clipped to the step's cap) and records what it saw."""

    name = "fixed"

    def __init__(self, budget: int) -> None:
        self.want = budget
        self.views: list[StepView] = []
        self.outcomes: list[StepOutcome] = []

    def budget(self, step: StepView) -> BudgetDecision:
        self.views.append(step)
        return step.score(min(self.want, step.cap))

    def observe(self, outcome: StepOutcome) -> None:
        self.outcomes.append(outcome)


def _step(rng: np.random.Generator, max_drafts: int = 5) -> tuple[SchedulerOutput, list[str], np.ndarray, np.ndarray]:
    n = int(rng.integers(1, 13))
    ids = [f"req-{int(x)}" for x in rng.permutation(100)[:n]]
    prefill = rng.random(n) < 0.2
    nd = np.where(prefill, 0, rng.integers(0, max_drafts + 1, size=n))
    nn = np.where(prefill, rng.integers(2, 30, size=n), 1)
    spec = {r: [int(t) for t in rng.integers(0, 500, size=int(d))] for r, d in zip(ids, nd, strict=True) if d}
    nst = {r: int(a + b) for r, a, b in zip(ids, nn, nd, strict=True)}
    so = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=nst,
        total_num_scheduled_tokens=sum(nst.values()),
        scheduled_spec_decode_tokens=spec,
        scheduled_encoder_inputs={},
        finished_req_ids={"gone-1", "gone-2"},
        free_encoder_mm_hashes=[],
    )
    return so, ids, nd.astype(np.int64), nn.astype(np.int64)


def test_plan_compacts_the_step_for_the_runner() -> None:
    rng = np.random.default_rng(0)
    regimes = set()
    for _ in range(300):
        so, ids, nd, nn = _step(rng)
        total = int(nd.sum())
        b = int(rng.integers(0, total + 1))
        sched = FixedBudget(b)
        ctl = adaptive._Controller(sched, "fixed", CostModel.linear())
        before = (dict(so.num_scheduled_tokens), {r: list(v) for r, v in so.scheduled_spec_decode_tokens.items()})
        plan = ctl.plan(so)
        trimmed = adaptive.compacted_output(so)
        # vLLM's scheduler keeps the step as scheduled.
        assert (so.num_scheduled_tokens, so.scheduled_spec_decode_tokens) == before
        if total == 0:
            assert trimmed is so and plan.budget == 0
            continue
        assert plan.budget == b
        cap = plan.capacity
        # Without beliefs every draft is equally likely: the reference allocation on equal confidences.
        assert cap.tolist() == reference.allocate(np.ones((len(ids), 5)), nd, b)
        assert plan.regime == regime_of(plan.layout, b)
        regimes.add(plan.regime)
        if b == total:
            assert trimmed is so
            continue
        assert trimmed is not so
        assert getattr(trimmed, SCHEDULED_SPEC_ATTR) is so.scheduled_spec_decode_tokens
        for r, c, n_non in zip(ids, cap.tolist(), nn.tolist(), strict=True):
            assert trimmed.num_scheduled_tokens[r] == n_non + c
            if c:
                assert trimmed.scheduled_spec_decode_tokens[r] == so.scheduled_spec_decode_tokens[r][:c]
            else:
                assert r not in trimmed.scheduled_spec_decode_tokens
        assert trimmed.total_num_scheduled_tokens == int(nn.sum()) + b == sum(trimmed.num_scheduled_tokens.values())
        # Everything else is vLLM's, untouched.
        for f in dataclasses.fields(SchedulerOutput):
            if f.name not in {"num_scheduled_tokens", "total_num_scheduled_tokens", "scheduled_spec_decode_tokens"}:
                assert getattr(trimmed, f.name) is getattr(so, f.name), f.name
        # What the workers get is plain data, serialisable as vLLM serialises the scheduler output,
        # and the copy a worker builds from the received output is the same step.
        received = pickle.loads(pickle.dumps(so))
        again = adaptive.compacted_output(received)
        assert again.num_scheduled_tokens == trimmed.num_scheduled_tokens
        assert again.scheduled_spec_decode_tokens == trimmed.scheduled_spec_decode_tokens
        assert again.total_num_scheduled_tokens == trimmed.total_num_scheduled_tokens
        assert getattr(again, SCHEDULED_SPEC_ATTR) == so.scheduled_spec_decode_tokens
    assert regimes == {"full", "partial", "zero"}


def _with_grammar(so: SchedulerOutput, gids: list[str], acceptable: list[int], rows: int) -> GrammarOutput:
    go = GrammarOutput(gids, np.full((rows, 16), -1, dtype=np.int32), None)
    g = len(gids)
    dm = DraftMasks(
        request=np.arange(g, dtype=np.int64),
        acceptable=np.asarray(acceptable, dtype=np.int64),
        forced=np.zeros((g, 6), dtype=bool),
    )
    setattr(go, adaptive._DRAFT_MASKS_ON_OUTPUT, dm)
    return go


def test_grammar_aware_budget_keeps_only_drafts_the_grammar_accepts() -> None:
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(200):
        so, ids, nd, _ = _step(rng)
        gsel = [i for i in range(len(ids)) if rng.random() < 0.6]
        gids = [ids[i] for i in gsel]
        acc = [int(rng.integers(0, nd[i] + 1)) for i in gsel]
        go = _with_grammar(so, gids, acc, sum(1 + int(nd[i]) for i in gsel))
        inner = FixedBudget(int(nd.sum()))
        ctl = adaptive._Controller(GrammarAwareScheduler(inner), "grammar-aware:fixed", CostModel.linear())
        plan = ctl.plan(so, go)
        if not int(nd.sum()):
            continue
        view = inner.views[-1]
        # The draft masks reached the scheduler in batch indices.
        assert view.grammar is not None and view.grammar.request.tolist() == gsel
        for i, a in zip(gsel, acc, strict=True):
            assert plan.capacity[i] <= a
        assert plan.structured == any(nd[i] > 0 for i in gsel)
        checked += 1
    assert checked > 100


def test_a_planned_step_asks_the_producer_for_its_draft_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``schedule`` sets :data:`~maskplug_vllm.scheduler.WANT_DRAFT_MASKS_ATTR` on the manager around the rows.

    The producer records the step's draft masks only while it is set (the
    forced rows a budget reads included); they reach the budget, and the
    attribute is cleared after the rows, also when the producer raises.
    """
    from maskplug_vllm.scheduler import DRAFT_MASKS_ATTR, WANT_DRAFT_MASKS_ATTR

    rng = np.random.default_rng(5)
    so, ids, nd, _ = _step(rng)
    while not int(nd.sum()):
        so, ids, nd, _ = _step(rng)
    gids = [r for r, d in zip(ids, nd, strict=True) if d][:1]
    forced = np.zeros((1, 6), dtype=bool)
    forced[0, 0] = True
    dm = DraftMasks(request=np.arange(1, dtype=np.int64), acceptable=np.asarray([1], np.int64), forced=forced)
    manager = SimpleNamespace()
    asked: list[bool] = []

    def rows(self: Any, so: Any) -> GrammarOutput:
        # What the wrapped manager does: the draft masks recorded only when they are wanted.
        want = bool(getattr(manager, WANT_DRAFT_MASKS_ATTR, False))
        asked.append(want)
        setattr(manager, DRAFT_MASKS_ATTR, (gids, dm) if want else None)
        if len(asked) == 2:
            raise RuntimeError("producer fault")
        return GrammarOutput(gids, np.full((1 + int(nd[ids.index(gids[0])]), 16), -1, dtype=np.int32), None)

    inner = FixedBudget(int(nd.sum()))
    ctl = adaptive._Controller(GrammarAwareScheduler(inner), "grammar-aware:fixed", CostModel.linear())
    monkeypatch.setattr(adaptive, "_controller", ctl)
    ctl.metrics = SimpleNamespace(write=lambda counts: None)  # type: ignore[assignment]
    sched = SimpleNamespace(structured_output_manager=manager, vllm_config=None)
    schedule = adaptive._make_schedule(lambda self: so, rows)
    assert schedule(sched) is so
    assert asked == [True] and getattr(manager, WANT_DRAFT_MASKS_ATTR) is False
    view = inner.views[-1]
    assert view.grammar is not None and view.grammar.forced[0].tolist() == forced[0].tolist()
    with pytest.raises(RuntimeError, match="producer fault"):
        schedule(sched)
    assert asked == [True, True] and getattr(manager, WANT_DRAFT_MASKS_ATTR) is False


def test_finish_reports_the_outcome_counts_and_fires_the_hook() -> None:
    calls: list[dict[str, Any]] = []

    class Hook:
        @hookimpl
        def maskplug_step_end(self, stats: dict[str, Any]) -> None:
            calls.append(stats)

    hook = Hook()
    get_registry().add_plugin(hook, "adaptive-unit-hook")
    try:
        rng = np.random.default_rng(2)
        sched = FixedBudget(0)
        ctl = adaptive._Controller(sched, "fixed", CostModel.linear())
        expect_acc = expect_ver = expect_sched = 0
        for step in range(50):
            so, ids, nd, _ = _step(rng)
            sched.want = int(rng.integers(0, int(nd.sum()) + 1))
            gids = ids[: len(ids) // 2]
            go = _with_grammar(
                so, gids, [int(nd[i]) for i in range(len(gids))], sum(1 + int(nd[i]) for i in range(len(gids)))
            )
            plan = ctl.plan(so, go)
            order = list(rng.permutation(len(ids)))
            sampled: list[list[int]] = [[] for _ in ids]
            acc = np.zeros(len(ids), dtype=np.int64)
            for i in range(len(ids)):
                acc[i] = int(rng.integers(0, plan.capacity[i] + 1))
                sampled[order[i]] = [7] * (int(acc[i]) + 1)
            out = SimpleNamespace(sampled_token_ids=sampled, req_id_to_index={r: order[i] for i, r in enumerate(ids)})
            ctl.finish(plan, out)
            o = sched.outcomes[-1]
            drafted = nd > 0  # only requests with drafts scheduled tell anything about acceptance
            assert o.req_ids.tolist() == [r for r, d in zip(ids, drafted, strict=True) if d]
            # every verified draft accepted and some trimmed: the first trimmed one is judged by the emitted token
            cap = plan.capacity
            probe = (acc == cap) & (cap < nd)
            hit = np.array(
                [bool(probe[i]) and so.scheduled_spec_decode_tokens[r][cap[i]] == 7 for i, r in enumerate(ids)]
            )
            assert o.verified.tolist() == (cap + probe)[drafted].tolist()
            assert o.accepted.tolist() == (acc + hit)[drafted].tolist()
            assert sorted(o.finished.tolist()) == ["gone-1", "gone-2"]
            expect_acc += int(acc.sum())
            expect_ver += plan.budget
            expect_sched += int(nd.sum())
            assert len(calls) == step + 1 and calls[-1]["budget"] == plan.budget
        # A step that runs nothing may still announce finished requests.
        ctl.forget({"gone-3"})
        assert sched.outcomes[-1].req_ids.size == 0 and sched.outcomes[-1].finished.tolist() == ["gone-3"]
        st = ctl.stats
        assert st["steps"] == 50
        assert (st["drafts_scheduled"], st["drafts_verified"], st["drafts_accepted"]) == (
            expect_sched,
            expect_ver,
            expect_acc,
        )
        assert sum(st["regimes"].values()) == st["structured_steps"] == sum(1 for c in calls if c["structured"])
    finally:
        get_registry().pm.unregister(hook)


def test_goodput_learns_from_the_engine_outcomes() -> None:
    """Requests whose drafts are always rejected get budget 0 after a few steps; the finished are forgotten."""
    sched = GoodputScheduler(alpha=0.5)
    ctl = adaptive._Controller(sched, "goodput", CostModel.linear(verify_base_ms=1.0, verify_per_token_ms=0.5))
    rng = np.random.default_rng(3)
    budgets = []
    for _ in range(12):
        so, ids, _, _ = _step(rng)
        plan = ctl.plan(so)
        out = SimpleNamespace(sampled_token_ids=[[1] for _ in ids], req_id_to_index={r: i for i, r in enumerate(ids)})
        ctl.finish(plan, out)
        budgets.append(plan.budget)
    assert budgets[-1] == 0 and max(budgets) > 0
    fin = StepOutcome(
        req_ids=np.zeros(0, dtype=str), verified=[], accepted=[], finished=np.asarray([f"req-{i}" for i in range(100)])
    )
    sched.observe(fin)
    assert sched._ids.keys.size == 0


def _oracle(
    logits: torch.Tensor,
    bitmask: np.ndarray,
    batch: list[str],
    gids: list[str],
    nd: dict[str, int],
    cap: dict[str, int],
) -> torch.Tensor:
    """Row by row: grammar request g's mask row p (rows laid out for the scheduled drafts) masks logits row p of
    its request (rows laid out for the kept drafts), for p up to its kept drafts; nothing else is touched."""
    out = logits.clone()
    start = {}
    row = 0
    for g in gids:
        start[g] = row
        row += 1 + nd[g]
    cu = {}
    row = 0
    for r in batch:
        cu[r] = row
        row += 1 + cap[r]
    for g in gids:
        if g not in cu:
            continue
        for p in range(cap[g] + 1):
            mrow = bitmask[start[g] + p].tolist()
            for t in range(out.shape[1]):
                if not reference.token_allowed(mrow, t):
                    out[cu[g] + p, t] = float("-inf")
    return out


def test_apply_scatter_of_a_compacted_step_matches_the_oracle() -> None:
    rng = np.random.default_rng(4)
    vocab = 64
    for _ in range(120):
        so, ids, ndv, _ = _step(rng)
        nd = dict(zip(ids, ndv.tolist(), strict=True))
        cap = {r: int(rng.integers(0, nd[r] + 1)) for r in ids}
        gids = [r for r in rng.permutation(ids).tolist() if rng.random() < 0.7]
        rows = sum(1 + nd[g] for g in gids)
        bitmask = rng.integers(-(2**31), 2**31, size=(rows, vocab // 32), dtype=np.int64).astype(np.int32)
        kept = {r: so.scheduled_spec_decode_tokens[r][: cap[r]] for r in ids if cap[r]}
        trimmed = dataclasses.replace(so, scheduled_spec_decode_tokens=kept)
        setattr(trimmed, SCHEDULED_SPEC_ATTR, so.scheduled_spec_decode_tokens)
        batch = rng.permutation(ids).tolist()
        logits = torch.from_numpy(rng.standard_normal((sum(1 + cap[r] for r in batch), vocab)).astype(np.float32))
        expect = _oracle(logits, bitmask, batch, gids, nd, cap)
        apply_scatter(trimmed, GrammarOutput(gids, bitmask), SimpleNamespace(req_ids=batch), logits)
        assert torch.equal(logits, expect)


def test_load_cost_model(tmp_path: Path) -> None:
    f = tmp_path / "cost.json"
    f.write_text(
        json.dumps({"verify": [[1, 4.0], [64, 6.0], [256, 14.0]], "draft": [[1, 0.2], [64, 1.0]], "device": "cpu"})
    )
    cost = adaptive.load_cost_model(f)
    ref = CostModel.from_curves([(1, 0.2), (64, 1.0)], [(1, 4.0), (64, 6.0), (256, 14.0)], 1024, 16384)
    sizes = np.arange(0, 600)
    assert np.array_equal(cost.verify_ms(sizes), ref.verify_ms(sizes))
    assert np.array_equal(cost.draft_ms(sizes), ref.draft_ms(sizes))
    f.write_text(json.dumps({"verify": [[1, 4.0], [8, 5.0]]}))
    assert adaptive.load_cost_model(f).draft_ms(10) == 0.0
    # Whole-step overheads (python -m maskplug_vllm.calibrate): per step on the drafter's curve, per token on verify.
    f.write_text(json.dumps({"verify": [[1, 4.0], [8, 5.0]], "step_overhead_ms": 0.5, "token_overhead_ms": 0.1}))
    whole = adaptive.load_cost_model(f)
    assert whole.draft_ms(10) == pytest.approx(0.5)
    assert whole.verify_ms(8) == pytest.approx(5.8) and whole.verify_ms(1) == pytest.approx(4.1)
    for bad, needle in [
        ("{", "parse error"),
        (json.dumps([1, 2]), "JSON object"),
        (json.dumps({"draft": [[1, 1.0]]}), "'verify'"),
        (json.dumps({"verify": [[1, "x"]]}), "'verify'"),
        (json.dumps({"verify": []}), "'verify'"),
        (json.dumps({"verify": [[1, 2.0], [2, -1.0]]}), "non-negative"),
        (json.dumps({"verify": [[1, 0.0]]}), "positive time"),
        (json.dumps({"verify": [[1, 1.0]], "graph_limit": -2}), "graph_limit"),
        (json.dumps({"verify": [[1, 1.0]], "step_overhead_ms": -1}), "step_overhead_ms: expected a finite number"),
        (json.dumps({"verify": [[1, 1.0]], "token_overhead_ms": None}), "token_overhead_ms: expected a finite"),
    ]:
        f.write_text(bad)
        with pytest.raises(BudgetError, match=needle) as exc:
            adaptive.load_cost_model(f)
        assert "MASKPLUG_VLLM_COST" in str(exc.value)
    with pytest.raises(BudgetError, match="readable"):
        adaptive.load_cost_model(tmp_path / "missing.json")
    # The fallback without a file.
    d = adaptive.default_cost_model()
    assert d.verify_ms(0) == adaptive.DEFAULT_COST["verify_base_ms"]


def test_scheduler_names() -> None:
    s = adaptive.make_scheduler("grammar-aware:goodput")
    assert isinstance(s, GrammarAwareScheduler) and isinstance(s.inner, GoodputScheduler)
    assert isinstance(adaptive.make_scheduler(" goodput "), GoodputScheduler)
    for bad in ["", "nope", "grammar-aware:nope", "goodput:verify-all", "grammar-aware:"]:
        with pytest.raises(PluginError, match=r"MASKPLUG_VLLM_SCHEDULER|registered"):
            adaptive.make_scheduler(bad)


def test_install_refuses_untested_releases_and_a_missing_base(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(patches, "vllm_version", lambda: "0.33.0")
    with pytest.raises(PluginError, match=r"MASKPLUG_VLLM_SCHEDULER.*0\.32\.0.*got 0\.33\.0"):
        adaptive.install_adaptive("goodput")
    monkeypatch.undo()
    assert not patches.installed()
    with pytest.raises(PluginError, match="MASKPLUG_VLLM=1"):
        adaptive.install_adaptive("goodput")
    with pytest.raises(PluginError, match="not installed"):
        adaptive.set_scheduler("goodput")


def test_install_and_switch_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import maskplug_vllm
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    originals = (Scheduler.schedule, GPUModelRunner.execute_model, GPUModelRunner.sample_tokens)
    own_drafts = Scheduler.update_draft_token_ids
    own_rows = Scheduler.get_grammar_bitmask
    monkeypatch.setenv("MASKPLUG_VLLM", "1")
    monkeypatch.setenv("MASKPLUG_VLLM_SCHEDULER", "grammar-aware:goodput")
    try:
        maskplug_vllm.register()
        assert maskplug_vllm.adaptive_installed()
        assert isinstance(maskplug_vllm.current_scheduler(), GrammarAwareScheduler)
        assert Scheduler.schedule is not originals[0] and GPUModelRunner.execute_model is not originals[1]
        planning = (Scheduler.schedule, Scheduler.update_draft_token_ids, Scheduler.get_grammar_bitmask)
        assert planning[1] is not own_drafts and planning[2] is not own_rows
        maskplug_vllm.set_scheduler("verify-all")
        assert maskplug_vllm.step_stats()["scheduler"] == "verify-all"
        # verify-all plans nothing, makes no rows ahead and takes no confidences: vLLM's own methods run its steps.
        assert (Scheduler.schedule, Scheduler.update_draft_token_ids, Scheduler.get_grammar_bitmask) == (
            originals[0],
            own_drafts,
            own_rows,
        )
        assert Scheduler.update_from_output is not patches.original(Scheduler, "update_from_output")  # it counts
        obj = FixedBudget(1)
        maskplug_vllm.set_scheduler(obj)
        assert maskplug_vllm.current_scheduler() is obj
        assert (Scheduler.schedule, Scheduler.update_draft_token_ids, Scheduler.get_grammar_bitmask) == planning
        # Something else wrapped schedule since (a profiler): it stays, whatever the scheduler.
        foreign = lambda self, *a, **k: planning[0](self, *a, **k)  # noqa: E731
        Scheduler.schedule = foreign  # type: ignore[method-assign]  # uninstall puts vLLM's own back
        maskplug_vllm.set_scheduler("verify-all")
        assert Scheduler.schedule is foreign and Scheduler.update_draft_token_ids is own_drafts
        assert Scheduler.get_grammar_bitmask is own_rows
        with pytest.raises(PluginError):
            maskplug_vllm.set_scheduler("nope")
    finally:
        maskplug_vllm.uninstall()
    assert (Scheduler.schedule, GPUModelRunner.execute_model, GPUModelRunner.sample_tokens) == originals
    assert (Scheduler.update_draft_token_ids, Scheduler.get_grammar_bitmask) == (own_drafts, own_rows)
    assert not maskplug_vllm.adaptive_installed() and maskplug_vllm.step_stats()["scheduler"] is None


def test_scheduler_without_the_adapter_warns_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import maskplug_vllm

    monkeypatch.delenv("MASKPLUG_VLLM", raising=False)
    monkeypatch.setenv("MASKPLUG_VLLM_SCHEDULER", "goodput")
    with pytest.warns(RuntimeWarning, match="MASKPLUG_VLLM_SCHEDULER is set but MASKPLUG_VLLM is not"):
        maskplug_vllm.register()
    assert not maskplug_vllm.installed() and not maskplug_vllm.adaptive_installed()


class BeliefBudget(FixedBudget):
    """A preset budget, with per-position beliefs the split must follow."""

    def __init__(self, budget: int, rng: np.random.Generator) -> None:
        super().__init__(budget)
        self.rng = rng

    def beliefs(self, step: StepView) -> np.ndarray:
        k = int(step.layout.num_drafts.max())
        return self.rng.random((step.layout.n, k))


def test_full_and_zero_budget_splits_equal_allocate_step() -> None:
    # At budget 0 and at every draft the split is not computed: it must be what allocate_step gives.
    rng = np.random.default_rng(7)
    seen = 0
    for _ in range(200):
        so, ids, nd, _ = _step(rng)
        total = int(nd.sum())
        if total == 0:
            continue
        gids = [r for r in ids if rng.random() < 0.6]
        g = len(gids)
        go = GrammarOutput(gids, np.full((g + sum(int(x) for x in nd), 16), -1, dtype=np.int32), None)
        gidx = [ids.index(r) for r in gids]
        dm = DraftMasks(
            request=np.arange(g, dtype=np.int64),
            acceptable=np.asarray([int(rng.integers(0, nd[i] + 1)) for i in gidx], dtype=np.int64),
            forced=rng.random((g, 6)) < 0.3,
        )
        setattr(go, adaptive._DRAFT_MASKS_ON_OUTPUT, dm)
        for b in (0, total):
            sched = BeliefBudget(b, np.random.default_rng(seen))
            ctl = adaptive._Controller(sched, "fixed", CostModel.linear())
            step = dataclasses.replace(so)
            plan = ctl.plan(step, go)
            trimmed = adaptive.compacted_output(step)
            view = sched.views[-1]
            conf = torch.from_numpy(BeliefBudget(b, np.random.default_rng(seen)).beliefs(view))
            expect = allocate_step(view, conf, b).numpy()
            assert plan.capacity.dtype == np.int64
            assert plan.capacity.tolist() == expect.tolist()
            assert plan.regime == regime_of(plan.layout, b)
            assert (trimmed is step) == (b == total)
            seen += 1
    assert seen > 100


def test_one_request_split_equals_allocate_step() -> None:
    # One request is split without allocate_step's device ops: the same capacities at every budget.
    rng = np.random.default_rng(11)
    checked = 0
    while checked < 60:
        so, ids, nd, _ = _step(rng)
        i = int(rng.integers(0, len(ids)))
        if nd[i] == 0:
            continue
        r = ids[i]
        one = dataclasses.replace(
            so,
            num_scheduled_tokens={r: so.num_scheduled_tokens[r]},
            total_num_scheduled_tokens=so.num_scheduled_tokens[r],
            scheduled_spec_decode_tokens={r: so.scheduled_spec_decode_tokens[r]},
        )
        grammar = rng.random() < 0.5
        go = _with_grammar(one, [r], [int(rng.integers(0, nd[i] + 1))], 1 + int(nd[i])) if grammar else None
        b = int(rng.integers(1, nd[i] + 1))
        sched = BeliefBudget(b, np.random.default_rng(checked))
        ctl = adaptive._Controller(sched, "fixed", CostModel.linear())
        plan = ctl.plan(one, go)
        view = sched.views[-1]
        conf = torch.from_numpy(BeliefBudget(b, np.random.default_rng(checked)).beliefs(view))
        assert plan.capacity.tolist() == allocate_step(view, conf, plan.budget).numpy().tolist()
        checked += 1


def test_apply_scatter_reuses_rows_of_a_repeated_step_correctly() -> None:
    # The same scheduled step applied again (its row mapping reused) with other kept drafts and logits.
    rng = np.random.default_rng(11)
    vocab = 64
    for _ in range(30):
        so, ids, ndv, _ = _step(rng)
        nd = dict(zip(ids, ndv.tolist(), strict=True))
        gids = [r for r in rng.permutation(ids).tolist() if rng.random() < 0.7]
        batch = rng.permutation(ids).tolist()
        rows = sum(1 + nd[g] for g in gids)
        for _ in range(4):
            cap = {r: int(rng.integers(0, nd[r] + 1)) for r in ids}
            bitmask = rng.integers(-(2**31), 2**31, size=(rows, vocab // 32), dtype=np.int64).astype(np.int32)
            kept = {r: so.scheduled_spec_decode_tokens[r][: cap[r]] for r in ids if cap[r]}
            trimmed = dataclasses.replace(so, scheduled_spec_decode_tokens=kept)
            setattr(trimmed, SCHEDULED_SPEC_ATTR, so.scheduled_spec_decode_tokens)
            n_rows = sum(1 + cap[r] for r in batch)
            logits = torch.from_numpy(rng.standard_normal((n_rows, vocab)).astype(np.float32))
            expect = _oracle(logits, bitmask, batch, gids, nd, cap)
            apply_scatter(trimmed, GrammarOutput(gids, bitmask), SimpleNamespace(req_ids=batch), logits)
            assert torch.equal(logits, expect)
            fresh = step_rows(batch, gids, draft_counts(batch, so.scheduled_spec_decode_tokens), 1)
            mapping, cu = worker._scheduled_rows(batch, gids, so.scheduled_spec_decode_tokens)
            assert np.array_equal(mapping.request, fresh.mapping.request)
            assert np.array_equal(mapping.position, fresh.mapping.position)
            assert np.array_equal(cu, fresh.pad_cu_logits(fresh.layout.cu_scheduled[: fresh.num_batch + 1]))
            assert mapping._trusted_needs() is not None  # applied without re-checking its values


def test_verify_all_shortcut_counts_what_the_general_path_counts() -> None:
    """The built-in ``verify-all`` skips the view and the outcome; a subclass of it takes the general path."""
    from maskplug.schedulers import VerifyAllScheduler

    class Watched(VerifyAllScheduler):
        def __init__(self) -> None:
            super().__init__()
            self.outcomes: list[StepOutcome] = []

        def observe(self, outcome: StepOutcome) -> None:
            self.outcomes.append(outcome)

    watched = Watched()
    fast = adaptive._Controller(VerifyAllScheduler(), "verify-all", CostModel.linear())
    general = adaptive._Controller(watched, "verify-all", CostModel.linear())
    # What the engine runs for the built-in verify-all: no plan; the step counted from vLLM's outputs.
    unplanned = adaptive._Controller(VerifyAllScheduler(), "verify-all", CostModel.linear())
    # ... with the grammar requests read off the step's grammar output (rows produced in schedule).
    from_output = adaptive._Controller(VerifyAllScheduler(), "verify-all", CostModel.linear())
    records: list[dict[str, Any]] = []
    listener = _StepEndListener(records)
    registry = get_registry()
    registry.pm.register(listener)
    assert fast.verifies_all and not general.verifies_all
    rng = np.random.default_rng(5)
    try:
        _verify_all_steps(rng, fast, general, [unplanned, from_output], records)
    finally:
        registry.pm.unregister(listener)
    assert fast.stats == general.stats == unplanned.stats == from_output.stats
    assert fast.stats["drafts_accepted"] > 0 and len(watched.outcomes) == 60
    assert fast.stats["structured_steps"] > 0


class _StepEndListener:
    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records

    @hookimpl
    def maskplug_step_end(self, stats: dict[str, Any]) -> None:
        self.records.append(dict(stats))


def _verify_all_steps(
    rng: np.random.Generator,
    fast: adaptive._Controller,
    general: adaptive._Controller,
    unplanned: list[adaptive._Controller],
    records: list[dict[str, Any]],
) -> None:
    for _ in range(60):
        so, ids, nd, _ = _step(rng)
        gids = ids[: len(ids) // 2]
        # vLLM's get_grammar_bitmask produces rows for the grammar requests that are not prefill chunks.
        requests = {r: SimpleNamespace(use_structured_output=r in gids, is_prefill_chunk=False) for r in ids}
        if rng.random() < 0.2 and gids:
            requests[gids[-1]].is_prefill_chunk = True
            gids = gids[:-1]
        so.has_structured_output_requests = bool(gids)
        go = _with_grammar(
            so, gids, [int(nd[i]) for i in range(len(gids))], sum(1 + int(nd[i]) for i in range(len(gids)))
        )
        plans = [fast.plan(so, go), general.plan(so, go)]
        a, b = plans
        assert (a.budget, a.regime, a.structured, a.num_grammar) == (b.budget, b.regime, b.structured, b.num_grammar)
        assert a.num_requests == b.num_requests == len(ids)
        assert not hasattr(so, adaptive.VERIFY_STEP_ATTR)  # every draft verified: vLLM's output runs as it is
        order = list(rng.permutation(len(ids)))
        sampled: list[list[int]] = [[] for _ in ids]
        for i in range(len(ids)):
            # Some requests emit nothing (a finished or preempted one), the rest 1 + accepted.
            if rng.random() < 0.9:
                sampled[order[i]] = [3] * (int(rng.integers(0, nd[i] + 1)) + 1)
        index = {r: order[i] for i, r in enumerate(ids)}
        if rng.random() < 0.3:
            del index[ids[int(rng.integers(0, len(ids)))]]  # a request the runner no longer holds
        out = SimpleNamespace(sampled_token_ids=sampled, req_id_to_index=index)
        del records[:]
        fast.finish(a, out)
        general.finish(b, out)
        unplanned[0].finish_all(requests, so, out)
        unplanned[1].finish_all(requests, so, out, list(gids))
        # The same step record for listeners, planned or not.
        assert len(records) == 4 and records[0] == records[1] == records[2] == records[3]
        # The fast plan builds its layout only when asked (after its outcome here): the same one.
        assert a.capacity.tolist() == b.capacity.tolist() == nd.tolist()
        assert a.layout.req_ids.tolist() == b.layout.req_ids.tolist()


def test_the_first_trimmed_draft_is_judged_by_the_emitted_token() -> None:
    """A request whose verified drafts were all accepted tells the scheduler about its first trimmed draft too."""
    rng = np.random.default_rng(11)
    probed = 0
    for _ in range(300):
        so, ids, nd, _ = _step(rng)
        total = int(nd.sum())
        sched = FixedBudget(int(rng.integers(0, total + 1)))
        ctl = adaptive._Controller(sched, "fixed", CostModel.linear())
        drafts = {r: list(v) for r, v in so.scheduled_spec_decode_tokens.items()}
        plan = ctl.plan(so)
        cap = dict(zip(ids, plan.capacity.tolist(), strict=True))
        # vLLM trims a request's draft list in place when it schedules it again: the probe was read at plan time
        for v in so.scheduled_spec_decode_tokens.values():
            del v[1:]
        sampled, want = [], {}
        for i, r in enumerate(ids):
            c, d = cap[r], drafts.get(r, [])
            a = int(rng.integers(0, c + 1))
            if a < c:
                bonus = (d[a] + 1) % 500  # the first rejected draft's position: not the draft
            elif a < len(d) and rng.random() < 0.5:
                bonus = d[a]  # the first trimmed draft, which verification would have accepted
            else:
                bonus = int(rng.integers(500, 600))  # never a draft
            sampled.append([*d[:a], bonus])
            if nd[i] > 0:
                probe = a == c < len(d)
                want[r] = (c + probe, a + (probe and bonus == d[a]))
                probed += probe
        ctl.finish(plan, SimpleNamespace(sampled_token_ids=sampled, req_id_to_index={r: i for i, r in enumerate(ids)}))
        (out,) = sched.outcomes
        got = {str(r): (int(v), int(a)) for r, v, a in zip(out.req_ids, out.verified, out.accepted, strict=True)}
        assert got == want
        # the counters count what was verified, not the probe
        assert ctl.stats["drafts_verified"] == plan.budget
        assert ctl.stats["drafts_accepted"] == sum(
            min(len(s) - 1, cap[r]) for r, s in zip(ids, sampled, strict=True) if nd[ids.index(r)] > 0
        )
    assert probed > 100
