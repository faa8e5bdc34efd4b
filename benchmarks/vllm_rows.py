"""The vLLM adapter's mask rows per step, against the plain xgrammar loop vLLM 0.32 runs, interleaved.

Runs in the vLLM environment from the repository root::

    adapters/.venv-vllm/bin/python benchmarks/vllm_rows.py [--requests 1,4,16] [--drafts 0,3] [--rounds 7]

The tiny model's tokenizer (vocabulary 640, as in ``vllm_overhead.py``),
the structured workload's grammars (JSON schemas and regexes, vLLM's own
unbounded whitespace) compiled by maskplug's xgrammar provider, ``n``
requests each a few tokens into its grammar, and ``k`` drafts per request,
all allowed by the grammar by default (vLLM's scheduler trims drafts with
the grammar's ``validate_tokens`` before the producer sees them; ``--refused
0.2`` makes about one in five a random token instead, where vLLM's own
producer logs an error per refused draft). Three producers fill the same
step on the same matchers:

* ``maskplug``: the adapter's replacement of ``StructuredOutputManager.grammar_bitmask``
  (binding, the small-batch producer, the checks that a row allows something;
  with ``--draft-masks`` also the step's :class:`~maskplug.DraftMasks` with its
  single-token rows, which only a planning scheduler reads);
* ``vllm``: vLLM 0.32's own ``StructuredOutputManager.grammar_bitmask``
  (unpatched) on vLLM's own ``XgrammarGrammar`` objects over the same
  xgrammar matchers: the path the engine runs without maskplug;
* ``loop``: the calls that path makes per request (fill a row, accept the
  draft, ..., roll back), written directly on xgrammar's ``GrammarMatcher``:
  a lower bound of any producer on these matchers.

With ``--validate`` the drafts' check is timed instead: vLLM's scheduler
calls each grammar request's ``validate_tokens`` on its next drafts every
step (``update_draft_token_ids``); maskplug's grammars against vLLM's own
``XgrammarGrammar`` over the same matchers (the results checked equal).

Each round times all three, one after the other in rotating order, in CPU time
of this thread per step (the fastest of five batches of ``--calls`` steps);
the summary is the median over rounds of the per-round ratios of ``maskplug``
to ``vllm`` and to ``loop``. With ``--cold``
each call is timed alone right after engine-like work (a small MLP forward,
numpy over 4 MB, some Python), the median of ``--calls / 4`` calls: in an
engine the producer runs between forward passes with its caches cold, where
it costs several times its figure in a loop (the engine profile of
``vllm_overhead.py`` shows it). The rows both
write are checked equal once per configuration (the rows after a refused
draft are vLLM's copies on one side and open on the other; neither is
applied, so only the rows up to the first refusal are compared).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
import vllm_tiny as tiny
from maskplug_vllm import scheduler as mp_sched
from maskplug_vllm.backend import MaskplugBackend, MaskplugGrammar, vocab_from_tokenizer
from transformers import AutoTokenizer

from maskplug.grammar.sdk import GrammarSpec, grammar_provider


def _spec(req: dict[str, Any]) -> GrammarSpec:
    if req["kind"] == "json":
        return GrammarSpec("json_schema", req["schema"], max_whitespace=None)
    return GrammarSpec("regex", req["regex"])


def _allowed(matcher: Any, bm: torch.Tensor, eos: set[int]) -> list[int]:
    matcher.fill(bm, 0)
    words = bm[0].tolist()
    return [t for t in range(32 * len(words)) if (words[t // 32] >> (t % 32)) & 1 and t not in eos]


def _step(
    compiled: list[Any], specs: list[GrammarSpec], vocab: Any, n: int, k: int, seed: int, refused: float = 0.0
) -> Any:
    rng = random.Random(seed)
    eos = set(vocab.eos_ids)
    bm = vocab.new_bitmask(1)
    grammars = []
    for i in range(n):
        g = MaskplugGrammar(compiled[i % len(compiled)].matcher(), specs[i % len(specs)], vocab)
        for _ in range(rng.randint(0, 6)):
            ok = _allowed(g.matcher, bm, eos)
            if not ok:
                break
            g.matcher.accept(rng.choice(ok))
        grammars.append(g)
    spec_tokens: dict[str, list[int]] = {}
    for i, g in enumerate(grammars):
        drafts: list[int] = []
        took = 0
        while len(drafts) < k:
            ok = _allowed(g.matcher, bm, eos)
            if not ok and rng.random() >= refused:
                break  # only a stop token is left: vLLM's validation ends the drafts here
            t = rng.choice(ok) if ok and rng.random() >= refused else rng.randrange(1, vocab.vocab_size)
            drafts.append(t)
            if took == len(drafts) - 1 and g.matcher.accept(t):
                took += 1
        if took:
            g.matcher.rollback(took)
        if k:
            spec_tokens[f"r{i}"] = drafts
    return grammars, [f"r{i}" for i in range(n)], spec_tokens


def _loop(bitmask: torch.Tensor, grammars: list[Any], ids: list[str], spec: dict[str, list[int]]) -> int:
    """vLLM 0.32's serial loop on xgrammar's own matchers: fill, accept, ..., copy after a refusal, roll back."""
    idx = 0
    for g, r in zip(grammars, ids, strict=True):
        raw = g.matcher.raw
        toks = spec.get(r, [])
        took, failed = 0, -1
        for t in toks:
            if failed >= 0:
                bitmask[idx].copy_(bitmask[failed])
            else:
                raw.fill_next_token_bitmask(bitmask, idx)
                if not raw.is_terminated():
                    if raw.accept_token(t):
                        took += 1
                    else:
                        failed = idx
            idx += 1
        if failed >= 0:
            bitmask[idx].copy_(bitmask[failed])
        else:
            raw.fill_next_token_bitmask(bitmask, idx)
        idx += 1
        if took:
            raw.rollback(took)
    return idx


def _vllm_manager(vocab: Any, k: int, grammars: list[Any]) -> tuple[Any, dict[str, Any]]:
    """vLLM's own manager and ``grammar_bitmask``, with ``XgrammarGrammar`` objects over ``grammars``' xgrammar matchers."""
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    mgr = StructuredOutputManager.__new__(StructuredOutputManager)
    ns = types.SimpleNamespace
    mgr.vllm_config = ns(
        num_speculative_tokens=k, scheduler_config=ns(max_num_seqs=64), model_config=ns(is_diffusion=False)
    )
    mgr.backend = ns(allocate_token_bitmask=vocab.new_bitmask)
    mgr.reasoner_cls = None
    mgr.enable_in_reasoning = False
    mgr._grammar_bitmask = None
    mgr._full_mask = torch.tensor(-1, dtype=torch.int32)
    mgr.fill_bitmask_parallel_threshold = 128
    requests = {}
    for i, g in enumerate(grammars):
        raw = g.matcher.raw
        xg = XgrammarGrammar(vocab.vocab_size, raw, None)
        xg._is_terminated = raw.is_terminated()
        so = ns(grammar=xg, reasoning_ended=None, reasoner=None)
        requests[f"r{i}"] = ns(request_id=f"r{i}", structured_output_request=so)
    return mgr, requests


def _manager(vocab: Any, k: int) -> tuple[Any, Any]:
    backend = MaskplugBackend.__new__(MaskplugBackend)
    backend.vocab = vocab
    ns = types.SimpleNamespace
    cfg = ns(num_speculative_tokens=k, scheduler_config=ns(max_num_seqs=64), model_config=ns(is_diffusion=False))
    mgr = ns(backend=backend, reasoner_cls=None, enable_in_reasoning=False, vllm_config=cfg, _grammar_bitmask=None)
    return mgr, mp_sched.make_grammar_bitmask(lambda *a: None)


def _time(fn: Any, calls: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.thread_time_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time_ns() - t0) / calls / 1e3)
    return best


class _Polluter:
    """Work like an engine's between two producer calls: a small MLP forward, numpy over 4 MB, some Python."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(128, 128, generator=gen) for _ in range(8)]
        self.junk = np.zeros(4 << 20, dtype=np.uint8)
        self.blob = {f"k{i}": [i, str(i), {"x": i}] for i in range(300)}
        self.rng = random.Random(0)

    def __call__(self) -> None:
        x = torch.ones(4, 128)
        for w in self.weights:
            x = torch.nn.functional.silu(x @ w)
        self.junk[::64] += 1
        json.dumps(self.blob)
        sorted(self.rng.random() for _ in range(200))


def _time_cold(fn: Any, calls: int, pollute: _Polluter) -> float:
    """Median CPU µs of one call made right after :class:`_Polluter`'s work (its caches cold, as in an engine)."""
    clock = time.thread_time_ns
    times = []
    for _ in range(calls):
        pollute()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) / 1e3


def _time_validate(
    a: argparse.Namespace,
    n: int,
    k: int,
    ours: list[Any],
    theirs: list[Any],
    ids: list[str],
    spec: dict[str, list[int]],
    pollute: _Polluter,
) -> None:
    """The drafts' check of a step: every request's ``validate_tokens``, maskplug's grammars against vLLM's own."""
    drafts = [spec.get(r, []) for r in ids]
    for g, v, d in zip(ours, theirs, drafts, strict=True):
        if g.validate_tokens(d) != v.validate_tokens(d):
            raise SystemExit(f"n={n} k={k}: the grammars validate {d} differently")

    def check(grammars: list[Any]) -> Any:
        def run() -> None:
            for g, d in zip(grammars, drafts, strict=True):
                g.validate_tokens(d)

        return run

    fns = {"ours": check(ours), "vllm": check(theirs)}
    times: dict[str, list[float]] = {"ours": [], "vllm": []}
    ratios = []
    for rnd in range(a.rounds):
        order = list(fns) if rnd % 2 == 0 else list(fns)[::-1]
        t = {m: _time_cold(fns[m], a.calls // 4, pollute) if a.cold else _time(fns[m], a.calls) for m in order}
        for m in fns:
            times[m].append(t[m])
        ratios.append(t["ours"] / t["vllm"])
    med = {m: statistics.median(v) for m, v in times.items()}
    print(
        f"{n:>4} {k:>3} {med['ours']:>12.1f} {med['vllm']:>9.1f} {'-':>9} "
        f"{statistics.median(ratios):>11.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) {'-':>8}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", default="1,4,16")
    p.add_argument("--drafts", default="0,3")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--refused", type=float, default=0.0, help="share of drafts drawn at random, mostly refused (default: 0)"
    )
    p.add_argument("--calls", type=int, default=2000, help="steps per timed batch (default: %(default)s)")
    p.add_argument(
        "--cold",
        action="store_true",
        help="time each call after engine-like work (a small forward, numpy, Python) instead of in a loop",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="time the drafts' check instead (each request's validate_tokens, as vLLM's scheduler calls it)",
    )
    p.add_argument(
        "--draft-masks",
        action="store_true",
        help="produce the step's draft masks too, as for a planning scheduler (default: as verify-all and grammars only)",
    )
    a = p.parse_args(argv)
    pollute = _Polluter()
    with tempfile.TemporaryDirectory(prefix="maskplug-rows-") as tmp:
        model = tiny.build_model(Path(tmp) / "model")
        tok = AutoTokenizer.from_pretrained(str(model))
    vocab = vocab_from_tokenizer(tok, 640)
    prov = grammar_provider("xgrammar", vocab)
    reqs = tiny.structured_workload(32, 0)
    specs = [_spec(r) for r in reqs]
    compiled = [prov.compile(s) for s in specs]
    print(f"vocabulary 640, xgrammar, {len(compiled)} grammars; load average {os.getloadavg()[0]:.1f}", flush=True)
    print(
        f"{'n':>4} {'k':>3} {'maskplug µs':>12} {'vllm µs':>9} {'loop µs':>9} "
        f"{'vs vllm (median, min-max)':>27} {'vs loop':>8}"
    )
    for n in [int(x) for x in a.requests.split(",")]:
        for k in [int(x) for x in a.drafts.split(",")]:
            grammars, ids, spec = _step(compiled, specs, vocab, n, k, seed=n * 100 + k, refused=a.refused)
            mgr, fill = _manager(vocab, k)
            requests = {
                r: types.SimpleNamespace(request_id=r, structured_output_request=types.SimpleNamespace(grammar=g))
                for r, g in zip(ids, grammars, strict=True)
            }
            vmgr, vrequests = _vllm_manager(vocab, k, grammars)
            vllm_fill = type(vmgr).grammar_bitmask
            if a.validate:
                _time_validate(
                    a, n, k, grammars, [vrequests[r].structured_output_request.grammar for r in ids], ids, spec, pollute
                )
                continue

            def ours(
                mgr: Any = mgr, fill: Any = fill, requests: Any = requests, ids: Any = ids, spec: Any = spec
            ) -> Any:
                return fill(mgr, requests, ids, spec)

            def vllm(
                vmgr: Any = vmgr, vrequests: Any = vrequests, ids: Any = ids, spec: Any = spec, run: Any = vllm_fill
            ) -> Any:
                return run(vmgr, vrequests, ids, spec)

            theirs_bm = vocab.new_bitmask(n * (k + 1))

            def loop(bm: Any = theirs_bm, grammars: Any = grammars, ids: Any = ids, spec: Any = spec) -> int:
                return _loop(bm, grammars, ids, spec)

            # Same rows up to each request's first refused draft (the rest is never applied).
            setattr(mgr, mp_sched.WANT_DRAFT_MASKS_ATTR, True)
            got = ours().copy()
            got_vllm = vllm().copy()
            loop()
            row = 0
            for g, r in enumerate(ids):
                d = spec.get(r, [])
                upto = len(d) + 1
                acc = int(mgr._maskplug_draft_masks[1].acceptable[g])
                upto = min(upto, acc + 1)
                for name, other in (("loop", theirs_bm.numpy()), ("vllm", got_vllm)):
                    if not (got[row : row + upto] == other[row : row + upto]).all():
                        raise SystemExit(f"n={n} k={k}: request {g}'s rows differ from the {name}'s")
                row += len(d) + 1
            # Timed as the engine runs it: the draft masks only where a planning scheduler reads them.
            setattr(mgr, mp_sched.WANT_DRAFT_MASKS_ATTR, a.draft_masks)
            times: dict[str, list[float]] = {"ours": [], "vllm": [], "loop": []}
            fns = {"ours": ours, "vllm": vllm, "loop": loop}
            to_vllm, to_loop = [], []
            for rnd in range(a.rounds):
                order = list(fns)[rnd % 3 :] + list(fns)[: rnd % 3]
                t = {
                    name: _time_cold(fns[name], a.calls // 4, pollute) if a.cold else _time(fns[name], a.calls)
                    for name in order
                }
                for name in fns:
                    times[name].append(t[name])
                to_vllm.append(t["ours"] / t["vllm"])
                to_loop.append(t["ours"] / t["loop"])
            med = {name: statistics.median(v) for name, v in times.items()}
            print(
                f"{n:>4} {k:>3} {med['ours']:>12.1f} {med['vllm']:>9.1f} {med['loop']:>9.1f} "
                f"{statistics.median(to_vllm):>11.2f}x ({min(to_vllm):.2f}-{max(to_vllm):.2f}) "
                f"{statistics.median(to_loop):>7.2f}x",
                flush=True,
            )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
