"""What a compiled xgrammar grammar costs to bring back from the compile worker, against compiling it again.

Runs in the core environment from the repository root::

    .venv/bin/python benchmarks/xgrammar_transfer.py [--vocab tekken|spm] [--first N]

Over the schemas of maskplug's packaged JSONSchemaBench subset, for four
option sets (maskplug's default: strict keys and at most 24 whitespace
characters in a row; lenient keys; each without the bound), it prints:

* in this process: xgrammar's compile, and the round trip of the compiled
  grammar (``serialize_json`` then ``deserialize_json``), wall-clock seconds
  summed over the schemas, with the grammars' ``memory_size_bytes`` and the
  rate of the round trip in those bytes per second (what
  ``maskplug_xgrammar.provider.TRANSFER_BYTES_PER_S`` is set from);
* through the provider with its compile worker, the wall-clock seconds of
  every compile when the worker always sends the grammar back (``sent``) and
  when it lets the caller compile again whatever is quicker to compile than
  to transfer (``default``), and how many were compiled again.

xgrammar's C++ warnings of the in-process compiles go to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import xgrammar as xgr
from maskplug_xgrammar import XGrammarProvider
from maskplug_xgrammar.provider import TRANSFER_BYTES_PER_S, compile_raw, worker_compiler

from maskplug import GrammarError, GrammarSpec, Vocab
from maskplug.conformance import SUBSET_PATH, load_cases
from maskplug.grammar.sdk import CompileWorker
from maskplug.grammar.vocabs import mistral_sentencepiece, mistral_tekken

OPTIONS: dict[str, dict[str, object]] = {
    "default": {},
    "lenient keys": {"strict_keys": False},
    "no bound": {"max_whitespace": None},
    "lenient, no bound": {"strict_keys": False, "max_whitespace": None},
}


def in_process(provider: XGrammarProvider, specs: list[GrammarSpec]) -> dict[str, float]:
    compiler = xgr.GrammarCompiler(provider.tokenizer_info, max_threads=2, cache_enabled=False)
    comp = trip = size = 0.0
    rates = []
    for spec in specs:
        t = time.perf_counter()
        raw, _ = compile_raw(compiler, spec, capture=False)
        comp += time.perf_counter() - t
        t = time.perf_counter()
        xgr.CompiledGrammar.deserialize_json(raw.serialize_json(), provider.tokenizer_info)
        dt = time.perf_counter() - t
        trip += dt
        size += raw.memory_size_bytes
        rates.append(raw.memory_size_bytes / dt)
    return {"compile": comp, "trip": trip, "mib": size / 2**20, "rate_med": statistics.median(rates) / 1e6}


def through_worker(vocab: Vocab, specs: list[GrammarSpec], bytes_per_s: float) -> tuple[float, int]:
    p = XGrammarProvider(vocab, max_threads=2)
    p.worker = CompileWorker(p.name, worker_compiler, (vocab.with_encoder(None), 2, bytes_per_s))
    p.worker.start()  # start-up is not a compile's time
    took = 0.0
    for spec in specs:
        t = time.perf_counter()
        p.compile(spec)
        took += time.perf_counter() - t
    p.worker.close()
    return took, p._compiled_again


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--vocab", choices=["tekken", "spm"], default="tekken")
    ap.add_argument("--first", type=int, default=None, help="only the first N schemas of the subset")
    args = ap.parse_args()
    vocab = mistral_tekken() if args.vocab == "tekken" else mistral_sentencepiece()
    cases = load_cases(SUBSET_PATH)[: args.first]
    probe = XGrammarProvider(vocab, compile_limit_s=None, max_threads=2)
    print(f"xgrammar, {len(cases)} subset schemas, vocabulary {args.vocab} ({vocab.vocab_size} tokens)")
    print(f"load average at the start: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"TRANSFER_BYTES_PER_S = {TRANSFER_BYTES_PER_S / 1e6:.0f} MB/s")
    head = f"{'options':18s} {'n':>3s} {'compile s':>9s} {'trip s':>7s} {'MiB':>7s} {'MB/s':>5s}"
    print(head + f" {'sent s':>7s} {'default s':>9s} {'again':>6s}")
    for label, opts in OPTIONS.items():
        specs = []
        for c in cases:
            spec = GrammarSpec("json_schema", json.loads(json.dumps(c.schema)), **opts)  # type: ignore[arg-type]
            try:
                probe.compile(spec)
            except GrammarError:
                continue
            specs.append(spec)
        here = in_process(probe, specs)
        sent, _ = through_worker(vocab, specs, math.inf)
        default, again = through_worker(vocab, specs, TRANSFER_BYTES_PER_S)
        print(
            f"{label:18s} {len(specs):3d} {here['compile']:9.2f} {here['trip']:7.2f} {here['mib']:7.1f} "
            f"{here['rate_med']:5.0f} {sent:7.2f} {default:9.2f} {again:3d}/{len(specs)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
