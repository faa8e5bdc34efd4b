#!/usr/bin/env python3
"""Device check of maskplug's kernel backends: correctness, copy bandwidth, timings against peers.

Run through ``benchmarks/gpu_check.sh`` on a CUDA machine. Steps:

1. **Correctness.** Every available maskplug kernel backend (``cupy``,
   ``triton``) on random verify steps (all budget regimes, both producer
   modes, duplicates, strided rows, vocabulary tails) in fp32/fp16/bf16,
   against ``maskplug.reference`` on small shapes and against a vectorised
   NumPy oracle (``numpy.unpackbits``) at 131,072 columns. Peers are checked
   against the same oracle on the shapes they are timed on.
2. **Copy bandwidth.** A device-to-device copy of 1 GiB (bytes read + written
   per second) and a 1 GiB fill (bytes written per second).
3. **Timings.** maskplug's backends (kernel launch on normalised arguments),
   xgrammar's Triton and CUDA kernels when importable, and a vLLM-style
   per-row Triton kernel written here for the comparison, at batch 1, 8, 64,
   512 and 4096 × vocabulary 131,072 with dense-masked (1,000 allowed tokens
   per row), half-masked (random bits) and sparse-masked (1,000 masked tokens
   per row) rows. Device time per call is the median of
   ``triton.testing.do_bench`` (which flushes L2 between calls); the launch
   floor is an empty kernel timed the same way.
4. **One table**: µs per call, fraction of the copy bandwidth reached by the
   bytes the call must move at least, the ratio to the best peer (< 1 means
   faster than every peer) and, at batch ≤ 8, the ratio to the launch floor.

``--dry-run`` runs every step on the CPU at tiny sizes with the torch
backend and xgrammar's CPU kernel, so the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

import maskplug

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MASKS = ("dense", "half", "sparse")
PEER_PREFIX = "peer:"


# ---- masks and oracles -------------------------------------------------------------------------------------


def make_bitmask(rng: np.random.Generator, rows: int, vocab: int, kind: str, count: int) -> np.ndarray:
    """``rows`` mask rows over ``vocab`` tokens: ``dense`` allows ``count`` tokens, ``sparse`` masks ``count``."""
    words = -(-vocab // 32)
    if kind == "half":
        return rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    hits = np.zeros((rows, words), dtype=np.uint32)
    tok = rng.integers(0, vocab, size=(rows, min(count, vocab)))
    r = np.repeat(np.arange(rows), tok.shape[1])
    np.bitwise_or.at(hits, (r, (tok >> 5).ravel()), (np.uint32(1) << (tok & 31).astype(np.uint32)).ravel())
    if kind == "dense":
        return hits.view(np.int32)
    if kind == "sparse":
        return (~hits).view(np.int32)
    raise ValueError(f"mask kind: expected one of {MASKS}, got {kind!r}")


def allowed_matrix(bitmask: np.ndarray, width: int, vocab: int, tail: bool) -> np.ndarray:
    """Bool ``(rows, width)``: which columns a mask row keeps (independent of every kernel)."""
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    if allowed.shape[1] < width:
        allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))
    allowed = allowed[:, :width]
    allowed[:, vocab:] = not tail
    return allowed


def dense_oracle(
    logits: torch.Tensor, bitmask: np.ndarray, dst: np.ndarray, vocab: int, tail: bool = True
) -> torch.Tensor:
    """Masked copy of ``logits``: mask row ``k`` applies to logits row ``dst[k]`` (``-1``: skipped)."""
    out = logits.detach().cpu().clone()
    allowed = allowed_matrix(bitmask, out.shape[1], vocab, tail)
    drop = np.zeros(out.shape, dtype=bool)
    live = dst >= 0
    d, a = dst[live], ~allowed[live]
    if d.size:
        # Duplicates: the AND of their masks, i.e. the OR of their drops, row group by row group.
        order = np.argsort(d, kind="stable")
        d, a = d[order], a[order]
        starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
        drop[d[starts]] = np.logical_or.reduceat(a, starts, axis=0)
    out[torch.from_numpy(drop)] = float("-inf")
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    it = torch.int32 if a.element_size() == 4 else torch.int16
    return bool(torch.equal(a.cpu().view(it), b.cpu().view(it)))


# ---- random verify steps -----------------------------------------------------------------------------------


@dataclass
class Step:
    """One apply call's inputs, on the host."""

    base: torch.Tensor  # the logits buffer; logits are base[:rows, :width]
    rows: int
    width: int
    bitmask: np.ndarray
    request: np.ndarray
    position: np.ndarray
    cu_logits: np.ndarray
    vocab_size: int | None
    tail: str


def random_step(rng: np.random.Generator, dtype: torch.dtype, width: int, max_requests: int) -> Step:
    """A verify step built with maskplug's own layout code, in a random budget regime."""
    n = int(rng.integers(1, max_requests + 1))
    nd = rng.integers(0, 5, size=n)
    layout = maskplug.ScheduledLayout(np.arange(n), nd, np.ones(n, dtype=np.int64))
    total = int(nd.sum())
    budget = int(rng.choice([0, total, int(rng.integers(0, total + 1))]))
    conf = torch.from_numpy(rng.uniform(0.05, 1.0, size=(n, 4)))
    cu = maskplug.active_cu_logits(maskplug.allocate(conf, nd, budget), 1).numpy()
    gids = rng.permutation(n)[: int(rng.integers(1, n + 1))]
    fixed = bool(rng.integers(0, 2))
    mp = maskplug.GrammarRows(gids, mode="fixed" if fixed else "ragged", stride=5 if fixed else None).mapping(layout)
    req, pos = mp.request, mp.position
    if req.size and rng.integers(0, 2):  # duplicated rows apply as an AND
        pick = rng.integers(0, req.size, size=3)
        req, pos = np.concatenate([req, req[pick]]), np.concatenate([pos, pos[pick]])
    vocab: int | None = None
    words = -(-width // 32)
    if rng.integers(0, 2):
        vocab = int(rng.integers(width // 2, width + 1))
        words = -(-vocab // 32)
    bm = rng.integers(-(2**31), 2**31, size=(req.size, words), dtype=np.int64).astype(np.int32)
    bm[rng.random(bm.shape) < 0.3] = 0
    bm[rng.random(bm.shape) < 0.3] = -1
    rows = int(cu[-1])
    pad = int(rng.choice([0, 4, 64]))
    base = torch.from_numpy(rng.standard_normal((max(rows, 1), width + pad), dtype=np.float32)).to(dtype)
    return Step(base, rows, width, bm, req, pos, cu.astype(np.int64), vocab, "mask" if rng.integers(0, 2) else "keep")


def step_oracle(step: Step, small: bool) -> torch.Tensor:
    logits = step.base[: step.rows, : step.width].clone()
    if small:
        maskplug.reference.apply_grammar_bitmask(
            logits,
            torch.from_numpy(step.bitmask),
            (step.request, step.position),
            step.cu_logits,
            vocab_size=step.vocab_size,
            tail=step.tail,
        )
        return logits
    r = np.maximum(step.request.astype(np.int64), 0)
    size = step.cu_logits[r + 1] - step.cu_logits[r]
    live = (step.request >= 0) & (step.position < size)
    dst = np.where(live, step.cu_logits[r] + step.position, -1)
    vocab = step.vocab_size if step.vocab_size is not None else step.width
    return dense_oracle(logits, step.bitmask, dst, vocab, step.tail == "mask")


def run_step(step: Step, backend: str, device: torch.device) -> torch.Tensor:
    base = step.base.to(device)
    view = base[: step.rows, : step.width]
    maskplug.apply_grammar_bitmask(
        view,
        torch.from_numpy(step.bitmask).to(device),
        (step.request, step.position),
        step.cu_logits,
        vocab_size=step.vocab_size,
        tail=step.tail,  # type: ignore[arg-type]
        backend=backend,
    )
    outside = torch.ones(base.shape, dtype=torch.bool)
    outside[: step.rows, : step.width] = False
    if not bits_equal(base.cpu()[outside], step.base[outside]):
        raise AssertionError("wrote outside the logits view")
    return view.cpu()


def check_backends(backends: list[str], device: torch.device, dry: bool, seed: int) -> list[str]:
    """Random steps and full-vocabulary rows for every backend; returns the failures."""
    failures: list[str] = []
    rng = np.random.default_rng(seed)
    big_width = 4096 if dry else 131_072
    for name in backends:
        t0 = time.perf_counter()
        count = 0
        for dt_name, dtype in DTYPES.items():
            for k in range(4 if dry else 25):
                step = random_step(rng, dtype, int(rng.integers(1, 3000)), 6)
                got = run_step(step, name, device)
                count += 1
                if not bits_equal(got, step_oracle(step, small=True)):
                    failures.append(f"{name} {dt_name} small step {k}: mismatch against maskplug.reference")
            for rows in (1, 7, 64) if dry else (1, 8, 64, 513):
                step = random_step(rng, dtype, big_width, max(1, rows // 5))
                got = run_step(step, name, device)
                count += 1
                if not bits_equal(got, step_oracle(step, small=False)):
                    failures.append(f"{name} {dt_name} {step.rows}x{big_width}: mismatch against the dense oracle")
        print(f"  {name:<8} {count} checks in {time.perf_counter() - t0:.1f} s", flush=True)
    return failures


# ---- implementations to time -------------------------------------------------------------------------------


@dataclass
class Impl:
    """A callable masking ``logits`` in place with identity mapping (mask row i → logits row i)."""

    name: str
    make: Callable[[torch.Tensor, torch.Tensor, int], Callable[[], None]]
    max_rows: int = 1 << 30


def maskplug_impl(name: str) -> Impl:
    be = maskplug.get_registry().kernels[name]

    def make(logits: torch.Tensor, bm: torch.Tensor, vocab: int) -> Callable[[], None]:
        rows = bm.shape[0]
        req = torch.arange(rows, dtype=torch.int32, device=logits.device)
        pos = torch.zeros(rows, dtype=torch.int32, device=logits.device)
        cu = torch.arange(rows + 1, dtype=torch.int32, device=logits.device)
        return lambda: be.apply(logits, bm, req, pos, cu, vocab, True)

    # The torch backend's device path materialises a keep-mask per mask row: only small batches.
    return Impl(name, make, max_rows=64 if name == "torch" else 1 << 30)


def _vllm_style_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def per_row_mask(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, index_ptr, vocab, BLOCK: tl.constexpr):
        # One program per (mask row, BLOCK columns); the logits row comes from an index table.
        row = tl.load(index_ptr + tl.program_id(0))
        col0 = tl.program_id(1) * BLOCK
        widx = col0 // 32 + tl.arange(0, BLOCK // 32)
        packed = tl.load(bitmask_ptr + tl.program_id(0) * bitmask_stride + widx, mask=widx < bitmask_stride, other=0)
        drop = ((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
        cols = col0 + tl.arange(0, BLOCK)
        tl.store(
            logits_ptr + row * logits_stride + cols, -float("inf"), mask=(cols < vocab) & tl.reshape(drop, [BLOCK])
        )

    return per_row_mask


def peer_impls(device: torch.device, want_xgrammar_cuda: bool) -> tuple[list[Impl], dict[str, str]]:
    """The peers that import here, and why the others do not."""
    impls: list[Impl] = []
    missing: dict[str, str] = {}
    if device.type == "cpu":
        try:
            import xgrammar

            def make_xgr_cpu(logits: torch.Tensor, bm: torch.Tensor, vocab: int) -> Callable[[], None]:
                return lambda: xgrammar.apply_token_bitmask_inplace(logits, bm, vocab_size=vocab)

            impls.append(Impl(PEER_PREFIX + "xgrammar-cpu", make_xgr_cpu))
        except Exception as exc:
            missing[PEER_PREFIX + "xgrammar-cpu"] = f"{type(exc).__name__}: {exc}"
        missing[PEER_PREFIX + "vllm-style-triton"] = "needs a CUDA device"
        return impls, missing
    try:
        from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_triton as xgr_tr

        def make_xgr_tr(logits: torch.Tensor, bm: torch.Tensor, vocab: int) -> Callable[[], None]:
            return lambda: xgr_tr(logits, bm, vocab_size=vocab)

        impls.append(Impl(PEER_PREFIX + "xgrammar-triton", make_xgr_tr))
    except Exception as exc:
        missing[PEER_PREFIX + "xgrammar-triton"] = f"{type(exc).__name__}: {exc}"
    if want_xgrammar_cuda:
        try:
            t0 = time.perf_counter()
            # Importing builds the extension with nvcc (about a minute, once).
            from xgrammar.kernels.apply_token_bitmask_inplace_cuda import apply_token_bitmask_inplace_cuda as xgr_cu

            print(f"  xgrammar CUDA kernel built in {time.perf_counter() - t0:.0f} s", flush=True)

            def make_xgr_cu(logits: torch.Tensor, bm: torch.Tensor, vocab: int) -> Callable[[], None]:
                return lambda: xgr_cu(logits, bm)

            impls.append(Impl(PEER_PREFIX + "xgrammar-cuda", make_xgr_cu))
        except Exception as exc:
            missing[PEER_PREFIX + "xgrammar-cuda"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    else:
        missing[PEER_PREFIX + "xgrammar-cuda"] = "skipped (--no-xgrammar-cuda)"
    try:
        kern = _vllm_style_kernel()

        def make_vllm(logits: torch.Tensor, bm: torch.Tensor, vocab: int) -> Callable[[], None]:
            rows = bm.shape[0]
            index = torch.arange(rows, dtype=torch.int32, device=logits.device)
            block = 8192
            grid = (rows, -(-vocab // block))
            return lambda: kern[grid](logits, logits.stride(0), bm, bm.stride(0), index, vocab, BLOCK=block)

        impls.append(Impl(PEER_PREFIX + "vllm-style-triton", make_vllm))
    except Exception as exc:
        missing[PEER_PREFIX + "vllm-style-triton"] = f"{type(exc).__name__}: {exc}"
    return impls, missing


# ---- timing -----------------------------------------------------------------------------------------------


def time_us(fn: Callable[[], None], device: torch.device, quick: bool) -> float:
    """Median device time of one call in µs (CUDA: do_bench with L2 flush; CPU: wall clock)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median")) * 1000.0
    fn()
    samples = []
    for _ in range(3 if quick else 10):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples)) * 1e6


def launch_floor_us(device: torch.device) -> float:
    """An empty kernel timed like the others: the least a call can cost."""
    if device.type != "cuda":
        return float("nan")
    import triton

    @triton.jit
    def empty(x_ptr):
        pass

    x = torch.empty(1, device=device)
    return time_us(lambda: empty[(1,)](x), device, quick=False)


def bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """Copy (read + write) and fill (write) bandwidth in bytes per second."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    out: dict[str, float] = {}
    for name, fn, moved in (
        ("copy", lambda: dst.copy_(src), 2 * nbytes),
        ("fill", lambda: dst.fill_(float("-inf")), nbytes),
    ):
        for _ in range(3):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 10
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            sec = start.elapsed_time(end) / 1000.0 / reps
        else:
            t0 = time.perf_counter()
            fn()
            sec = time.perf_counter() - t0
        out[name] = moved / sec
    return out


def required_bytes(kind: str, rows: int, vocab: int, esize: int, count: int) -> int:
    """The least traffic a call must cause: mask words, plus stores (and sector reads where masks are mixed)."""
    mask = rows * (-(-vocab // 32)) * 4
    if kind == "dense":  # nearly every column stored, nothing needs reading
        return mask + rows * vocab * esize
    if kind == "half":  # every 32-byte sector partly written: read and written back
        return mask + 2 * rows * vocab * esize
    return mask + rows * min(count, vocab) * 2 * 32  # a few scattered tokens: one sector each, read + write


@dataclass
class Row:
    """One table row."""

    dtype: str
    batch: int
    mask: str
    impl: str
    us: float
    frac_copy_bw: float
    vs_best_peer: float
    vs_floor: float


def time_table(
    impls: list[Impl],
    device: torch.device,
    batches: list[int],
    vocab: int,
    dtypes: list[str],
    count: int,
    copy_bw: float,
    floor: float,
    deadline: float,
    seed: int,
) -> tuple[list[Row], list[str]]:
    rng = np.random.default_rng(seed)
    rows_out: list[Row] = []
    notes: list[str] = []
    max_b = max(batches)
    masks_host = {k: make_bitmask(rng, max_b, vocab, k, count) for k in MASKS}
    for dt_name in dtypes:
        dtype = DTYPES[dt_name]
        esize = torch.empty(0, dtype=dtype).element_size()
        logits_all = torch.randn(max_b, vocab, device=device).to(dtype)
        for kind in MASKS:
            bm_all = torch.from_numpy(masks_host[kind]).to(device)
            for b in batches:
                if time.perf_counter() > deadline:
                    notes.append(f"time budget reached before {dt_name} {kind} batch {b}")
                    return rows_out, notes
                logits, bm = logits_all[:b], bm_all[:b]
                ref = dense_oracle(logits, masks_host[kind][:b], np.arange(b), vocab) if b <= 64 else None
                results: dict[str, float] = {}
                for impl in impls:
                    if b > impl.max_rows:
                        continue
                    work = logits.clone()
                    try:
                        fn = impl.make(work, bm, vocab)
                        fn()
                        if ref is not None and not bits_equal(work, ref):
                            notes.append(f"{impl.name} {dt_name} {kind} batch {b}: result differs from the oracle")
                        results[impl.name] = time_us(fn, device, quick=b >= 512)
                    except Exception as exc:
                        notes.append(f"{impl.name} {dt_name} {kind} batch {b}: {type(exc).__name__}: {str(exc)[:160]}")
                    del work
                peers = [v for k, v in results.items() if k.startswith(PEER_PREFIX)]
                best_peer = min(peers) if peers else float("nan")
                need = required_bytes(kind, b, vocab, esize, count)
                for name, us in results.items():
                    frac = need / (us * 1e-6) / copy_bw if copy_bw > 0 else float("nan")
                    rows_out.append(
                        Row(dt_name, b, kind, name, us, frac, us / best_peer, us / floor if b <= 8 else float("nan"))
                    )
                print(
                    f"  {dt_name} {kind:<6} batch {b:>5}: " + ", ".join(f"{k}={v:.1f}" for k, v in results.items()),
                    flush=True,
                )
            del bm_all
        del logits_all
    return rows_out, notes


def format_table(rows: list[Row]) -> str:
    def num(x: float, fmt: str) -> str:
        return "–" if x != x else format(x, fmt)

    lines = [
        "| dtype | batch | mask | implementation | µs/call | of copy BW | × best peer | × launch floor |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.dtype} | {r.batch} | {r.mask} | {r.impl} | {r.us:.1f} | {num(r.frac_copy_bw, '.0%')} | "
            f"{num(r.vs_best_peer, '.2f')} | {num(r.vs_floor, '.2f')} |"
        )
    return "\n".join(lines)


def host_overhead_us(backend: str, device: torch.device, rows: int, vocab: int) -> float:
    """Wall-clock µs per full ``apply_grammar_bitmask`` call with a NumPy mapping (validation + staging + launch)."""
    logits = torch.randn(rows, vocab, device=device)
    bm = torch.full((rows, -(-vocab // 32)), -1, dtype=torch.int32, device=device)
    req, pos, cu = np.arange(rows), np.zeros(rows, dtype=np.int64), np.arange(rows + 1)
    for _ in range(5):
        maskplug.apply_grammar_bitmask(logits, bm, (req, pos), cu, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        maskplug.apply_grammar_bitmask(logits, bm, (req, pos), cu, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, torch backend: tests the script")
    ap.add_argument("--batches", default="1,8,64,512,4096")
    ap.add_argument("--vocab", type=int, default=131_072)
    ap.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated, of {sorted(DTYPES)}")
    ap.add_argument("--count", type=int, default=1000, help="allowed (dense) or masked (sparse) tokens per row")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop timing after this many seconds")
    ap.add_argument("--no-xgrammar-cuda", action="store_true", help="skip building xgrammar's CUDA kernel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    if args.dry_run:
        device = torch.device("cpu")
        batches, vocab, count, bw_bytes = [1, 4], 4096, 64, 64 << 20
    else:
        if not torch.cuda.is_available():
            print(
                "gpu_bench: no CUDA device (torch.cuda.is_available() is False); use --dry-run on a CPU",
                file=sys.stderr,
            )
            return 2
        device = torch.device("cuda")
        batches, vocab, count, bw_bytes = [int(b) for b in args.batches.split(",")], args.vocab, args.count, 1 << 30
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: expected names from {sorted(DTYPES)}, got {d!r}")

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"maskplug {maskplug.__version__} · torch {torch.__version__} · {card} · {time.strftime('%Y-%m-%d')}")
    status = maskplug.backend_status(device)
    for name, why in status.items():
        print(f"  backend {name:<8} {'available' if why is None else 'unavailable: ' + why}")
    ours = [n for n in ("cupy", "triton") if status.get(n) is None]
    if args.dry_run:
        ours.append("torch")
    if not ours:
        print("gpu_bench: none of maskplug's kernel backends can run here", file=sys.stderr)
        return 2

    print("\n[1] correctness against maskplug.reference and the dense oracle", flush=True)
    failures = check_backends(ours, device, args.dry_run, args.seed)
    for f in failures:
        print("  FAIL", f)
    print(f"  {'all passed' if not failures else f'{len(failures)} failures'}", flush=True)

    print("\n[2] device memory bandwidth", flush=True)
    bw = bandwidth(device, bw_bytes)
    print(f"  copy {bw['copy'] / 1e9:.0f} GB/s (read + write) · fill {bw['fill'] / 1e9:.0f} GB/s (write)", flush=True)
    floor = launch_floor_us(device)
    print(f"  launch floor (empty kernel, do_bench median): {floor:.1f} µs", flush=True)

    print("\n[3] timings", flush=True)
    peers, missing = peer_impls(device, want_xgrammar_cuda=not args.no_xgrammar_cuda and not args.dry_run)
    for name, why in missing.items():
        print(f"  {name} not timed: {why}")
    impls = [maskplug_impl(n) for n in ours] + peers
    deadline = t_start + args.budget_s
    rows, notes = time_table(impls, device, batches, vocab, dtypes, count, bw["copy"], floor, deadline, args.seed)
    overhead = {n: host_overhead_us(n, device, 64 if not args.dry_run else 4, vocab) for n in ours}

    print(
        f"\n[4] results (vocabulary {vocab}; 'of copy BW' = least bytes the call must move / time / copy bandwidth)\n"
    )
    print(format_table(rows))
    print()
    for n, us in overhead.items():
        print(
            f"host µs per apply_grammar_bitmask call (batch {64 if not args.dry_run else 4}, NumPy mapping): {n} {us:.1f}"
        )
    for note in notes:
        print("note:", note)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "card": card,
                    "date": time.strftime("%Y-%m-%d"),
                    "vocab": vocab,
                    "bandwidth": bw,
                    "launch_floor_us": floor,
                    "failures": failures,
                    "rows": [asdict(r) for r in rows],
                    "host_overhead_us": overhead,
                    "notes": notes,
                    "not_timed": missing,
                },
                fh,
                indent=1,
            )
    return 1 if failures or any("differs" in n for n in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
