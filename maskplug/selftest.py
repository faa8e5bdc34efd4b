"""``maskplug selftest``: every installed backend and provider against independent checks, in seconds.

* the core host functions (row mapping, compaction, ``choose_budget``,
  ``allocate``) against :mod:`maskplug.reference` on random layouts;
* every kernel backend that can run here, against
  :func:`maskplug.reference.apply_grammar_bitmask`, bit for bit, in all three
  budget regimes, both producer modes, fp32/fp16/bf16, with vocabulary tails;
* every grammar provider on a small vocabulary: along random walks through a
  few regular expressions, each filled mask row is compared with ``accept``
  (token by token) and with an independent prefix oracle (the ``regex``
  package's partial matching): an allowed token keeps the text a prefix of the
  language, the stop token is allowed exactly when the text is complete; and
  :func:`maskplug.fill_draft_masks` is compared with a sequential
  accept/fill/rollback loop (a request it fails is reported with the
  engine's error, :attr:`maskplug.DraftMasks.failed`).

A backend or provider that cannot run here is listed with the reason and is
not counted as passed. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from . import reference
from .budget import CostModel, allocate, choose_budget
from .compaction import active_cu_logits, compact
from .console import Progress, render_table
from .dispatch import apply_grammar_bitmask, backend_status
from .layout import GrammarRows, ScheduledLayout

__all__ = ["CheckResult", "run_selftest"]


@dataclass
class CheckResult:
    """One line of the self-test: what was checked, on how many cases, and what went wrong."""

    name: str
    cases: int = 0
    status: str = "passed"  # passed | FAILED | unavailable
    detail: str = ""
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        """Record a mismatch."""
        self.status = "FAILED"
        if len(self.failures) < 5:
            self.failures.append(what)


def _random_layout(rng: np.random.Generator, max_n: int = 6, max_k: int = 5) -> ScheduledLayout:
    n = int(rng.integers(0, max_n + 1))
    nd = rng.integers(0, max_k + 1, size=n)
    nn = rng.integers(1, 4, size=n)
    ids = rng.permutation(100)[:n]
    return ScheduledLayout(ids, nd, nn, num_bonus=int(rng.integers(1, 3)))


def _check_core(rng: np.random.Generator, cases: int) -> CheckResult:
    res = CheckResult("core host path vs reference")
    cost = CostModel.linear(1.0, 0.02, 5.0, 0.05)
    for _ in range(cases):
        lay = _random_layout(rng)
        res.cases += 1
        order = rng.permutation(lay.req_ids)[: int(rng.integers(0, lay.n + 1))]
        for mode in ("ragged", "fixed"):
            stride = int(lay.num_drafts.max(initial=0)) + lay.num_bonus + int(rng.integers(0, 2))
            rows = GrammarRows(order, mode, stride if mode == "fixed" else None)  # type: ignore[arg-type]
            got, want = rows.mapping(lay), reference.mapping(rows, lay)
            if not (np.array_equal(got.request, want.request) and np.array_equal(got.position, want.position)):
                res.fail(f"mapping {mode}: {lay!r}")
        k = int(lay.num_drafts.max(initial=0))
        conf = rng.choice([0.0, 0.25, 0.5, 0.9, 1.0], size=(lay.n, max(k, 1)))
        dec, ref_dec = choose_budget(conf, lay, cost), reference.choose_budget(conf, lay, cost)
        if dec.budget != ref_dec.budget:
            res.fail(f"choose_budget {dec.budget} != reference {ref_dec.budget} for {lay!r}")
        b = int(rng.integers(0, lay.total_drafts + 1))
        cap = allocate(torch.tensor(conf), lay.num_drafts, b).tolist()
        if cap != list(reference.allocate(conf, lay.num_drafts, b)):
            res.fail(f"allocate budget {b}: {cap} for {lay!r}")
        for capacity in (None, np.asarray(cap, dtype=np.int64)):
            c, rc = compact(lay, b, capacity), reference.compact(lay, b, capacity)
            same = (
                c.regime == rc.regime
                and c.exact == rc.exact
                and np.array_equal(c.cu_logits, rc.cu_logits)
                and c.num_tokens == rc.num_tokens
            )
            if not same:
                res.fail(f"compact budget {b} capacity {capacity}: {c} vs {rc}")
    return res


def _check_backend(name: str, device: torch.device, rng: np.random.Generator, cases: int) -> CheckResult:
    res = CheckResult(f"kernel {name} on {device.type}")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    for i in range(cases):
        lay = _random_layout(rng)
        if lay.n == 0:
            continue
        res.cases += 1
        width = int(rng.integers(1, 140))
        vocab = int(rng.integers(1, width + 1))
        words = (vocab + 31) // 32
        mode = "fixed" if rng.random() < 0.3 else "ragged"
        stride = int(lay.num_drafts.max()) + lay.num_bonus + 1
        order = rng.permutation(lay.req_ids)[: int(rng.integers(1, lay.n + 1))]
        rows = GrammarRows(order, mode, stride if mode == "fixed" else None)  # type: ignore[arg-type]
        mapping = rows.mapping(lay)
        regime = i % 3  # zero, partial, full in turn
        total = lay.total_drafts
        b = 0 if regime == 0 else (total if regime == 2 else int(rng.integers(0, total + 1)))
        conf = torch.tensor(rng.random((lay.n, max(int(lay.num_drafts.max()), 1))))
        cap = allocate(conf, lay.num_drafts, b)
        cu = active_cu_logits(cap, lay.num_bonus)
        total_rows = int(cu[-1])
        dtype = dtypes[i % 3]
        logits = torch.from_numpy(rng.standard_normal((total_rows, width))).to(dtype)
        bm = torch.from_numpy(
            rng.integers(-(2**31), 2**31, size=(len(mapping), words), dtype=np.int64).astype(np.int32)
        )
        tail: Literal["mask", "keep"] = "mask" if rng.random() < 0.5 else "keep"
        want = logits.clone()
        reference.apply_grammar_bitmask(want, bm, mapping, cu, vocab_size=vocab, tail=tail)
        got = logits.to(device)
        apply_grammar_bitmask(
            got,
            bm.to(device),
            mapping,
            cu.to(device),
            vocab_size=vocab,
            tail=tail,
            backend=name,
        )
        if not torch.equal(got.cpu(), want):
            res.fail(f"case {i}: {lay!r}, budget {b}, {mode}, {dtype}, vocab {vocab}/{width}, tail {tail}")
    return res


# A small vocabulary: every printable ASCII byte plus a few multi-byte tokens, stop token last.
_MULTI = (b"ab", b"abc", b"12", b"123", b"-1", b"00", b", ", b"yes", b"no", b"cat", b"at", b"@x", b".com")
_REGEXES = (r"[a-c]{2,5}", r"[0-9]{3}-[0-9]{2}", r"(yes|no), [a-z]{1,4}", r"[a-z]+@x\.com", r"-?[1-9][0-9]{0,3}")


def _small_vocab() -> Any:
    from .grammar import Vocab

    toks = [bytes([c]) for c in range(32, 127)] + list(_MULTI) + [b"</s>"]
    return Vocab(toks, eos_ids=[len(toks) - 1], special_ids=[len(toks) - 1], vocab_size=len(toks) + 5)


def _allowed(bitmask: torch.Tensor, row: int, n: int) -> np.ndarray:
    words = bitmask[row].numpy().astype("<i4").view(np.uint8)
    return np.unpackbits(words, bitorder="little")[:n].astype(bool)


def _check_provider(name: str, rng: np.random.Generator, cases: int) -> CheckResult:
    from .grammar import GrammarSpec, commit, fill_draft_masks, grammar_provider

    res = CheckResult(f"grammar {name}")
    try:
        import regex as rx
    except ImportError:
        res.status, res.detail = "unavailable", "needs the 'regex' package for the independent prefix oracle"
        return res
    vocab = _small_vocab()
    prov = grammar_provider(name, vocab)
    if not prov.supports("regex"):
        res.status, res.detail = "unavailable", "provider does not support regex grammars"
        return res
    eos = vocab.eos_ids[0]
    n_tok = len(vocab.tokens)
    for c in range(cases):
        pattern = _REGEXES[c % len(_REGEXES)]
        m = prov.compile(GrammarSpec("regex", pattern)).matcher()
        text = b""
        res.cases += 1
        for _ in range(12):
            bm = vocab.new_bitmask(1)
            m.fill(bm, 0)
            allowed = _allowed(bm, 0, n_tok)
            done = rx.fullmatch(pattern, text.decode()) is not None
            if bool(allowed[eos]) != done:
                res.fail(f"{pattern!r} after {text!r}: stop token allowed={bool(allowed[eos])}, text complete={done}")
            for t in np.nonzero(allowed)[0].tolist():
                if t == eos:
                    continue
                cand = (text + vocab.tokens[t]).decode()
                if rx.fullmatch(pattern, cand, partial=True) is None:
                    res.fail(f"{pattern!r}: token {vocab.tokens[t]!r} allowed after {text!r} leaves the language")
            probe = rng.choice(n_tok - 1, size=8, replace=False).tolist()
            for t in probe:
                ok = m.accept(int(t))
                if ok:
                    m.rollback(1)
                if ok != bool(allowed[t]):
                    res.fail(
                        f"{pattern!r} after {text!r}: accept({vocab.tokens[t]!r})={ok}, mask says {bool(allowed[t])}"
                    )
            choices = [t for t in np.nonzero(allowed)[0].tolist() if t != eos]
            if not choices:
                break
            t = int(rng.choice(choices))
            if commit(m, [t]) != 1:
                res.fail(f"{pattern!r}: commit refused allowed token {vocab.tokens[t]!r} after {text!r}")
                break
            text += vocab.tokens[t]
        # fill_draft_masks against a sequential accept / fill / rollback loop.
        m2 = prov.compile(GrammarSpec("regex", pattern)).matcher()
        drafts = [int(x) for x in rng.choice(n_tok, size=3)]
        lay = ScheduledLayout(["r"], [3], [1])
        rows = GrammarRows(["r"])
        got = vocab.new_bitmask(rows.num_rows(lay))
        dm = fill_draft_masks([m2], [drafts], got, rows, lay, threads=0)
        if dm.failed:
            # The engine failed the request: its error, not a comparison of the stop-only rows it got.
            for err in dm.failed.values():
                res.fail(f"fill_draft_masks {pattern!r} drafts {drafts}: the request failed: {err}")
            continue
        want = vocab.new_bitmask(4)
        taken = 0
        for p in range(4):
            m2.fill(want, p)
            if p == 3 or m2.is_terminated() or not m2.accept(drafts[p]):
                break
            taken += 1
        m2.rollback(taken)
        limit = min(taken + 1, 4)
        if not torch.equal(got[:limit], want[:limit]) or int(dm.acceptable[0]) != taken:
            res.fail(
                f"fill_draft_masks {pattern!r} drafts {drafts}: rows or acceptable ({int(dm.acceptable[0])}) differ"
            )
    return res


def run_selftest(seed: int = 0, cases: int = 40, as_json: bool = False, progress: bool = True) -> int:
    """Run every check; print a table (or JSON); return the exit status (1 on any mismatch)."""
    from .grammar import grammar_providers

    rng = np.random.default_rng(seed)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    jobs: list[tuple[str, Callable[[], CheckResult]]] = [("core", lambda: _check_core(rng, cases))]
    skipped: list[CheckResult] = []
    for dev in devices:
        for name, why in backend_status(dev).items():
            if why is None:
                jobs.append((f"kernel {name}", lambda n=name, d=dev: _check_backend(n, d, rng, cases)))  # type: ignore[misc]
            else:
                skipped.append(CheckResult(f"kernel {name} on {dev.type}", status="unavailable", detail=why))
    for prov in grammar_providers():
        jobs.append((f"grammar {prov}", lambda p=prov: _check_provider(p, rng, max(cases // 4, 3))))  # type: ignore[misc]
    results: list[CheckResult] = []
    t0 = time.perf_counter()
    with Progress(len(jobs), "selftest", enabled=progress) as bar:
        for i, (label, job) in enumerate(jobs):
            bar.update(i, label)
            try:
                results.append(job())
            except Exception as exc:  # a crash is a failure of that check, reported with its cause
                r = CheckResult(label, status="FAILED", detail=f"{type(exc).__name__}: {exc}")
                r.failures.append(traceback.format_exc(limit=3))
                results.append(r)
        bar.update(len(jobs))
    results += skipped
    failed = [r for r in results if r.status == "FAILED"]
    if as_json:
        print(
            json.dumps(
                {
                    "passed": not failed,
                    "seconds": round(time.perf_counter() - t0, 2),
                    "checks": [r.__dict__ for r in results],
                },
                indent=2,
            )
        )
    else:
        print(
            render_table(
                [("status", "left"), ("check", "left"), ("cases", "right"), ("detail", "left")],
                [[r.status, r.name, str(r.cases), r.detail] for r in results],
            )
        )
        for r in results:
            for f in r.failures:
                print(f"  {r.name}: {f}")
        verdict = "all checks passed" if not failed else f"{len(failed)} check(s) FAILED"
        print(f"\n{verdict} in {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_selftest())
