"""The synthetic target model and drafter, and the counter-based randomness they share.

Nothing here keeps hidden random state: every random draw is a hash of
``(seed, stream, request id, output position, ...)``. So a request's drafts
and the target's logits are the same whichever scheduler runs, whatever the
batch composition, and the same seed gives the same run.

The target model prefers the next token of the request's reference document
(by ``margin`` logits over Gaussian noise of scale ``noise``); now and then,
on a grammar request, it is *tempted* by a token the grammar forbids, ranked
above the reference token, which only a correctly applied mask removes. Off
the reference (possible only through sampling) it prefers the stop token.

The drafter believes the reference token with a per-position probability
(its *skill*: high on structural punctuation, a per-request base elsewhere)
and otherwise a wrong one (the next reference token, or a random token).
Greedy requests draft the belief with confidence = skill; sampled requests
draw the draft from ``q = conc·δ(belief) + (1 − conc)/V`` with confidence
``conc·skill``. Both confidences are calibrated: they are the probability that
verification accepts the draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ..grammar import Vocab

__all__ = ["Drafts", "Streams", "TargetModel", "draft", "hash64", "structural_tokens", "uniform"]

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


class Streams:
    """Distinct tags for the independent random streams."""

    DRAFT_RIGHT = 1
    DRAFT_WRONG_KIND = 2
    DRAFT_RANDOM_TOKEN = 3
    DRAFT_FROM_Q = 4
    DRAFT_Q_TOKEN = 5
    TEMPT = 6
    TEMPT_TOKEN = 7
    BANK_ROW = 8
    ACCEPT = 9
    SAMPLE = 10


def _mix(x: U64) -> U64:
    # splitmix64's finaliser: a bijection with good avalanche, enough for simulation noise.
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))  # type: ignore[no-any-return]


def hash64(seed: int, stream: int, *keys: npt.ArrayLike) -> U64:
    """A 64-bit hash of ``(seed, stream, *keys)``, broadcast over the key arrays."""
    with np.errstate(over="ignore"):
        h = _mix(np.asarray([(int(seed) & 0xFFFFFFFFFFFFFFFF)], dtype=np.uint64) + _GOLDEN)
        h = _mix(h ^ (np.uint64(stream) * _GOLDEN))
        for k in keys:
            kk = np.asarray(k).astype(np.int64).astype(np.uint64)
            h = _mix(h ^ (kk + _GOLDEN))
    return h


def uniform(seed: int, stream: int, *keys: npt.ArrayLike) -> F64:
    """Uniform floats in ``[0, 1)`` from :func:`hash64`."""
    return (hash64(seed, stream, *keys) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def structural_tokens(vocab: Vocab) -> npt.NDArray[np.bool_]:
    """Tokens made only of JSON punctuation and spaces: easy for a drafter to guess."""
    punct = set(b'{}[]":, \n')
    out = np.zeros(vocab.vocab_size, dtype=bool)
    for i, t in enumerate(vocab.tokens):
        if t and i not in vocab.special_ids and all(c in punct for c in t):
            out[i] = True
    return out


@dataclass(frozen=True)
class Drafts:
    """One step's drafts, ``(n, K)`` each; columns past ``num_drafts[r]`` are unused.

    Attributes:
        tokens: the drafted tokens.
        belief: the drafter's most likely token per position.
        conf: calibrated per-position confidences (0 past the drafts).
        conc: per request, the drafter's mass on its belief (sampled
            requests; 1 for greedy ones, whose ``q`` is a point mass).
    """

    tokens: I64
    belief: I64
    conf: F64
    conc: F64


def draft(
    seed: int,
    rid: I64,
    length: I64,
    window: I64,
    num_drafts: I64,
    skill: F64,
    sampled: npt.NDArray[np.bool_],
    structural: npt.NDArray[np.bool_],
    first_token: int,
    vocab_size: int,
    k: int,
    conc: float = 0.9,
) -> Drafts:
    """Draft up to ``k`` tokens per request (vectorised over requests and positions).

    ``window[r, j]`` is the reference token ``j`` places after request ``r``'s
    current output (the stop token past the end); ``length`` is the output
    length, which keys the randomness to the output position.
    """
    n = rid.shape[0]
    if k == 0 or n == 0:
        z = np.zeros((n, k), dtype=np.int64)
        return Drafts(z, z.copy(), np.zeros((n, k)), np.ones(n))
    pos = length[:, None] + np.arange(k)[None, :]
    r = rid[:, None]
    ref = window[:, :k]
    p_right = np.where(structural[ref], 0.97, skill[:, None])
    right = uniform(seed, Streams.DRAFT_RIGHT, r, pos) < p_right
    span = vocab_size - first_token
    rand_tok = first_token + (hash64(seed, Streams.DRAFT_RANDOM_TOKEN, r, pos) % np.uint64(span)).astype(np.int64)
    confuse_next = uniform(seed, Streams.DRAFT_WRONG_KIND, r, pos) < 0.5
    wrong = np.where(confuse_next, window[:, 1 : k + 1], rand_tok)
    belief = np.where(right, ref, wrong)
    conc_r = np.where(sampled, conc, 1.0)
    from_q_tail = uniform(seed, Streams.DRAFT_FROM_Q, r, pos) >= conc_r[:, None]
    q_tok = (hash64(seed, Streams.DRAFT_Q_TOKEN, r, pos) % np.uint64(vocab_size)).astype(np.int64)
    tokens = np.where(from_q_tail, q_tok, belief)
    live = np.arange(k)[None, :] < num_drafts[:, None]
    conf = np.where(live, p_right * conc_r[:, None], 0.0)
    return Drafts(np.where(live, tokens, 0), np.where(live, belief, 0), conf, conc_r)


class TargetModel:
    """Logits rows of the synthetic target over the full vocabulary.

    A bank of ``bank_rows`` Gaussian noise rows (seeded) is drawn once; a row
    of logits is a bank row picked by hash, plus ``margin`` at the preferred
    token, plus ``margin + 4`` at a tempting token when there is one.
    """

    def __init__(self, seed: int, vocab_size: int, *, noise: float = 2.0, margin: float = 30.0, bank_rows: int = 32):
        gen = torch.Generator().manual_seed(int(seed) & 0x7FFFFFFF)
        self.bank = torch.randn(bank_rows, vocab_size, generator=gen, dtype=torch.float32) * float(noise)
        self.seed = int(seed)
        self.margin = float(margin)
        self.vocab_size = int(vocab_size)
        self._buf = torch.empty(0, self.vocab_size, dtype=torch.float32)

    def logits(self, rid: I64, out_pos: I64, preferred: I64, tempt: I64) -> torch.Tensor:
        """``(rows, V)`` fp32 logits; ``tempt < 0`` means no temptation on that row.

        The result is a view of a buffer the next call overwrites.
        """
        rows = rid.shape[0]
        pick = (hash64(self.seed, Streams.BANK_ROW, rid, out_pos) % np.uint64(self.bank.shape[0])).astype(np.int64)
        # One buffer reused across steps: a fresh multi-megabyte tensor per step
        # costs more in page faults than the copy itself.
        if self._buf.shape[0] < rows:
            self._buf = torch.empty(max(rows, 2 * self._buf.shape[0]), self.vocab_size, dtype=torch.float32)
        out = self._buf[:rows]
        bank = self.bank
        for i, j in enumerate(pick.tolist()):  # row copies beat index_select here
            out[i].copy_(bank[j])
        ar = torch.arange(rows)
        out[ar, torch.from_numpy(preferred)] += self.margin
        has = tempt >= 0
        if np.any(has):
            idx = torch.from_numpy(np.nonzero(has)[0])
            out[idx, torch.from_numpy(tempt[has])] += self.margin + 4.0
        return out
