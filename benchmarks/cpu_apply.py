"""CPU mask apply: maskplug's torch backend against xgrammar's CPU kernel and plain torch.

64 logits rows × 131,072 columns (a 128k vocabulary). Two kinds of mask:

* ``json``: a few hundred allowed tokens per row, as a JSON grammar gives
  between structural tokens;
* ``half``: random bits, about half of the vocabulary allowed.

Peers, measured in the same run on the same inputs:

* ``xgrammar``: ``xgrammar.apply_token_bitmask_inplace`` (its C++ CPU kernel);
* ``expand+fill``: the plain torch approach, expanding the bits to a boolean
  mask of the logits shape and calling ``masked_fill_``;
* ``copy``: a single-threaded numpy copy of the same logits, the least any
  apply that writes every row can cost (the ``/ copy`` column: maskplug's time
  over it).

Each timed call starts from freshly copied logits (the copy is not timed); all
three results are checked to be identical before anything is timed.

Every table is measured twice in the same run: on the machine as it is
(``idle``), and ``loaded``, with a competing process spinning on one core (pinned
to the first CPU this process may use) for the whole measurement, as a CPU serving
engine's other work would. Both are repeated for each torch intra-op thread
setting of the caller (``--threads``, default ``1`` and torch's default), since
a kernel that leans on torch's thread pool behaves differently under each.

``--fixed`` measures instead the per-call cost at one request (one decode row:
no drafts, one bonus row), where argument handling is most of the work: maskplug
with the mapping and offsets a :class:`~maskplug.StepPlanner` step returns (a
checked mapping, trusted), maskplug with the same mapping as a plain
``(request, position)`` pair (every check), ``xgrammar.apply_token_bitmask_inplace``
and ``logits.masked_fill_(~mask, -inf)`` with the boolean mask already expanded
(the least any torch approach does), at a 32-token and a 131,072-token
vocabulary. Calls are interleaved one by one; the figure is the median per call.
A second line (``cpu``) gives the CPU time of the calling thread per call, the
median over batches of 100 calls interleaved peer by peer: on a shared machine
the wall-clock figure also counts time the process spent waiting for a core.

Run: ``.venv/bin/python benchmarks/cpu_apply.py [--repeat N] [--threads 1,default] [--load idle,loaded] [--fixed]``
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mproc
import os
import statistics
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

import maskplug as mp

ROWS = 64
VOCAB = 131_072
INT_VIEWS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
WORDS = VOCAB // 32


def json_like_masks(rng: np.random.Generator, rows: int) -> torch.Tensor:
    """A few hundred allowed tokens per row: clustered (as token ids of punctuation and keys are) and scattered."""
    bm = np.zeros((rows, WORDS), dtype=np.uint32)
    for r in range(rows):
        scattered = rng.choice(VOCAB, size=int(rng.integers(100, 400)), replace=False)
        start = int(rng.integers(0, VOCAB - 256))
        clustered = np.arange(start, start + int(rng.integers(16, 128)))
        tok = np.concatenate([scattered, clustered])
        np.bitwise_or.at(bm[r], tok >> 5, (np.uint32(1) << (tok & 31).astype(np.uint32)))
    return torch.from_numpy(bm.view(np.int32))


def half_masks(rng: np.random.Generator, rows: int) -> torch.Tensor:
    return torch.from_numpy(
        rng.integers(0, 2**32, size=(rows, WORDS), dtype=np.uint64).astype(np.uint32).view(np.int32)
    )


def expand_and_fill(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The straightforward torch approach: one boolean per logit, then masked_fill_."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))


def median_ms(fn: Callable[[torch.Tensor], None], source: torch.Tensor, repeat: int) -> tuple[float, float]:
    """Median wall-clock and median CPU time of the calling thread, in ms.

    With one torch thread every peer runs entirely on the calling thread, so
    its CPU time is the work done, unaffected by waiting for a busy machine.
    """
    work = source.clone()
    fn(work)  # warm up (allocations, lazy initialisation)
    wall, cpu = [], []
    for _ in range(repeat):
        work.copy_(source)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        fn(work)
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - t0)
    return statistics.median(wall) / 1e6, statistics.median(cpu) / 1e6


def _spin(cpu: int) -> None:  # pragma: no cover - runs in the competing process
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {cpu})
    x = 0
    while True:
        x += 1


@contextlib.contextmanager
def competitor(loaded: bool) -> Iterator[str]:
    """A process spinning on one core for the duration (nothing when ``loaded`` is false)."""
    if not loaded:
        yield "none"
        return
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    proc = mproc.get_context("spawn").Process(target=_spin, args=(cpus[0],), daemon=True)
    proc.start()
    try:
        time.sleep(0.5)  # let it reach its core
        yield f"one process spinning on CPU {cpus[0]}"
    finally:
        proc.terminate()
        proc.join()


def table(
    xgr_apply: Callable[[torch.Tensor, torch.Tensor], None] | None,
    repeat: int,
    label: str,
) -> None:
    """One table: both mask kinds, three dtypes, every peer, in the current thread setting and load."""
    # Eight requests with seven drafts plus a bonus each, full budget: 64 mask rows onto 64 logits rows.
    layout = mp.ScheduledLayout(list(range(8)), [7] * 8, [1] * 8)
    mapping = mp.GrammarRows(list(range(8))).mapping(layout)
    cu = mp.compact(layout, layout.total_drafts).cu_logits
    assert len(mapping) == ROWS and int(cu[-1]) == ROWS

    rng = np.random.default_rng(0)
    base = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
    print(f"\n{label}; median of {repeat} calls")
    head = f"{'mask':<5} {'dtype':<9}"
    for peer in ("maskplug", "xgrammar", "expand+fill"):
        head += f" {peer + ' wall':>16} {peer + ' cpu':>15}"
    print(head + f" {'copy wall':>10} {'copy cpu':>9} {'vs xgrammar':>12} {'vs expand+fill':>15} {'/ copy':>11}")
    for mask_name, make in (("json", json_like_masks), ("half", half_masks)):
        bitmask = make(rng, ROWS)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            source = base.to(dtype)

            def ours(x: torch.Tensor, bm: torch.Tensor = bitmask) -> None:
                mp.apply_grammar_bitmask(x, bm, mapping, cu, backend="torch")

            def plain(x: torch.Tensor, bm: torch.Tensor = bitmask) -> None:
                expand_and_fill(x, bm)

            src_np = source.view(INT_VIEWS[dtype]).numpy()

            def copy(x: torch.Tensor, src: np.ndarray = src_np) -> None:
                # The copy limit: one single-threaded numpy pass reading and writing every logit.
                np.copyto(x.view(INT_VIEWS[x.dtype]).numpy(), src)

            peers: dict[str, Callable[[torch.Tensor], None]] = {"maskplug": ours, "expand+fill": plain}
            if xgr_apply is not None and dtype == torch.float32:

                def theirs(x: torch.Tensor, bm: torch.Tensor = bitmask) -> None:
                    xgr_apply(x, bm)  # type: ignore[misc]

                peers["xgrammar"] = theirs
            # Same answer from every peer before any timing.
            results = {}
            for name, fn in peers.items():
                out = source.clone()
                fn(out)
                results[name] = out
            for name, out in results.items():
                assert torch.equal(out, results["maskplug"]), f"{name} disagrees with maskplug"
            ms = {name: median_ms(fn, source, repeat) for name, fn in peers.items()}
            ms["copy"] = median_ms(copy, source, repeat)
            row = f"{mask_name:<5} {str(dtype).removeprefix('torch.'):<9}"
            for peer in ("maskplug", "xgrammar", "expand+fill"):
                w, c = ms.get(peer, (float("nan"), float("nan")))
                row += f" {w:>16.2f} {c:>15.2f}"
            ours_w, ours_c = ms["maskplug"]
            row += f" {ms['copy'][0]:>10.2f} {ms['copy'][1]:>9.2f}"
            for peer, width in (("xgrammar", 12), ("expand+fill", 15)):
                if peer in ms:
                    row += f" {f'{ms[peer][0] / ours_w:.1f}x, {ms[peer][1] / ours_c:.1f}x':>{width}}"
                else:
                    row += f" {'-':>{width}}"
            # maskplug's time over the copy's (the goal: within 2x), wall and cpu.
            over = f"{ours_w / ms['copy'][0]:.1f}x, {ours_c / ms['copy'][1]:.1f}x"
            row += f" {over:>11}"
            print(row, flush=True)


def fixed_cost(xgr_apply: Callable[[torch.Tensor, torch.Tensor], None] | None, calls: int) -> None:
    """Per-call cost at one request: the argument handling around a one-row apply."""
    from maskplug.steps import StepPlanner

    planner = StepPlanner(["req-0"], ["req-0"])
    step = planner.step(np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64))
    mapping, cu = step.mapping, step.compaction.cu_logits
    pair = (mapping.request.copy(), mapping.position.copy())
    print(f"\nper-call cost at one request (one row), median of {calls} interleaved calls, µs")
    print(
        f"{'vocab':>8} {'clock':>5} {'maskplug':>9} {'checked':>8} {'xgrammar':>9} {'masked_fill_':>13}"
        f" {'vs xgrammar':>12}"
    )
    rng = np.random.default_rng(1)
    for vocab in (32, VOCAB):
        words = (vocab + 31) // 32
        bm = torch.from_numpy(rng.integers(0, 2**32, size=(1, words), dtype=np.uint64).astype(np.uint32).view(np.int32))
        allowed = ((bm.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(1, -1)[:, :vocab]
        logits = torch.randn(1, vocab)

        def ours(x: torch.Tensor = logits, b: torch.Tensor = bm) -> None:
            mp.apply_grammar_bitmask(x, b, mapping, cu)

        def checked(x: torch.Tensor = logits, b: torch.Tensor = bm) -> None:
            mp.apply_grammar_bitmask(x, b, pair, cu)

        def fill(x: torch.Tensor = logits, m: torch.Tensor = allowed) -> None:
            x.masked_fill_(~m, float("-inf"))

        peers: dict[str, Callable[[], None]] = {"maskplug": ours, "checked": checked, "masked_fill_": fill}
        if xgr_apply is not None:

            def theirs(x: torch.Tensor = logits, b: torch.Tensor = bm) -> None:
                xgr_apply(x, b)  # type: ignore[misc]

            peers["xgrammar"] = theirs
        # Same answer from every peer first.
        outs = {}
        for name, fn in peers.items():
            saved = logits.clone()
            fn()
            outs[name] = logits.clone()
            logits.copy_(saved)
        for name, out in outs.items():
            assert torch.equal(out, outs["maskplug"]), f"{name} disagrees with maskplug"
        times: dict[str, list[int]] = {name: [] for name in peers}
        for fn in peers.values():
            for _ in range(100):
                fn()  # masking twice changes nothing: every call does the same work
        for _ in range(calls):
            for name, fn in peers.items():
                t0 = time.perf_counter_ns()
                fn()
                times[name].append(time.perf_counter_ns() - t0)
        cpu: dict[str, list[float]] = {name: [] for name in peers}
        for _ in range(max(1, calls // 100)):
            for name, fn in peers.items():
                c0 = time.thread_time_ns()
                for _ in range(100):
                    fn()
                cpu[name].append((time.thread_time_ns() - c0) / 100)
        for clock, table in (("wall", times), ("cpu", cpu)):
            med = {name: statistics.median(ts) / 1e3 for name, ts in table.items()}
            xg = med.get("xgrammar", float("nan"))
            print(
                f"{vocab:>8} {clock:>5} {med['maskplug']:>9.1f} {med['checked']:>8.1f} {xg:>9.1f}"
                f" {med['masked_fill_']:>13.1f} {xg / med['maskplug']:>11.1f}x",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30, help="timed calls per cell (default 30)")
    parser.add_argument(
        "--threads",
        default="1,default",
        help="comma-separated torch intra-op thread settings of the caller: numbers or 'default' (default '1,default')",
    )
    parser.add_argument(
        "--load",
        default="idle,loaded",
        help="comma-separated: 'idle' (the machine as it is), 'loaded' (one competing process spinning on a core)",
    )
    parser.add_argument("--fixed", action="store_true", help="only the per-call cost at one request")
    parser.add_argument("--calls", type=int, default=20000, help="interleaved calls per peer with --fixed")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    settings = [default_threads if t.strip() == "default" else int(t) for t in args.threads.split(",")]
    loads = [x.strip() for x in args.load.split(",")]
    if any(x not in ("idle", "loaded") for x in loads):
        parser.error(f"--load: expected 'idle' and/or 'loaded', got {args.load!r}")
    try:
        import xgrammar

        xgr_apply: Callable[[torch.Tensor, torch.Tensor], None] | None = xgrammar.apply_token_bitmask_inplace
    except ImportError:  # pragma: no cover - xgrammar is installed in the dev environment
        xgr_apply = None

    if args.fixed:
        print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}")
        fixed_cost(xgr_apply, args.calls)
        return
    print(f"CPU mask apply, {ROWS} x {VOCAB:,}; {os.cpu_count()} CPUs; torch default threads {default_threads}")
    print("wall: wall-clock ms; cpu: CPU ms of the calling thread; ratios: peer time / maskplug time (wall, cpu)")
    print("xgrammar's CPU kernel is single-threaded whatever the torch setting")
    for threads in settings:
        torch.set_num_threads(threads)
        for load in loads:
            with competitor(load == "loaded") as who:
                table(xgr_apply, args.repeat, f"torch threads {threads}, {load} (competitor: {who})")
    torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
