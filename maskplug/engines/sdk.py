"""The engine SDK: what maskplug's engine adapters (and outside ones) share.

Engines rarely have a registry for what an adapter must change (vLLM's mask
apply and its verify step, SGLang's DSpark planner), so adapters replace a
few named attributes of the engine, after checking its release.
:class:`PatchSet` keeps that bookkeeping in one place: each replacement is
made once per process, the engine's own attribute stays reachable
(:meth:`PatchSet.original`), a missing attribute (an engine build that does
not match the tested source) is a :class:`~maskplug.PluginError` naming it,
and :meth:`PatchSet.uninstall` puts everything back in reverse order.
:func:`wraps` marks a wrapper with the engine function it wraps.

Every adapter also wraps maskplug's matchers in the engine's own grammar
object, and a grammar that fails must fail its request alone:
:class:`GuardedGrammar` holds that failure handling (the error, the
matcher never called again, the stop-only rows, the stand-in matcher the
mask-row producers get). :func:`fill_windows_serially` is the producer's
serial walk for an engine's hot path with a few requests, whose inputs the
adapter has already checked.

Scheduler names reach adapters from the engine's configuration (an
environment variable, a server flag): :func:`parse_scheduler_spec` is the
core's one parser of ``name`` and ``grammar-aware:inner``, re-exported here
with :class:`VerifyAllScheduler`, the built-in an adapter may recognise to
skip the per-step view and outcome (it verifies every draft and learns nothing).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import torch

from .._checks import INT32_MAX
from ..draftmasks import DraftMasks
from ..errors import GrammarError, LayoutError, PluginError
from ..grammar.bases import MatcherBase, plain_matcher_type
from ..grammar.jobs import claim, release
from ..grammar.sdk import FailedMatcher, Matcher, Vocab, brief_error, stop_row
from ..grammar.serial import walk_windows
from ..layout import RowMapping
from ..schedulers import SchedulerSpec, VerifyAllScheduler, parse_scheduler_spec

__all__ = [
    "GuardedGrammar",
    "PatchSet",
    "SchedulerSpec",
    "VerifyAllScheduler",
    "accept_emitted",
    "draft_validator",
    "emitted_acceptor",
    "fill_windows_serially",
    "parse_scheduler_spec",
    "ragged_mapping",
    "wraps",
]

F = TypeVar("F", bound=Callable[..., Any])


def wraps(orig: Callable[..., Any]) -> Callable[[F], F]:
    """Give a wrapper the engine function's docstring and ``__wrapped__`` (its name stays its own)."""

    def mark(fn: F) -> F:
        fn.__doc__ = orig.__doc__
        fn.__wrapped__ = orig  # type: ignore[attr-defined]
        return fn

    return mark


class PatchSet:
    """The attributes one adapter replaced in one engine, in this process.

    Args:
        engine: the engine's name as errors show it (``"vllm"``, ``"sglang"``).
        tested: what the adapter was tested with, for the error on a missing
            attribute (e.g. ``"vLLM 0.32.0"``), or a function returning it
            (called only then).
    """

    def __init__(self, engine: str, tested: str | Callable[[], str]) -> None:
        self.engine = engine
        self._tested = tested
        self.lock = threading.RLock()
        self._originals: dict[tuple[int, str], tuple[Any, str, Any]] = {}
        # (module name, attribute, replacement, original) of each copy a module may bind at its import.
        self._copies: list[tuple[str, str, Any, Any]] = []

    def replace(self, owner: Any, attr: str, new: Any, copies: Sequence[str] = ()) -> None:
        """Set ``owner.attr = new`` unless this set already replaced it (then nothing changes).

        ``copies`` names modules that bind the attribute at their import
        (``from owner import attr``): those already imported are replaced
        too, and :meth:`uninstall` also puts the original back in any of them
        imported later, which bound the replacement then.
        """
        with self.lock:
            key = (id(owner), attr)
            if key in self._originals:
                return
            if not hasattr(owner, attr):
                tested = self._tested() if callable(self._tested) else self._tested
                raise PluginError(
                    f"{self.engine} internals: expected {getattr(owner, '__name__', owner)!r} to define {attr!r} "
                    f"(tested with {tested}), got nothing; this {self.engine} build does not match the tested source"
                )
            own = getattr(owner, attr)
            self._originals[key] = (owner, attr, own)
            setattr(owner, attr, new)
            for name in copies:
                self._copies.append((name, attr, new, own))
                module = sys.modules.get(name)
                if module is not None:
                    self.replace(module, attr, new)

    def wrap(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.attr`` by ``make(original)``, where ``original`` is the engine's own attribute."""
        with self.lock:
            if (id(owner), attr) not in self._originals:
                self.replace(owner, attr, make(self.original(owner, attr)))

    def original(self, owner: Any, attr: str) -> Any:
        """The engine's own implementation of ``owner.attr`` (the current one when not replaced)."""
        entry = self._originals.get((id(owner), attr))
        return entry[2] if entry is not None else getattr(owner, attr)

    def replaced(self, owner: Any, attr: str) -> bool:
        """Whether this set replaced ``owner.attr``."""
        return (id(owner), attr) in self._originals

    def installed(self) -> bool:
        """Whether any replacement is in place."""
        return bool(self._originals)

    def uninstall(self) -> None:
        """Put every replaced attribute back, the last replaced first."""
        with self.lock:
            for owner, attr, value in list(self._originals.values())[::-1]:
                setattr(owner, attr, value)
            self._originals.clear()
            for name, attr, new, own in self._copies:
                module = sys.modules.get(name)
                # Imported after the replacement, it bound the replacement: the original goes back too.
                if module is not None and getattr(module, attr, None) is new:
                    setattr(module, attr, own)
            self._copies.clear()


class GuardedGrammar:
    """Failure handling for an engine's grammar object on a maskplug matcher (a mixin).

    Put it before the engine's base class (``class Grammar(GuardedGrammar,
    EngineGrammar)``); the subclass sets :attr:`matcher` and :attr:`vocab`.
    A grammar fails through :meth:`fail`: a producer reported it
    (:attr:`maskplug.DraftMasks.failed`), or its matcher raised inside one of
    the subclass's methods, which report it with :meth:`_raised`. From then
    on :attr:`error` holds the :class:`~maskplug.GrammarError`, the matcher
    is not called again, :meth:`is_terminated` is False (the request still
    needs rows), :meth:`fill_row` writes the rows that allow only the
    stop tokens and :meth:`producer_matcher` hands the producers a stand-in
    that raises the error, so they give the request the stop-only rows and
    report it again. How the request then ends is the engine's: the
    subclass names it in :meth:`_describe` and acts in :meth:`_failed_now`.

    Attributes:
        matcher: the request's maskplug matcher.
        vocab: the vocabulary whose stop tokens a failed grammar's rows allow
            (``None``: no stop tokens known; the rows stay all-allowed).
        error: the error the grammar failed with (``None`` while it serves).
    """

    matcher: Matcher
    vocab: Vocab | None
    error: GrammarError | None = None
    _failed: FailedMatcher | None = None
    _stop: torch.Tensor | None = None

    def _describe(self, text: str) -> str:
        """The failure text as the error states it (a subclass adds the request or the grammar)."""
        return text

    def _failed_now(self, error: GrammarError) -> None:
        """Called once, right after the grammar failed with ``error`` (a subclass logs or reports it)."""

    def fail(self, error: BaseException) -> None:
        """Fail this grammar with ``error`` (a no-op once failed); the matcher is not called again.

        A :class:`~maskplug.GrammarError` keeps its text; any other exception
        is reported as raised by the matcher. The stored error's cause is
        ``error``.
        """
        if self.error is not None:
            return
        text = (
            str(error)
            if isinstance(error, GrammarError)
            else f"the matcher raised {type(error).__name__}: {brief_error(error)}"
        )
        err = GrammarError(self._describe(text))
        err.__cause__ = error
        self.error = err
        self._failed_now(err)

    def _raised(self, exc: Exception, doing: str) -> None:
        """Fail the grammar because its matcher raised ``exc`` while ``doing`` something."""
        err = GrammarError(f"the matcher raised {type(exc).__name__} in {doing}: {brief_error(exc)}")
        err.__cause__ = exc
        self.fail(err)

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted (False once failed: its stop-only rows are still needed)."""
        if self.error is not None:
            return False
        try:
            return bool(self.matcher.is_terminated())
        except Exception as exc:
            self._raised(exc, "is_terminated")
            return False

    def producer_matcher(self) -> Matcher:
        """The matcher a mask-row producer gets: the real one, or once failed a stand-in that raises its error."""
        if self.error is None:
            return self.matcher
        if self._failed is None:
            self._failed = FailedMatcher(self.vocab, self.error)
        return self._failed

    def fill_row(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the grammar's allowed tokens into ``bitmask[index]``: the matcher's row, or the stop-only row.

        The stop-only row once the grammar failed, and when the matcher
        raises while filling (the grammar then fails).
        """
        if self.error is None:
            try:
                self.matcher.fill(bitmask, index)
                return
            except Exception as exc:
                self._raised(exc, f"filling mask row {index}")
        self.fill_stop_row(bitmask, index)

    def fill_stop_row(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the row allowing only the stop tokens into ``bitmask[index]`` (on the bitmask's device)."""
        row = bitmask[index]
        if self.vocab is None:
            # No vocabulary to read the stop tokens from: the row stays open (a
            # row allowing nothing cannot be sampled); the error ends the request.
            row.fill_(-1)
            return
        if self._stop is None:
            self._stop = stop_row(self.vocab)
        w = min(int(row.shape[0]), int(self._stop.shape[0]))
        row.zero_()
        row[:w] = self._stop[:w].to(row.device)


def fill_windows_serially(
    matchers: Sequence[Matcher],
    windows: Sequence[Sequence[int]],
    row0: Sequence[int],
    bitmask: torch.Tensor,
    total: int,
    host: np.ndarray[Any, Any] | None = None,
    *,
    claim_matchers: bool = True,
    find_forced: bool = True,
) -> DraftMasks:
    """:func:`maskplug.fill_draft_masks` with ``strategy="serial"``, on inputs the caller has checked.

    The same walk, fault handling and result as that call, without what it
    spends on general input (no layout, row mapping, draft-matrix or bitmask
    checks), for an engine's hot path with a few requests. Request ``g``'s
    rows are ``row0[g]`` to ``row0[g] + len(windows[g])`` (its drafts' rows
    and its bonus row); ``total`` is the number of rows the step spans, and
    the rows below it that no request owns come out all-allowed (the
    producer's tail, as for the rows of drafts it does not reach). The
    matchers are claimed for the call (see ``claim_matchers``).

    The caller guarantees, as :func:`maskplug.fill_draft_masks` would check:
    ``matchers`` are distinct :class:`~maskplug.grammar.Matcher` objects,
    each with a ``vocab`` of the same mask width; every draft id lies in
    ``[0, vocab_size)``; the rows of different requests do not overlap and
    lie below ``total``; ``bitmask`` passes
    :func:`maskplug.grammar.sdk.check_bitmask` for row ``total - 1``;
    ``host``, when given, is ``bitmask.numpy()``, kept by the caller for a
    buffer it fills step after step (the walk reads the rows it wrote through
    it; between an engine's forward passes making the view costs more than
    the walk's own bookkeeping at one request).

    ``claim_matchers=False`` skips the claim, for an engine whose matchers
    are its own and used on one thread only (vLLM's scheduler thread drives
    every call on its requests' grammars): nothing then refuses a matcher
    that another call is using, and the caller answers for that. Between an
    engine's forward passes the claim and its release cost a few
    microseconds at one request.

    ``find_forced=False`` leaves the single-token rows unlooked-for: the
    result's ``forced`` is all False, and the rows are only checked for an
    allowed token each (a row that allows none still fails its request). For
    an engine that reads nothing of the result but ``failed`` and
    ``acceptable``: finding the forced rows counts every row's allowed tokens,
    which at sixteen requests cost as much as a quarter of the walk.

    Raises:
        MatcherInUse: another thread's call holds one of the matchers (with the claim).
    """
    if not claim_matchers:
        return walk_windows(matchers, windows, row0, bitmask, total, host, find_forced=find_forced)
    keys = [id(m) for m in matchers]
    held = claim(matchers, keys, "matchers")
    try:
        return walk_windows(matchers, windows, row0, bitmask, total, host, find_forced=find_forced)
    finally:
        release(held)


def accept_emitted(matcher: Matcher, tokens: Sequence[int]) -> int:
    """Advance ``matcher`` by the tokens an engine emitted; how many it took.

    In order, as ``matcher.accept`` would, stopping at the first token it
    refuses (the state stays after the tokens before it) or once the matcher
    is terminated (the tokens after a stop token are not offered: engines
    emit the stop token and may pad after it). So ``tokens[n]`` was refused
    when ``n < len(tokens)`` and the matcher is not terminated.

    For an engine's per-step bookkeeping: ids that are ``int`` within the
    matcher's vocabulary go to the unchecked accept the mask-row producer uses
    (the same result, without the per-call argument check); anything else
    goes through ``accept`` and its checks (a bad id raises
    :class:`~maskplug.GrammarError` there).
    """
    if plain_matcher_type(type(matcher)):
        return cast(MatcherBase, matcher)._accept_run(tokens)
    fast: Callable[[int], bool] = matcher.accept
    size = -1  # every id through accept()
    terminated = matcher.is_terminated
    n = 0
    for t in tokens:
        if terminated():
            break
        if not (fast(t) if t.__class__ is int and 0 <= t < size else matcher.accept(t)):
            break
        n += 1
    return n


def emitted_acceptor(matcher: Matcher) -> Callable[[Sequence[int]], int]:
    """:func:`accept_emitted` bound to ``matcher``, looked up once.

    For an engine object that holds one request's matcher and advances it
    every step: the returned callable takes the emitted tokens and returns how
    many the matcher took, exactly as ``accept_emitted(matcher, tokens)``,
    with the matcher's type asked only here (for a plain
    :class:`~maskplug.grammar.sdk.MatcherBase` it is the matcher's own loop,
    one Python call per step).
    """
    if plain_matcher_type(type(matcher)):
        return cast(MatcherBase, matcher)._accept_run
    return functools.partial(accept_emitted, matcher)


def draft_validator(matcher: Matcher) -> Callable[[Sequence[int]], int]:
    """``matcher.validate`` for an engine that checks a request's drafts every step, 0 once it has ended.

    The returned callable takes the drafts and returns how many the grammar
    accepts, without advancing (``matcher.validate(drafts)``, bad ids raising
    as there), and 0 without looking at them once the matcher is terminated
    (as vLLM's own grammars answer then). Looked up once: for a
    :class:`~maskplug.grammar.sdk.MatcherBase` that keeps ``validate``,
    ``accept`` and ``rollback`` it is one bound method of the matcher (one
    Python call per step, the termination read as an attribute); any other
    matcher is asked ``is_terminated()`` first.
    """
    cls = type(matcher)
    if plain_matcher_type(cls) and cls.validate is MatcherBase.validate:  # type: ignore[attr-defined]
        return cast(MatcherBase, matcher)._validate_drafts
    return functools.partial(_validate_unless_ended, matcher)


def _validate_unless_ended(matcher: Matcher, tokens: Sequence[int]) -> int:
    return 0 if matcher.is_terminated() else matcher.validate(tokens)


def ragged_mapping(batch_index: Sequence[int], rows: Sequence[int], num_batch: int) -> RowMapping:
    """The row mapping of ragged mask rows, from each grammar request's batch index and row count.

    Grammar request ``g`` (in the order the producer wrote its rows) owns
    the next ``rows[g]`` bitmask rows, for positions ``0 .. rows[g] - 1`` of
    batch request ``batch_index[g]``: what
    :meth:`maskplug.GrammarRows.mapping` builds for a ragged layout, without
    building the :class:`~maskplug.ScheduledLayout` first, for an engine that
    maps a new step every time its batch or draft counts change. The mapping
    is checked here, so :func:`maskplug.apply_grammar_bitmask` trusts it as
    it trusts the planner's.

    Raises:
        LayoutError: lengths that differ, a batch index outside ``[0,
            num_batch)`` or repeated, a row count below 1, or more than
            ``2**31 - 1`` rows.
    """
    g = len(batch_index)
    if len(rows) != g:
        raise LayoutError(f"rows: expected {g} counts (one per grammar request), got {len(rows)}")
    if g <= _FEW_REQUESTS:
        return _ragged_few([int(b) for b in batch_index], [int(r) for r in rows], num_batch)
    idx = np.asarray(batch_index, dtype=np.int64).reshape(g)
    per = np.asarray(rows, dtype=np.int64).reshape(g)
    if g:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= num_batch:
            bad = lo if lo < 0 else hi
            raise LayoutError(f"batch_index: expected indices in [0, {num_batch}), got {bad}")
        if np.unique(idx).shape[0] != g:
            raise LayoutError("batch_index: expected each batch request at most once, got a repeat")
        if int(per.min()) < 1:
            raise LayoutError(f"rows: expected at least 1 row per grammar request, got {int(per.min())}")
    total = int(per.sum())
    if total > INT32_MAX:
        raise LayoutError(f"rows: expected at most 2**31 - 1 mask rows (int32 row indices), got {total}")
    starts = np.zeros(g, dtype=np.int32)
    if g > 1:
        np.cumsum(per[:-1], out=starts[1:])
    request = np.repeat(idx.astype(np.int32), per)
    position = np.arange(total, dtype=np.int32)
    position -= np.repeat(starts, per)
    return RowMapping._checked(request, position, int(idx.max()) + 1 if g else 0)


#: Up to this many grammar requests :func:`ragged_mapping` works on Python lists (fewer numpy calls).
_FEW_REQUESTS = 64


def _ragged_few(idx: list[int], per: list[int], num_batch: int) -> RowMapping:
    """:func:`ragged_mapping` of a few requests, its checks and rows in Python lists (the same checks and result)."""
    if idx:
        lo, hi = min(idx), max(idx)
        if lo < 0 or hi >= num_batch:
            raise LayoutError(f"batch_index: expected indices in [0, {num_batch}), got {lo if lo < 0 else hi}")
        if len(set(idx)) != len(idx):
            raise LayoutError("batch_index: expected each batch request at most once, got a repeat")
        if min(per) < 1:
            raise LayoutError(f"rows: expected at least 1 row per grammar request, got {min(per)}")
    total = sum(per)
    if total > INT32_MAX:
        raise LayoutError(f"rows: expected at most 2**31 - 1 mask rows (int32 row indices), got {total}")
    request: list[int] = []
    position: list[int] = []
    for b, k in zip(idx, per, strict=True):
        request += [b] * k
        position += range(k)
    return RowMapping._checked(
        np.array(request, dtype=np.int32), np.array(position, dtype=np.int32), max(idx) + 1 if idx else 0
    )
