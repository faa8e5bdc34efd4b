"""The DSpark patches: version check, install/uninstall, and a decode step through them.

SGLang's ``DSparkVerifyPlanner`` here is the real class, in the state its
constructor leaves it in ragged ``compact`` mode with a profiled cost table
(built without its constructor, which needs a draft model and a server
context). The decode step calls, in the order of SGLang 0.5.23's
``DSparkWorkerV2._forward_decode``: the proposer, the planner's
``resolve_verify_token_budget`` and ``schedule_layout`` (patched, SGLang's
top-k and layout inside), ``GrammarTree.from_linear_chain``, the worker
module's ``build_grammar_vocab_mask`` (patched), ``GrammarMask.apply`` and
``accept_greedy``. Only the worker and proposer bodies (which need a model)
are stand-ins; the patches wrap them exactly as they wrap SGLang's.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

import numpy as np
import pytest
import torch
from conftest import control_columns
from dspark_chain import Req, check_kept_rows, make_batch, make_chain, make_logits, run_verify, same_outcome
from hypothesis import given
from hypothesis import strategies as st
from maskplug_sglang import dspark, patches
from maskplug_sglang.backend import allocate_mask
from sglang.kernels.ops.speculative.dspark.dspark_accept import AcceptGreedy
from sglang.kernels.ops.speculative.dspark.dspark_schedule import ScheduleVerifyLensTopk
from sglang.srt.environ import envs
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.speculative.dspark_components.dspark_planner import (
    DSparkScheduleConfig,
    DSparkVerifyPlanner,
    HostConfidenceBudgetPlanner,
)
from sglang.srt.speculative.dspark_components.dspark_sps import SpsCostTable
from sglang.srt.speculative.ragged_verify import RaggedVerifyMode
from sglang.srt.speculative.spec_tp_sync import SpecTpSync
from sglang.srt.speculative.spec_utils import GrammarTree

import maskplug
from maskplug import PluginError

WORKER = importlib.import_module(patches.WORKER)
LAG = max(int(envs.SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS.get()), 1)
PROBES = [1, 2, 4, 8, 16, 32, 64]
SPS = SpsCostTable(PROBES, [100.0 / (1.0 + 0.08 * p) for p in PROBES], 64)


@pytest.fixture(scope="module")
def installed() -> Any:
    patches.install()
    yield
    patches.uninstall()


def test_version_check_names_the_tested_release() -> None:
    assert dspark.check_sglang_version() == "0.5.23"
    with pytest.raises(PluginError, match=r"tested with SGLang 0\.5\.23, got 0\.5\.22"):
        dspark.check_sglang_version("0.5.22")


def test_install_refuses_an_untested_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dspark, "sglang_version", lambda: "0.6.0")
    before = DSparkVerifyPlanner.schedule_layout
    with pytest.raises(PluginError, match=r"0\.5\.23.*got 0\.6\.0"):
        patches.install()
    assert not patches.installed() and DSparkVerifyPlanner.schedule_layout is before


def test_install_and_uninstall_replace_exactly_the_listed_attributes() -> None:
    draft = importlib.import_module(patches.DRAFT)
    owners = [
        (WORKER.DSparkWorkerV2, "_forward_decode"),
        (draft.DraftBlockProposer, "propose"),
        (DSparkVerifyPlanner, "resolve_verify_token_budget"),
        (DSparkVerifyPlanner, "schedule_layout"),
        (WORKER, "build_grammar_vocab_mask"),
    ]
    before = [getattr(o, a) for o, a in owners]
    patches.install()
    try:
        patches.install()  # idempotent
        after = [getattr(o, a) for o, a in owners]
        assert all(x is not y for x, y in zip(before, after, strict=True))
        assert all(getattr(x, "__wrapped__", None) is y for x, y in zip(after, before, strict=True))
    finally:
        patches.uninstall()
    assert [getattr(o, a) for o, a in owners] == before and not patches.installed()


def test_plugin_installs_the_patches_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from maskplug_sglang.plugin import register

    monkeypatch.delenv(patches.ENABLE_ENV, raising=False)
    register()
    assert not patches.installed()
    monkeypatch.setenv(patches.ENABLE_ENV, "1")
    try:
        register()
        assert patches.installed()
    finally:
        patches.uninstall()


def verify_planner(gamma: int) -> DSparkVerifyPlanner:
    """SGLang's planner in the state its constructor sets for ragged ``compact`` mode on one rank."""
    vp = object.__new__(DSparkVerifyPlanner)
    cfg = DSparkScheduleConfig(gamma=gamma)
    runner = types.SimpleNamespace(decode_cuda_graph_runner=None)
    vp.draft_model = None
    vp.gamma = gamma
    vp.model_runner = runner
    vp.device = "cpu"
    vp.verify_num_draft_tokens = gamma + 1
    vp._tp_sync = SpecTpSync(types.SimpleNamespace(world_size=1, rank_in_group=0))
    vp._align_verify_tokens_to_graph_tier = False
    vp._confidence_head = object()
    vp._ragged_verify_mode = RaggedVerifyMode.COMPACT
    vp._schedule_cfg = cfg
    vp._budget_planner = HostConfidenceBudgetPlanner(sps_table=SPS, cfg=cfg, model_runner=runner, relay_lag_steps=LAG)
    vp._dynamic_graph_tier = False
    vp._dp_tier_gather_enabled = False
    vp._is_verify_all = False
    vp._uniform_layout_cache = {}
    return vp


class Worker:
    """The DSpark worker's parts one decode step touches (its model-running parts are stand-ins)."""

    def __init__(self, vp: DSparkVerifyPlanner, proposal: Any, logits: torch.Tensor) -> None:
        self._verify_planner = vp
        self.proposal = proposal
        self.logits = logits
        self.seen: dict[str, Any] = {}

    def propose(self, **kwargs: Any) -> Any:
        return self.proposal

    def forward_decode(
        self, batch: Any, on_publish: Any, grammar_barrier: Any = None, coordination_plan: Any = None
    ) -> Any:
        """SGLang 0.5.23's ``_forward_decode`` calls that concern the budget and the mask, in its order."""
        proposal = patched_propose(self, batch=batch)
        confidence = proposal.confidence
        budget = self._verify_planner.resolve_verify_token_budget(
            draft_input=batch.spec_info,
            confidence=confidence,
            prefix_lens=batch.seq_lens,
            req_pool_indices=batch.req_pool_indices,
        )
        layout = self._verify_planner.schedule_layout(
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.seq_lens,
            device="cpu",
            confidence=confidence,
            budget=budget,
            global_num_reqs=None,
            dp_tier_num_tokens=None,
        )
        ids = torch.cat([proposal.draft_block_ids[:, :1], proposal.draft_block.draft_tokens], dim=1)
        tree = GrammarTree.from_linear_chain(ids)
        gm = WORKER.build_grammar_vocab_mask(
            reqs=batch.reqs, tree=tree, sampling_info=batch.sampling_info, device="cpu", barrier=grammar_barrier
        )
        logits = self.logits.clone()
        if gm is not None:
            gm.apply(logits)
        correct_len, bonus, _ = AcceptGreedy.execute(
            candidates=ids,
            target_logits=logits,
            verify_num_draft_tokens=ids.shape[1],
            cutoff_verify_lens=layout.verify_lens,
        )
        self.seen = {"budget": budget, "layout": layout, "mask": None if gm is None else gm.vocab_mask}
        self.seen.update(correct_len=correct_len, bonus=bonus)
        return GenerationBatchResult(next_token_ids=None, accept_lens=(correct_len + 1).to(torch.int32))


patched_propose = patches.make_propose(Worker.propose)
patched_forward_decode = patches.make_forward_decode(Worker.forward_decode)


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize("scheduler", ["grammar-aware:dspark", "goodput", "grammar-aware:goodput", "verify-all"])
@given(seed=st.integers(0, 2**32 - 1))
def test_decode_step_through_the_patches(bpe_backends: tuple[Any, Any], scheduler: str, seed: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASKPLUG_SCHEDULER", scheduler)
        decode_step(bpe_backends, scheduler, seed)


def decode_step(bpe_backends: tuple[Any, Any], scheduler: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = bpe_backends[1].vocab
    size = vocab.vocab_size
    keep = ~control_columns(vocab)
    avoid = set(vocab.special_ids) - set(vocab.eos_ids)
    bs, gamma = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    width = gamma + 1
    theirs_g, ours_g = make_batch(rng, bpe_backends, bs)
    reqs = [Req(f"q{i}", g) for i, g in enumerate(ours_g)]
    ids = make_chain(rng, theirs_g, size, width, avoid)
    logits = make_logits(rng, ids, size, sorted(avoid))
    confidence = torch.from_numpy(rng.uniform(0.05, 1.0, (bs, gamma)).astype(np.float32))
    proposal = types.SimpleNamespace(
        draft_block_ids=ids[:, :1].clone(),
        draft_block=types.SimpleNamespace(draft_tokens=ids[:, 1:].clone()),
        confidence=confidence,
        verify_ids=None,
    )
    barrier_calls: list[int] = []
    batch = types.SimpleNamespace(
        reqs=reqs,
        forward_mode=types.SimpleNamespace(is_idle=lambda: False),
        sampling_info=types.SimpleNamespace(vocab_size=size, grammar_mask=None),
        spec_info=types.SimpleNamespace(verify_token_budget=None),
        seq_lens=torch.full((bs,), 10, dtype=torch.int64),
        req_pool_indices=torch.arange(bs, dtype=torch.int64),
    )
    vp = verify_planner(gamma)
    worker = Worker(vp, proposal, logits)
    patched_forward_decode(worker, batch, None, grammar_barrier=lambda: barrier_calls.append(1))
    assert patches.current_step() is None
    seen = worker.seen
    lens = seen["layout"].verify_lens.to(torch.int64)

    # The budget is the maskplug scheduler's, placed by SGLang's top-k on grammar-corrected confidences.
    mine = vp._maskplug_planner
    full = allocate_mask(size, bs * width)
    dm = dspark.fill_verify_rows(ours_g, ids, full)
    assert batch.spec_info.verify_token_budget == seen["budget"]
    # Only a scheduler that reads the grammar pays for the walk over the whole chain.
    corrected = dspark.grammar_corrected_confidence(confidence, dm if mine.reads_grammar else None)
    topk = ScheduleVerifyLensTopk.execute(confidence=corrected, budget=seen["budget"], cfg=vp._schedule_cfg)
    assert torch.equal(topk.to(torch.int64), lens)
    host = confidence.to(torch.float64).numpy()
    layout = maskplug.ScheduledLayout([r.rid for r in reqs], [gamma] * bs, [1] * bs, num_bonus=1)
    if scheduler == "grammar-aware:dspark":
        # The scheduler saw the grammar's view of the whole chain.
        live = any(g is not None and not g.is_terminated() for g in ours_g)
        want = maskplug.choose_budget(host, layout, mine.cost, grammar=dm if live else None)
        assert seen["budget"] == want.budget
        assert len(barrier_calls) >= (1 if live else 0)
    if scheduler == "verify-all":
        assert seen["budget"] == bs * gamma
    if mine.reads_grammar:
        for i, a in zip(np.asarray(dm.request).tolist(), np.asarray(dm.acceptable).tolist(), strict=True):
            assert int(lens[i]) - 1 <= a

    # The mask: the kept rows are SGLang's own, the rest were never computed; outcomes unchanged.
    theirs = run_verify(
        [Req(f"q{i}", g) for i, g in enumerate(theirs_g)], ids, logits, lens.to(torch.int32), size, maskplug_rows=False
    )
    ours = run_verify(reqs, ids, logits, lens.to(torch.int32), size, maskplug_rows=False)
    if seen["mask"] is None:
        assert ours["mask"] is None
    else:
        check_kept_rows(ours["mask"], seen["mask"], lens, width)
        kept_theirs = theirs["mask"].clone()
        from maskplug_sglang.dspark import blank_rows_past

        blank_rows_past(kept_theirs, lens, width)
        assert torch.equal(kept_theirs & keep, seen["mask"] & keep)
    same_outcome(ours, theirs)
    assert torch.equal(seen["correct_len"], ours["correct_len"]) and torch.equal(seen["bonus"], ours["bonus"])

    # The outcome is queued, and handed to the scheduler when the next step is planned.
    assert mine._maskplug_pending is not None
    sched = None
    if scheduler.endswith("goodput"):
        sched = mine.scheduler.inner if scheduler.startswith("grammar-aware") else mine.scheduler
        before = sched.estimates([r.rid for r in reqs], gamma).copy()
    patches.flush_observations(mine)
    assert mine._maskplug_pending is None
    if sched is not None:
        # A step that verified a draft moves the requests' estimates. (Not "away from the population":
        # the population warms up from the same prior by the same running mean, so one step can leave
        # a request equal to it.)
        est = sched.estimates([r.rid for r in reqs], gamma)
        assert not np.allclose(est, before) or int(lens.sum()) == bs


def test_outside_a_step_the_mask_is_sglangs(installed: None, bpe_backends: tuple[Any, Any]) -> None:
    rng = np.random.default_rng(7)
    theirs_g, ours_g = make_batch(rng, bpe_backends, 3)
    size = bpe_backends[1].vocab.vocab_size
    ids = make_chain(rng, theirs_g, size, 4, set())
    reqs = [Req(f"q{i}", g) for i, g in enumerate(ours_g)]
    info = types.SimpleNamespace(vocab_size=size, grammar_mask=None)
    got = WORKER.build_grammar_vocab_mask(
        reqs=reqs, tree=GrammarTree.from_linear_chain(ids), sampling_info=info, device="cpu", barrier=None
    )
    want = run_verify(
        reqs, ids, make_logits(rng, ids, size, []), torch.full((3,), 4, dtype=torch.int32), size, maskplug_rows=False
    )
    if got is None:
        assert want["mask"] is None
    else:
        assert torch.equal(got.vocab_mask, want["mask"])
