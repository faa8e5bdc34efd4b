"""vLLM's own compacted-worker kernel, run by Triton's interpreter on CPU tensors.

Not collected by the main test run (the name does not start with ``test_``):
``test_worker_kernel.py`` runs it in a child pytest with ``TRITON_INTERPRET=1``
in the environment, because the variable only takes effect when a kernel is
decorated, and would leak into every other test of the same process.

vLLM 0.32 finds no active Triton driver on a machine without a GPU and swaps
Triton for placeholders (``vllm.triton_utils``), so its kernel would be left a
plain Python function. Here the real Triton is put back into
``vllm.triton_utils`` before ``vllm.v1.worker.gpu.structured_outputs`` is
imported: the kernel is then decorated by Triton, from vLLM's own source, and
interpreted. Only what needs CUDA is stubbed: ``torch.cuda.Stream``,
``torch.cuda.stream`` and ``torch.cuda.current_stream`` (stream ordering has
no meaning for CPU tensors). Everything else, the mapping, the host-to-device
copies and the kernel launch, is vLLM's own code.

Three implementations meet on every batch:

* vLLM's ``StructuredOutputsWorker.apply_grammar_bitmask`` (ragged rows,
  its own ``_build_grammar_mapping``) and, for the fixed producer layout
  (``mask_stride`` rows per grammar request, as vLLM's later release lays
  them out), vLLM's kernel launched with the fixed ``req_idx * mask_stride +
  position`` mapping;
* maskplug: :func:`maskplug_vllm.worker.apply_compacted` (ragged), and for
  fixed rows :func:`maskplug.apply_grammar_bitmask` with the fixed
  :class:`maskplug.GrammarRows` mapping and, with one bonus row per request,
  the adapter's fixed-row worker apply (``maskplug_vllm.v0_33.apply_compacted``);
* the oracle, :func:`maskplug.reference.apply_grammar_bitmask`.

in all three budget regimes: every draft verified (full), some trimmed on the
device (partial), none verified (zero).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 in the environment before Triton is imported", allow_module_level=True)

import triton
import triton.language as tl
import vllm.triton_utils as vllm_triton

vllm_triton.triton, vllm_triton.tl = triton, tl

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from maskplug_vllm import patches, v0_33  # noqa: E402
from maskplug_vllm.worker import apply_compacted  # noqa: E402
from vllm.v1.worker.gpu import structured_outputs as so  # noqa: E402
from vllm_release import host_streams, random_bitmask  # noqa: E402

from maskplug import GrammarRows, ScheduledLayout, apply_grammar_bitmask, reference  # noqa: E402

MAX_DRAFTS = 3
DTYPES = [torch.float32, torch.float16]  # the interpreter has no bfloat16
REGIMES = ["full", "partial", "zero"]


@pytest.fixture(autouse=True)
def cpu_only_streams(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    host_streams(monkeypatch)
    yield


def test_the_kernel_is_vllms_own_and_interpreted() -> None:
    kernel = so._apply_grammar_bitmask_kernel
    assert isinstance(kernel, triton.runtime.interpreter.InterpretedFunction)
    assert kernel.fn.__module__ == "vllm.v1.worker.gpu.structured_outputs"
    # The method under test is vLLM's (not the adapter's patch, whether or not it is installed).
    assert vllm_apply().__module__ == "vllm.v1.worker.gpu.structured_outputs"


def vllm_apply() -> Any:
    return patches.original(so.StructuredOutputsWorker, "apply_grammar_bitmask")


@dataclass
class Case:
    req_ids: list[str]
    num_drafts: np.ndarray  # scheduled, per batch request
    active: np.ndarray  # verified after the budget (device side), per batch request
    num_bonus: int
    grammar_req_ids: list[str]
    vocab: int
    bitmask_rows: dict[str, np.ndarray]  # ragged and fixed producer rows
    logits: torch.Tensor
    no_drafts: bool  # vLLM passes num_draft_tokens_per_req=None when no request has drafts

    @property
    def stride(self) -> int:
        return MAX_DRAFTS + self.num_bonus

    @property
    def layout(self) -> ScheduledLayout:
        return ScheduledLayout(self.req_ids, self.num_drafts, np.ones(len(self.req_ids)), num_bonus=self.num_bonus)

    def cu(self, counts: np.ndarray) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(counts + self.num_bonus)]).astype(np.int32)

    def input_batch(self) -> SimpleNamespace:
        return SimpleNamespace(
            req_ids=list(self.req_ids),
            num_reqs=len(self.req_ids),
            num_draft_tokens_per_req=None if self.no_drafts else self.num_drafts.astype(np.int32),
            # Device offsets after the budget; the host copy keeps the scheduled upper bound.
            cu_num_logits=torch.from_numpy(self.cu(self.active)),
            cu_num_logits_np=self.cu(self.num_drafts),
        )

    def rows(self, mode: str) -> GrammarRows:
        return (
            GrammarRows(self.grammar_req_ids)
            if mode == "ragged"
            else GrammarRows(self.grammar_req_ids, "fixed", self.stride)
        )

    def expected(self, mode: str) -> torch.Tensor:
        out = self.logits.clone()
        bitmask = torch.from_numpy(self.bitmask_rows[mode])
        mapping = reference.mapping(self.rows(mode), self.layout)
        reference.apply_grammar_bitmask(out, bitmask, mapping, self.cu(self.active), tail="mask")
        return out

    def worker(self) -> so.StructuredOutputsWorker:
        return so.StructuredOutputsWorker(
            max_num_logits=len(self.req_ids) * self.stride,
            vocab_size=self.vocab,
            device=torch.device("cpu"),
            mask_stride=self.stride,
            num_bonus_tokens=self.num_bonus,
        )


@st.composite
def cases(draw: st.DrawFn, regime: str) -> Case:
    n = draw(st.integers(1, 6))
    num_bonus = draw(st.integers(1, 2))
    no_drafts = draw(st.booleans()) if regime == "full" else False
    nd = (
        np.zeros(n, dtype=np.int64)
        if no_drafts
        else np.array(draw(st.lists(st.integers(0, MAX_DRAFTS), min_size=n, max_size=n)), dtype=np.int64)
    )
    if regime == "full":
        active = nd.copy()
    elif regime == "zero":
        active = np.zeros(n, dtype=np.int64)
    else:
        active = np.array([draw(st.integers(0, int(k))) for k in nd], dtype=np.int64)
    ids = [f"q{i}" for i in draw(st.permutations(range(3 * n)))[:n]]
    order = draw(st.permutations(range(n)))
    gids = [ids[i] for i in order[: draw(st.integers(1, n))]]
    vocab = draw(st.integers(1, 300))
    words = (vocab + 31) // 32
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    index = {r: i for i, r in enumerate(ids)}
    ragged = random_bitmask(rng, int(sum(nd[index[g]] + num_bonus for g in gids)), words)
    # Fixed rows: stride rows per grammar request; the unused ones hold garbage that must never be applied.
    fixed = random_bitmask(rng, len(gids) * (MAX_DRAFTS + num_bonus), words)
    width = int(np.sum(active + num_bonus))
    logits = torch.from_numpy(rng.standard_normal((width, vocab))).to(dtype)
    return Case(ids, nd, active, num_bonus, gids, vocab, {"ragged": ragged, "fixed": fixed}, logits, no_drafts)


def run_vllm(case: Case, mode: str) -> torch.Tensor:
    out = case.logits.clone()
    batch = case.input_batch()
    worker = case.worker()
    if mode == "ragged":
        vllm_apply()(worker, out, batch, case.grammar_req_ids, case.bitmask_rows["ragged"])
        return out
    # Fixed rows: vLLM's kernel with the fixed-stride mapping, as its fixed-width consumer launches it.
    index = {r: i for i, r in enumerate(case.req_ids)}
    mapping = [index[g] * case.stride + p for g in case.grammar_req_ids for p in range(case.stride)]
    bitmask = torch.from_numpy(case.bitmask_rows["fixed"])
    grid = (bitmask.shape[0], triton.cdiv(case.vocab, 8192))
    so._apply_grammar_bitmask_kernel[grid](
        out,
        out.stride(0),
        torch.tensor(mapping, dtype=torch.int32),
        batch.cu_num_logits,
        bitmask,
        bitmask.stride(0),
        case.vocab,
        MASK_STRIDE=case.stride,
        BLOCK_SIZE=8192,
    )
    return out


def run_maskplug(case: Case, mode: str) -> torch.Tensor:
    out = case.logits.clone()
    batch = case.input_batch()
    if mode == "ragged":
        apply_compacted(case.worker(), out, batch, case.grammar_req_ids, case.bitmask_rows["ragged"])
        return out
    mapping = case.rows("fixed").mapping(case.layout)
    bitmask = torch.from_numpy(case.bitmask_rows["fixed"])
    apply_grammar_bitmask(out, bitmask, mapping, batch.cu_num_logits, vocab_size=case.vocab, tail="mask")
    return out


def check(case: Case, mode: str) -> bool:
    """All three agree; returns whether anything was masked (the comparison was not between untouched tensors)."""
    want = case.expected(mode)
    theirs = run_vllm(case, mode)
    ours = run_maskplug(case, mode)
    assert torch.equal(theirs, want), f"vLLM's kernel differs from the oracle ({mode})"
    assert torch.equal(ours, want), f"maskplug differs from the oracle ({mode})"
    if mode == "fixed" and case.num_bonus == v0_33.NUM_BONUS:
        # The adapter's own fixed-row worker apply (vLLM's later releases lay rows out this way).
        fixed = case.logits.clone()
        v0_33.apply_compacted(
            case.worker(), fixed, case.input_batch(), case.grammar_req_ids, case.bitmask_rows["fixed"]
        )
        assert torch.equal(fixed, want), "maskplug_vllm.v0_33.apply_compacted differs from the oracle"
    return bool(torch.isinf(ours).any())


@pytest.mark.parametrize("mode", ["ragged", "fixed"])
@pytest.mark.parametrize("regime", REGIMES)
def test_random_batches(regime: str, mode: str) -> None:
    masked: list[bool] = []

    @settings(max_examples=40, deadline=None)
    @given(cases(regime))
    def prop(case: Case) -> None:
        masked.append(check(case, mode))

    prop()
    assert sum(masked) > len(masked) // 2


@pytest.mark.parametrize("mode", ["ragged", "fixed"])
def test_pinned_partial_step(mode: str) -> None:
    """Two requests, the first with 3 drafts of which 1 is kept; one-hot rows show which row lands where."""
    ids, nd, active = ["a", "b"], np.array([3, 2]), np.array([1, 0])
    stride = MAX_DRAFTS + 1
    need = {"a": 4, "b": 3}
    cols: dict[str, list[int]] = {"ragged": [], "fixed": []}
    for g in ["b", "a"]:  # producer order differs from batch order
        cols["ragged"] += [10 * (g == "a") + p for p in range(need[g])]
        cols["fixed"] += [10 * (g == "a") + p if p < need[g] else 31 for p in range(stride)]
    rows = {}
    for m, c in cols.items():
        bm = np.zeros((len(c), 1), dtype=np.int64)
        bm[np.arange(len(c)), 0] = 1 << np.array(c)
        rows[m] = bm.astype(np.uint32).view(np.int32)
    case = Case(ids, nd, active, 1, ["b", "a"], 32, rows, torch.zeros(3, 32), False)
    theirs, ours = run_vllm(case, mode), run_maskplug(case, mode)
    allowed = [torch.nonzero(torch.isfinite(r)).flatten().tolist() for r in ours]
    # a's bonus and its one kept draft, then b's bonus (its drafts trimmed): each row its own mask.
    assert allowed == [[10], [11], [0]]
    assert torch.equal(theirs, ours)
    assert torch.equal(ours, case.expected(mode))
    assert check(case, mode)  # every implementation of this layout, the fixed-row worker apply included
