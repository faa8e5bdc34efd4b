"""maskplug-triton on the CPU machine: interpreter run, ahead-of-time compile, plugin and op plumbing.

Takes about 20 s on two cores, most of it the child interpreter run (~10 s)
and four ahead-of-time compiles (~1 s each).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from _cases import compile_one_graph
from hypothesis import given
from hypothesis import strategies as st

import maskplug
from maskplug.testing import run_interpreted

triton = pytest.importorskip("triton", reason="maskplug-triton needs triton")

from maskplug_triton import kernel as tk  # noqa: E402
from maskplug_triton import ops  # noqa: E402,F401  (registers torch.ops.maskplug_triton)
from maskplug_triton.plugin import BACKEND, TritonBackend  # noqa: E402

HERE = Path(__file__).resolve().parent


def test_interpreter_cases_in_child_process() -> None:
    """Run ``interp_triton_cases.py`` under ``TRITON_INTERPRET=1`` in its own interpreter."""
    run = run_interpreted(HERE / "interp_triton_cases.py", cwd=HERE.parent.parent)
    out = run.output
    assert run.returncode == 0, out[-6000:]
    assert run.passed is not None and run.passed >= 20, out[-3000:]
    assert "skipped" not in out and "failed" not in out, out[-3000:]


def test_kernel_not_interpreted_here() -> None:
    assert not tk.INTERPRETED


# ---- ahead-of-time compilation for real GPUs, without one ------------------------------------------------

_SIG = {
    "logits_ptr": "*i32",
    "row_stride": "i64",
    "bitmask_ptr": "*i32",
    "words": "i32",
    "request_ptr": "*i32",
    "position_ptr": "*i32",
    "cu_ptr": "*i32",
    "num_requests": "i32",
    "vocab_size": "i32",
    "limit": "i32",
    "chunks_per_row": "i32",
    "NINF": "constexpr",
    "PACK": "constexpr",
    "BLOCK_W": "constexpr",
    "TILES": "constexpr",
}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("elem", ["i32", "i16"])
def test_aot_compile(arch: int, elem: str) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(_SIG, logits_ptr=f"*{elem}")
    ninf = -8388608 if elem == "i32" else -1024
    # What Triton's launcher specialises at run time for aligned tensors and strides.
    div = [["tt.divisibility", 16]]
    attrs = {(k,): div for k in range(7)}
    src = ASTSource(
        fn=tk.kernel_fn(),
        signature=sig,
        constexprs={"NINF": ninf, "PACK": 4 if elem == "i32" else 8, "BLOCK_W": tk.BLOCK_W, "TILES": 4},
        attrs=attrs,
    )
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    ptx = compiled.asm["ptx"]
    cubin = compiled.asm["cubin"]
    assert f".target sm_{arch}" in ptx
    assert re.search(r"\.entry _mask_kernel\b", ptx)
    assert cubin[:4] == b"\x7fELF" and b"_mask_kernel" in cubin
    # The dense-masked tile path must become 16-byte stores; the kernel never loads a logit (only
    # the four row-lookup words and the mask words are loaded, all 32-bit).
    assert "st.global.v4.b32" in ptx
    assert not re.search(r"ld\.global[\.\w]*\.(b16|v2|v4)", ptx)


# ---- plugin plumbing -------------------------------------------------------------------------------------


def test_registered_through_entry_point() -> None:
    reg = maskplug.get_registry()
    be = reg.kernels.get("triton")
    assert be is BACKEND
    assert be.priority > reg.kernels["torch"].priority


def test_unavailable_reasons_are_precise() -> None:
    be = TritonBackend()
    assert "TRITON_INTERPRET=1" in (be.unavailable_reason(torch.device("cpu")) or "")
    assert "CUDA devices only" in (be.unavailable_reason(torch.device("meta")) or "")
    if not torch.cuda.is_available():
        assert "no CUDA device" in (be.unavailable_reason(torch.device("cuda")) or "")


def test_named_backend_raises_with_reason_and_writes_nothing() -> None:
    logits = torch.randn(2, 64)
    before = logits.clone()
    bm = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(maskplug.BackendUnavailable, match="TRITON_INTERPRET"):
        maskplug.apply_grammar_bitmask(logits, bm, ([0, 1], [0, 0]), [0, 1, 2], backend="triton")
    assert torch.equal(logits, before)


def test_auto_on_cpu_is_not_triton() -> None:
    assert maskplug.resolve_backend("auto", torch.device("cpu")).name != "triton"


def test_custom_op_traces_with_fullgraph() -> None:
    """Dynamo traces a step that calls the op as one node; meta tensors run the fake implementation."""

    def step(x: torch.Tensor, bm: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        y = torch.log_softmax(x, dim=-1)
        torch.ops.maskplug_triton.apply_bitmask(y, bm, req, pos, cu, 1000, True)
        return y * 2

    dev = torch.device("meta")
    out, targets = compile_one_graph(
        step,
        torch.empty(6, 1000, device=dev),
        torch.empty(5, 32, dtype=torch.int32, device=dev),
        torch.empty(5, dtype=torch.int32, device=dev),
        torch.empty(5, dtype=torch.int32, device=dev),
        torch.empty(4, dtype=torch.int32, device=dev),
    )
    assert out.shape == (6, 1000) and out.device == dev
    assert any("maskplug_triton.apply_bitmask" in t for t in targets), targets


# ---- launch shape ----------------------------------------------------------------------------------------


@given(rows=st.integers(1, 20_000), limit=st.integers(1, 300_000), sms=st.integers(1, 200))
def test_launch_shape_covers_every_column_once(rows: int, limit: int, sms: int) -> None:
    tiles, chunks, programs = tk.launch_shape(rows, limit, sms)
    cols_per_program = tiles * tk.BLOCK_W * 32
    assert tiles in (1, 2, 4, 8, 16) and tiles <= tk.MAX_TILES
    assert programs == rows * chunks < 2**31
    assert chunks * cols_per_program >= limit  # every column reached
    assert (chunks - 1) * cols_per_program < limit  # no program entirely past the row
    if tiles > 1:  # wider chunks only when the grid still has enough programs for every SM
        assert programs >= 8 * sms


def test_single_decode_row_spreads_over_the_card() -> None:
    assert tk.launch_shape(1, 131_072, 132) == (1, 128, 128)
    tiles, chunks, programs = tk.launch_shape(4096, 131_072, 132)
    assert tiles == tk.MAX_TILES and programs == 4096 * chunks
