"""Real launches of the Triton and CuPy kernels (CUDA only; skipped with the reason elsewhere).

Against ``maskplug.reference`` on random steps of every regime and producer
mode, against a vectorised oracle at 131,072 columns, inside CUDA-graph
capture, and with torch's sync debug mode set to raise on any host sync.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _cases import check, int_view, make_case

import maskplug

pytestmark = pytest.mark.gpu

BACKENDS = ["triton", "cupy"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _require(backend: str) -> None:
    why = maskplug.backend_status("cuda").get(backend, f"{backend} is not installed")
    if why is not None:
        pytest.fail(f"backend {backend!r} must run on this CUDA machine: {why}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_steps_match_reference(backend: str, dtype: torch.dtype) -> None:
    _require(backend)
    for seed in range(40):
        check(make_case(seed, dtype=dtype, max_width=3000, max_requests=8), backend, "cuda")


def _dense_oracle(logits: torch.Tensor, bm: np.ndarray, dst: np.ndarray, vocab: int, tail: bool) -> torch.Tensor:
    out = logits.cpu().clone()
    width = out.shape[1]
    allowed = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little").astype(bool)[:, :width]
    if allowed.shape[1] < width:
        allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))
    allowed[:, vocab:] = not tail
    for k, row in enumerate(dst.tolist()):  # duplicates AND together
        if row >= 0:
            out[row][torch.from_numpy(~allowed[k])] = float("-inf")
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_full_vocab(backend: str, dtype: torch.dtype, rows: int) -> None:
    _require(backend)
    rng = np.random.default_rng(rows)
    width, vocab = 131_072, 131_000
    bm = rng.integers(-(2**31), 2**31, size=(rows, 4096), dtype=np.int64).astype(np.int32)
    bm[: rows // 3] &= rng.integers(0, 2**31, size=(rows // 3, 4096), dtype=np.int64).astype(np.int32) & 0x01010101
    bm[rows // 3 : rows // 2] = -1
    logits = torch.randn(rows, width, device="cuda").to(dtype)
    req = np.arange(rows)
    pos = np.zeros(rows, dtype=np.int64)
    cu = np.arange(rows + 1)
    want = _dense_oracle(logits, bm, req, vocab, True)
    maskplug.apply_grammar_bitmask(
        logits, torch.from_numpy(bm).cuda(), (req, pos), cu, vocab_size=vocab, backend=backend
    )
    assert torch.equal(int_view(logits.cpu()), int_view(want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_capture_and_replay(backend: str) -> None:
    _require(backend)
    n, width = 4, 4000
    words = -(-width // 32)
    dev = torch.device("cuda")
    logits = torch.empty(12, width, device=dev)
    bm = torch.empty(8, words, dtype=torch.int32, device=dev)
    req = torch.tensor([0, 0, 1, 1, 2, 3, 3, -1], dtype=torch.int32, device=dev)
    pos = torch.tensor([0, 1, 0, 1, 0, 0, 1, -1], dtype=torch.int32, device=dev)
    capacity = torch.zeros(n, dtype=torch.int32, device=dev)
    cu = torch.empty(n + 1, dtype=torch.int32, device=dev)

    def step() -> None:
        cu.copy_(maskplug.active_cu_logits(capacity, 1))
        maskplug.apply_grammar_bitmask(logits, bm, (req, pos), cu, backend=backend)

    logits.normal_()
    bm.random_(-(2**31), 2**31 - 1)
    step()  # warm up: compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rng = np.random.default_rng(5)
    for _ in range(3):  # new inputs in the same buffers, then replay
        cap = rng.integers(0, 2, size=n)
        capacity.copy_(torch.from_numpy(cap.astype(np.int32)))
        logits.normal_()
        bm.random_(-(2**31), 2**31 - 1)
        before = logits.cpu()
        bm_host = bm.cpu()
        graph.replay()
        torch.cuda.synchronize()
        want = before.clone()
        cu_host = np.concatenate([[0], np.cumsum(cap + 1)])
        maskplug.reference.apply_grammar_bitmask(want, bm_host, (req.cpu(), pos.cpu()), cu_host)
        assert torch.equal(int_view(logits.cpu()), int_view(want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_never_syncs(backend: str) -> None:
    """With torch's sync debug mode set to raise, the apply (device mapping and offsets) still runs and masks."""
    _require(backend)
    dev = torch.device("cuda")
    logits = torch.randn(6, 2048, device=dev, dtype=torch.float16)
    bm = torch.randint(-(2**31), 2**31 - 1, (6, 64), dtype=torch.int32, device=dev)
    req = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32, device=dev)
    pos = torch.tensor([0, 1, 0, 1, 0, 1], dtype=torch.int32, device=dev)
    cu = maskplug.active_cu_logits(torch.tensor([1, 0, 1], dtype=torch.int32, device=dev), 1)
    maskplug.apply_grammar_bitmask(logits.clone(), bm, (req, pos), cu, backend=backend)  # warm-up: compile, load
    torch.cuda.synchronize()
    want = logits.cpu()
    maskplug.reference.apply_grammar_bitmask(want, bm.cpu(), (req.cpu(), pos.cpu()), cu.cpu())
    torch.cuda.set_sync_debug_mode("error")
    try:
        # The detector is live: an operation that must synchronise raises in this mode ...
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.nonzero(cu)
        # ... and the apply does not.
        maskplug.apply_grammar_bitmask(logits, bm, (req, pos), cu, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(int_view(logits.cpu()), int_view(want))


def test_auto_prefers_cupy_then_triton() -> None:
    status = maskplug.backend_status("cuda")
    want = "cupy" if status.get("cupy") is None else "triton" if status.get("triton") is None else "torch"
    assert maskplug.resolve_backend("auto", torch.device("cuda")).name == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_op_compiled_step(backend: str) -> None:
    _require(backend)
    op = getattr(torch.ops, f"maskplug_{backend}").apply_bitmask
    dev = torch.device("cuda")
    x = torch.randn(3, 1000, device=dev)
    bm = torch.randint(-(2**31), 2**31 - 1, (3, 32), dtype=torch.int32, device=dev)
    req = torch.tensor([0, 1, 2], dtype=torch.int32, device=dev)
    pos = torch.zeros(3, dtype=torch.int32, device=dev)
    cu = torch.arange(4, dtype=torch.int32, device=dev)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        op(y, bm, req, pos, cu, 1000, True)
        return y

    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    want = (x * 2.0).cpu()
    maskplug.reference.apply_grammar_bitmask(want, bm.cpu(), (req.cpu(), pos.cpu()), cu.cpu())
    assert torch.equal(got.cpu(), want)
