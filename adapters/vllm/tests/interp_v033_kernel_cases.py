"""vLLM 0.33's compacted-worker kernel, run by Triton's interpreter on CPU tensors, against maskplug.

Not collected by the main test run (the name does not start with ``test_``):
``test_v033_kernel.py`` runs it in a child pytest with ``TRITON_INTERPRET=1``
in the environment (the variable only takes effect when Triton decorates a
kernel, and must not leak into the other tests of the same process).

Without a GPU, vLLM swaps Triton for placeholders (``vllm.triton_utils``), so
the real Triton is put back there before ``vllm.v1.worker.gpu.structured_outputs``
is imported; its kernel is then decorated by Triton from vLLM's own source
and interpreted. Only what needs CUDA is replaced: ``torch.cuda.Stream``,
``torch.cuda.stream`` and ``torch.cuda.current_stream`` (no stream ordering
for CPU tensors) and pinned host memory. vLLM 0.33's
``StructuredOutputsWorker.apply_grammar_bitmask`` (its fixed-block mapping, its
copies, its kernel launch) is otherwise run as shipped, against
:func:`maskplug_vllm.v0_33.apply_compacted` and the oracle, in every budget
regime: every draft verified (full), some trimmed on the device (partial),
none verified (zero).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
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
from maskplug_vllm import patches, v0_33  # noqa: E402
from vllm.v1.worker.gpu import structured_outputs as so  # noqa: E402
from vllm_release import V033, host_streams, no_pinned_memory, random_bitmask  # noqa: E402

from maskplug import GrammarRows, ScheduledLayout, reference  # noqa: E402

if not V033:
    pytest.skip(f"vLLM 0.33 only (installed: vLLM {patches.vllm_version()})", allow_module_level=True)

VLLM_RELEASES = ("0.33.0",)

MAX_DRAFTS = 3
STRIDE = MAX_DRAFTS + 1
DTYPES = [torch.float32, torch.float16]  # the interpreter has no bfloat16


@pytest.fixture(autouse=True)
def host_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    host_streams(monkeypatch)
    no_pinned_memory(monkeypatch)
    yield


def vllm_apply() -> Any:
    return patches.original(so.StructuredOutputsWorker, "apply_grammar_bitmask")


def test_the_kernel_is_vllms_own_and_interpreted() -> None:
    kernel = so._apply_grammar_bitmask_kernel
    assert isinstance(kernel, triton.runtime.interpreter.InterpretedFunction)
    assert kernel.fn.__module__ == "vllm.v1.worker.gpu.structured_outputs"
    assert vllm_apply().__module__ == "vllm.v1.worker.gpu.structured_outputs"


def _case(rng: np.random.Generator, regime: str) -> tuple[SimpleNamespace, list[str], np.ndarray, torch.Tensor, Any]:
    n = int(rng.integers(1, 7))
    no_drafts = regime == "full" and rng.random() < 0.2
    nd = np.zeros(n, dtype=np.int64) if no_drafts else rng.integers(0, MAX_DRAFTS + 1, size=n)
    active = {"full": nd, "zero": np.zeros_like(nd), "partial": rng.integers(0, nd + 1)}[regime]
    ids = [f"q{i}" for i in rng.permutation(3 * n)[:n]]
    gids = [ids[i] for i in rng.permutation(n)[: int(rng.integers(1, n + 1))]]
    vocab = int(rng.integers(1, 300))
    # STRIDE rows per grammar request; the unused ones hold garbage that must never be applied.
    bitmask = random_bitmask(rng, len(gids) * STRIDE, (vocab + 31) // 32)
    cu = np.concatenate([[0], np.cumsum(active + 1)]).astype(np.int32)
    # vLLM 0.33's host offsets: the scheduled widths, exact (one row each) at budget 0 or without drafts.
    host_cu = cu if regime == "zero" or no_drafts else np.concatenate([[0], np.cumsum(nd + 1)]).astype(np.int32)
    batch = SimpleNamespace(
        req_ids=ids,
        num_reqs=n,
        num_draft_tokens_per_req=None if no_drafts else nd.astype(np.int32),
        cu_num_logits=torch.from_numpy(cu),
        cu_num_logits_np=host_cu,
    )
    dtype = DTYPES[int(rng.integers(0, len(DTYPES)))]
    logits = torch.from_numpy(rng.standard_normal((int(cu[-1]), vocab))).to(dtype)
    layout = ScheduledLayout(ids, nd, np.ones(n), num_bonus=1)
    return batch, gids, bitmask, logits, reference.mapping(GrammarRows(gids, "fixed", STRIDE), layout)


def _worker(n: int, vocab: int) -> so.StructuredOutputsWorker:
    return so.StructuredOutputsWorker(
        max_num_logits=n * STRIDE, vocab_size=vocab, device=torch.device("cpu"), mask_stride=STRIDE
    )


@pytest.mark.parametrize("regime", ["full", "partial", "zero"])
def test_random_batches(regime: str) -> None:
    rng = np.random.default_rng({"full": 51, "partial": 52, "zero": 53}[regime])
    masked = 0
    for _ in range(40):
        batch, gids, bitmask, logits, mapping = _case(rng, regime)
        want = logits.clone()
        reference.apply_grammar_bitmask(want, torch.from_numpy(bitmask), mapping, batch.cu_num_logits, tail="mask")
        theirs, ours = logits.clone(), logits.clone()
        vllm_apply()(_worker(len(batch.req_ids), logits.shape[1]), theirs, batch, gids, bitmask)
        v0_33.apply_compacted(_worker(len(batch.req_ids), logits.shape[1]), ours, batch, gids, bitmask)
        assert torch.equal(theirs, want), "vLLM 0.33's kernel differs from the oracle"
        assert torch.equal(ours, want), "maskplug differs from the oracle"
        masked += bool(torch.isinf(ours).any())
    assert masked > 20


def test_pinned_partial_step() -> None:
    """Two requests, the first with 3 drafts of which 1 is kept; one-hot rows show which row lands where."""
    ids, nd, active = ["a", "b"], np.array([3, 2]), np.array([1, 0])
    cols: list[int] = []
    for g, need in (("b", 3), ("a", 4)):  # producer order differs from batch order
        cols += [10 * (g == "a") + p if p < need else 31 for p in range(STRIDE)]
    bm = np.zeros((len(cols), 1), dtype=np.int64)
    bm[np.arange(len(cols)), 0] = 1 << np.array(cols)
    bitmask = bm.astype(np.uint32).view(np.int32)
    cu = np.concatenate([[0], np.cumsum(active + 1)]).astype(np.int32)
    batch = SimpleNamespace(
        req_ids=ids,
        num_reqs=2,
        num_draft_tokens_per_req=nd.astype(np.int32),
        cu_num_logits=torch.from_numpy(cu),
        cu_num_logits_np=np.concatenate([[0], np.cumsum(nd + 1)]).astype(np.int32),
    )
    theirs, ours = torch.zeros(3, 32), torch.zeros(3, 32)
    vllm_apply()(_worker(2, 32), theirs, batch, ["b", "a"], bitmask)
    v0_33.apply_compacted(_worker(2, 32), ours, batch, ["b", "a"], bitmask)
    allowed = [torch.nonzero(torch.isfinite(r)).flatten().tolist() for r in ours]
    # a's bonus and its one kept draft, then b's bonus (its drafts trimmed): each row its own mask.
    assert allowed == [[10], [11], [0]]
    assert torch.equal(theirs, ours)
