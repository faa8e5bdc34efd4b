"""Grammar work per DSpark verify step in SGLang: the whole chain against the rows the verify layout keeps.

Runs in the SGLang environment (``adapters/.venv-sglang``, made by
``make -C adapters/sglang venv``) on SGLang 0.5.23's own modules, with the
stand-ins of the adapter's tests for ``torchvision`` and ``opentelemetry``.

One DSpark step: ``bs`` requests, each under a JSON-schema grammar part-way
through its document, a chain of ``gamma`` drafts (mostly ones the grammar
allows, some it refuses), the 32,000-token SentencePiece vocabulary of
mistral-common. SGLang builds the grammar mask over the whole chain
(``build_grammar_vocab_mask`` → ``generate_token_bitmask`` → ``traverse_tree``
per request) whatever the verify lengths; maskplug's producer
(``maskplug_sglang.dspark.build_verify_mask``) fills only the rows each
request's verify length keeps. Verify lengths come from SGLang's own
``schedule_verify_lens_topk`` at budget 0, at ragged budgets (a quarter and
half of the drafts) and at the full budget, on random confidences.

Timed per step (host time, the mask staged on the CPU):

* ``sglang/xgrammar``: SGLang's producer with SGLang's xgrammar grammar objects
  (today's path, same work at every budget);
* ``sglang/maskplug``: SGLang's producer with maskplug's grammar objects;
* ``maskplug whole``: maskplug's producer over the whole chain;
* ``maskplug kept``: maskplug's producer, kept rows only;
* ``xgrammar kept``: SGLang's xgrammar objects through maskplug's producer
  (``traverse_tree`` on each chain cut to its verify length).

Torch runs one intra-op thread, as in SGLang's worker process on a GPU
(``ModelRunner.load_model`` sets it; with two threads on this loaded 2-core
machine each small torch fill took about 30 ms of waiting). Before timing, the kept rows of every producer are checked equal to the whole
chain's. Each round runs every (budget, producer) pair once in a random order; each
figure is the median over rounds.

Run: ``adapters/.venv-sglang/bin/python benchmarks/sglang_grammar_work.py [--bs 16] [--gamma 7] [--rounds 15]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

TESTS = Path(__file__).resolve().parents[1] / "adapters" / "sglang" / "tests"
sys.path.insert(0, str(TESTS))

import conftest  # noqa: E402  (the stand-ins for torchvision/opentelemetry, the tokenizer hook)
from maskplug_sglang.backend import MaskplugGrammarBackend  # noqa: E402
from maskplug_sglang.dspark import build_verify_mask  # noqa: E402
from sglang.kernels.ops.speculative.dspark.dspark_schedule import ScheduleVerifyLensTopk  # noqa: E402
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend  # noqa: E402
from sglang.srt.speculative.dspark_components.dspark_planner import DSparkScheduleConfig  # noqa: E402
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask  # noqa: E402


class Req:
    def __init__(self, grammar: Any) -> None:
        self.grammar = grammar


def allowed(g: Any, size: int) -> np.ndarray:
    one = g.allocate_vocab_mask(size, 1, "cpu")
    g.fill_vocab_mask(one, 0)
    return conftest.allowed_ids(one[0], size)


def make_step(bs: int, gamma: int, seed: int) -> dict[str, Any]:
    tok = conftest.SentencePieceTokenizer()
    vocab = tok.maskplug_vocab
    size = vocab.vocab_size
    theirs_b = XGrammarGrammarBackend(tok, vocab_size=size, model_eos_token_ids=[tok.eos_token_id])
    ours_b = MaskplugGrammarBackend(tok, size, {tok.eos_token_id}, provider="xgrammar")
    schemas = conftest.schema_texts()
    rng = np.random.default_rng(seed)
    eos = set(vocab.eos_ids)
    special = set(vocab.special_ids)
    theirs: list[Any] = []
    ours: list[Any] = []
    ids = np.zeros((bs, gamma + 1), dtype=np.int64)
    for i in range(bs):
        key = ("json", schemas[i % len(schemas)])
        t, o = theirs_b._init_value_dispatch(key, False), ours_b._init_value_dispatch(key, False)
        # Part-way through the document: a random walk over allowed, non-stop tokens.
        for _ in range(int(rng.integers(3, 25))):
            ok = [x for x in allowed(t, size).tolist() if x not in eos and x not in special]
            if not ok:
                break
            x = int(rng.choice(ok))
            t.accept_token(x)
            o.accept_token(x)
        ids[i, 0] = int(rng.integers(3, size))
        took = 0
        for k in range(1, gamma + 1):
            ok = allowed(t, size) if not t.is_terminated() and took == k - 1 else np.zeros(0, dtype=np.int64)
            if ok.size and rng.random() < 0.9:
                x = int(rng.choice(ok))
                t.accept_token(x)
                took += 1
            else:
                x = int(rng.integers(3, size))
            ids[i, k] = x
        if took:
            t.rollback(took)
        theirs.append(t)
        ours.append(o)
    return {
        "size": size,
        "theirs": [Req(g) for g in theirs],
        "ours": [Req(g) for g in ours],
        "ids": torch.from_numpy(ids),
    }


def producers(step: dict[str, Any], lens: torch.Tensor) -> dict[str, Callable[[], Any]]:
    size, ids = step["size"], step["ids"]

    def sglang(reqs: list[Req]) -> Callable[[], Any]:
        def run() -> Any:
            info = types.SimpleNamespace(vocab_size=size, grammar_mask=None)
            tree = GrammarTree.from_linear_chain(ids)
            return build_grammar_vocab_mask(reqs=reqs, tree=tree, sampling_info=info, device="cpu", barrier=None)

        return run

    def ours(reqs: list[Req], verify_lens: torch.Tensor | None) -> Callable[[], Any]:
        def run() -> Any:
            info = types.SimpleNamespace(vocab_size=size, grammar_mask=None)
            tree = GrammarTree.from_linear_chain(ids)
            return build_verify_mask(
                reqs=reqs, tree=tree, sampling_info=info, device="cpu", barrier=None, verify_lens=verify_lens
            )

        return run

    return {
        "sglang/xgrammar": sglang(step["theirs"]),
        "sglang/maskplug": sglang(step["ours"]),
        "maskplug whole": ours(step["ours"], None),
        "maskplug kept": ours(step["ours"], lens),
        "xgrammar kept": ours(step["theirs"], lens),
    }


def check(step: dict[str, Any], lens: torch.Tensor) -> None:
    """Every producer's kept rows equal the whole chain's (the control-token columns aside for xgrammar)."""
    p = producers(step, lens)
    width = int(step["ids"].shape[1])
    whole_ours = p["sglang/maskplug"]().vocab_mask
    whole_theirs = p["sglang/xgrammar"]().vocab_mask
    assert torch.equal(p["maskplug whole"]().vocab_mask, whole_ours)
    kept_ours = p["maskplug kept"]().vocab_mask
    kept_theirs = p["xgrammar kept"]().vocab_mask
    for i, n in enumerate(lens.tolist()):
        rows = slice(i * width, i * width + n)
        assert torch.equal(kept_ours[rows], whole_ours[rows])
        assert torch.equal(kept_theirs[rows], whole_theirs[rows])
        assert bool((kept_ours[i * width + n : (i + 1) * width] == -1).all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as SGLang's model runner sets it in the worker process
    step = make_step(args.bs, args.gamma, args.seed)
    bs, gamma = args.bs, args.gamma
    cfg = DSparkScheduleConfig(gamma=gamma)
    conf = torch.from_numpy(np.random.default_rng(args.seed + 1).uniform(0.2, 1.0, (bs, gamma)).astype(np.float32))
    budgets = {"0": 0, "ragged 1/4": bs * gamma // 4, "ragged 1/2": bs * gamma // 2, "full": bs * gamma}
    print(
        f"DSpark chain, bs={bs}, gamma={gamma} (W={gamma + 1}), vocabulary {step['size']}, "
        f"JSON-schema grammars; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"median over {args.rounds} rounds, ms per step (host)")
    print(f"{'budget':>11} {'rows kept':>10} " + " ".join(f"{n:>16}" for n in producers(step, torch.ones(bs)).keys()))
    # Every (budget, producer) pair runs once per round, in a fresh random order, so that the
    # machine's changing load falls on all of them alike.
    cases: dict[tuple[str, str], Callable[[], Any]] = {}
    kept: dict[str, str] = {}
    for label, budget in budgets.items():
        lens = ScheduleVerifyLensTopk.execute(confidence=conf, budget=budget, cfg=cfg).to(torch.int64)
        check(step, lens)
        kept[label] = f"{int(lens.sum())}/{bs * (gamma + 1)}"
        for name, fn in producers(step, lens).items():
            cases[(label, name)] = fn
    times: dict[tuple[str, str], list[float]] = {k: [] for k in cases}
    order = np.random.default_rng(args.seed + 2)
    keys = list(cases)
    for _ in range(args.rounds):
        for i in order.permutation(len(keys)).tolist():
            t0 = time.perf_counter()
            cases[keys[i]]()
            times[keys[i]].append((time.perf_counter() - t0) * 1e3)
    names = list(producers(step, torch.ones(bs, dtype=torch.int64)))
    for label in budgets:
        med = [statistics.median(times[(label, n)]) for n in names]
        print(f"{label:>11} {kept[label]:>10} " + " ".join(f"{m:>16.2f}" for m in med))
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
