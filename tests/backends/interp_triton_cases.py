"""The Triton kernel run by Triton's interpreter on CPU tensors, against the oracle.

Not collected by the main test run (the file name does not start with
``test_``): ``test_triton_backend.py`` runs it in a child pytest with
``TRITON_INTERPRET=1`` in the environment, because the variable only takes
effect when the kernel is decorated and would leak into every other test of
the same worker.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from _cases import check, expected, int_view, make_case
from hypothesis import given, settings
from hypothesis import strategies as st

import maskplug

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 in the environment before Triton is imported", allow_module_level=True)

from maskplug_triton import kernel as tk
from maskplug_triton import ops  # noqa: F401  (registers torch.ops.maskplug_triton)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_kernel_is_interpreted() -> None:
    assert tk.INTERPRETED
    assert maskplug.backend_status("cpu")["triton"] is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("regime", ["full", "partial", "zero"])
@pytest.mark.parametrize("mode", ["ragged", "fixed"])
def test_regimes_modes_dtypes(dtype: torch.dtype, regime: str, mode: str) -> None:
    for seed in range(4):
        check(make_case(1000 * seed + 7, dtype=dtype, regime=regime, mode=mode), "triton")  # type: ignore[arg-type]


@settings(max_examples=120)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(DTYPES))
def test_random_cases(seed: int, dtype: torch.dtype) -> None:
    check(make_case(seed, dtype=dtype, max_width=2500), "triton")


@pytest.mark.parametrize(
    ("dtype", "width", "vocab", "tail"),
    [
        (torch.float32, 131_072, 131_072, True),
        (torch.float16, 131_072, 131_072, True),
        (torch.bfloat16, 131_072, 131_072, True),
        (torch.float16, 100_000, 99_999, True),
        (torch.bfloat16, 100_000, 70_001, False),
    ],
)
def test_full_vocab_rows(dtype: torch.dtype, width: int, vocab: int, tail: bool) -> None:
    """Real vocabulary sizes: several tiles per program, tiles past the row end, every tile classification."""
    rng = np.random.default_rng(3)
    words = -(-vocab // 32)
    assert tk.launch_shape(3, width, 4)[0] > 1  # the multi-tile programs are what this covers
    bm = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    bm[0, :2000] = 0  # dense-masked tiles: unmasked vector stores
    bm[1, 1000:] = -1  # all-allowed tiles: skipped
    bm[2, ::3] = 0  # whole packs disallowed inside mixed tiles
    logits = torch.from_numpy(rng.standard_normal((3, width), dtype=np.float32)).to(dtype)
    got, want = logits.clone(), logits.clone()
    req, pos, cu = np.array([0, 1, 2]), np.zeros(3, dtype=np.int64), np.arange(4)
    maskplug.apply_grammar_bitmask(
        got, torch.from_numpy(bm), (req, pos), cu, vocab_size=vocab, tail="mask" if tail else "keep", backend="triton"
    )
    # A vectorised oracle, independent of the kernel: unpack the bits little-endian.
    allowed = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little").astype(bool)[:, :vocab]
    drop = np.zeros((3, width), dtype=bool)
    drop[:, :vocab] = ~allowed
    drop[:, vocab:] = tail
    want[torch.from_numpy(drop)] = float("-inf")
    assert torch.equal(int_view(got), int_view(want))


def test_trimmed_rows_write_nothing() -> None:
    """Budget 0: only position 0 is live, every other mapped row is skipped on the device."""
    layout = maskplug.ScheduledLayout([1, 2, 3], [3, 0, 2], [1, 1, 1])
    mp = maskplug.GrammarRows([3, 1], mode="fixed", stride=5).mapping(layout)
    cu = maskplug.compact(layout, 0).cu_logits
    logits = torch.randn(3, 200)
    before = logits.clone()
    # Dead rows would mask every column, live rows allow every column.
    bm = torch.zeros(mp.request.size, 7, dtype=torch.int32)
    live = (mp.request >= 0) & (mp.position == 0)
    bm[torch.from_numpy(live)] = -1
    maskplug.apply_grammar_bitmask(logits, bm, mp, cu, backend="triton")
    assert torch.equal(int_view(logits), int_view(before))


def test_duplicates_are_anded() -> None:
    logits = torch.randn(2, 64)
    bm = torch.tensor([[0x0000FFFF, -1], [-1, 0x00FF00FF], [0x0F0F0F0F, 0x0F0F0F0F]], dtype=torch.int32)
    req, pos, cu = np.array([0, 0, 1]), np.array([0, 0, 0]), np.array([0, 1, 2])
    want = logits.clone()
    maskplug.reference.apply_grammar_bitmask(want, bm, (req, pos), cu)
    maskplug.apply_grammar_bitmask(logits, bm, (req, pos), cu, backend="triton")
    assert torch.equal(int_view(logits), int_view(want))
    assert torch.isinf(logits[0, 16:32]).all() and torch.isfinite(logits[0, :16]).all()


def test_custom_op_under_torch_compile() -> None:
    """``torch.compile(fullgraph=True)`` traces a step calling the op; the compiled step runs the kernel."""
    # The op takes normalised arguments: pick a case whose vocabulary is the logits width.
    cases = (make_case(s, dtype=torch.float16, regime="partial") for s in range(11, 500))
    case = next(c for c in cases if c.vocab_size is None)
    req = torch.from_numpy(case.request)
    pos = torch.from_numpy(case.position)
    cu = torch.from_numpy(case.cu_logits.astype(np.int32))
    width = case.logits.shape[1]

    def step(x: torch.Tensor, bm: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        torch.ops.maskplug_triton.apply_bitmask(y, bm, req, pos, cu, width, case.tail == "mask")
        return y

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    got = compiled(case.logits.contiguous(), case.bitmask)
    assert torch.equal(int_view(got), int_view(expected(case)))


def test_benchmark_peer_kernel_is_correct() -> None:
    """The vLLM-style per-row kernel that ``benchmarks/gpu_bench.py`` times must mask correctly too."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"
    spec = importlib.util.spec_from_file_location("maskplug_gpu_bench_interp", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    kern = bench._vllm_style_kernel()
    rng = np.random.default_rng(9)
    for kind in ("dense", "half", "sparse"):
        rows, vocab, block = 3, 3000, 1024
        bm = bench.make_bitmask(rng, rows, vocab, kind, 40)
        logits = torch.randn(rows, vocab)
        want = bench.dense_oracle(logits, bm, np.arange(rows), vocab)
        index = torch.arange(rows, dtype=torch.int32)
        bmt = torch.from_numpy(bm)
        kern[(rows, -(-vocab // block))](logits, logits.stride(0), bmt, bmt.stride(0), index, vocab, BLOCK=block)
        assert torch.equal(int_view(logits), int_view(want)), kind
