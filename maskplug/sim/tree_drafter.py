"""The simulator's tree drafter: top-k branching, a settable depth and width per level.

At every node the drafter proposes its ``branch`` most likely next tokens.
Like the chain drafter of :mod:`.models` it is calibrated: a node's
confidence is the probability that verification accepts it once its parent
is accepted. At a node that follows the request's reference document:

* the top-1 candidate is the chain drafter's greedy draft at that position
  (:func:`.models.draft`), right with probability ``p`` (the chain's
  per-position skill, high on structural punctuation);
* when the top-1 is wrong, the reference token is the drafter's
  ``2 + m``-th candidate with probability ``q·(1 − q)^m`` (``q`` =
  ``second_chance``), absent when that rank is past ``branch``; the other
  candidates are random tokens. Rank ``i ≥ 2`` therefore has confidence
  ``(1 − p)·q·(1 − q)^(i − 2)``.

Below a node that left the reference every candidate is a random token (the
target rejects them all: their confidences are conditional on a parent that
is never accepted), except that the top-1 path keeps the chain drafter's
drafts all the way down: the top-1 path is the greedy chain, up to its first
stop token. Siblings are distinct tokens, and a stop token is a leaf.

The tree grows level by level as EAGLE-2's dynamic trees do: each of the
``width`` kept nodes of a level proposes its ``branch`` children, and the
``width`` children with the highest path values (product of confidences from
the root) are kept, ties to the earlier parent and the better rank. Every
random draw is a hash of ``(seed, stream, request, position, ...)``, so a
request's tree is the same whichever scheduler runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import LayoutError
from .models import draft, hash64, uniform

__all__ = ["TreeConfig", "TreeDrafts", "draft_trees"]

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
B = npt.NDArray[np.bool_]

# Random streams of the tree drafter (distinct from those of :class:`.models.Streams`).
_RANK = 41
_TOKEN = 42
_KEY = 43


@dataclass(frozen=True)
class TreeConfig:
    """The tree drafter's shape.

    Attributes:
        branch: candidates proposed per node (top-k); 1 drafts chains.
        depth: levels below the root; ``None`` = the run's ``drafts``.
        width: nodes kept per level (best path values).
        second_chance: ``q``, the chance that the reference token is the
            drafter's next candidate when the ones before it are wrong.
    """

    branch: int = 2
    depth: int | None = None
    width: int = 4
    second_chance: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.branch, int) or self.branch < 1:
            raise LayoutError(f"branch: expected an integer >= 1, got {self.branch!r}")
        if self.depth is not None and (not isinstance(self.depth, int) or self.depth < 0):
            raise LayoutError(f"depth: expected an integer >= 0 or None, got {self.depth!r}")
        if not isinstance(self.width, int) or self.width < 1:
            raise LayoutError(f"width: expected an integer >= 1, got {self.width!r}")
        if not (isinstance(self.second_chance, float | int) and 0.0 < float(self.second_chance) < 1.0):
            raise LayoutError(f"second_chance: expected a number in (0, 1), got {self.second_chance!r}")

    def levels(self, drafts: int) -> int:
        """The depth in effect for a run drafting ``drafts`` tokens per chain."""
        return int(drafts) if self.depth is None else int(self.depth)

    def as_json(self, drafts: int) -> dict[str, int | float]:
        """The shape as plain JSON values (depth resolved)."""
        return {
            "branch": self.branch,
            "depth": self.levels(drafts),
            "width": self.width,
            "second_chance": float(self.second_chance),
        }


@dataclass(frozen=True)
class TreeDrafts:
    """One step's draft trees, per request (nodes in level order, parents before children).

    Attributes:
        parents: parent index of every node (``-1``: the root).
        tokens: the drafted token of every node.
        conf: calibrated conditional confidences.
        depth: depth of every node (1 for the root's children).
        on_ref: the path to the node follows the reference document (what
            the simulated target prefers; the drafter does not know it).
    """

    parents: list[I64]
    tokens: list[I64]
    conf: list[F64]
    depth: list[I64]
    on_ref: list[B]

    @property
    def num_nodes(self) -> I64:
        """Nodes per request."""
        return np.asarray([p.shape[0] for p in self.parents], dtype=np.int64)

    def flat_tokens(self) -> I64:
        """Every node's token in batch order."""
        return np.concatenate(self.tokens) if self.tokens else np.zeros(0, dtype=np.int64)

    def conf_matrix(self) -> F64:
        """Confidences as an ``(n, max nodes)`` matrix, 0 past each request's nodes (at least one column)."""
        nn = self.num_nodes
        out = np.zeros((len(self.conf), max(1, int(nn.max()) if nn.size else 1)))
        for r, c in enumerate(self.conf):
            out[r, : c.shape[0]] = c
        return out


def _rank_conf(p: float, branch: int, q: float) -> F64:
    ranks = np.arange(branch)
    tail = (1.0 - p) * q * (1.0 - q) ** np.maximum(ranks - 1, 0)
    return np.where(ranks == 0, p, tail)


def draft_trees(
    seed: int,
    rid: I64,
    length: I64,
    window: I64,
    levels: I64,
    on_track: B,
    skill: F64,
    structural: B,
    first_token: int,
    vocab_size: int,
    eos: int,
    config: TreeConfig,
) -> TreeDrafts:
    """Draft one tree per request, ``levels[r]`` levels deep (0: no nodes).

    ``window[r, j]`` is the reference token ``j`` places past request ``r``'s
    output (``window`` has at least ``max(levels) + 1`` columns); ``on_track``
    says whether the output so far follows the reference.
    """
    n = rid.shape[0]
    k_max = int(levels.max()) if n else 0
    span = vocab_size - first_token
    q = float(config.second_chance)
    branch, width = config.branch, config.width
    # The chain drafter's greedy drafts: the top-1 candidates along the reference.
    chain = draft(
        seed, rid, length, window, levels, skill, np.zeros(n, dtype=bool), structural, first_token, vocab_size,
        max(k_max, 1),
    )  # fmt: skip
    out_p: list[I64] = []
    out_t: list[I64] = []
    out_c: list[F64] = []
    out_d: list[I64] = []
    out_o: list[B] = []
    for r in range(n):
        parents: list[int] = []
        tokens: list[int] = []
        conf: list[float] = []
        depth: list[int] = []
        on_ref: list[bool] = []
        # Frontier entries: (node index or -1, path value, key, on the reference, token, on the top-1 path)
        frontier: list[tuple[int, float, int, bool, int, bool]] = [(-1, 1.0, int(rid[r]), bool(on_track[r]), -1, True)]
        for d in range(1, int(levels[r]) + 1):
            pos = int(length[r]) + d - 1
            ref = int(window[r, d - 1])
            p = float(chain.conf[r, d - 1])
            rc = _rank_conf(p, branch, q)
            # Candidates: (path value, frontier index, rank, parent, confidence, on the reference, token, key)
            cands: list[tuple[float, int, int, int, float, bool, int, int]] = []
            for fi, (node, value, key, f_on, f_tok, f_top) in enumerate(frontier):
                if f_tok == eos:
                    continue  # a stop token ends its path
                keys = hash64(seed, _KEY, key, np.arange(branch)).astype(np.int64)
                rand = first_token + (hash64(seed, _TOKEN, rid[r], pos, keys) % np.uint64(span)).astype(np.int64)
                toks = [int(x) for x in rand]
                placed = -1  # the rank holding the reference token, if the drafter has it
                if f_top:
                    toks[0] = int(chain.tokens[r, d - 1])
                if f_on:
                    top = toks[0]
                    if top == ref:
                        placed = 0
                    else:
                        m = math.floor(math.log1p(-float(uniform(seed, _RANK, rid[r], pos)[0])) / math.log1p(-q))
                        if 1 + m < branch:
                            toks[1 + m] = ref
                            placed = 1 + m
                # Distinct siblings, and a random candidate never equals the reference by chance.
                seen: set[int] = set()
                for i, tk in enumerate(toks):
                    fixed = (i == 0 and f_top) or (f_on and i == placed)
                    while tk in seen or (not fixed and f_on and tk == ref):
                        tk = first_token + (tk - first_token + 1) % span
                    seen.add(tk)
                    toks[i] = tk
                for i in range(branch):
                    child_on = f_on and toks[i] == ref
                    cands.append((value * float(rc[i]), fi, i, node, float(rc[i]), child_on, toks[i], int(keys[i])))
            if not cands:
                break
            cands.sort(key=lambda c: (-c[0], c[1], c[2]))
            nxt: list[tuple[int, float, int, bool, int, bool]] = []
            for value, fi, i, node, c, child_on, tk, key in cands[:width]:
                nxt.append((len(parents), value, key, child_on, tk, frontier[fi][5] and i == 0))
                parents.append(node)
                tokens.append(tk)
                conf.append(c)
                depth.append(d)
                on_ref.append(child_on)
            frontier = nxt
        out_p.append(np.asarray(parents, dtype=np.int64))
        out_t.append(np.asarray(tokens, dtype=np.int64))
        out_c.append(np.asarray(conf, dtype=np.float64))
        out_d.append(np.asarray(depth, dtype=np.int64))
        out_o.append(np.asarray(on_ref, dtype=bool))
    return TreeDrafts(out_p, out_t, out_c, out_d, out_o)
