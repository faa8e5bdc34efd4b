"""Helpers for the grammar tests: real vocabularies, random walks, and a slow draft-row oracle.

The oracle here deliberately uses only the per-matcher protocol (accept,
validate, fill, rollback) and replays every row from scratch, so it shares no
code path with :func:`maskplug.fill_draft_masks`'s batched walk.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from maskplug import GrammarSpec, Vocab, grammar_provider, grammar_providers
from maskplug.grammar import Matcher
from maskplug.grammar.vocabs import mistral_sentencepiece, mistral_tekken

# The engine providers; ``auto`` (listed too, as a built-in) routes to them and has tests of its own.
PROVIDERS = [p for p in grammar_providers() if p != "auto"]

# Regexes every provider supports; short enough that random walks finish.
REGEXES = (
    r"[a-z]{1,8}( [0-9]{1,3}){0,3}",
    r"(yes|no|maybe)",
    r"\{\"id\": [0-9]{1,4}, \"tag\": \"[a-z]{0,5}\"\}",
    r"[A-Z][a-z]+(, [A-Z][a-z]+)*\.",
)


@lru_cache(maxsize=2)
def vocab(name: str) -> Vocab:
    """``"spm"`` (32,000 tokens) or ``"tekken"`` (131,072 tokens), from mistral-common's data files."""
    return mistral_sentencepiece() if name == "spm" else mistral_tekken()


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set in one bitmask row."""
    words = bitmask_row.numpy().view(np.uint32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def state_of(m: Matcher, v: Vocab, probe: Sequence[int]) -> tuple[bytes, bool, int]:
    """A fingerprint of a matcher's state: its mask, termination and how far ``probe`` goes."""
    bm = v.new_bitmask(1)
    m.fill(bm, 0)
    return bm.numpy().tobytes(), m.is_terminated(), m.validate(list(probe))


def random_walk(m: Matcher, v: Vocab, rng: random.Random, length: int, *, stop: bool) -> list[int]:
    """Up to ``length`` tokens the grammar allows, chosen at random (matcher restored afterwards).

    With ``stop``, the walk ends with a stop token as soon as one is allowed. A terminated matcher
    (its stop token accepted) allows nothing more: its walk is empty.
    """
    out: list[int] = []
    bm = v.new_bitmask(1)
    try:
        while len(out) < length and not m.is_terminated():
            m.fill(bm, 0)
            ids = allowed_ids(bm[0], v.vocab_size)
            eos = [int(t) for t in ids if int(t) in v.eos_ids]
            text = [int(t) for t in ids if int(t) not in v.eos_ids]
            if stop and eos and (not text or rng.random() < 0.5):
                assert m.accept(eos[0])
                out.append(eos[0])
                break
            if not text:
                break
            t = rng.choice(text)
            assert m.accept(t)
            out.append(t)
    finally:
        if out:
            m.rollback(len(out))
    return out


def disallowed_token(m: Matcher, v: Vocab, rng: random.Random) -> int:
    """A text token the matcher refuses now."""
    bm = v.new_bitmask(1)
    m.fill(bm, 0)
    ok = set(allowed_ids(bm[0], v.vocab_size).tolist())
    while True:
        t = rng.randrange(len(v.tokens))
        if t not in ok:
            return t


@dataclass
class RefRows:
    """The oracle's rows of one request, its accepted-draft count and forced flags."""

    rows: list[np.ndarray]
    acceptable: int
    forced: list[bool]


def reference_rows(m: Matcher, v: Vocab, drafts: Sequence[int], num_bonus: int, gate: int) -> RefRows:
    """Row ``p`` replayed from scratch: accept the grammar drafts before ``p`` one by one, fill, roll back."""
    k = len(drafts)
    full = np.full(v.mask_words, -1, dtype=np.int32)
    grammar = list(drafts[gate:]) if gate < k else []
    good = m.validate(grammar)
    acceptable = k if gate >= k else gate + good
    rows: list[np.ndarray] = []
    forced: list[bool] = []
    for p in range(k + num_bonus):
        prefix = list(drafts[gate:p]) if p > gate else []
        ended = any(t in v.eos_ids for t in prefix)
        if p < gate or len(prefix) > good or ended:
            rows.append(full.copy())
            forced.append(False)
            continue
        for t in prefix:
            assert m.accept(t)
        bm = v.new_bitmask(1)
        m.fill(bm, 0)
        if prefix:
            m.rollback(len(prefix))
        row = bm[0].numpy().copy()
        rows.append(row)
        forced.append(int(sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in row)) == 1)
    return RefRows(rows, acceptable, forced)


def compiled(provider: str, vocab_name: str, spec: GrammarSpec):  # type: ignore[no-untyped-def]
    """The provider's compiled grammar (cached by the provider)."""
    return grammar_provider(provider, vocab(vocab_name)).compile(spec)


def small_vocab(extra: int = 0, eos: tuple[int, ...] = (0,)) -> Vocab:
    """A tiny vocabulary: two control tokens, printable ASCII bytes and a few merges; ``extra`` padding ids."""
    tokens = [b"</s>", b"<ctl>", *(bytes([c]) for c in range(32, 127)), b"ab", b"abc", b'{"', b'":', b"\n"]
    return Vocab(tokens, eos_ids=eos, special_ids=(1,), vocab_size=len(tokens) + extra)


def tid(vocab: Vocab, piece: bytes) -> int:
    """The id of a token by its bytes."""
    return vocab.tokens.index(piece)


def allowed(m: Matcher, vocab: Vocab) -> set[int]:
    """The token ids a matcher allows now."""
    b = vocab.new_bitmask(1)
    m.fill(b, 0)
    bits = np.unpackbits(b[0].numpy().view(np.uint8), bitorder="little")[: vocab.vocab_size]
    return set(np.flatnonzero(bits).tolist())


# Building outlines-core's automaton for this schema over tekken's 131k tokens takes seconds.
SLOW_OUTLINES = GrammarSpec(
    "json_schema",
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string", "pattern": "[a-z]{2,12}"}, "maxItems": 6},
            "id": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{6}"},
            "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
        },
        "required": ["name", "id"],
    },
)
