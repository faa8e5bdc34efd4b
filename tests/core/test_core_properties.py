"""Property tests: every fast path of the core against ``maskplug.reference``.

Hypothesis draws the structure of each case (batch size, draft counts, budget
regime, producer mode, dtype, widths, tail policy, argument forms); the bulk
arrays (draft counts, mask words, logits bit patterns) come from a numpy
generator seeded by hypothesis, so a failing case replays exactly.

Logits are compared through an integer view so that NaN payloads, signed zeros
and infinities count bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import maskplug as mp
from maskplug import reference
from maskplug.kernels.torch_backend import TorchBackend

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
NP_BITS: dict[torch.dtype, type[np.signedinteger[Any]]] = {
    torch.float32: np.int32,
    torch.float16: np.int16,
    torch.bfloat16: np.int16,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern of a float tensor, for exact comparison."""
    return t.view(INT_VIEW[t.dtype])


# --------------------------------------------------------------------------- layouts


@dataclass
class Batch:
    layout: mp.ScheduledLayout
    rows: mp.GrammarRows
    rng: np.random.Generator


def _ids(rng: np.random.Generator, n: int, kind: str) -> list[Any]:
    """Unique request ids in a random (not sorted) batch order."""
    raw = rng.choice(10 * n + 10, size=n, replace=False)
    if kind == "str":
        return [f"req-{int(v)}" for v in raw]
    return [int(v) for v in raw]


@st.composite
def batches(draw: st.DrawFn, max_n: int = 256, max_drafts: int = 16) -> Batch:
    """A scheduled batch with decodes, drafted requests, prefill chunks and a grammar subset."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(0, max_n))
    kmax = draw(st.integers(0, max_drafts))
    num_drafts = rng.integers(0, kmax + 1, size=n)
    # Some requests carry no drafts this step: plain decodes and prefill chunks.
    no_draft = rng.random(n) < draw(st.sampled_from([0.0, 0.2, 0.6]))
    num_drafts[no_draft] = 0
    prefill = no_draft & (rng.random(n) < 0.5)
    num_non_draft = np.where(prefill, rng.integers(2, 65, size=n), 1)
    num_bonus = draw(st.sampled_from([1, 1, 1, 0, 2]))
    ids = _ids(rng, n, draw(st.sampled_from(["int", "str"])))
    as_numpy = draw(st.booleans())
    layout = mp.ScheduledLayout(
        np.array(ids) if as_numpy else ids,
        num_drafts if as_numpy else num_drafts.tolist(),
        num_non_draft if as_numpy else num_non_draft.tolist(),
        num_bonus=num_bonus,
    )
    # A random subset of requests has a grammar, visited in a shuffled order.
    frac = draw(st.sampled_from([0.0, 0.3, 1.0, None]))  # None: a random fraction
    p = rng.random() if frac is None else frac
    chosen = [ids[i] for i in rng.permutation(n) if rng.random() < p]
    if draw(st.booleans()):
        need = max((int(num_drafts[layout.index_of(r)]) + num_bonus for r in chosen), default=1)
        rows = mp.GrammarRows(chosen, mode="fixed", stride=max(need, 1) + draw(st.integers(0, 3)))
    else:
        rows = mp.GrammarRows(chosen)
    return Batch(layout, rows, rng)


def _random_capacity(rng: np.random.Generator, num_drafts: np.ndarray, budget: int) -> np.ndarray:
    """A per-request prefix split of ``budget`` (any split, not only the top-b one)."""
    slots = np.repeat(np.arange(num_drafts.shape[0]), num_drafts)
    picked = rng.choice(slots.shape[0], size=budget, replace=False)
    return np.bincount(slots[picked], minlength=num_drafts.shape[0]).astype(np.int64)


def _budget(draw: Callable[[st.SearchStrategy[Any]], Any], layout: mp.ScheduledLayout) -> int:
    total = layout.total_drafts
    regime = draw(st.sampled_from(["zero", "partial", "full", "any"]))
    if regime == "zero" or total == 0:
        return 0
    if regime == "full":
        return total
    if regime == "partial" and total > 1:
        return draw(st.integers(1, total - 1))
    return draw(st.integers(0, total))


# --------------------------------------------------------------------------- apply


@st.composite
def apply_cases(draw: st.DrawFn) -> dict[str, Any]:
    batch = draw(batches())
    layout, rows, rng = batch.layout, batch.rows, batch.rng
    budget = _budget(draw, layout)
    offsets = draw(st.sampled_from(["compact", "capacity-numpy", "device"]))
    if offsets == "compact" and budget in (0, layout.total_drafts):
        comp = mp.compact(layout, budget)
        assert comp.exact
        cu: Any = comp.cu_logits
    else:
        cap = _random_capacity(rng, layout.num_drafts, budget)
        if offsets == "device":
            cu = mp.active_cu_logits(torch.from_numpy(cap).to(torch.int32), layout.num_bonus)
        else:
            cu = mp.compact(layout, budget, capacity=cap).cu_logits
    num_logits = int(cu[-1]) + draw(st.sampled_from([0, 0, 3]))  # padded rows are never touched

    width = draw(st.integers(1, 300))
    if draw(st.booleans()):
        grammar_vocab = draw(st.integers(1, width))
        vocab_size: int | None = grammar_vocab
        words = (grammar_vocab + 31) // 32 + draw(st.integers(0, 2))
    else:
        vocab_size = None
        words = (width + 31) // 32 + draw(st.integers(0, 2))
    mapping = rows.mapping(layout)
    nrows = len(mapping)
    bm = rng.integers(-(2**31), 2**31, size=(nrows, words), dtype=np.int64).astype(np.int32)
    kind = rng.integers(0, 4, size=nrows)
    bm[kind == 1] = -1  # all allowed
    bm[kind == 2] = 0  # nothing allowed
    sparse = kind == 3  # a few allowed tokens, like a JSON grammar
    bm[sparse] &= rng.integers(-(2**31), 2**31, size=(int(sparse.sum()), words), dtype=np.int64).astype(np.int32)

    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    pad = draw(st.sampled_from([0, 0, 5, 37]))
    off = draw(st.integers(0, pad))
    info = np.iinfo(NP_BITS[dtype])
    raw = rng.integers(info.min, info.max, size=(num_logits, width + pad))
    if draw(st.booleans()):
        # Mostly ordinary values; raw bit patterns (NaNs, infinities, subnormals) otherwise.
        normal = torch.randn(num_logits, width + pad, generator=torch.Generator().manual_seed(int(rng.integers(2**31))))
        wide = normal.to(dtype)
    else:
        wide = torch.from_numpy(raw.astype(NP_BITS[dtype])).view(dtype)
    logits = wide[:, off : off + width]  # row stride > width when pad > 0

    form = draw(st.sampled_from(["rowmapping", "numpy64", "tensor"]))
    if form == "rowmapping":
        m: Any = mapping
    elif form == "numpy64":
        m = (mapping.request.astype(np.int64), mapping.position.astype(np.int64))
    else:
        m = (torch.from_numpy(mapping.request.copy()), torch.from_numpy(mapping.position.copy()))
    if draw(st.booleans()) and not isinstance(cu, torch.Tensor):
        cu = torch.from_numpy(np.asarray(cu).copy())
    return {
        "logits": logits,
        "bitmask": torch.from_numpy(bm),
        "mapping": m,
        "cu": cu,
        "vocab_size": vocab_size,
        "tail": draw(st.sampled_from(["mask", "keep"])),
    }


def _apply_torch(logits: torch.Tensor, case: dict[str, Any]) -> None:
    """``apply_grammar_bitmask`` with the torch backend on ``logits`` and the rest of ``case``."""
    mp.apply_grammar_bitmask(
        logits,
        case["bitmask"],
        case["mapping"],
        case["cu"],
        vocab_size=case["vocab_size"],
        tail=case["tail"],
        backend="torch",
    )


@given(apply_cases())
def test_torch_backend_matches_reference(case: dict[str, Any]) -> None:
    logits = case["logits"]
    expected = logits.clone()
    reference.apply_grammar_bitmask(
        expected, case["bitmask"], case["mapping"], case["cu"], vocab_size=case["vocab_size"], tail=case["tail"]
    )
    got = logits.clone()
    _apply_torch(got, case)
    assert torch.equal(bits(got), bits(expected))
    # In place on the strided view: columns outside the view are untouched.
    strided = logits.clone() if logits.is_contiguous() else logits
    base = strided._base if strided._base is not None else strided
    base_before = base.clone()
    _apply_torch(strided, case)
    assert torch.equal(bits(strided), bits(expected))
    if base is not strided:
        outside = torch.ones(base.shape, dtype=torch.bool)
        start = strided.storage_offset() - base.storage_offset()
        outside[:, start : start + strided.shape[1]] = False
        assert torch.equal(bits(base)[outside], bits(base_before)[outside])
        # Restore so later uses of the drawn case see the original values.
        base.copy_(base_before)


def _normalised(case: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    m = case["mapping"]
    req, pos = (m.request, m.position) if isinstance(m, mp.RowMapping) else m
    as_t = lambda v: torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v).to(torch.int32)  # noqa: E731
    return as_t(req).contiguous(), as_t(pos).contiguous(), as_t(case["cu"]).contiguous()


@given(apply_cases())
def test_torch_device_path_matches_reference(case: dict[str, Any]) -> None:
    """The no-host-sync path (what CUDA runs) is exact too; it runs on CPU tensors."""
    logits = case["logits"].clone()
    width = logits.shape[1]
    words = case["bitmask"].shape[1]
    vs = case["vocab_size"] if case["vocab_size"] is not None else min(width, 32 * words)
    expected = logits.clone()
    reference.apply_grammar_bitmask(
        expected, case["bitmask"], case["mapping"], case["cu"], vocab_size=vs, tail=case["tail"]
    )
    req, pos, cu = _normalised(case)
    if logits.shape[0] and width and req.shape[0]:
        TorchBackend()._apply_device(logits, case["bitmask"].contiguous(), req, pos, cu, vs, case["tail"] == "mask")
    assert torch.equal(bits(logits), bits(expected))


@given(st.integers(0, 2**32 - 1), st.sampled_from(sorted(DTYPES)), st.integers(1, 200), st.booleans())
def test_duplicate_rows_apply_as_and(seed: int, dt: str, width: int, device_path: bool) -> None:
    """Several mask rows for one logits row (hand-made mappings) combine as AND on both paths."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    nrows = int(rng.integers(1, 12))
    req = rng.integers(0, n, size=nrows).astype(np.int32)
    pos = rng.integers(0, 2, size=nrows).astype(np.int32)
    cu = np.arange(n + 1, dtype=np.int64) * 2
    words = (width + 31) // 32
    bm = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(nrows, words), dtype=np.int64).astype(np.int32))
    logits = torch.randn(2 * n, width).to(DTYPES[dt])
    expected = logits.clone()
    reference.apply_grammar_bitmask(expected, bm, (req, pos), cu)
    if device_path:
        TorchBackend()._apply_device(
            logits, bm, torch.from_numpy(req), torch.from_numpy(pos), torch.from_numpy(cu).to(torch.int32), width, True
        )
    else:
        mp.apply_grammar_bitmask(logits, bm, (req, pos), cu, backend="torch")
    assert torch.equal(bits(logits), bits(expected))


# --------------------------------------------------------------------------- layouts & compaction


@given(batches())
def test_mapping_matches_reference(batch: Batch) -> None:
    got = batch.rows.mapping(batch.layout)
    want = reference.mapping(batch.rows, batch.layout)
    assert got.request.dtype == np.int32 and got.position.dtype == np.int32
    np.testing.assert_array_equal(got.request, want.request)
    np.testing.assert_array_equal(got.position, want.position)
    assert len(got) == batch.rows.num_rows(batch.layout)


@given(batches(), st.data())
def test_compact_matches_reference(batch: Batch, data: st.DataObject) -> None:
    layout = batch.layout
    scheduled = (layout.num_drafts.copy(), layout.num_non_draft.copy(), layout.cu_scheduled.copy())
    before = batch.rows.mapping(layout)
    budget = data.draw(st.integers(0, layout.total_drafts))
    with_capacity = data.draw(st.booleans())
    cap = _random_capacity(batch.rng, layout.num_drafts, budget) if with_capacity else None
    got = mp.compact(layout, budget, capacity=cap)
    want = reference.compact(layout, budget, capacity=cap)
    assert (got.regime, got.exact) == (want.regime, want.exact)
    np.testing.assert_array_equal(got.num_tokens_per_req, want.num_tokens_per_req)
    np.testing.assert_array_equal(got.cu_logits, want.cu_logits)
    assert got.num_tokens == int(layout.num_non_draft.sum()) + budget
    # Compaction leaves the scheduled layout alone ...
    for kept, now in zip(scheduled, (layout.num_drafts, layout.num_non_draft, layout.cu_scheduled), strict=True):
        np.testing.assert_array_equal(now, kept)
    # ... and the mapping never depends on the budget or the active layout: built
    # again after compacting with this budget (and capacities), with budget 0 and
    # with the full budget, it is the same entry by entry, one entry per mask row.
    assert len(before) == batch.rows.num_rows(layout)
    for b, c in ((budget, cap), (0, None), (layout.total_drafts, None)):
        active = mp.compact(layout, b, capacity=c)
        again = batch.rows.mapping(layout)
        np.testing.assert_array_equal(again.request, before.request)
        np.testing.assert_array_equal(again.position, before.position)
        if active.exact:
            # The active layout only decides which entries are live: every compacted
            # row of a grammar request receives exactly one live mask row.
            cu = active.cu_logits
            r = np.maximum(before.request, 0)
            live = (before.request >= 0) & (before.position < cu[r + 1] - cu[r])
            dst = np.sort(cu[r[live]] + before.position[live])
            gidx = np.array([layout.index_of(g) for g in batch.rows.grammar_req_ids], dtype=np.int64)
            sizes = cu[gidx + 1] - cu[gidx]
            want_dst = [row for i, k in zip(gidx, sizes, strict=True) for row in range(cu[i], cu[i] + k)]
            assert dst.tolist() == sorted(want_dst)


# --------------------------------------------------------------------------- budget


def _confidences(rng: np.random.Generator, n: int, k: int, style: str) -> np.ndarray:
    if style == "ties":
        return rng.choice(np.array([0.0, 0.25, 0.5, 1.0]), size=(n, k))
    if style == "extreme":
        return rng.choice(np.array([0.0, 1.0, 1e-300, 1 - 1e-16]), size=(n, k))
    return rng.random((n, k))


def _allocate_case(batch: Batch, data: st.DataObject) -> tuple[torch.Tensor, int]:
    """Confidences (random, tied or extreme; fp32 or fp64, a column or two past the drafts) and a budget."""
    layout = batch.layout
    n = layout.n
    k = int(layout.num_drafts.max()) + data.draw(st.integers(0, 2)) if n else 0
    conf = _confidences(batch.rng, n, k, data.draw(st.sampled_from(["random", "ties", "extreme"])))
    conf_t = torch.from_numpy(conf).to(data.draw(st.sampled_from([torch.float32, torch.float64])))
    return conf_t, _budget(data.draw, layout)


@given(batches(max_n=128), st.data())
def test_allocate_matches_reference(batch: Batch, data: st.DataObject) -> None:
    layout = batch.layout
    n = layout.n
    conf_t, budget = _allocate_case(batch, data)
    nd: Any = (
        torch.from_numpy(layout.num_drafts.copy()) if data.draw(st.booleans()) else layout.num_drafts.astype(np.int32)
    )
    as_tensor_budget = data.draw(st.booleans())
    b: Any = torch.tensor(budget) if as_tensor_budget else budget
    got = mp.allocate(conf_t, nd, b)
    again = mp.allocate(conf_t.clone(), nd, b)
    assert got.dtype == torch.int32 and got.shape == (n,)
    assert torch.equal(got, again)
    assert int(got.sum()) == budget
    cap = got.numpy()
    assert np.all(cap >= 0) and np.all(cap <= layout.num_drafts)
    assert cap.tolist() == reference.allocate(conf_t, layout.num_drafts, budget)


@given(batches(max_n=128), st.data())
def test_allocate_device_path_matches_the_host_path(batch: Batch, data: st.DataObject) -> None:
    # Host arguments take a numpy path; the device path (torch ops, no host sync) is run here on
    # CPU tensors so that it stays tested without a GPU: both give the same capacities.
    from maskplug.budget import _top_budget, _top_budget_host

    layout = batch.layout
    conf_t, budget = _allocate_case(batch, data)
    host = _top_budget_host(conf_t, layout.num_drafts, budget)
    device = _top_budget(conf_t, torch.from_numpy(layout.num_drafts.copy()), budget, unchecked=False)
    assert host.dtype == device.dtype == torch.int32
    assert host.tolist() == device.tolist()


def _cost_model(data: st.DataObject) -> mp.CostModel:
    if data.draw(st.booleans()):
        return mp.CostModel.linear(
            draft_base_ms=data.draw(st.floats(0.1, 5)),
            draft_per_req_ms=data.draw(st.floats(0, 0.1)),
            verify_base_ms=data.draw(st.floats(0.1, 20)),
            verify_per_token_ms=data.draw(st.floats(0, 0.2)),
        )
    xs = sorted(set(data.draw(st.lists(st.integers(1, 4096), min_size=1, max_size=8))))
    ys = data.draw(st.lists(st.floats(0.5, 50), min_size=len(xs), max_size=len(xs)))
    draft = [(0, 1.0), (256, 2.0)]
    return mp.CostModel.from_curves(
        draft, list(zip(xs, ys, strict=True)), 1024, 8192, graph_limit=data.draw(st.sampled_from([0, 64, 512]))
    )


@given(batches(max_n=96), st.data())
def test_choose_budget_matches_reference(batch: Batch, data: st.DataObject) -> None:
    layout, rng = batch.layout, batch.rng
    n = layout.n
    k = int(layout.num_drafts.max()) + data.draw(st.integers(0, 2)) if n else 0
    conf = _confidences(rng, n, k, data.draw(st.sampled_from(["random", "ties", "extreme"])))
    # Columns past a request's drafts are stale leftovers and may hold anything finite or not.
    stale = np.arange(k)[None, :] >= layout.num_drafts[:, None]
    conf[stale & (rng.random((n, k)) < 0.3)] = np.nan
    cost = _cost_model(data)
    num_sampling = data.draw(st.one_of(st.none(), st.integers(0, 300)))
    max_logits = None
    if data.draw(st.booleans()):
        max_logits = n * layout.num_bonus + data.draw(st.integers(0, layout.total_drafts + 3))
    grammar = None
    if data.draw(st.booleans()) and n:
        g = rng.permutation(n)[: int(rng.integers(0, n + 1))]
        acc = np.array([int(rng.integers(0, layout.num_drafts[r] + 1)) for r in g], dtype=np.int64)
        forced = rng.random((g.shape[0], k + layout.num_bonus)) < 0.3
        grammar = mp.DraftMasks(g.astype(np.int64), acc, forced)
    got = mp.choose_budget(conf, layout, cost, num_sampling=num_sampling, max_logits=max_logits, grammar=grammar)
    want = reference.choose_budget(
        conf, layout, cost, num_sampling=num_sampling, max_logits=max_logits, grammar=grammar
    )
    assert got == want
    cap = layout.total_drafts if max_logits is None else min(layout.total_drafts, max_logits - n * layout.num_bonus)
    assert 0 <= got.budget <= cap
