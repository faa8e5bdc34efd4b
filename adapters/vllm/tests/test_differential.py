"""maskplug's host arithmetic against vLLM's own functions (0.32 and 0.33), on thousands of random batches.

Where vLLM and maskplug mean the same thing, the results must be identical:
the grammar row mapping (0.32's ragged ``_build_grammar_mapping``; 0.33's
fixed blocks, as its ``StructuredOutputsWorker`` hands them to its kernel), the compaction table
(``AdaptiveVerificationManager.compact_batch``), the per-request allocation
(``_assign_draft_token_budget``), the budget (``get_num_tokens``) and the cost
tables (``build_cost_tables_from_curves``). Every place where maskplug
deliberately differs has its own ``test_difference_*`` below, which pins both
behaviours down.

vLLM's functions are called unmodified; the manager is created without its
``__init__`` (which needs CUDA streams) and given just the attributes the
method under test reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from maskplug_vllm import step_rows
from maskplug_vllm.v0_33 import fixed_step_rows
from vllm.v1.worker.gpu.spec_decode import adaptive_verification as av
from vllm_release import V033, needs_v032, needs_v033, no_pinned_memory, v033_kernel_mapping, v033_worker

import maskplug
from maskplug import BudgetError, CostModel, ScheduledLayout

VLLM_RELEASES = ("0.32.0", "0.33.0")

if not V033:
    from vllm.v1.worker.gpu.structured_outputs import _build_grammar_mapping

N_BATCHES = 2000
MAX_DRAFTS = 7


def _batch(
    rng: np.random.Generator, max_reqs: int = 40, verification_first: bool = False
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Request ids, drafts and non-draft tokens per request for one random step."""
    n = int(rng.integers(0, max_reqs + 1))
    ids = [f"req-{i}" for i in rng.permutation(4 * max(n, 1))[:n]]
    nd = rng.integers(0, MAX_DRAFTS + 1, size=n)
    nd[rng.random(n) < 0.2] = 0
    if verification_first:
        # vLLM's batch order keeps requests with drafts at the front.
        nd = np.sort(nd)[::-1].copy()
    non_draft = np.where(nd > 0, 1, rng.integers(1, 6, size=n))
    return ids, nd.astype(np.int64), non_draft.astype(np.int64)


def _cu(rows: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)


# ---------------------------------------------------------------- mapping --


@needs_v032
def test_mapping_matches_vllm_build_grammar_mapping() -> None:
    rng = np.random.default_rng(1)
    for _ in range(N_BATCHES):
        ids, nd, _ = _batch(rng)
        num_bonus = int(rng.integers(1, 3))
        stride = MAX_DRAFTS + num_bonus
        gids = [ids[i] for i in rng.permutation(len(ids))[: int(rng.integers(0, len(ids) + 1))]]
        cu = _cu(nd + num_bonus)
        theirs = _build_grammar_mapping(ids, gids, cu, nd, num_bonus, stride)
        rows = step_rows(ids, gids, nd, num_bonus)
        ours = rows.mapping.request.astype(np.int64) * stride + rows.mapping.position
        assert ours.tolist() == theirs
        # vLLM's branch without draft counts reads the offsets; uncompacted, it agrees too.
        assert _build_grammar_mapping(ids, gids, cu, None, num_bonus, stride) == theirs


@needs_v032
def test_difference_vllm_mapping_without_draft_counts_follows_compacted_offsets() -> None:
    """vLLM's fallback derives row counts from ``cu_num_logits``; after compaction that no longer
    matches the bitmask (the 6-rows-vs-2-entries crash). maskplug only ever uses the scheduled layout."""
    ids, nd, num_bonus = ["a", "b", "c"], np.array([3, 2, 0]), 1
    active_cu = np.arange(4) * num_bonus  # budget 0: bonus rows only
    bitmask_rows = int((nd + num_bonus).sum())
    theirs = _build_grammar_mapping(ids, ids, active_cu, None, num_bonus, MAX_DRAFTS + 1)
    assert len(theirs) == 3 != bitmask_rows
    assert len(step_rows(ids, ids, nd, num_bonus).mapping) == bitmask_rows


@needs_v033
def test_fixed_mapping_matches_vllm_033_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 maps row ``g * stride + p`` to ``(request of g, p)`` for every ``p < stride``; maskplug's
    fixed mapping is the same for every row a request uses and ``-1`` for the rest, which vLLM's
    kernel never applies either (their position is past the request's scheduled width)."""
    rng = np.random.default_rng(7)
    stride = MAX_DRAFTS + 1
    unused_rows = 0
    for _ in range(N_BATCHES // 4):
        ids, nd, _ = _batch(rng)
        if not ids:
            continue
        gids = [ids[i] for i in rng.permutation(len(ids))[: int(rng.integers(1, len(ids) + 1))]]
        cu = _cu(nd + 1).astype(np.int32)
        batch = SimpleNamespace(
            req_ids=ids,
            num_draft_tokens_per_req=nd.astype(np.int32),
            cu_num_logits=torch.from_numpy(cu),
            cu_num_logits_np=cu,
        )
        worker = v033_worker(stride, 64 * stride, 64)
        bitmask = np.zeros((len(gids) * stride, 2), dtype=np.int32)
        theirs, _ = v033_kernel_mapping(monkeypatch, worker, torch.zeros(int(cu[-1]), 64), batch, gids, bitmask)
        ours = fixed_step_rows(ids, gids, nd, 1, stride).mapping
        used = ours.request >= 0
        flat = ours.request.astype(np.int64) * stride + ours.position
        assert np.array_equal(flat[used], theirs[used])
        req, pos = theirs // stride, theirs % stride
        assert bool(np.all(pos[~used] >= (nd + 1)[req[~used]]))
        assert bool(np.all(ours.position[~used] == -1))
        unused_rows += int((~used).sum())
    assert unused_rows > N_BATCHES


# ------------------------------------------------------------- compaction --


def _manager(**attrs: object) -> av.AdaptiveVerificationManager:
    m = object.__new__(av.AdaptiveVerificationManager)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def test_compaction_matches_vllm_compact_batch() -> None:
    rng = np.random.default_rng(2)
    seen = {"full": 0, "zero": 0, "partial": 0}
    for _ in range(N_BATCHES):
        ids, nd, non_draft = _batch(rng, verification_first=True)
        num_bonus = int(rng.integers(1, 3))
        total = int(nd.sum())
        budget = int(rng.choice([0, total, int(rng.integers(0, total + 1))]))
        m = _manager(num_bonus_tokens=num_bonus, _batch_budget=({}, {}, budget))
        cu = _cu(nd + num_bonus).astype(np.int32)
        their_tokens, their_cu = m.compact_batch(nd.astype(np.int32), (non_draft + nd).astype(np.int32), cu)
        c = maskplug.compact(ScheduledLayout(ids, nd, non_draft, num_bonus), budget)
        seen[c.regime] += 1
        assert int(their_tokens.sum()) == c.num_tokens
        assert np.array_equal(np.asarray(their_cu, dtype=np.int64), c.cu_logits)
        if c.regime == "partial":
            # Both hand back the scheduled upper bound; neither split is the device's.
            assert not c.exact
        else:
            assert c.exact
            assert np.array_equal(np.asarray(their_tokens, dtype=np.int64), c.num_tokens_per_req)
    assert min(seen.values()) > N_BATCHES // 10, seen


def test_difference_partial_placeholder_split() -> None:
    """In the partial regime only the total is known on the host. vLLM spreads the budget evenly over
    the requests with drafts (a request may get more than it drafted); maskplug fills requests front
    to back and never exceeds a request's drafts. Both keep the total, which is all either promises."""
    nd, non_draft, budget = np.array([1, 7]), np.array([1, 1]), 6
    m = _manager(num_bonus_tokens=1, _batch_budget=({}, {}, budget))
    theirs, _ = m.compact_batch(nd.astype(np.int32), (nd + non_draft).astype(np.int32), _cu(nd + 1))
    ours = maskplug.compact(ScheduledLayout(["a", "b"], nd, non_draft), budget)
    assert theirs.tolist() == [4, 4]
    assert ours.num_tokens_per_req.tolist() == [2, 6]
    assert int(theirs.sum()) == ours.num_tokens == 8


def test_device_offsets_match_vllm_reallocate_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's device ``cu_num_logits`` after reallocation equals ``active_cu_logits(allocate(...))``
    whenever the allocation has no tie at its boundary (ties: see the difference test below)."""
    # The compiled variant only adds torch.compile around the same function.
    monkeypatch.setattr(av, "_assign_draft_token_budget_compiled", av._assign_draft_token_budget)
    no_pinned_memory(monkeypatch)
    rng = np.random.default_rng(3)
    checked = 0
    for _ in range(300):
        ids, nd, non_draft = _batch(rng, max_reqs=16)
        n = len(ids)
        if n == 0:
            continue
        conf = _dyadic(rng, n)
        budget = int(rng.integers(0, int(nd.sum()) + 1))
        req_states = SimpleNamespace(num_speculative_steps=MAX_DRAFTS, max_num_reqs=n, device=torch.device("cpu"))
        m = _manager(
            req_states=req_states,
            num_speculative_steps=MAX_DRAFTS,
            num_bonus_tokens=1,
            _batch_budget=(
                dict(zip(ids, nd.tolist(), strict=True)),
                dict(zip(ids, non_draft.tolist(), strict=True)),
                budget,
            ),
            _batch_draft_capacity=torch.zeros(n, dtype=torch.int32),
            _confidence_probs=torch.from_numpy(conf),
            _num_non_draft_tokens=torch.zeros(n, dtype=torch.int32),
            _cu_num_logits=torch.zeros(n + 1, dtype=torch.int32),
            _copy_admitted_drafts_to_host=False,  # vLLM 0.33: no host copy without batch-sharded sampling
        )
        qsl = torch.zeros(n + 1, dtype=torch.int32)
        m.query_start_loc = qsl
        out = m.reallocate_drafts(ids, torch.arange(n))
        their_cu, _, their_budget = out[:3]
        # vLLM 0.33 returns a fourth item, the admitted counts in flight to the host: none here.
        assert len(out) == (4 if V033 else 3) and (not V033 or out[3] is None)
        cap = maskplug.allocate(torch.from_numpy(conf), nd, budget)
        assert their_budget == budget
        if _boundary_tied(conf, nd, budget):
            continue
        checked += 1
        assert torch.equal(their_cu, maskplug.active_cu_logits(cap, 1))
        assert torch.equal(qsl, torch.from_numpy(_cu(cap.numpy() + non_draft).astype(np.int32)))
    assert checked > 100


# -------------------------------------------------------------- allocation --


def _dyadic(rng: np.random.Generator, n: int) -> np.ndarray:
    """Confidences in multiples of 1/8: every running product is exact in float32 and float64,
    so vLLM (float32 on the device) and maskplug (float64) rank the same numbers."""
    return (rng.integers(1, 9, size=(n, MAX_DRAFTS)) / 8).astype(np.float32)


def _survivals(conf: np.ndarray, nd: np.ndarray) -> np.ndarray:
    s = np.cumprod(conf.astype(np.float64), axis=1)
    return s[np.arange(conf.shape[1])[None, :] < nd[:, None]]


def _boundary_tied(conf: np.ndarray, nd: np.ndarray, budget: int) -> bool:
    s = np.sort(_survivals(conf, nd))[::-1]
    return 0 < budget < s.shape[0] and s[budget - 1] == s[budget]


def _admitted(conf: np.ndarray, cap: np.ndarray) -> np.ndarray:
    s = np.cumprod(conf.astype(np.float64), axis=1)
    return np.sort(s[np.arange(conf.shape[1])[None, :] < np.asarray(cap)[:, None]])


def test_allocation_matches_vllm_assign_draft_token_budget() -> None:
    rng = np.random.default_rng(4)
    exact = 0
    for _ in range(N_BATCHES):
        _, nd, _ = _batch(rng, max_reqs=24)
        n, total = nd.shape[0], int(nd.sum())
        if total < 2:
            continue
        conf = _dyadic(rng, n)
        budget = int(rng.integers(1, total))  # vLLM only calls it for 0 < budget < total
        theirs = torch.from_numpy(nd.astype(np.int32))
        av._assign_draft_token_budget(torch.from_numpy(conf), torch.arange(n), theirs, budget, MAX_DRAFTS)
        ours = maskplug.allocate(torch.from_numpy(conf), nd, budget)
        assert int(theirs.sum()) == int(ours.sum()) == budget
        assert np.all(ours.numpy() <= nd)
        # The same survivals are admitted, tie or not ...
        assert np.array_equal(_admitted(conf, theirs.numpy()), _admitted(conf, ours.numpy()))
        # ... and without a tie at the boundary, the very same slots.
        if not _boundary_tied(conf, nd, budget):
            exact += 1
            assert torch.equal(theirs, ours)
    assert exact > N_BATCHES // 4


def test_difference_allocation_ties_broken_by_position_then_request() -> None:
    """Equal survivals: vLLM takes whatever ``topk`` returns (unspecified order); maskplug admits by
    position first, then request, so every rank computes the same capacities."""
    conf = torch.ones(3, 4)
    nd = np.array([4, 4, 4])
    ours = maskplug.allocate(conf, nd, 5)
    assert ours.tolist() == [2, 2, 1]
    theirs = torch.from_numpy(nd.astype(np.int32))
    av._assign_draft_token_budget(conf, torch.arange(3), theirs, 5, 4)
    assert int(theirs.sum()) == 5 and bool((theirs <= 4).all())


def test_difference_allocation_ranks_in_float64() -> None:
    """vLLM multiplies confidences in their own dtype (float32); maskplug in float64, so two
    survivals that collide in float32 are still told apart."""
    a, b = np.float32(0.7), np.float32(0.9)
    c = np.float32(a * b)  # request 1's single draft: exactly request 0's float32 survival
    assert float(a) * float(b) != float(c)
    conf = torch.tensor([[a, b], [c, 0.0]], dtype=torch.float32)
    nd = np.array([2, 1])
    s32 = torch.cumprod(conf, dim=1)
    assert s32[0, 1] == s32[1, 0]  # a tie for vLLM
    ours = maskplug.allocate(conf, nd, 2)  # request 0's draft 0 (0.7) plus the larger of the other two
    want = [2, 0] if float(a) * float(b) > float(c) else [1, 1]
    assert ours.tolist() == want


# ------------------------------------------------------------------ budget --


def _curves(rng: np.random.Generator, max_reqs: int, max_tokens: int) -> tuple[list, list]:
    dx = np.unique(np.concatenate([[1], rng.integers(1, max_reqs + 1, size=int(rng.integers(1, 6)))]))
    vx = np.unique(np.concatenate([[1], rng.integers(1, max_tokens + 1, size=int(rng.integers(1, 8)))]))
    dy = np.sort(rng.uniform(0.2, 3.0, size=dx.shape[0]))
    vy = np.asarray(rng.uniform(1.0, 20.0, size=vx.shape[0]))  # not monotone: both make it so
    return list(zip(dx.tolist(), dy.tolist(), strict=True)), list(zip(vx.tolist(), vy.tolist(), strict=True))


def test_budget_matches_vllm_get_num_tokens() -> None:
    rng = np.random.default_rng(5)
    max_reqs, max_tokens = 48, 512
    budgets = set()
    for _ in range(N_BATCHES):
        ids, nd, non_draft = _batch(rng, max_reqs=40)
        n = len(ids)
        dc, vc = _curves(rng, max_reqs, max_tokens)
        # With the capture limit at the table end both build the same tables (see the cost tests).
        tables = av.build_cost_tables_from_curves(dc, vc, max_reqs, max_tokens, max_tokens)
        cost = CostModel.from_curves(dc, vc, max_reqs, max_tokens, graph_limit=max_tokens)
        slots = rng.permutation(max_reqs)[:n]
        stale = rng.uniform(0.0, 1.0, size=(max_reqs, MAX_DRAFTS)).astype(np.float32)
        stale[rng.random(stale.shape) < 0.1] = 1.0
        prefill_len = rng.integers(1, 50, size=max_reqs)
        computed = np.zeros(max_reqs, dtype=np.int64)
        # Most requests decode (sampling); some are mid-prefill (not sampling).
        mid = rng.random(n) < 0.25
        computed[slots] = np.where(mid, prefill_len[slots] - non_draft - 1, prefill_len[slots])
        n_sampling = int(np.count_nonzero(computed[slots] + non_draft >= prefill_len[slots]))
        max_logits = n + int(rng.integers(0, int(nd.sum()) + 2))
        req_states = SimpleNamespace(
            req_id_to_index=dict(zip(ids, slots.tolist(), strict=True)),
            num_computed_tokens_np=computed,
            prefill_len=SimpleNamespace(np=prefill_len),
            num_speculative_steps=MAX_DRAFTS,
        )
        m = _manager(
            req_states=req_states,
            num_speculative_steps=MAX_DRAFTS,
            cost_tables=tables,
            _stale_confidences=[SimpleNamespace(np=stale)],
            _stale_idx=0,
            _max_total_logits=max_logits,
            num_bonus_tokens=1,
        )
        tokens = m.get_num_tokens(
            dict(zip(ids, (non_draft + nd).tolist(), strict=True)),
            {r: list(range(k)) for r, k in zip(ids, nd.tolist(), strict=True) if k},
        )
        their_budget = m._batch_budget[2]
        layout = ScheduledLayout(ids, nd, non_draft)
        ours = maskplug.choose_budget(stale[slots], layout, cost, num_sampling=n_sampling, max_logits=max_logits)
        assert ours.budget == their_budget
        assert tokens == int(non_draft.sum()) + ours.budget
        budgets.add(ours.budget)
    assert len(budgets) > 10


def test_difference_budget_refuses_logit_room_below_bonus_rows() -> None:
    """With fewer logits rows than requests × bonus, vLLM silently clamps the budget to 0; maskplug
    refuses the call, because no budget can fit and the caller's limit is wrong."""
    ids, nd, non_draft = ["a", "b", "c"], np.array([2, 2, 2]), np.array([1, 1, 1])
    tables = av.build_cost_tables_from_curves([(1, 1.0)], [(1, 5.0), (16, 6.0)], 4, 16, 16)
    m = _manager(
        req_states=SimpleNamespace(
            req_id_to_index={"a": 0, "b": 1, "c": 2},
            num_computed_tokens_np=np.full(3, 10),
            prefill_len=SimpleNamespace(np=np.full(3, 5)),
            num_speculative_steps=2,
        ),
        num_speculative_steps=2,
        cost_tables=tables,
        _stale_confidences=[SimpleNamespace(np=np.ones((3, 2), dtype=np.float32))],
        _stale_idx=0,
        _max_total_logits=2,
        num_bonus_tokens=1,
    )
    m.get_num_tokens(dict(zip(ids, [3, 3, 3], strict=True)), {r: [0, 0] for r in ids})
    assert m._batch_budget[2] == 0
    cost = CostModel.from_curves([(1, 1.0)], [(1, 5.0), (16, 6.0)], 4, 16, graph_limit=16)
    with pytest.raises(BudgetError, match="max_logits"):
        maskplug.choose_budget(np.ones((3, 2)), ScheduledLayout(ids, nd, non_draft), cost, max_logits=2)


# -------------------------------------------------------------- cost model --


def test_cost_tables_match_vllm_where_the_semantics_agree() -> None:
    rng = np.random.default_rng(6)
    max_reqs, max_tokens = 64, 400
    compared = 0
    for _ in range(N_BATCHES):
        dc, vc = _curves(rng, max_reqs, max_tokens)
        limit = int(rng.choice([0, int(rng.integers(1, max_tokens)), max_tokens]))
        d_theirs, v_theirs = av.build_cost_tables_from_curves(dc, vc, max_reqs, max_tokens, limit)
        cost = CostModel.from_curves(dc, vc, max_reqs, max_tokens, graph_limit=limit)
        for curve, size, theirs, ours in (
            (dc, max_reqs, d_theirs, cost.draft_ms(np.arange(max_reqs + 1))),
            (vc, max_tokens, v_theirs, cost.verify_ms(np.arange(max_tokens + 1))),
        ):
            xs = np.array([x for x, _ in curve])
            s = np.arange(size + 1)
            if limit == 0:
                # Agreement: at the samples, at or below the first, at or past the last.
                agree = np.isin(s, xs) | (s <= xs[0]) | (s >= xs[-1])
            else:
                above = xs[xs > limit]
                agree = (s <= limit) | (s >= (above[0] if above.size else limit + 1))
            compared += int(agree.sum())
            assert np.array_equal(theirs[agree], ours[agree])
            if limit >= xs[-1]:
                assert np.array_equal(theirs, ours)
    assert compared > N_BATCHES * 100


def test_difference_cost_without_graph_limit_interpolates() -> None:
    """Without a capture limit (eager execution) vLLM still snaps every size up to the next profiled
    sample; maskplug interpolates between samples, since nothing pads then."""
    _, v_theirs = av.build_cost_tables_from_curves([(1, 1.0)], [(0, 1.0), (10, 2.0)], 4, 20, 0)
    cost = CostModel.from_curves([(1, 1.0)], [(0, 1.0), (10, 2.0)], 4, 20, graph_limit=0)
    assert v_theirs[5] == 2.0
    assert cost.verify_ms(5) == pytest.approx(1.5)
    assert v_theirs[10] == cost.verify_ms(10) == 2.0


def test_difference_cost_just_past_the_graph_limit() -> None:
    """Between the capture limit and the first sample above it, vLLM uses that sample's cost (it does
    not blend across the limit); maskplug interpolates from the last sample at or below it."""
    curve = [(8, 1.0), (16, 1.2), (64, 3.0)]
    _, v_theirs = av.build_cost_tables_from_curves([(1, 1.0)], curve, 4, 100, 16)
    cost = CostModel.from_curves([(1, 1.0)], curve, 4, 100, graph_limit=16)
    assert v_theirs[40] == 3.0
    assert cost.verify_ms(40) == pytest.approx(1.2 + (3.0 - 1.2) * (40 - 16) / 48)
    assert v_theirs[64] == cost.verify_ms(64) == 3.0


def test_difference_zero_cost_curves() -> None:
    """vLLM floors verify costs at 1e-6 ms so the ratio is always defined; maskplug keeps the profiled
    zero and refuses to choose a budget from a cost model that says a step is free."""
    _, v_theirs = av.build_cost_tables_from_curves([(1, 0.0)], [(0, 0.0), (8, 0.0)], 4, 8, 0)
    assert np.all(v_theirs == 1e-6)
    cost = CostModel.from_curves([(1, 0.0)], [(0, 0.0), (8, 0.0)], 4, 8)
    assert cost.verify_ms(3) == 0.0
    with pytest.raises(BudgetError, match="positive step costs"):
        maskplug.choose_budget(np.ones((1, 2)), ScheduledLayout(["a"], [2], [1]), cost)
