"""Committing a verified step: the matchers advance by the tokens the step emitted.

:func:`commit` advances one matcher, :func:`commit_many` a batch (failing
only the requests that go wrong, :class:`CommitResult`). Both hold their
matchers while they advance, as the producers do (:mod:`maskplug.grammar.jobs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..errors import GrammarError
from .checks import brief_error
from .fillargs import MATCHER_TYPES, check_matchers
from .jobs import claim, release
from .protocols import Matcher
from .recovery import roll_back

__all__ = ["CommitResult", "commit", "commit_many"]

IntArray = npt.NDArray[np.int64]


def _token_array(tokens: Any, arg: str) -> IntArray:
    """``tokens`` as a 1-D int64 array (an empty sequence included), else a :class:`GrammarError` naming ``arg``."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().tolist()
    if isinstance(tokens, (str, bytes)) or tokens is None:
        raise GrammarError(f"{arg}: expected a 1-D sequence of token ids, got {type(tokens).__name__}")
    try:
        toks = np.asarray(tokens)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{arg}: expected a 1-D sequence of token ids, got {type(tokens).__name__}") from exc
    if toks.ndim == 1 and toks.size == 0:
        toks = toks.astype(np.int64)
    if toks.ndim != 1 or toks.dtype.kind not in "iu":
        raise GrammarError(f"{arg}: expected a 1-D sequence of token ids, got shape {toks.shape} {toks.dtype}")
    return toks.astype(np.int64, copy=False)


def _bad_token(matcher: Matcher, toks: IntArray, arg: str) -> GrammarError | None:
    """The error for the first token id outside ``matcher``'s vocabulary, or None."""
    vocab = getattr(matcher, "vocab", None)
    if vocab is None or not toks.size:
        return None
    bad = (toks < 0) | (toks >= vocab.vocab_size)
    if not np.any(bad):
        return None
    p = int(np.argmax(bad))
    return GrammarError(f"{arg}[{p}]: expected a token id in [0, {vocab.vocab_size}), got {int(toks[p])}")


def _advance(matcher: Matcher, toks: IntArray, arg: str) -> int:
    """Feed ``toks`` to a held matcher up to termination or the first refusal; return how many it took.

    An exception from the matcher becomes a :class:`GrammarError` naming
    ``arg`` (the exception chained), after the tokens this call had taken are
    rolled back; the message says when that rollback failed too.
    """
    taken = 0
    doing = "is_terminated()"
    try:
        for t in toks.tolist():
            doing = "is_terminated()"
            if matcher.is_terminated():
                break
            doing = f"accept of tokens[{taken}] = {t}"
            if not matcher.accept(int(t)):
                break
            taken += 1
        return taken
    except Exception as exc:
        msg = f"{arg}: the matcher raised {type(exc).__name__} in its {doing}: {brief_error(exc)}"
        if taken:
            msg += (
                roll_back(matcher, taken, "tokens it had taken")
                or f"; the {taken} tokens it had taken were rolled back"
            )
        raise GrammarError(msg) from exc


def commit(matcher: Matcher, tokens: Sequence[int] | Any) -> int:
    """Advance ``matcher`` by the tokens the step emitted; return how many it took.

    ``tokens`` are the accepted drafts followed by the bonus (or recovered)
    token. Advancing stops at termination (a stop token) and at the first
    token the grammar refuses (which a correctly masked step never emits);
    the tokens after that point are not taken. Arguments are checked before
    the matcher is touched (a bad one raises :class:`GrammarError` naming
    it). An exception from inside the matcher (an engine failure) is raised
    as a :class:`GrammarError` naming ``matcher``, with the engine's
    exception as its ``__cause__``, after the tokens this call had taken are
    rolled back (the message says when that was not possible). The matcher
    is held while it advances (see :func:`fill_draft_masks`): one in use by
    a call on another thread is refused with :class:`~maskplug.MatcherInUse`,
    and an unfinished ``wait=False`` fill that holds it is waited for, so a
    step's commit never races that step's fill. :func:`commit_many` commits
    a whole batch, failing only the requests that go wrong.
    """
    if not MATCHER_TYPES.ok(matcher):
        raise GrammarError(f"matcher: expected a Matcher, got {type(matcher).__name__}")
    toks = _token_array(tokens, "tokens")
    bad = _bad_token(matcher, toks, "tokens")
    if bad is not None:
        raise bad
    held = claim((matcher,), [id(matcher)], "matcher")
    try:
        return _advance(matcher, toks, "matcher")
    finally:
        release(held)


@dataclass(frozen=True)
class CommitResult:
    """What :func:`commit_many` did, per request (in the order of the matchers given).

    Attributes:
        taken: tokens each matcher took (0 for a failed request).
        failed: the requests that could not be committed, by index into the
            matchers given, each with the :class:`GrammarError` saying why
            (``tokens_per_request[i][p]: ...`` for a token id outside the
            vocabulary, ``matchers[i]: ...`` for an exception from the
            matcher). A failed request's matcher is where it was before the
            call, unless the error says that rolling it back failed.
    """

    taken: tuple[int, ...]
    failed: Mapping[int, GrammarError] = field(default_factory=lambda: MappingProxyType({}))


def commit_many(matchers: Sequence[Matcher], tokens_per_request: Sequence[Any]) -> CommitResult:
    """:func:`commit` for a batch: ``matchers[i]`` advances by ``tokens_per_request[i]``.

    Every request advances exactly as a single :func:`commit` would; one
    whose tokens hold an id outside its vocabulary (or negative) is not
    touched, and one whose matcher raises is rolled back to where it was
    (where the matcher allows): either fails alone, reported in
    :attr:`CommitResult.failed`, and the others are committed all the same.
    Structural mistakes raise :class:`GrammarError` before any matcher is
    touched: ``matchers`` not a sequence of distinct matchers, a different
    number of token sequences, a token sequence that is not a 1-D sequence of
    integers. All the matchers are held for the call (see
    :func:`fill_draft_masks`).
    """
    if isinstance(matchers, (str, bytes)) or not isinstance(matchers, Sequence):
        raise GrammarError(f"matchers: expected a sequence of matchers, got {type(matchers).__name__}")
    if isinstance(tokens_per_request, (str, bytes, torch.Tensor)) or not isinstance(tokens_per_request, Sequence):
        raise GrammarError(
            f"tokens_per_request: expected one token sequence per matcher, got {type(tokens_per_request).__name__}"
        )
    ms, keys = check_matchers(matchers, len(matchers))
    if len(tokens_per_request) != len(ms):
        raise GrammarError(
            f"tokens_per_request: expected {len(ms)} token sequences (one per matcher), got {len(tokens_per_request)}"
        )
    toks = [_token_array(t, f"tokens_per_request[{i}]") for i, t in enumerate(tokens_per_request)]
    errors: dict[int, GrammarError] = {}
    for i, (m, t) in enumerate(zip(ms, toks, strict=True)):
        bad = _bad_token(m, t, f"tokens_per_request[{i}]")
        if bad is not None:
            errors[i] = bad
    taken = [0] * len(ms)
    held = claim(ms, keys, "matchers")
    try:
        for i, (m, t) in enumerate(zip(ms, toks, strict=True)):
            if i in errors:
                continue
            try:
                taken[i] = _advance(m, t, f"matchers[{i}]")
            except GrammarError as err:
                errors[i] = err
    finally:
        release(held)
    return CommitResult(tuple(taken), MappingProxyType(dict(sorted(errors.items()))))
