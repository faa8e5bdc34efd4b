"""Both places vLLM applies grammar masks, with maskplug in them, against vLLM and the oracle.

Run against the installed release: vLLM 0.32 hands the workers ragged rows
(``len(drafts) + 1`` per grammar request), vLLM 0.33 fixed blocks of
``mask_stride`` rows; the cases below build whichever the release produces and
compare with that release's own code.

* The CPU model runner's path: vLLM's own ``apply_grammar_bitmask`` (scatter
  into a full-size buffer, then xgrammar's CPU kernel) is run unmodified on the
  same random batches as maskplug's scatter apply; the logits must come out
  bit for bit the same.
* The newer runner's ``StructuredOutputsWorker``: vLLM's kernel is Triton
  and needs a GPU, so its rule (mask row ``i`` with flat index ``m`` →
  ``(m // stride, m % stride)``, applied iff the position is below the
  request's row count in the device ``cu_num_logits``) is run through
  :func:`maskplug.reference.apply_grammar_bitmask`, on random compacted
  batches in every budget regime. The flat indices are vLLM's own: from
  0.32's ``_build_grammar_mapping``, and from what 0.33's worker hands its
  kernel (the launch recorded, CUDA streams stubbed).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from maskplug_vllm import patches
from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.structured_output import utils as so_utils
from vllm.v1.worker.gpu.structured_outputs import StructuredOutputsWorker
from vllm_release import V033, needs_v033, no_pinned_memory, v033_kernel_mapping, v033_worker

from maskplug import LayoutError, reference

VLLM_RELEASES = ("0.32.0", "0.33.0")

if not V033:
    from vllm.v1.worker.gpu.structured_outputs import _build_grammar_mapping

MAX_DRAFTS = 3
STRIDE = MAX_DRAFTS + 1  # vLLM 0.33's mask_stride for MAX_DRAFTS speculative tokens
IMPL = patches.implementations()
apply_scatter, apply_compacted = IMPL.apply_scatter, IMPL.apply_compacted


@pytest.fixture(scope="module", autouse=True)
def _host_memory() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as m:
        no_pinned_memory(m)
        yield


def _producer_rows(gids: list[str], spec: dict[str, list[int]]) -> int:
    """Bitmask rows the installed release's producer emits for these grammar requests."""
    if V033:
        return STRIDE * len(gids)
    return sum(1 + len(spec.get(r, ())) for r in gids)


def _random_bitmask(rng: np.random.Generator, rows: int, words: int) -> np.ndarray:
    bm = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    # Some rows all-allowed, some nearly empty: both ends of what grammars produce.
    bm[rng.random(rows) < 0.2] = -1
    sparse = rng.random(rows) < 0.2
    bm[sparse] &= rng.integers(0, 2**31, size=(int(sparse.sum()), words), dtype=np.int64).astype(np.int32) & 0x11
    return bm


def _scatter_case(rng: np.random.Generator) -> tuple[SimpleNamespace, GrammarOutput, SimpleNamespace, torch.Tensor]:
    n = int(rng.integers(1, 12))
    ids = [f"r{i}" for i in rng.permutation(3 * n)[:n]]
    spec: dict[str, list[int]] = {}
    for r in ids:
        k = int(rng.integers(0, MAX_DRAFTS + 1))
        if k:
            toks = rng.integers(0, 100, size=k).tolist()
            if rng.random() < 0.2:  # vLLM pads missing drafts with -1 (the list keeps its length)
                cut = int(rng.integers(0, k))
                toks[cut:] = [-1] * (k - cut)
            spec[r] = toks
    gids = [ids[i] for i in rng.permutation(n)[: int(rng.integers(1, n + 1))]]
    if rng.random() < 0.2:
        # A grammar request the worker's batch does not hold: its rows are skipped.
        gids.insert(int(rng.integers(0, len(gids) + 1)), "absent")
        spec["absent"] = [0] * int(rng.integers(0, MAX_DRAFTS + 1))
    vocab = int(rng.integers(33, 400))
    words = (vocab + 31) // 32
    bitmask = _random_bitmask(rng, _producer_rows(gids, spec), words)
    dtype = [torch.float32, torch.bfloat16, torch.float16][int(rng.integers(0, 3))]
    logits = torch.from_numpy(rng.standard_normal((n + sum(len(spec.get(r, ())) for r in ids), vocab))).to(dtype)
    return (
        SimpleNamespace(scheduled_spec_decode_tokens=spec),
        GrammarOutput(gids, bitmask),
        SimpleNamespace(req_ids=ids),
        logits,
    )


def test_scatter_path_matches_vllm_bit_for_bit() -> None:
    rng = np.random.default_rng(11)
    vllm_apply = patches.original(so_utils, "apply_grammar_bitmask")
    masked = 0
    for _ in range(400):
        sched, grammar, batch, logits = _scatter_case(rng)
        theirs, ours = logits.clone(), logits.clone()
        vllm_apply(sched, grammar, batch, theirs)
        apply_scatter(sched, grammar, batch, ours)
        assert torch.equal(theirs, ours)
        masked += bool(torch.isinf(ours).any())
    assert masked > 300  # the comparison is not between two untouched tensors


@st.composite
def _scatter_batches(draw: st.DrawFn) -> tuple[SimpleNamespace, GrammarOutput, SimpleNamespace, torch.Tensor]:
    ids = draw(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=8, unique=True))
    absent = draw(st.lists(st.text(min_size=1, max_size=6).filter(lambda x: x not in ids), max_size=2, unique=True))
    drafts = st.lists(st.integers(-1, 60), max_size=MAX_DRAFTS)
    spec = {r: d for r in ids + absent if (d := draw(drafts))}
    gids = draw(st.permutations(ids + absent).map(lambda p: p[: draw(st.integers(0, len(p)))]))
    # vLLM's CPU path hands rows to xgrammar 0.2.8's kernel by index; at some narrow widths that
    # kernel writes outside the indexed rows (seen here: masked columns in unmapped rows, and heap
    # corruption below 32 columns), so the property runs at model-like widths, multiples of 32.
    vocab = 32 * draw(st.integers(1, 5))
    words = (vocab + 31) // 32
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    bitmask = _random_bitmask(rng, _producer_rows(gids, spec), words)
    logits = torch.from_numpy(rng.standard_normal((len(ids) + sum(len(spec.get(r, ())) for r in ids), vocab)))
    return (
        SimpleNamespace(scheduled_spec_decode_tokens=spec),
        GrammarOutput(gids, bitmask),
        SimpleNamespace(req_ids=ids),
        logits.to(torch.float32),
    )


@given(_scatter_batches())
def test_scatter_path_matches_vllm_property(
    case: tuple[SimpleNamespace, GrammarOutput, SimpleNamespace, torch.Tensor],
) -> None:
    """Arbitrary ids, grammar orders, absent grammar requests, padding and widths (down to one column)."""
    sched, grammar, batch, logits = case
    theirs, ours = logits.clone(), logits.clone()
    if grammar.structured_output_request_ids:
        patches.original(so_utils, "apply_grammar_bitmask")(sched, grammar, batch, theirs)
    apply_scatter(sched, grammar, batch, ours)
    assert torch.equal(theirs, ours)


def _compacted_case(
    rng: np.random.Generator, regime: str
) -> tuple[SimpleNamespace, SimpleNamespace, list[str], np.ndarray, torch.Tensor, int]:
    n = int(rng.integers(1, 12))
    # vLLM 0.33 samples one bonus row per request (its worker has no num_bonus_tokens).
    num_bonus = 1 if V033 else int(rng.integers(1, 3))
    ids = [f"q{i}" for i in rng.permutation(3 * n)[:n]]
    nd = rng.integers(0, MAX_DRAFTS + 1, size=n)
    cap = {"full": nd, "zero": np.zeros_like(nd), "partial": rng.integers(0, nd + 1)}[regime]
    cu = np.concatenate([[0], np.cumsum(cap + num_bonus)]).astype(np.int32)
    gids = [ids[i] for i in rng.permutation(n)[: int(rng.integers(1, n + 1))]]
    vocab = int(rng.integers(33, 300))
    rows = STRIDE * len(gids) if V033 else int(sum(nd[ids.index(g)] + num_bonus for g in gids))
    bitmask = _random_bitmask(rng, rows, (vocab + 31) // 32)
    # The host cu_num_logits_np stays the scheduled upper bound (vLLM's compact_batch), except that
    # vLLM 0.33 makes it exact (one row per request) at budget 0.
    host_cu = cu if V033 and regime == "zero" else np.concatenate([[0], np.cumsum(nd + num_bonus)]).astype(np.int32)
    batch = SimpleNamespace(
        req_ids=ids,
        num_reqs=n,
        num_draft_tokens_per_req=nd.astype(np.int32),
        cu_num_logits=torch.from_numpy(cu),
        cu_num_logits_np=host_cu,
    )
    if V033:
        worker = SimpleNamespace(mask_stride=STRIDE, grammar_bitmask=None)
    else:
        worker = SimpleNamespace(num_bonus_tokens=num_bonus, mask_stride=MAX_DRAFTS + num_bonus, grammar_bitmask=None)
    logits = torch.from_numpy(rng.standard_normal((int(cu[-1]), vocab))).to(torch.float32)
    return worker, batch, gids, bitmask, logits, num_bonus


def _vllm_flat_mapping(
    monkeypatch: pytest.MonkeyPatch,
    worker: SimpleNamespace,
    batch: SimpleNamespace,
    gids: list[str],
    bitmask: np.ndarray,
    logits: torch.Tensor,
    num_bonus: int,
) -> np.ndarray:
    """The flat ``request * stride + position`` per mask row that the release's own worker computes."""
    if V033:
        theirs = v033_worker(worker.mask_stride, 64 * worker.mask_stride, logits.shape[1])
        flat, _ = v033_kernel_mapping(monkeypatch, theirs, logits.clone(), batch, gids, bitmask)
        return flat
    return np.asarray(
        _build_grammar_mapping(
            batch.req_ids, gids, batch.cu_num_logits_np, batch.num_draft_tokens_per_req, num_bonus, worker.mask_stride
        ),
        dtype=np.int64,
    )


@pytest.mark.parametrize("regime", ["full", "partial", "zero"])
def test_compacted_path_matches_vllm_kernel_rule(regime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng({"full": 12, "partial": 13, "zero": 14}[regime])
    for _ in range(300):
        worker, batch, gids, bitmask, logits, num_bonus = _compacted_case(rng, regime)
        stride = worker.mask_stride
        flat = _vllm_flat_mapping(monkeypatch, worker, batch, gids, bitmask, logits, num_bonus)
        want = logits.clone()
        vllm_rows = ((flat // stride).astype(np.int32), (flat % stride).astype(np.int32))
        reference.apply_grammar_bitmask(want, torch.from_numpy(bitmask), vllm_rows, batch.cu_num_logits.numpy())
        got = logits.clone()
        apply_compacted(worker, got, batch, gids, bitmask)
        assert torch.equal(got, want)


def test_compacted_path_refuses_a_grammar_request_missing_from_the_batch() -> None:
    worker = SimpleNamespace(num_bonus_tokens=1, mask_stride=2, grammar_bitmask=None)
    batch = SimpleNamespace(
        req_ids=["a"],
        num_draft_tokens_per_req=np.array([1], dtype=np.int32),
        cu_num_logits=torch.tensor([0, 2], dtype=torch.int32),
        cu_num_logits_np=np.array([0, 2], dtype=np.int32),
    )
    logits = torch.zeros(2, 64)
    # Two requests' rows: 2 + 2 ragged (one draft each), or two blocks of mask_stride 2.
    with pytest.raises(LayoutError, match="'b' is not in the batch"):
        apply_compacted(worker, logits, batch, ["a", "b"], np.zeros((4, 2), dtype=np.int32))
    assert bool((logits == 0).all())


@needs_v033
def test_compacted_path_refuses_rows_that_are_not_whole_blocks() -> None:
    """vLLM 0.33 asserts one ``mask_stride`` block per grammar request; maskplug says which argument is off."""
    worker = SimpleNamespace(mask_stride=STRIDE, grammar_bitmask=None)
    batch = SimpleNamespace(
        req_ids=["a"],
        num_draft_tokens_per_req=np.array([1], dtype=np.int32),
        cu_num_logits=torch.tensor([0, 2], dtype=torch.int32),
        cu_num_logits_np=np.array([0, 2], dtype=np.int32),
    )
    logits = torch.zeros(2, 64)
    with pytest.raises(LayoutError, match=rf"grammar_bitmask: expected {STRIDE} rows \(mask_stride\)"):
        apply_compacted(worker, logits, batch, ["a"], np.zeros((2, 2), dtype=np.int32))
    # Host offsets that are neither the scheduled widths nor one row per request.
    batch.cu_num_logits_np = np.array([0, 3], dtype=np.int32)
    with pytest.raises(LayoutError, match=r"input_batch.cu_num_logits_np: expected 1 \+ drafts rows"):
        apply_compacted(worker, logits, batch, ["a"], np.zeros((STRIDE, 2), dtype=np.int32))
    assert bool((logits == 0).all())


@needs_v033
def test_scatter_path_refuses_rows_that_are_not_whole_blocks() -> None:
    sched = SimpleNamespace(scheduled_spec_decode_tokens={"a": [1]})
    logits = torch.zeros(2, 64)
    with pytest.raises(LayoutError, match="grammar_bitmask: expected a whole block of rows per grammar request"):
        apply_scatter(
            sched,
            GrammarOutput(["a", "b"], np.zeros((3, 2), dtype=np.int32)),
            SimpleNamespace(req_ids=["a", "b"]),
            logits,
        )
    # A block narrower than the request's drafts + 1.
    with pytest.raises(LayoutError, match=r"stride: expected >= num_drafts \+ num_bonus"):
        apply_scatter(
            sched, GrammarOutput(["a"], np.zeros((1, 2), dtype=np.int32)), SimpleNamespace(req_ids=["a"]), logits
        )
    assert bool((logits == 0).all())


def test_patched_entry_points_route_to_maskplug(patched: object) -> None:
    """With the patches installed, vLLM's names resolve to maskplug's implementations."""
    assert so_utils.apply_grammar_bitmask is apply_scatter
    method = StructuredOutputsWorker.apply_grammar_bitmask
    assert method.__wrapped__ is apply_compacted
    worker = object.__new__(StructuredOutputsWorker)
    worker.num_bonus_tokens = 1
    worker.mask_stride = 3
    worker.grammar_bitmask = torch.zeros(8, 1, dtype=torch.int32)
    batch = SimpleNamespace(
        req_ids=["a", "b"],
        num_draft_tokens_per_req=np.array([2, 0], dtype=np.int32),
        cu_num_logits=torch.tensor([0, 1, 2], dtype=torch.int32),  # budget 0: bonus rows only
        # vLLM 0.32 keeps the scheduled widths on the host; 0.33 makes them exact at budget 0.
        cu_num_logits_np=np.array([0, 1, 2] if V033 else [0, 3, 4], dtype=np.int32),
    )
    logits = torch.zeros(2, 32)
    # Three rows for "a" (2 drafts + bonus) and one for "b" (ragged), or a block of three each
    # (fixed, b's last two unused): only each request's position-0 row is live.
    rows = [[1], [2], [4], [8], [16], [32]] if V033 else [[1], [2], [4], [8]]
    bitmask = np.array(rows, dtype=np.int32)
    worker.apply_grammar_bitmask(logits, batch, ["a", "b"], bitmask)
    assert torch.isfinite(logits[0]).tolist() == [c == 0 for c in range(32)]
    assert torch.isfinite(logits[1]).tolist() == [c == 3 for c in range(32)]


@pytest.mark.gpu
@pytest.mark.parametrize("regime", ["full", "partial", "zero"])
def test_compacted_path_matches_vllm_triton_kernel_on_cuda(regime: str) -> None:
    """On a GPU: the real ``StructuredOutputsWorker`` (CUDA streams, vLLM's Triton kernel) against
    the same worker patched to maskplug, on device-side compacted offsets."""
    rng = np.random.default_rng({"full": 31, "partial": 32, "zero": 33}[regime])
    vllm_apply = patches.original(StructuredOutputsWorker, "apply_grammar_bitmask")
    for _ in range(50):
        _, batch, gids, bitmask, logits, num_bonus = _compacted_case(rng, regime)
        # vLLM 0.33's worker takes no num_bonus_tokens (one bonus row per request).
        extra = {} if V033 else {"num_bonus_tokens": num_bonus}
        worker = StructuredOutputsWorker(
            max_num_logits=64 * (MAX_DRAFTS + num_bonus),
            vocab_size=logits.shape[1],
            device=torch.device("cuda"),
            mask_stride=MAX_DRAFTS + num_bonus,
            **extra,
        )
        batch.cu_num_logits = batch.cu_num_logits.cuda()
        want, got = logits.cuda(), logits.cuda()
        vllm_apply(worker, want, batch, gids, bitmask)
        apply_compacted(worker, got, batch, gids, bitmask)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
