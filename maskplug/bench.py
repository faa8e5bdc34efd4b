"""``maskplug bench``: compact versions of the benchmarks under ``benchmarks/``, as one command.

Each measurement times maskplug and a peer on the same inputs in the same run
(median of repeats) and reports the ratio ``peer / maskplug`` (above 1:
maskplug is faster):

* **host path**: layout, ``choose_budget``, ``compact`` and the row mapping
  for ``n`` requests × 7 drafts, against the straightforward per-request
  Python of :func:`maskplug.baselines.python_step`;
* **apply**: ``apply_grammar_bitmask`` (the ``auto`` backend) on
  ``rows × V`` fp32 logits, against xgrammar's ``apply_token_bitmask_inplace``
  when xgrammar is installed, and against a dense torch unpack-and-fill;
* **draft rows**: ``fill_draft_masks`` against a sequential
  accept/fill/rollback loop, per installed grammar provider (a request it
  fails stops the benchmark with the engine's error, not a comparison).

The scripts in ``benchmarks/`` measure more sizes and record results; this
command is the quick look. Outputs are checked equal before anything is timed.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .baselines import PythonCost, python_step
from .budget import CostModel, choose_budget
from .compaction import compact
from .console import Justify, Progress, render_table
from .dispatch import apply_grammar_bitmask, resolve_backend
from .draftmasks import DraftMasks
from .errors import GrammarError
from .layout import GrammarRows, ScheduledLayout

__all__ = ["BenchRow", "run_bench"]


@dataclass
class BenchRow:
    """One line of the summary: maskplug's time, the peer's, and their ratio."""

    bench: str
    size: str
    maskplug_us: float
    peer: str
    peer_us: float

    @property
    def ratio(self) -> float:
        """``peer / maskplug``: above 1, maskplug is faster."""
        return self.peer_us / self.maskplug_us if self.maskplug_us > 0 else float("nan")


def _time(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up (allocations, caches)
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return 1e6 * statistics.median(samples)


def _host_path(n: int, repeat: int) -> list[BenchRow]:
    rng = np.random.default_rng(n)
    ids = [f"req-{i}" for i in range(n)]
    nd = np.full(n, 7)
    nnd = np.ones(n, dtype=np.int64)
    conf = rng.random((n, 7))
    cost = CostModel.linear(1.0, 0.01, 5.0, 0.02)
    py_cost = PythonCost(1.0, 0.01, 5.0, 0.02)  # the same straight line, in plain Python
    order = [str(x) for x in rng.permutation(ids)]
    nd_list, nnd_list, conf_list = nd.tolist(), nnd.tolist(), conf.tolist()

    def ours() -> Any:
        lay = ScheduledLayout(ids, nd, nnd)
        dec = choose_budget(conf, lay, cost)
        return dec.budget, compact(lay, dec.budget).cu_logits, GrammarRows(order).mapping(lay)

    def peer() -> Any:
        return python_step(ids, nd_list, nnd_list, conf_list, order, py_cost)

    a, b = ours(), peer()
    assert a[0] == b[0] and a[1].tolist() == b[1] and a[2].request.tolist() == b[2] and a[2].position.tolist() == b[3]
    return [BenchRow("host path", f"n={n}", _time(ours, repeat), "per-request Python", _time(peer, repeat))]


def _apply(rows: int, vocab: int, repeat: int) -> list[BenchRow]:
    rng = np.random.default_rng(rows)
    words = (vocab + 31) // 32
    base = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32))
    bm = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32))
    req = np.arange(rows, dtype=np.int32)
    pos = np.zeros(rows, dtype=np.int32)
    cu = np.arange(rows + 1, dtype=np.int64)
    backend = resolve_backend("auto", torch.device("cpu")).name
    buf = base.clone()
    shifts = torch.arange(32, dtype=torch.int32)

    def ours() -> None:
        buf.copy_(base)
        apply_grammar_bitmask(buf, bm, (req, pos), cu, vocab_size=vocab)

    peer_buf = base.clone()

    def dense() -> None:
        peer_buf.copy_(base)
        bits = ((bm[:, :, None] >> shifts) & 1).reshape(rows, -1)[:, :vocab]
        peer_buf.masked_fill_(bits == 0, float("-inf"))

    ours()
    dense()
    assert torch.equal(buf, peer_buf)
    t_ours = _time(ours, repeat)
    out = [BenchRow(f"apply ({backend})", f"{rows}x{vocab}", t_ours, "torch unpack+fill", _time(dense, repeat))]
    try:
        import xgrammar as xgr
    except ImportError:
        return out
    xg_buf = base.clone()

    def xg() -> None:
        xg_buf.copy_(base)
        xgr.apply_token_bitmask_inplace(xg_buf, bm, vocab_size=vocab)

    xg()
    assert torch.equal(xg_buf, buf)
    out.append(BenchRow(f"apply ({backend})", f"{rows}x{vocab}", t_ours, "xgrammar CPU kernel", _time(xg, repeat)))
    return out


def _draft_pair(
    matchers: list[Any],
    draft_list: list[list[int]],
    bm_a: torch.Tensor,
    bm_b: torch.Tensor,
    rows: GrammarRows,
    lay: ScheduledLayout,
    drafts: int,
) -> tuple[Callable[[], DraftMasks], Callable[[], None]]:
    """maskplug's producer (returning what it learned) and the sequential accept/fill/rollback loop it replaces."""
    from .grammar import fill_draft_masks

    def ours() -> DraftMasks:
        return fill_draft_masks(matchers, draft_list, bm_a, rows, lay)

    def peer() -> None:
        row = 0
        for m, ds in zip(matchers, draft_list, strict=True):
            taken = 0
            for p in range(drafts + 1):
                if taken == p:
                    m.fill(bm_b, row + p)
                    if p < drafts and m.accept(ds[p]):
                        taken += 1
                else:
                    bm_b[row + p].fill_(-1)  # past a rejected draft every row allows everything
            m.rollback(taken)
            row += drafts + 1

    return ours, peer


def _draft_rows(tokenizer: str, requests: int, drafts: int, repeat: int) -> list[BenchRow]:
    from .data import load_schemas, load_tokenizer
    from .grammar import GrammarSpec, grammar_provider, grammar_providers

    tok = load_tokenizer(tokenizer)
    schemas = load_schemas()
    out = []
    for name in grammar_providers():
        prov = grammar_provider(name, tok.vocab)
        spec = GrammarSpec("json_schema", json.dumps(schemas[0][1]))
        if not prov.supports("json_schema"):
            continue
        compiled = prov.compile(spec)
        matchers = [compiled.matcher() for _ in range(requests)]
        prefix = tok.encode('{"street": "')
        for m in matchers:
            for t in prefix:
                m.accept(t)
        word = tok.encode("main road 12 north")[:drafts]
        draft_list = [word + [word[-1]] * (drafts - len(word)) for _ in range(requests)]
        ids = list(range(requests))
        lay = ScheduledLayout(ids, [drafts] * requests, [1] * requests)
        rows = GrammarRows(ids)
        bm_a = tok.vocab.new_bitmask(rows.num_rows(lay))
        bm_b = tok.vocab.new_bitmask(rows.num_rows(lay))

        ours, peer = _draft_pair(matchers, draft_list, bm_a, bm_b, rows, lay, drafts)
        failed = ours().failed
        if failed:
            # The engine failed a request: say why, rather than comparing its stop-only rows.
            r, err = next(iter(failed.items()))
            raise GrammarError(
                f"draft rows ({name}): fill_draft_masks failed {len(failed)} of {requests} requests; request {r}: {err}"
            ) from err
        peer()
        if not torch.equal(bm_a, bm_b):
            raise AssertionError(f"draft rows: fill_draft_masks and the sequential loop disagree for {name}")
        out.append(
            BenchRow(
                f"draft rows ({name})",
                f"{requests}x{drafts + 1} rows",
                _time(ours, repeat),
                "sequential loop",
                _time(peer, repeat),
            )
        )
    return out


def run_bench(quick: bool = False, as_json: bool = False, progress: bool = True) -> int:
    """Run the benchmarks, print the summary table (or JSON); return the exit status."""
    repeat = 5 if quick else 20
    jobs: list[tuple[str, Callable[[], list[BenchRow]]]] = []
    for n in (8, 64) if quick else (8, 64, 256, 1024):
        jobs.append((f"host path n={n}", lambda n=n: _host_path(n, repeat)))  # type: ignore[misc]
    for nrows, vocab in ((8, 32000),) if quick else ((8, 131072), (64, 131072)):
        jobs.append((f"apply {nrows}x{vocab}", lambda r=nrows, v=vocab: _apply(r, v, repeat)))  # type: ignore[misc]
    if quick:
        jobs.append(("draft rows", lambda: _draft_rows("spm", 8, 3, repeat)))
    else:
        jobs.append(("draft rows", lambda: _draft_rows("tekken", 64, 7, repeat)))
    rows: list[BenchRow] = []
    with Progress(len(jobs), "bench", enabled=progress) as bar:
        for i, (label, job) in enumerate(jobs):
            bar.update(i, label)
            rows += job()
        bar.update(len(jobs))
    if as_json:
        print(json.dumps([{**r.__dict__, "ratio": round(r.ratio, 3)} for r in rows], indent=2))
        return 0
    columns: list[tuple[str, Justify]] = [
        ("benchmark", "left"),
        ("size", "left"),
        ("maskplug µs", "right"),
        ("peer", "left"),
        ("peer µs", "right"),
        ("peer/maskplug", "right"),
    ]
    table = [[r.bench, r.size, f"{r.maskplug_us:,.1f}", r.peer, f"{r.peer_us:,.1f}", f"{r.ratio:.2f}"] for r in rows]
    print(render_table(columns, table))
    print("\nmedian of repeats, same inputs, same run; peer/maskplug above 1 means maskplug is faster")
    return 0
