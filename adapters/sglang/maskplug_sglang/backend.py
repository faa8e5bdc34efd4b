"""maskplug as an SGLang grammar backend.

:class:`MaskplugGrammarBackend` compiles SGLang's grammar keys (``json``,
``regex``, ``ebnf``) with one of maskplug's grammar providers and returns
:class:`MaskplugGrammar` objects, which implement SGLang's
``BaseGrammarObject`` on maskplug's matchers, its batched fill and its
``apply_grammar_bitmask`` kernels.

SGLang's calling conventions, kept exactly:

* ``accept_token`` raises ``ValueError`` (here :class:`TokenRejected`, a
  :class:`maskplug.GrammarError`) for a token the grammar refuses, and does
  nothing once the grammar has terminated;
* ``rollback(k)`` undoes ``k`` accepted tokens, an accepted stop token counting
  as one;
* the vocab mask is the shared int32 bitmask (bit ``t & 31`` of word
  ``t >> 5``), ``ceil(vocab_size / 32)`` words per row, allocated all-allowed
  on the host and moved to the device without blocking;
* ``apply_vocab_mask`` masks row ``i`` of the logits with row ``i`` of the mask
  and leaves columns past ``32 × words`` as they are;
* ``copy`` returns a fresh grammar at the start state (SGLang caches one
  object per key and hands out copies);
* a grammar that fails to compile is an ``InvalidGrammarObject`` carrying the
  reason.

A grammar whose matcher fails while serving a request (an exception inside
it, or :attr:`maskplug.DraftMasks.failed` from a producer) fails that request
alone: see :class:`MaskplugGrammar` and :func:`abort_failed_requests`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from http import HTTPStatus
from typing import Any

import numpy as np
import torch
from sglang.srt.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarRow,
    GrammarStats,
    InvalidGrammarObject,
)

import maskplug
from maskplug import GrammarError, GrammarRows, LayoutError, PluginError, ScheduledLayout, fill_draft_masks
from maskplug.engines.sdk import GuardedGrammar
from maskplug.grammar.sdk import (
    AUTO,
    DEFAULT_MAX_WHITESPACE,
    GrammarProvider,
    GrammarSpec,
    Matcher,
    Vocab,
    check_bitmask,
    check_token,
    grammar_provider,
    grammar_providers,
)

from .vocab import vocab_from_tokenizer

__all__ = [
    "DEFAULT_PROVIDER",
    "ERROR_PREFIX",
    "PROVIDER_ENV",
    "MaskplugGrammar",
    "MaskplugGrammarBackend",
    "TokenRejected",
    "abort_failed_requests",
    "allocate_mask",
    "apply_mask",
    "fail_grammars",
    "fill_draft_chains",
    "producer_matcher",
]

logger = logging.getLogger(__name__)

ERROR_PREFIX = "maskplug grammar error: "
"""How the abort message of a request whose grammar failed begins (the error text follows)."""

PROVIDER_ENV = "MASKPLUG_SGLANG_PROVIDER"
"""Environment variable naming the maskplug grammar provider the backend uses."""

DEFAULT_PROVIDER = AUTO
"""The provider used when :data:`PROVIDER_ENV` is unset: ``"auto"``, which picks a provider per grammar."""

MAX_JUMP_FORWARD = 256
"""Most forced tokens one ``try_jump_forward`` walks (a forced run is rarely longer)."""


class TokenRejected(GrammarError):
    """A token the grammar does not allow was given to ``accept_token``.

    A ``ValueError`` (through :class:`maskplug.GrammarError`), which is what
    SGLang's scheduler catches to abort the request.
    """


def _pin() -> bool:
    # Pinned host memory makes the later host-to-device copy truly asynchronous;
    # it needs an accelerator runtime, so plain CPU machines skip it.
    return torch.cuda.is_available()


def allocate_mask(vocab_size: int, batch_size: int) -> torch.Tensor:
    """An all-allowed host bitmask: ``batch_size`` rows of ``ceil(vocab_size / 32)`` int32 words."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size <= 0:
        raise LayoutError(f"vocab_size: expected a positive int, got {vocab_size!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 0:
        raise LayoutError(f"batch_size: expected an int >= 0, got {batch_size!r}")
    words = (int(vocab_size) + 31) // 32
    return torch.full((int(batch_size), words), -1, dtype=torch.int32, pin_memory=_pin())


class _IdentityMaps(threading.local):
    """Row ``i`` → logits row ``i`` mappings, kept per device and row count.

    SGLang's mask has exactly one row per logits row, so the mapping is the
    identity; building it once per (device, rows) keeps the apply path free of
    host work and host-to-device copies.
    """

    def __init__(self) -> None:
        self.cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (str(device), rows)
        hit = self.cache.get(key)
        if hit is None:
            if len(self.cache) > 64:
                self.cache.clear()
            ar = torch.arange(rows + 1, dtype=torch.int32, device=device)
            hit = (ar[:rows], torch.zeros(rows, dtype=torch.int32, device=device), ar)
            self.cache[key] = hit
        return hit


_identity = _IdentityMaps()


def apply_mask(logits: torch.Tensor, vocab_mask: torch.Tensor, backend: str = "auto") -> None:
    """Mask ``logits`` in place with one bitmask row per logits row (SGLang's convention).

    Columns ``< min(width, 32 × words)`` follow the bits (a zero bit becomes
    ``-inf``); columns past the mask are left unchanged, as SGLang's own
    kernels do. The work is done by :func:`maskplug.apply_grammar_bitmask`.

    Raises:
        LayoutError: the row counts differ, or shapes/dtypes/devices are wrong
            (nothing is written).
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(vocab_mask, torch.Tensor):
        raise LayoutError(
            f"logits, vocab_mask: expected torch.Tensors, got {type(logits).__name__}, {type(vocab_mask).__name__}"
        )
    if logits.ndim != 2 or vocab_mask.ndim != 2:
        raise LayoutError(
            f"logits, vocab_mask: expected 2-D tensors, got shapes {tuple(logits.shape)} and {tuple(vocab_mask.shape)}"
        )
    rows = int(vocab_mask.shape[0])
    if int(logits.shape[0]) != rows:
        raise LayoutError(f"vocab_mask: expected one row per logits row ({int(logits.shape[0])}), got {rows} rows")
    width = int(logits.shape[1])
    vocab_size = min(width, 32 * int(vocab_mask.shape[1]))
    if rows == 0 or vocab_size == 0:
        return
    request, position, cu = _identity.get(logits.device, rows)
    if vocab_mask.device != logits.device:
        raise LayoutError(f"vocab_mask: expected device {logits.device} (the logits device), got {vocab_mask.device}")
    maskplug.apply_grammar_bitmask(
        logits,
        vocab_mask,
        (request, position),
        cu,
        vocab_size=vocab_size,
        tail="keep",
        backend=backend,
    )


class _VocabMaskOps:
    """The mask operations SGLang calls on both its grammar objects and its grammar backend."""

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device: Any) -> torch.Tensor:
        """The mask on ``device``, copied without blocking the host."""
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        """Mask ``logits`` in place with maskplug's kernels (see :func:`apply_mask`)."""
        apply_mask(logits, vocab_mask)


class MaskplugGrammar(GuardedGrammar, _VocabMaskOps, BaseGrammarObject):
    """One request's grammar: SGLang's ``BaseGrammarObject`` on a maskplug matcher.

    A grammar can fail: a producer reports it (:attr:`maskplug.DraftMasks.failed`,
    see :func:`fill_draft_chains` and :func:`maskplug_sglang.dspark.fill_verify_rows`),
    or its matcher raises inside one of the methods below. It then holds the
    :class:`~maskplug.GrammarError` in :attr:`error` and never calls its
    matcher again (:class:`maskplug.engines.sdk.GuardedGrammar`): its mask
    rows allow only the stop tokens and it walks no draft. The request ends
    with that error as its abort message, once: either a producer that
    knows the request aborts it
    (:func:`abort_failed_requests`), or the next :meth:`accept_token`
    raises the error as a ``ValueError``, which every SGLang commit path
    turns into ``FINISH_ABORT`` with the message (logged with the request
    id). The matcher's own exceptions never reach SGLang; that error is the
    only one a failed grammar raises (SGLang's EAGLE ``traverse_tree`` does
    not catch it: see the adapter's README).

    Bad arguments (a token id outside the vocabulary, a mask of the wrong
    width, a rollback past the start) still raise
    :class:`~maskplug.GrammarError` naming the argument, with nothing changed.

    Args:
        compiled: the provider's compiled grammar (copies start from it).
        vocab: the vocabulary the grammar was compiled for.
        key_string: SGLang's grammar key text (for messages).
        grammar_stats: SGLang's statistics record.
        matcher: the matcher to use (default: a fresh one from ``compiled``).
    """

    vocab: Vocab

    def __init__(
        self,
        compiled: Any,
        vocab: Vocab,
        key_string: str | None = None,
        grammar_stats: GrammarStats | None = None,
        matcher: Matcher | None = None,
    ) -> None:
        super().__init__()
        self.compiled = compiled
        self.vocab = vocab
        self.matcher: Matcher = compiled.matcher() if matcher is None else matcher
        self.key_string = key_string
        self.grammar_stats = grammar_stats
        self.num_accepted = 0
        self.error: GrammarError | None = None
        self.error_reported = False

    # -- failure -------------------------------------------------------------------
    def _describe(self, text: str) -> str:
        return f"{text} (grammar key {' '.join(self._short_key().split())})"

    @property
    def abort_message(self) -> str | None:
        """The request's abort message once the grammar failed."""
        return None if self.error is None else f"{ERROR_PREFIX}{self.error}"

    # -- tokens ------------------------------------------------------------------
    def accept_token(self, token: int) -> None:
        """Advance by ``token``; raises :class:`TokenRejected` if the grammar refuses it.

        Once the grammar has terminated, further tokens are ignored (SGLang
        feeds the tokens of a finished step through here). A failed grammar
        raises its error (a :class:`~maskplug.GrammarError`, so a
        ``ValueError``: SGLang aborts the request with it) unless the request
        was already aborted for it; then the token is ignored.
        """
        if self.error is None:
            check_token(token, self.vocab)  # bad input is the caller's error, not the grammar's
            try:
                if self.matcher.is_terminated():
                    return
                self.current_token = token
                ok = self.matcher.accept(token)
            except Exception as exc:
                self._raised(exc, f"accepting token {token}")
            else:
                if not ok:
                    raise TokenRejected(
                        f"token: expected a token the grammar allows after {self.num_accepted} accepted tokens, "
                        f"got {token} (grammar key {self._short_key()})"
                    )
                self.num_accepted += 1
                return
        if self.error_reported:
            return
        self.error_reported = True
        raise GrammarError(self.abort_message)

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens (an accepted stop token counts as one; nothing once failed)."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= self.num_accepted:
            raise GrammarError(f"k: expected an int in [0, {self.num_accepted}] (tokens accepted so far), got {k!r}")
        if self.error is not None:
            return
        try:
            self.matcher.rollback(int(k))
        except Exception as exc:
            self._raised(exc, f"rolling back {int(k)} tokens")
            return
        self.num_accepted -= int(k)

    # -- masks -------------------------------------------------------------------
    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: Any) -> torch.Tensor:
        """An all-allowed host bitmask of ``batch_size`` rows for this grammar's vocabulary.

        Raises:
            LayoutError: ``vocab_size`` gives a different mask width than the
                vocabulary the grammar was compiled for.
        """
        words = (int(vocab_size) + 31) // 32
        if words != self.vocab.mask_words:
            raise LayoutError(
                f"vocab_size: expected a width of {self.vocab.mask_words} mask words (vocab_size "
                f"{self.vocab.vocab_size} of the grammar backend), got {vocab_size} ({words} words)"
            )
        return allocate_mask(vocab_size, batch_size)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Write this grammar's allowed set into ``vocab_mask[idx]`` (the stop-only row once failed).

        A bad ``vocab_mask`` or ``idx`` raises :class:`~maskplug.GrammarError`
        before anything is written (the caller's error, not the grammar's).
        """
        check_bitmask(vocab_mask, idx, self.vocab)
        self.fill_row(vocab_mask, idx)

    @staticmethod
    def fill_vocab_mask_batched(entries: list[GrammarRow], vocab_mask: torch.Tensor) -> None:
        """Fill the listed rows (others untouched), one batched call per provider where it has one.

        Should a batched call raise, its rows are filled again one grammar at
        a time, so that only the grammars whose own matcher raises fail.
        """
        groups: dict[int, tuple[Any, list[MaskplugGrammar], list[int]]] = {}
        rest: list[GrammarRow] = []
        for entry in entries:
            g = entry.grammar
            ops = getattr(getattr(g, "matcher", None), "batch_ops", None)
            if isinstance(g, MaskplugGrammar) and ops is not None and g.error is None:
                grp = groups.setdefault(id(ops), (ops, [], []))
                grp[1].append(g)
                grp[2].append(int(entry.row))
            else:
                rest.append(entry)
        for ops, grammars, rows in groups.values():
            # The batch call trusts its buffer: check the width and every row first.
            r = np.asarray(rows, dtype=np.int64)
            check_bitmask(vocab_mask, int(r.max()), grammars[0].matcher.vocab)  # type: ignore[attr-defined]
            if r.min() < 0:
                raise GrammarError(f"entries: expected rows in [0, {vocab_mask.shape[0]}), got row {int(r.min())}")
            try:
                ops.fill([g.matcher for g in grammars], vocab_mask, rows)
            except Exception:
                for g, row in zip(grammars, rows, strict=True):
                    g.fill_vocab_mask(vocab_mask, row)
        for entry in rest:
            entry.grammar.fill_vocab_mask(vocab_mask, entry.row)

    @staticmethod
    def reset_vocab_mask(vocab_mask: torch.Tensor) -> None:
        """Back to all-allowed."""
        vocab_mask.fill_(-1)

    # -- lifecycle -----------------------------------------------------------------
    def copy(self) -> MaskplugGrammar:
        """A fresh grammar at the start state, sharing the compiled grammar."""
        stats = self.grammar_stats
        if stats is not None:
            stats = dataclasses.replace(stats, is_cache_hit=True, tree_traversal_time=[])
        return MaskplugGrammar(self.compiled, self.vocab, self.key_string, stats)

    # -- jump forward --------------------------------------------------------------
    def try_jump_forward(self, tokenizer: Any) -> tuple[list[int], str] | None:
        """The tokens spelling the text the grammar forces next, or None.

        Works with every provider, from the masks alone: while every allowed
        token starts with the same bytes and one token is exactly those bytes,
        that token is forced text (whatever the model samples begins with it),
        so it is taken and the walk goes on. It stops where the output could
        end (a stop token is allowed) or branch. The state is left unchanged.
        """
        if self.error is not None:
            return None
        try:
            return self._jump_forward(tokenizer)
        except Exception as exc:
            self._raised(exc, "a jump-forward walk")
            return None

    def _jump_forward(self, tokenizer: Any) -> tuple[list[int], str] | None:
        if self.matcher.is_terminated():
            return None
        scratch = self.vocab.new_bitmask(1)
        eos = self.vocab.eos_ids
        n_tokens = len(self.vocab.tokens)
        tokens: list[int] = []
        try:
            while len(tokens) < MAX_JUMP_FORWARD:
                self.matcher.fill(scratch, 0)
                bits = np.unpackbits(scratch[0].numpy().view(np.uint8), bitorder="little")
                ids = np.flatnonzero(bits[:n_tokens])
                if ids.size == 0 or any(bits[e] for e in eos):
                    break
                t = self._forced_token(ids)
                if t is None or not self.matcher.accept(t):
                    break
                tokens.append(t)
        finally:
            if tokens:
                self.matcher.rollback(len(tokens))
        if not tokens:
            return None
        if tokenizer is not None and callable(getattr(tokenizer, "decode", None)):
            text = str(tokenizer.decode(tokens))
        else:
            text = b"".join(self.vocab.tokens[t] for t in tokens).decode("utf-8", errors="replace")
        return tokens, text

    def _forced_token(self, ids: np.ndarray) -> int | None:
        """The allowed token equal to the common prefix of all allowed tokens' bytes, if any."""
        toks = self.vocab.tokens
        pieces = [toks[i] for i in ids.tolist()]
        lo, hi = min(pieces), max(pieces)
        # The common prefix of a set of strings is that of its least and greatest elements.
        n = 0
        for a, b in zip(lo, hi, strict=False):
            if a != b:
                break
            n += 1
        if n == 0:
            return None
        prefix = lo[:n]
        for i, p in zip(ids.tolist(), pieces, strict=True):
            if p == prefix:
                return int(i)
        return None

    def jump_forward_str_state(self, helper: tuple[list[int], str]) -> tuple[str, int]:
        """The forced text and the number of forced tokens."""
        tokens, text = helper
        return text, len(tokens)

    def jump_and_retokenize(self, old_output_ids: list[int], new_output_ids: list[int], next_state: int) -> None:
        """Re-align the grammar after SGLang re-tokenized its output.

        Rolls back to the longest common prefix of the old and new ids, then
        accepts the rest of the new ids.
        """
        k = 0
        for a, b in zip(old_output_ids, new_output_ids, strict=False):
            if a != b:
                break
            k += 1
        if k < len(old_output_ids):
            self.rollback(len(old_output_ids) - k)
        for t in new_output_ids[k:]:
            self.accept_token(int(t))

    def _short_key(self) -> str:
        key = self.key_string or "?"
        return key if len(key) <= 80 else key[:77] + "..."

    def __repr__(self) -> str:
        return (
            f"MaskplugGrammar(key={self._short_key()!r}, accepted={self.num_accepted}, "
            f"terminated={self.is_terminated()})"
        )


def producer_matcher(grammar: MaskplugGrammar) -> Matcher:
    """The matcher a mask-row producer gets for ``grammar`` (a raising stand-in once it failed)."""
    return grammar.producer_matcher()


def fail_grammars(grammars: Sequence[Any], failed: Any) -> None:
    """Fail the grammars a producer reported (``failed``: index into ``grammars`` → error)."""
    for i, err in failed.items():
        g = grammars[int(i)]
        if isinstance(g, MaskplugGrammar):
            g.fail(err)


def abort_failed_requests(reqs: Sequence[Any]) -> list[Any]:
    """Abort each request whose maskplug grammar failed and was not yet reported; returns their ids.

    The request's ``to_finish`` becomes SGLang's ``FINISH_ABORT`` with the
    grammar's error as its message (status 500, as SGLang's own grammar
    failures), so it finishes at its next result; the error is logged once,
    with the request id. Other requests are not touched.
    """
    aborted = []
    for req in reqs:
        g = getattr(req, "grammar", None)
        if not isinstance(g, MaskplugGrammar) or g.error is None or g.error_reported:
            continue
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        g.error_reported = True
        rid = getattr(req, "rid", None)
        logger.error("maskplug: the grammar of request %s failed, aborting it: %s", rid, g.error)
        req.to_finish = FINISH_ABORT(g.abort_message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
        aborted.append(rid)
    return aborted


def _window_batch(
    grammars: Sequence[MaskplugGrammar | None], draft_tokens: np.ndarray, vocab_mask: torch.Tensor
) -> tuple[int, int, list[MaskplugGrammar | None], list[int]]:
    """``(batch, W, grammars, live)`` of a step of SGLang windows; ``live``: the requests with an unterminated grammar.

    Raises:
        LayoutError: not one grammar entry per row of ``draft_tokens`` (``(batch, W)``), or
            ``vocab_mask`` without ``batch × W`` rows.
    """
    batch, width = int(draft_tokens.shape[0]), int(draft_tokens.shape[1])
    gs = list(grammars)
    if len(gs) != batch:
        raise LayoutError(f"grammars: expected one entry per request ({batch}), got {len(gs)}")
    if vocab_mask.ndim != 2 or vocab_mask.shape[0] < batch * width:
        raise LayoutError(
            f"vocab_mask: expected at least batch × W = {batch * width} rows, got shape {tuple(vocab_mask.shape)}"
        )
    live = [i for i, g in enumerate(gs) if g is not None and not g.is_terminated()]
    return batch, width, gs, live


def fill_draft_chains(
    grammars: Sequence[MaskplugGrammar | None], draft_tokens: Any, vocab_mask: torch.Tensor
) -> np.ndarray:
    """Mask rows of linear speculative windows, all requests at once, with :func:`maskplug.fill_draft_masks`.

    SGLang's layout: ``draft_tokens`` is ``(batch, W)``, column 0 the last
    verified token (not fed to the grammar) and columns ``1..W-1`` the drafts;
    request ``i`` owns mask rows ``i*W .. i*W+W-1``, row ``i*W+k`` being the
    mask after accepting drafts ``1..k``. The bits are those SGLang's
    ``traverse_tree`` writes for a chain: rows after the first refused draft,
    or after an accepted stop token, stay all-allowed, as do the rows of
    requests without a grammar or whose grammar has terminated. The grammars
    end in the state they started in. A grammar that fails (its matcher
    raises, a draft outside the vocabulary) gets the stop-only rows and is
    failed (:meth:`MaskplugGrammar.fail`: its request is aborted with the
    error at its next committed token); the other requests' rows are those of
    the batch without it.

    Returns:
        For each request, how many drafts its grammar accepts (``-1`` where no
        grammar was active, 0 where it failed).

    Raises:
        LayoutError: shapes disagree (nothing written).
    """
    dt = draft_tokens.detach().cpu().numpy() if isinstance(draft_tokens, torch.Tensor) else np.asarray(draft_tokens)
    if dt.ndim != 2 or (dt.size and dt.dtype.kind not in "iu"):
        raise LayoutError(f"draft_tokens: expected a 2-D integer array (batch, W), got shape {dt.shape} {dt.dtype}")
    batch, width, gs, active = _window_batch(grammars, dt, vocab_mask)
    acceptable = np.full(batch, -1, dtype=np.int64)
    if not active or width == 0:
        return acceptable
    for i in active:
        if not isinstance(gs[i], MaskplugGrammar):
            raise LayoutError(f"grammars[{i}]: expected a MaskplugGrammar or None, got {type(gs[i]).__name__}")
    n = len(active)
    layout = ScheduledLayout(list(range(n)), [width - 1] * n, [1] * n, num_bonus=1)
    rows = GrammarRows(list(range(n)))
    scratch = torch.empty((n * width, int(vocab_mask.shape[1])), dtype=torch.int32)
    matchers = [gs[i].producer_matcher() for i in active]  # type: ignore[union-attr]
    drafts = dt[active, 1:].astype(np.int64)
    got = fill_draft_masks(matchers, list(drafts), scratch, rows, layout)
    # The producer's batch indices are positions in ``active``.
    fail_grammars([gs[i] for i in active], got.failed)
    # Scatter each request's block to its own rows of SGLang's mask.
    dest = (np.asarray(active, dtype=np.int64)[:, None] * width + np.arange(width)[None, :]).reshape(-1)
    vocab_mask[torch.from_numpy(dest).to(vocab_mask.device)] = scratch.to(vocab_mask.device)
    acceptable[active] = got.acceptable
    return acceptable


class MaskplugGrammarBackend(_VocabMaskOps, BaseGrammarBackend):
    """SGLang's grammar backend on a maskplug grammar provider.

    Args:
        tokenizer: SGLang's tokenizer (see :func:`maskplug_sglang.vocab.vocab_from_tokenizer`).
        vocab_size: the model's logits width.
        eos_token_ids: the model's stop tokens.
        provider: the maskplug provider name (default: ``$MASKPLUG_SGLANG_PROVIDER``
            or :data:`DEFAULT_PROVIDER`).
        vocab: a ready :class:`Vocab` instead of reading ``tokenizer``.
        disable_any_whitespace: SGLang's ``constrained_json_disable_any_whitespace``:
            JSON grammars get ``whitespace="compact"``.
        max_whitespace: the bound on whitespace runs of JSON grammars (default
            :data:`maskplug.grammar.spec.DEFAULT_MAX_WHITESPACE`; SGLang's own
            backends set none).

    Raises:
        PluginError: the provider is not installed (the message lists those that are).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        *,
        provider: str | None = None,
        vocab: Vocab | None = None,
        disable_any_whitespace: bool = False,
        max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
    ) -> None:
        super().__init__()
        # Checked here (GrammarError naming it), not at the first request.
        GrammarSpec("json_object", max_whitespace=max_whitespace)
        self.json_options: dict[str, Any] = {
            "whitespace": "compact" if disable_any_whitespace else "flexible",
            "max_whitespace": max_whitespace,
        }
        name = provider or os.environ.get(PROVIDER_ENV, "").strip() or DEFAULT_PROVIDER
        known = grammar_providers()
        if name != AUTO and name not in known:
            raise PluginError(
                f"provider: expected one of the installed maskplug grammar providers {known} "
                f"(set {PROVIDER_ENV}), got {name!r}"
            )
        self.vocab = vocab if vocab is not None else vocab_from_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.provider: GrammarProvider = grammar_provider(name, self.vocab)
        self.vocab_size = self.vocab.vocab_size

    # -- SGLang's dispatch -----------------------------------------------------------
    def _compile(self, spec: GrammarSpec, key_type: str, key_string: str) -> BaseGrammarObject:
        if not self.provider.supports(spec.kind):
            return InvalidGrammarObject(
                f"grammar: maskplug provider {self.provider.name!r} does not support {spec.kind} grammars"
            )
        try:
            compiled = self.provider.compile(spec)
        except GrammarError as exc:
            return InvalidGrammarObject(str(exc))
        return MaskplugGrammar(compiled, self.vocab, key_string, GrammarStats(dispatch_type=key_type))

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        """A JSON-schema grammar; ``$$ANY$$`` is any JSON value."""
        if key_string == "$$ANY$$":
            return self._compile(GrammarSpec("json_object", **self.json_options), "json", key_string)
        return self._compile(GrammarSpec("json_schema", key_string, **self.json_options), "json", key_string)

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        """A regular-expression grammar."""
        return self._compile(GrammarSpec("regex", key_string), "regex", key_string)

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        """An EBNF grammar (GBNF dialect, as xgrammar reads it)."""
        return self._compile(GrammarSpec("ebnf", key_string), "ebnf", key_string)

    # -- masks (SGLang calls some of these on the backend) ------------------------------
    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: Any) -> torch.Tensor:
        """An all-allowed host bitmask (see :meth:`MaskplugGrammar.allocate_vocab_mask`)."""
        return allocate_mask(vocab_size, batch_size)

    @property
    def is_support_token_filter(self) -> bool:
        """This backend can set or clear individual tokens of a mask row."""
        return True

    @staticmethod
    def set_token_filter(
        vocab_mask: torch.Tensor,
        token_ids: Sequence[int],
        batch_idx: int,
        is_allowed: bool = True,
        reset_vocab_mask: bool = True,
    ) -> None:
        """Allow (or forbid) ``token_ids`` in row ``batch_idx``.

        With ``reset_vocab_mask`` the row first becomes all-forbidden (when
        allowing) or all-allowed (when forbidding); otherwise the given tokens
        are added to (or removed from) what the row already allows.
        """
        row = vocab_mask[batch_idx]
        if reset_vocab_mask:
            row.fill_(0 if is_allowed else -1)
        ids = np.asarray(list(token_ids), dtype=np.int64)
        if ids.size == 0:
            return
        words = int(vocab_mask.shape[-1])
        if ids.min() < 0 or ids.max() >= 32 * words:
            raise LayoutError(f"token_ids: expected ids in [0, {32 * words}), got {ids.min()}..{ids.max()}")
        # Collapse the ids to one bit pattern per touched word (duplicates OR together).
        bits = np.zeros(words, dtype=np.uint32)
        np.bitwise_or.at(bits, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
        touched = np.flatnonzero(bits)
        idx = torch.from_numpy(touched).to(row.device)
        pattern = torch.from_numpy(bits[touched].view(np.int32).copy()).to(row.device)
        if is_allowed:
            row[idx] = row[idx] | pattern
        else:
            row[idx] = row[idx] & ~pattern

    def reset(self) -> None:
        """Forget SGLang's cached grammar objects (the provider keeps its compile cache)."""
        super().reset()


def create_backend(
    server_args: Any, tokenizer: Any, vocab_size: int, eos_token_ids: Any = None
) -> MaskplugGrammarBackend:
    """The factory SGLang calls for ``--grammar-backend maskplug`` (its registry's signature).

    ``server_args.constrained_json_disable_any_whitespace`` (SGLang's flag, off by default) makes JSON compact.
    """
    compact = bool(getattr(server_args, "constrained_json_disable_any_whitespace", False))
    return MaskplugGrammarBackend(tokenizer, vocab_size, eos_token_ids, disable_any_whitespace=compact)
