"""The interfaces the core programs against: matchers, compiled grammars, providers and batch operations.

A provider distribution implements these (most easily on top of
:mod:`maskplug.grammar.sdk`); :func:`maskplug.fill_draft_masks` and the
engine adapters only ever call what is declared here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch

from .spec import GrammarSpec, Vocab

__all__ = ["BatchOps", "ChainOps", "CompiledGrammar", "GrammarProvider", "Matcher", "TreeOps"]


@runtime_checkable
class Matcher(Protocol):
    """One request's grammar state. Identical semantics for every provider.

    * ``accept(token)``: advance by one token; False (state unchanged) when the
      grammar does not allow it. Accepting a stop token terminates.
    * ``validate(tokens)``: length of the accepted prefix, without advancing.
    * ``rollback(n)``: undo the last ``n`` accepted tokens (a stop token counts).
    * ``fill(bitmask, row)``: write the allowed set into ``bitmask[row]`` (a CPU
      int32 tensor exactly ``ceil(vocab_size/32)`` words wide); returns False
      when every token is allowed. A terminated matcher allows only the stop
      tokens.
    * ``is_terminated()``, ``reset()``, ``fork()`` (an independent copy).
    """

    def accept(self, token: int) -> bool: ...
    def validate(self, tokens: Sequence[int]) -> int: ...
    def rollback(self, n: int) -> None: ...
    def fill(self, bitmask: torch.Tensor, row: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def reset(self) -> None: ...
    def fork(self) -> Matcher: ...


@runtime_checkable
class CompiledGrammar(Protocol):
    """A grammar compiled for one vocabulary; cheap to make matchers from."""

    spec: GrammarSpec

    def matcher(self) -> Matcher: ...


@runtime_checkable
class GrammarProvider(Protocol):
    """A grammar engine bound to one :class:`Vocab`."""

    name: str
    vocab: Vocab
    kinds: frozenset[str]

    def supports(self, kind: str) -> bool: ...
    def compile(self, spec: GrammarSpec) -> CompiledGrammar: ...


@runtime_checkable
class BatchOps(Protocol):
    """Optional batch operations over many matchers of one provider.

    A matcher that offers them has a ``batch_ops`` attribute (shared by all
    matchers of its provider); :func:`maskplug.fill_draft_masks` groups
    matchers by it and calls these instead of one Python call per matcher and
    row. Semantics are those of the per-matcher methods, element-wise.

    * ``fill(matchers, bitmask, rows)``: ``matchers[i].fill(bitmask, rows[i])``
      (the bitmask was already checked).
    * ``accept(matchers, tokens) -> list[bool]``.
    * ``rollback(matchers, counts)``: ``matchers[i].rollback(counts[i])``.
    """

    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None: ...
    def accept(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> list[bool]: ...
    def rollback(self, matchers: Sequence[Matcher], counts: Sequence[int]) -> None: ...


@runtime_checkable
class ChainOps(BatchOps, Protocol):
    """Batch operations that also fill whole draft chains (see :mod:`maskplug.grammar.draft`).

    * ``fill_chains(matchers, bitmask, rows, drafts, threads=None, forced=None)
      -> list[int]``: for each live matcher ``i``, row ``rows[i] + p`` is the
      mask after ``drafts[i][:p]``, for every ``p`` up to the number of drafts
      it accepts, which it returns; the walk stops at the first refused draft
      (its row is written) and after an accepted stop token (the row after it
      is not). Terminated matchers are refused with :class:`GrammarError`;
      matchers end where they started, also on error. ``threads`` bounds the
      workers it may use.
    * ``fills_forced``: whether ``fill_chains`` takes ``forced``, one flag per
      bitmask row, and sets the flag of every row it writes to whether that
      row allows exactly one token (so the caller need not scan those rows).
    """

    fills_forced: bool

    def fill_chains(
        self,
        matchers: Sequence[Matcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
        drafts: Sequence[Sequence[int]],
        threads: int | None = None,
        forced: npt.NDArray[np.bool_] | None = None,
    ) -> list[int]: ...


@runtime_checkable
class TreeOps(BatchOps, Protocol):
    """Batch operations that also walk whole draft trees in the engine (see :mod:`maskplug.grammar.trees`).

    * ``fill_tree(matcher, next_child, next_sibling, tokens, bitmask)``: one
      request's draft tree of ``n`` nodes, node 0 the matcher's current state
      (live, not terminated) and node ``j > 0`` reached from its parent by
      ``tokens[j]`` (``tokens[0]`` is not fed); ``next_child[j]`` is node
      ``j``'s first child and ``next_sibling[j]`` its next sibling (-1: none),
      all three 1-D CPU int64 tensors of ``n`` entries. Row ``j`` of
      ``bitmask`` (a CPU int32 tensor of ``n`` rows) becomes the mask at node
      ``j`` for every node the walk reaches; it goes below no token the mask
      above it refuses and past no accepted stop token, and the rows of the
      nodes it does not reach may hold anything. The matcher ends where it
      started, also when it raises. This is xgrammar's
      ``GrammarMatcher.traverse_draft_tree``, the walk in one native call.
    """

    def fill_tree(
        self,
        matcher: Matcher,
        next_child: torch.Tensor,
        next_sibling: torch.Tensor,
        tokens: torch.Tensor,
        bitmask: torch.Tensor,
    ) -> None: ...
