"""maskplug-cupy on the CPU machine: the CUDA source compiles, and the host side is right.

* NVRTC (``cuda.bindings.nvrtc`` with the ``nvidia-cuda-nvrtc`` wheel) compiles
  ``kernel.cu`` to PTX and cubin for sm_80 and sm_90, without warnings;
* ``nvcc`` does the same with warnings as errors, where it is installed;
* the launch plan matches the kernels' parameter list (names, order, widths),
  and a NumPy model of the kernel driven by that plan (grid, chunks, pointers,
  strides, alignment flag) reproduces ``maskplug.reference`` bit for bit;
* plugin plumbing, unavailability reasons and ``torch.compile`` tracing of the op.

About 10 s on two cores (four NVRTC and four nvcc compiles, ~0.5 s each).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from _cases import Case, compile_one_graph, expected, int_view, make_case
from hypothesis import given, settings
from hypothesis import strategies as st
from maskplug_cupy import kernel as ck
from maskplug_cupy import ops  # noqa: F401  (registers torch.ops.maskplug_cupy)
from maskplug_cupy.plugin import BACKEND, CupyBackend

import maskplug
from maskplug.kernels.sdk import LaunchArgs

# ---- the CUDA source compiles for real GPUs without one --------------------------------------------------


def _nvrtc_compile(arch: str, want_cubin: bool) -> tuple[bytes, str]:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (maskplug-cupy[nvrtc])")

    def ok(res: tuple) -> tuple:  # type: ignore[type-arg]
        assert res[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS, res[0]
        return res[1:]

    try:
        (prog,) = ok(nvrtc.nvrtcCreateProgram(ck.cuda_source().encode(), b"kernel.cu", 0, [], []))
    except RuntimeError as exc:  # the bindings load libnvrtc lazily
        pytest.fail(f"NVRTC library not found (install nvidia-cuda-nvrtc): {exc}")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    # NVRTC writes into the buffers it is given, so they must be fresh, writable
    # bytearrays. An immutable ``b" " * size`` is not: for size 1 (an empty log,
    # just its NUL) it is CPython's shared one-byte ``b" "`` object, and writing
    # the NUL into it turns every ``b" "`` of the process into ``b"\x00"``.
    (size,) = ok(nvrtc.nvrtcGetProgramLogSize(prog))
    log = bytearray(size)
    ok(nvrtc.nvrtcGetProgramLog(prog, log))
    log_text = bytes(log).rstrip(b"\x00").decode().strip()
    assert res[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS, log_text
    if want_cubin:
        (size,) = ok(nvrtc.nvrtcGetCUBINSize(prog))
        buf = bytearray(size)
        ok(nvrtc.nvrtcGetCUBIN(prog, buf))
    else:
        (size,) = ok(nvrtc.nvrtcGetPTXSize(prog))
        buf = bytearray(size)
        ok(nvrtc.nvrtcGetPTX(prog, buf))
    nvrtc.nvrtcDestroyProgram(prog)
    # The interpreter's one-byte bytes objects are untouched.
    assert all(bytes([c])[0] == c for c in range(256))
    return bytes(buf), log_text


def _check_ptx(ptx: str, arch: int) -> None:
    assert f".target sm_{arch}" in ptx
    for name in ck.KERNELS.values():
        assert re.search(rf"\.visible \.entry {name}\(", ptx), name
    # Wide stores for all-disallowed packs; the only global loads are 32-bit (mask words and the
    # row lookup): the kernel never reads a logit.
    assert "st.global.v4.u32" in ptx
    loads = set(re.findall(r"ld\.global[\.\w]*", ptx))
    assert loads and all(ld.endswith(".u32") and ".v" not in ld for ld in loads), loads


@pytest.mark.parametrize("arch", [80, 90])
def test_nvrtc_ptx(arch: int) -> None:
    ptx, log = _nvrtc_compile(f"compute_{arch}", want_cubin=False)
    assert log == "", log  # no warnings either
    _check_ptx(ptx.rstrip(b"\x00").decode(), arch)


@pytest.mark.parametrize("arch", [80, 90])
def test_nvrtc_cubin(arch: int) -> None:
    cubin, log = _nvrtc_compile(f"sm_{arch}", want_cubin=True)
    assert log == "", log
    assert cubin[:4] == b"\x7fELF"
    for name in ck.KERNELS.values():
        assert name.encode() in cubin


NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", [80, 90])
def test_nvcc_warnings_as_errors(arch: int, tmp_path: Path) -> None:
    src = tmp_path / "kernel.cu"
    src.write_text(ck.cuda_source())
    assert NVCC is not None
    flags = ["--Werror", "all-warnings", "-Xptxas", "-Werror,-warn-spills,-warn-lmem-usage", "-O3", "-std=c++17"]
    cubin = tmp_path / "k.cubin"
    ptx = tmp_path / "k.ptx"
    for out, kind, target in ((cubin, "-cubin", f"sm_{arch}"), (ptx, "-ptx", f"compute_{arch}")):
        proc = subprocess.run(
            [NVCC, kind, f"-arch={target}", *flags, "-o", str(out), str(src)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.strip() == "", proc.stderr
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    _check_ptx(ptx.read_text(), arch)


# ---- the launch plan against the kernels' parameter list -------------------------------------------------

_C_WIDTH = {"u32*": 8, "u16*": 8, "const u32*": 8, "const int*": 8, "i64": 8, "int": 4, "u32": 4}


def _kernel_params(name: str) -> list[tuple[str, str]]:
    src = ck.cuda_source()
    m = re.search(rf"{name}\((.*?)\)\s*\{{", src, re.S)
    assert m is not None, name
    params = []
    for raw in m.group(1).split(","):
        decl = " ".join(raw.replace("__restrict__", "").split())
        ctype, pname = decl.rsplit(" ", 1)
        params.append((ctype.replace(" *", "*"), pname))
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_plan_matches_kernel_signature(dtype: torch.dtype) -> None:
    logits = torch.zeros(4, 100, dtype=dtype)
    bm = torch.zeros(3, 4, dtype=torch.int32)
    req, pos, cu = (
        torch.zeros(3, dtype=torch.int32),
        torch.zeros(3, dtype=torch.int32),
        torch.arange(5, dtype=torch.int32),
    )
    plan = ck.plan_launch(LaunchArgs(logits, bm, req, pos, cu, 100, True), num_sms=132)
    assert plan is not None
    params = _kernel_params(plan.kernel)
    assert [p for _, p in params] == list(ck.ARG_NAMES)
    assert len(plan.args) == len(params)
    for (ctype, pname), arg in zip(params, plan.args, strict=True):
        assert ctype in _C_WIDTH, ctype
        assert np.asarray(arg).dtype.itemsize == _C_WIDTH[ctype], (pname, ctype, arg)
        if ctype.endswith("*"):
            assert np.asarray(arg).dtype == np.uint64
    named = dict(zip(ck.ARG_NAMES, plan.args, strict=True))
    assert int(named["logits"]) == logits.data_ptr() and int(named["bitmask"]) == bm.data_ptr()
    assert int(named["request"]) == req.data_ptr() and int(named["cu"]) == cu.data_ptr()
    assert int(named["num_requests"]) == 4
    want_ninf = {torch.float32: 0xFF800000, torch.float16: 0xFC00, torch.bfloat16: 0xFF80}[dtype]
    assert int(named["ninf"]) == want_ninf
    one = torch.tensor([float("-inf")], dtype=dtype).view(torch.int32 if dtype == torch.float32 else torch.int16)
    assert int(one.item()) & (0xFFFFFFFF if dtype == torch.float32 else 0xFFFF) == want_ninf


def test_plan_alignment_flag() -> None:
    def aligned(view: torch.Tensor) -> bool:
        plan = ck.plan_launch(LaunchArgs(view, *_small_args(), 1024, True), 132)
        assert plan is not None
        return plan.aligned

    assert aligned(torch.zeros(8, 1032)[:, :1024])  # 4,128-byte rows
    assert not aligned(torch.zeros(8, 1030)[:, :1024])  # 4,120-byte rows: not a multiple of 16
    assert not aligned(torch.zeros(8, 1032)[:, 1:1025])  # base pointer 4 bytes past alignment
    assert aligned(torch.zeros(8, 1032, dtype=torch.float16)[:, 8:1032])  # 16 bytes in, 2,064-byte rows
    assert aligned(torch.zeros(1, 1030)[:, :1024])  # one row: its stride is never used


def _small_args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(2, 32, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.arange(3, dtype=torch.int32),
    )


@given(
    rows=st.integers(1, 20_000), limit=st.integers(1, 300_000), sms=st.integers(1, 200), esize=st.sampled_from([2, 4])
)
def test_plan_shape_covers_each_pack_once(rows: int, limit: int, sms: int, esize: int) -> None:
    dtype = torch.float32 if esize == 4 else torch.float16
    logits = torch.empty_strided((2, limit), (limit + 64, 1), dtype=dtype, device="meta")
    bm = torch.empty(rows, -(-limit // 32), dtype=torch.int32, device="meta")
    vec = torch.empty(rows, dtype=torch.int32, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    plan = ck.plan_launch(LaunchArgs(logits, bm, vec, vec, cu, limit, True), sms)
    assert plan is not None
    packs = -(-limit // plan.pack)
    assert plan.pack * esize == 16
    assert plan.grid == rows * plan.chunks_per_row < 2**31
    assert plan.chunks_per_row * plan.packs_per_chunk >= packs > (plan.chunks_per_row - 1) * plan.packs_per_chunk
    assert plan.packs_per_chunk % plan.block == 0 and 32 <= plan.block <= ck.BLOCK and plan.block % 32 == 0
    if plan.packs_per_chunk > plan.block:  # longer chunks only when the grid still fills the card
        assert plan.grid >= 8 * sms


def test_single_decode_row_spreads_over_the_card() -> None:
    logits = torch.empty(1, 131_072, device="meta")
    bm = torch.empty(1, 4096, dtype=torch.int32, device="meta")
    vec = torch.empty(1, dtype=torch.int32, device="meta")
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    plan = ck.plan_launch(LaunchArgs(logits, bm, vec, vec, cu, 131_072, True), 132)
    assert plan is not None and plan.grid == 128 and plan.packs_per_chunk == ck.BLOCK


# ---- a NumPy model of the kernel, driven by the plan -----------------------------------------------------


def _emulate(plan: ck.LaunchPlan, tensors: dict[int, torch.Tensor]) -> None:
    """Execute ``plan`` the way ``kernel.cu`` does, block by block, on CPU tensors found by address."""
    a = {k: int(v) for k, v in zip(ck.ARG_NAMES, plan.args, strict=True)}
    logits = tensors[a["logits"]]
    esize = logits.element_size()
    itype = torch.int32 if esize == 4 else torch.int16
    # Address arithmetic exactly as the kernel does it: element offsets from the logits pointer.
    storage = logits.untyped_storage()
    flat = torch.empty(0, dtype=logits.dtype).set_(storage, 0, (storage.nbytes() // esize,), (1,)).view(itype)
    start = logits.storage_offset()
    bits = tensors[a["bitmask"]].numpy().view(np.uint32).reshape(-1)
    req = tensors[a["request"]].numpy()
    pos = tensors[a["position"]].numpy()
    cu = tensors[a["cu"]].numpy()
    pack, chunks, ppc = plan.pack, a["chunks_per_row"], a["packs_per_chunk"]
    vocab, limit, words = a["vocab_size"], a["limit"], a["words"]
    full = (1 << pack) - 1
    ninf = np.array(a["ninf"] & (0xFFFFFFFF if esize == 4 else 0xFFFF), dtype=np.uint32 if esize == 4 else np.uint16)
    ninf_signed = int(ninf.view(np.int32 if esize == 4 else np.int16))
    num_packs = -(-limit // pack)
    for b in range(plan.grid):
        i, chunk = divmod(b, chunks)
        r = int(req[i])
        if r < 0 or r >= a["num_requests"]:
            continue
        p, c0 = int(pos[i]), int(cu[r])
        if p < 0 or p >= int(cu[r + 1]) - c0:
            continue
        row = start + (c0 + p) * a["row_stride"]
        ks = np.arange(chunk * ppc, min((chunk + 1) * ppc, num_packs))
        cols = ks * pack
        fast = cols + pack <= vocab
        w = bits[i * words + (cols[fast] >> 5)]
        drop = np.zeros(ks.size, dtype=np.int64)
        drop[fast] = (~(w >> (cols[fast] & 31).astype(np.uint32))).astype(np.int64) & full
        for j in range(pack):  # the general path, column by column
            c = cols[~fast] + j
            in_vocab = c < vocab
            allowed = np.zeros(c.size, dtype=bool)
            wi = bits[i * words + (c[in_vocab] >> 5)]
            allowed[in_vocab] = ((wi >> (c[in_vocab] & 31).astype(np.uint32)) & 1) == 1
            drop[~fast] |= ((c < limit) & ~allowed).astype(np.int64) << j
        vector = (drop == full) & bool(a["aligned"])
        if vector.any():
            addr = logits.data_ptr() + ((c0 + p) * a["row_stride"] + cols[vector]) * esize
            assert np.all(addr % 16 == 0), "a 16-byte store would be misaligned"
        for j in range(pack):
            hit = ((drop >> j) & 1) == 1
            flat[torch.from_numpy(row + cols[hit] + j)] = ninf_signed
        assert np.all(cols[drop != 0] < limit)


def _emulated(case: Case, num_sms: int) -> torch.Tensor:
    logits = case.base.clone()[: case.logits.shape[0], : case.logits.shape[1]]
    words = case.bitmask.shape[1]
    vocab = case.vocab_size if case.vocab_size is not None else logits.shape[1]
    req = torch.from_numpy(case.request.astype(np.int32))
    pos = torch.from_numpy(case.position.astype(np.int32))
    cu = torch.from_numpy(case.cu_logits.astype(np.int32))
    assert vocab <= 32 * words
    plan = ck.plan_launch(LaunchArgs(logits, case.bitmask, req, pos, cu, vocab, case.tail == "mask"), num_sms)
    if plan is not None:
        tensors = {t.data_ptr(): t for t in (logits, case.bitmask, req, pos, cu)}
        _emulate(plan, tensors)
    return logits


@settings(max_examples=150)
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    num_sms=st.integers(1, 6),
)
def test_plan_driven_model_matches_reference(seed: int, dtype: torch.dtype, num_sms: int) -> None:
    case = make_case(seed, dtype=dtype, max_width=6000, max_requests=6)
    got = _emulated(case, num_sms)
    assert torch.equal(int_view(got), int_view(expected(case))), case.describe()


# ---- plugin plumbing -------------------------------------------------------------------------------------


def test_registered_with_highest_priority() -> None:
    reg = maskplug.get_registry()
    assert "cupy" in reg.kernels and reg.kernels["cupy"] is BACKEND
    assert BACKEND.priority > reg.kernels["triton"].priority > reg.kernels["torch"].priority


def test_unavailable_reasons_are_precise() -> None:
    be = CupyBackend()
    assert "CUDA devices only" in (be.unavailable_reason(torch.device("cpu")) or "")
    if not torch.cuda.is_available():
        assert "no CUDA device" in (be.unavailable_reason(torch.device("cuda")) or "")
    with pytest.raises(maskplug.BackendUnavailable, match="cupy"):
        maskplug.apply_grammar_bitmask(
            torch.zeros(1, 8), torch.zeros(1, 1, dtype=torch.int32), ([0], [0]), [0, 1], backend="cupy"
        )


def test_op_refuses_cpu_tensors() -> None:
    x = torch.zeros(1, 8)
    with pytest.raises(maskplug.BackendUnavailable, match="CUDA tensors"):
        torch.ops.maskplug_cupy.apply_bitmask(
            x,
            torch.zeros(1, 1, dtype=torch.int32),
            *(torch.zeros(1, dtype=torch.int32),) * 2,
            torch.arange(2, dtype=torch.int32),
            8,
            True,
        )


def test_custom_op_traces_with_fullgraph() -> None:
    def step(x: torch.Tensor, bm: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        y = x.float() / 0.7
        torch.ops.maskplug_cupy.apply_bitmask(y, bm, req, pos, cu, 900, False)
        return torch.softmax(y, dim=-1)

    dev = torch.device("meta")
    out, targets = compile_one_graph(
        step,
        torch.empty(3, 1000, dtype=torch.bfloat16, device=dev),
        torch.empty(4, 29, dtype=torch.int32, device=dev),
        torch.empty(4, dtype=torch.int32, device=dev),
        torch.empty(4, dtype=torch.int32, device=dev),
        torch.empty(3, dtype=torch.int32, device=dev),
    )
    assert out.shape == (3, 1000)
    assert any("maskplug_cupy.apply_bitmask" in t for t in targets), targets


def test_launch_stream_is_torchs_stream() -> None:
    """The launch goes on the stream whose handle torch reports, wrapped without a deprecated API."""
    pytest.importorskip("cupy", reason="maskplug-cupy needs cupy")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stream = ck._cupy_stream(0x7F00_1234_5600, 0)
    assert stream.ptr == 0x7F00_1234_5600
    assert ck._cupy_stream(0, 0).ptr == 0  # torch's legacy default stream is CuPy's null stream
