"""Building blocks of a DSpark verify step on SGLang's real modules, shared by the DSpark tests.

The request, batch and result-processor objects here carry only the fields SGLang's grammar
steps read; everything else (the tree, the mask, the apply, the accept kernels, the grammar
advance) is SGLang's own code.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np
import torch
from conftest import allowed_ids, compile_pair, grammar_keys
from maskplug_sglang.backend import MaskplugGrammar
from maskplug_sglang.dspark import build_verify_mask
from sglang.kernels.ops.speculative.dspark.dspark_accept import AcceptGreedy, FinalizeAcceptLens
from sglang.kernels.ops.speculative.dspark.dspark_verify_window import BuildOutTokens
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

KEYS = grammar_keys()


# -- the parts of SGLang's request/batch objects the verify chain reads -------------------
class Req:
    """The fields of SGLang's ``Req`` that the grammar steps read and write."""

    def __init__(self, rid: str, grammar: Any) -> None:
        self.rid = rid
        self.grammar = grammar
        self.is_retracted = False
        self.to_finish: Any = None

    def finished(self) -> bool:
        return False


class DecodeMode:
    def is_decode(self) -> bool:
        return True

    def is_extend(self) -> bool:
        return False


def decode_batch(reqs: list[Req]) -> Any:
    return types.SimpleNamespace(
        reqs=reqs, has_grammar=any(r.grammar is not None for r in reqs), forward_mode=DecodeMode()
    )


def result_processor() -> Any:
    """SGLang's batch-result processor methods on a bare object (the grammar steps use nothing else)."""
    proc = types.SimpleNamespace()
    proc._accept_grammar_tokens = functools.partial(SchedulerBatchResultProcessor._accept_grammar_tokens, proc)
    return proc


# -- random batches ---------------------------------------------------------------------------
def _allowed(g: Any, size: int, avoid: set[int]) -> np.ndarray:
    one = g.allocate_vocab_mask(size, 1, "cpu")
    g.fill_vocab_mask(one, 0)
    return np.array([t for t in allowed_ids(one[0], size) if t not in avoid], dtype=np.int64)


def make_batch(rng: np.random.Generator, backends: tuple[Any, Any], bs: int) -> tuple[list[Any], list[Any]]:
    """One grammar pair per request (or None), some advanced a little, some finished."""
    ours_backend = backends[1]
    size = ours_backend.vocab.vocab_size
    eos = ours_backend.vocab.eos_ids[0]
    avoid = set(ours_backend.vocab.special_ids)
    theirs_l: list[Any] = []
    ours_l: list[Any] = []
    for _ in range(bs):
        if rng.random() < 0.15:
            theirs_l.append(None)
            ours_l.append(None)
            continue
        theirs, ours = compile_pair(backends, KEYS[int(rng.integers(0, len(KEYS)))])
        assert isinstance(ours, MaskplugGrammar)
        finish = rng.random() < 0.15
        for _ in range(int(rng.integers(0, 4)) if not finish else 40):
            ok = _allowed(theirs, size, avoid)
            one = theirs.allocate_vocab_mask(size, 1, "cpu")
            theirs.fill_vocab_mask(one, 0)
            if finish and (int(one[0][eos >> 5]) >> (eos & 31)) & 1:
                theirs.accept_token(eos)
                ours.accept_token(eos)
                break
            if not ok.size:
                break
            t = int(rng.choice(ok))
            theirs.accept_token(t)
            ours.accept_token(t)
        assert theirs.is_terminated() == ours.is_terminated()
        theirs_l.append(theirs)
        ours_l.append(ours)
    return theirs_l, ours_l


def make_chain(rng: np.random.Generator, oracles: list[Any], size: int, width: int, avoid: set[int]) -> torch.Tensor:
    """``(bs, W)`` verify ids: a committed token, then drafts the grammar allows or (sometimes) refuses."""
    ids = np.zeros((len(oracles), width), dtype=np.int64)
    pool = np.array([t for t in range(size) if t not in avoid], dtype=np.int64)
    for i, g in enumerate(oracles):
        ids[i, 0] = int(rng.choice(pool))
        bad = float(rng.choice([0.0, 0.15, 0.5]))
        taken = 0
        for k in range(1, width):
            ok = np.zeros(0, dtype=np.int64) if g is None or g.is_terminated() else _allowed(g, size, avoid)
            if ok.size and rng.random() >= bad and taken == k - 1:
                t = int(rng.choice(ok))
                g.accept_token(t)
                taken += 1
            else:
                t = int(rng.choice(pool))
            ids[i, k] = t
        if g is not None and taken:
            g.rollback(taken)
    return torch.from_numpy(ids)


def make_logits(rng: np.random.Generator, ids: torch.Tensor, size: int, no_go: list[int]) -> torch.Tensor:
    """Target logits ``(bs*W, size)``: row ``k`` often prefers draft ``k+1``; control tokens never win."""
    bs, width = ids.shape
    logits = torch.from_numpy(rng.standard_normal((bs * width, size)).astype(np.float32))
    agree = float(rng.choice([0.5, 0.9, 1.0]))
    for i in range(bs):
        for k in range(width - 1):
            if rng.random() < agree:
                logits[i * width + k, int(ids[i, k + 1])] += 20.0
    if no_go:
        logits[:, no_go] = -1e4
    return logits


def run_verify(
    reqs: list[Req], ids: torch.Tensor, logits: torch.Tensor, lens: torch.Tensor, size: int, *, maskplug_rows: bool
) -> dict[str, Any]:
    """Mask, apply, accept and finalize one step; the grammars are not advanced."""
    bs, width = ids.shape
    sampling_info = types.SimpleNamespace(vocab_size=size, grammar_mask="stale")
    tree = GrammarTree.from_linear_chain(ids)
    if maskplug_rows:
        gm = build_verify_mask(
            reqs=reqs, tree=tree, sampling_info=sampling_info, device="cpu", barrier=None, verify_lens=lens
        )
    else:
        gm = build_grammar_vocab_mask(reqs=reqs, tree=tree, sampling_info=sampling_info, device="cpu", barrier=None)
    masked = logits.clone()
    if gm is not None:
        assert sampling_info.grammar_mask is None  # SGLang's convention: the extend stage's mask is dropped
        gm.apply(masked)
    correct_len, bonus, trim = AcceptGreedy.execute(
        candidates=ids, target_logits=masked, verify_num_draft_tokens=width, cutoff_verify_lens=lens
    )
    fin = FinalizeAcceptLens.execute(
        correct_len=correct_len, cap_trim_lens=trim, prefix_lens=torch.full((bs,), 10, dtype=torch.int64)
    )
    out = BuildOutTokens.execute(
        draft_tokens=ids[:, 1:], correct_len=correct_len, bonus=bonus, verify_num_draft_tokens=width, gamma=width - 1
    )
    return {
        "mask": None if gm is None else gm.vocab_mask,
        "correct_len": correct_len,
        "bonus": bonus,
        "commit_lens": fin.commit_lens,
        "out": out,
    }


def advance(reqs: list[Req], step: dict[str, Any], width: int) -> list[Any] | None:
    """SGLang's grammar barrier: ``advance_grammar_fsm`` over what the step committed."""
    result = GenerationBatchResult(
        next_token_ids=step["out"].reshape(-1),
        accept_lens=step["commit_lens"],
        speculative_num_draft_tokens=width,
    )
    batch = decode_batch(reqs)
    SchedulerBatchResultProcessor.advance_grammar_fsm(result_processor(), result, batch)
    assert result.grammar_advanced == batch.has_grammar
    return list(result.grammar_retained_tokens) if batch.has_grammar else None


def same_outcome(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in ("correct_len", "bonus", "commit_lens", "out"):
        assert torch.equal(a[k], b[k]), f"{k}: {a[k].tolist()} != {b[k].tolist()}"


def check_kept_rows(full: torch.Tensor, kept: torch.Tensor, lens: torch.Tensor, width: int) -> None:
    """maskplug's rows equal the full chain's where kept; rows past each verify length were not computed."""
    for i, n in enumerate(lens.tolist()):
        block = slice(i * width, i * width + n)
        assert torch.equal(kept[block], full[block]), f"request {i}: kept rows differ"
        assert bool((kept[i * width + n : (i + 1) * width] == -1).all()), f"request {i}: rows past {n} filled"
