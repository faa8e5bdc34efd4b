"""Base classes for providers: the compile cache, provider and matcher bases, batch and chain operations.

:class:`MatcherBase` turns a handful of engine primitives into the normalised
:class:`~maskplug.grammar.Matcher` semantics; :class:`ProviderBase` adds the
kind checks and the compile cache; :class:`BatchOpsBase` and
:class:`ChainOpsBase` give batch operations their per-matcher defaults and the
argument handling of ``fill_chains``.
"""

from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from ..errors import GrammarError, MaskplugError
from .checks import check_bitmask, check_chain_args, check_token
from .protocols import BatchOps, CompiledGrammar, Matcher
from .rows import stop_row
from .spec import GrammarSpec, Vocab

if TYPE_CHECKING:
    # Imported where used: maskplug.grammar.limits is also the compile workers' start-up script
    # (python -m maskplug.grammar.limits), which must not be imported with the package before it runs.
    from .limits import BuildFn, CompileWorker

__all__ = [
    "DEFAULT_CACHE_ENTRIES",
    "BatchOpsBase",
    "ChainOpsBase",
    "Chains",
    "CompileCache",
    "FailedMatcher",
    "MatcherBase",
    "ProviderBase",
    "check_start",
    "plain_matcher_type",
]


DEFAULT_CACHE_ENTRIES = 256
"""Compiled grammars a provider keeps by default (least recently used dropped first). A grammar with
its token masks over a 131k vocabulary can take megabytes (xgrammar: about 14 MB on average over
JSONSchemaBench's schemas), and a server whose requests each bring their own schema compiles a new
one per request: an unbounded cache grew past 10 GB within 700 schemas."""


class CompileCache:
    """A thread-safe cache of compiled grammars, keyed by :meth:`GrammarSpec.key`, at most ``max_entries`` of them.

    Only successes are stored: a spec that fails to compile raises again on
    the next attempt (and is recompiled then), so a transient failure never
    turns into a cached one. Concurrent compiles of the same key are
    serialised so the work is done once. Past ``max_entries`` (``None``: no
    bound) the least recently used grammar is dropped: matchers made from it
    keep working (they hold their grammar), and the next request for its spec
    compiles it again.
    """

    def __init__(self, max_entries: int | None = DEFAULT_CACHE_ENTRIES) -> None:
        if max_entries is not None and (
            isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1
        ):
            raise GrammarError(f"max_entries: expected an int >= 1 or None, got {max_entries!r}")
        self.max_entries = max_entries
        """The most grammars kept (None: no bound)."""
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self.hits = 0
        """Lookups answered from the cache."""
        self.misses = 0
        """Lookups that compiled (failed compiles included)."""
        self.evicted = 0
        """Grammars dropped to stay within ``max_entries``."""

    def get_or_compile(self, spec: GrammarSpec, compile_fn: Callable[[GrammarSpec], Any]) -> Any:
        """The cached value for ``spec``, compiling it with ``compile_fn`` on a miss."""
        key = spec.key()
        with self._lock:
            if key in self._items:
                return self._hit(key)
            klock = self._key_locks.setdefault(key, threading.Lock())
        with klock:
            with self._lock:
                if key in self._items:
                    return self._hit(key)
                self.misses += 1
            value = compile_fn(spec)  # raises on failure: nothing is stored
            with self._lock:
                self._items[key] = value
                self._key_locks.pop(key, None)
                bound = self.max_entries
                while bound is not None and len(self._items) > bound:
                    self._items.popitem(last=False)
                    self.evicted += 1
            return value

    def get(self, spec: GrammarSpec) -> Any | None:
        """The cached value for ``spec`` (a hit, made the most recently used), or ``None``; nothing is compiled."""
        key = spec.key()
        with self._lock:
            return self._hit(key) if key in self._items else None

    def _hit(self, key: str) -> Any:
        """The value cached under ``key``, counted as a hit and made the most recently used (lock held)."""
        self.hits += 1
        self._items.move_to_end(key)
        return self._items[key]

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, spec: object) -> bool:
        return isinstance(spec, GrammarSpec) and spec.key() in self._items

    def clear(self) -> None:
        """Forget every compiled grammar."""
        with self._lock:
            self._items.clear()


_G = TypeVar("_G", bound=CompiledGrammar)


class ProviderBase(Generic[_G]):
    """A convenience base for providers: kind checks and the compile cache.

    Subclasses set ``name`` and ``kinds`` and implement :meth:`_compile`,
    which raises :class:`GrammarError` with the engine's reason on failure.
    The type parameter is the provider's compiled-grammar class, so
    ``compile`` is typed with it (``ProviderBase[MyGrammar]``).

    A provider whose compiles must stop at a limit calls :meth:`_use_worker`
    in its ``__init__`` and asks :meth:`_limit_for` in ``_compile`` whether to
    compile in the calling process (None) or with :meth:`_run_in_worker`
    under the limit it returns (see :mod:`maskplug.grammar.limits`).
    """

    name: ClassVar[str] = ""
    """The provider's registry name (also in error messages)."""
    kinds: frozenset[str] = frozenset()
    """The spec kinds it compiles (a subset of :data:`~maskplug.grammar.SPEC_KINDS`)."""
    compile_limit_s: float | None = None
    """Seconds a compile may take (None: compile in this process, no limit); see :mod:`maskplug.grammar.limits`."""
    worker: CompileWorker
    """The compile worker process of a provider that compiles under a limit (set by :meth:`_use_worker`;
    a provider that never calls it has none)."""

    def __init__(self, vocab: Vocab) -> None:
        if not isinstance(vocab, Vocab):
            raise GrammarError(f"vocab: expected a maskplug Vocab, got {type(vocab).__name__}")
        self.vocab = vocab
        """The vocabulary every grammar is compiled for."""
        self.cache = CompileCache()
        """Compiled grammars by spec key (successes only)."""

    def _use_worker(self, compile_limit_s: Any, build: BuildFn, *args: Any) -> None:
        """Compile under ``compile_limit_s`` (checked; None: no limit) in a :class:`CompileWorker` whose start-up
        process runs ``build(*args)`` for its compile function."""
        from .limits import CompileWorker, check_limit

        self.compile_limit_s = check_limit(compile_limit_s, "compile_limit_s")
        self.worker = CompileWorker(self.name, build, args)

    def _limit_for(self, spec: GrammarSpec) -> float | None:
        """The limit for compiling ``spec`` with :attr:`worker` (the spec's own, else the provider's), or None
        to compile in this process: no limit holds or there is no worker. Both limits are checked here (a
        :class:`GrammarError` naming the bad one), so a ``compile_limit_s`` set after construction is too."""
        from .limits import check_limit, effective_limit

        limit = effective_limit(check_limit(self.compile_limit_s, "compile_limit_s"), spec)
        return limit if hasattr(self, "worker") else None

    def _run_in_worker(self, spec: GrammarSpec, limit: float) -> Any:
        """What the worker's compile function returns for ``spec`` within ``limit`` (:meth:`CompileWorker.run`)."""
        return self.worker.run(spec, limit)

    def supports(self, kind: str) -> bool:
        """Whether this provider compiles specs of ``kind``."""
        return kind in self.kinds

    #: Whether :meth:`compile` checks the start of every grammar it compiles (see :func:`check_start`);
    #: a provider whose grammars are other providers' grammars, already checked (auto), turns it off.
    checks_start: ClassVar[bool] = True

    def compile(self, spec: GrammarSpec) -> _G:
        """Compile ``spec`` for this provider's vocabulary (cached; failures are not).

        A grammar whose start allows no token (not even a stop token), or for
        a JSON kind only the stop tokens, admits no text: a
        :class:`GrammarError`, not a grammar (:func:`check_start`).
        """
        if not isinstance(spec, GrammarSpec):
            raise GrammarError(f"spec: expected a GrammarSpec, got {type(spec).__name__}")
        if not self.supports(spec.kind):
            raise GrammarError(f"spec.kind: provider {self.name!r} supports {sorted(self.kinds)}, got {spec.kind!r}")
        if not self.checks_start:
            return self.cache.get_or_compile(spec, self._compile)  # type: ignore[no-any-return]
        return self.cache.get_or_compile(spec, self._compile_checked)  # type: ignore[no-any-return]

    def _compile_checked(self, spec: GrammarSpec) -> _G:
        grammar = self._compile(spec)
        check_start(grammar, spec, self.vocab, self.name)
        return grammar

    def _compile(self, spec: GrammarSpec) -> _G:
        raise NotImplementedError


#: Spec kinds whose every text is a JSON value: the empty output is never one.
_JSON_KINDS = frozenset({"json_schema", "json_object"})


def check_start(grammar: Any, spec: GrammarSpec, vocab: Vocab, provider: str = "") -> None:
    """:class:`GrammarError` when ``grammar``'s start admits no text.

    A fresh matcher's first row is filled: when it allows no token at all
    (not even a stop token), every logit would become ``-inf``; for a JSON
    kind, a row allowing only stop tokens admits nothing but the empty output,
    which is no JSON value. Engines build such grammars from schemas that
    admit nothing (llguidance for ``{"$ref": "#"}``, every engine for the
    regex ``[^\\s\\S]``, outlines-core for ``{"enum": []}``).
    """
    make = getattr(grammar, "matcher", None)
    if not callable(make):
        return  # not a compiled grammar with matchers (a provider's own value type): nothing to fill
    bitmask = vocab.new_bitmask(1)
    try:
        make().fill(bitmask, 0)
    except MaskplugError:
        raise
    except Exception as exc:  # the engine's own failure on its first row: the compile's error
        raise GrammarError(f"spec: {provider or 'the engine'} could not fill the first row: {exc}") from exc
    row = bitmask[0].numpy().view(np.uint32)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: vocab.vocab_size]
    allowed = np.flatnonzero(bits)
    who = f"{provider} compiled" if provider else "it compiles to"
    if allowed.size == 0:
        raise GrammarError(
            f"spec.source: this {spec.kind} spec admits no text: {who} a grammar whose start allows no token, "
            "not even a stop token"
        )
    if spec.kind in _JSON_KINDS and np.isin(allowed, np.asarray(vocab.eos_ids, dtype=np.int64)).all():
        raise GrammarError(
            f"spec.source: this {spec.kind} spec admits only the empty output, which is no JSON value: {who} a "
            "grammar whose start allows only the stop tokens"
        )


_M = TypeVar("_M", bound="MatcherBase")


class MatcherBase:
    """Normalised matcher semantics on top of a few engine primitives.

    Subclasses implement ``_accept(token) -> bool`` (False and no state change
    on refusal; a stop token is only offered when the engine should terminate),
    ``_rollback(n)`` (undo ``n`` accepted non-stop tokens), ``_fill(bitmask,
    row)``, ``_is_complete() -> bool`` (the text so far is a full match),
    ``_reset()`` (the engine back to the start) and ``_fork()`` (a new matcher
    with a copy of the engine state). This class tracks the stop token itself,
    so what ``rollback`` counts, how a stop token in a final state is handled
    and what a terminated matcher allows are the same everywhere:

    * ``accept(stop)`` succeeds exactly when the text is complete, and
      terminates; any token after that is refused;
    * ``rollback(n)`` counts an accepted stop token as one;
    * a terminated matcher's ``fill`` allows only the stop tokens.

    Optional: ``_accepted_count()`` (accepted text tokens, when the engine
    keeps them) bounds ``rollback`` and gives :attr:`num_accepted`. Batch
    operations that drive engines directly use :meth:`_set_terminated` and
    :meth:`_unwind_stop` to keep the stop-token bookkeeping.

    ``releases_gil`` tells :func:`maskplug.fill_draft_masks` whether a thread
    pool over matchers gains anything.
    """

    releases_gil: ClassVar[bool] = False
    """Whether the engine's fill and accept run without the GIL (threads over matchers then gain)."""
    batch_ops: BatchOps | None = None
    """The provider's batch operations over its matchers (None: maskplug calls each matcher)."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        """The vocabulary of the grammar."""
        self._terminated = False
        self._stop_row: torch.Tensor | None = None

    @property
    def mask_words(self) -> int:
        """Words per bitmask row this matcher fills."""
        return self.vocab.mask_words

    # -- engine primitives ----------------------------------------------------
    def _accept(self, token: int) -> bool:
        raise NotImplementedError

    def _rollback(self, n: int) -> None:
        raise NotImplementedError

    def _fill(self, bitmask: torch.Tensor, row: int) -> bool | None:
        """Write the row; may return whether it restricts anything (None: maskplug checks the row)."""
        raise NotImplementedError

    def _is_complete(self) -> bool:
        raise NotImplementedError

    def _reset(self) -> None:
        raise NotImplementedError

    def _fork(self: _M) -> _M:
        raise NotImplementedError

    def _accepted_count(self) -> int | None:
        """Accepted text tokens (the stop token not counted), or None when the engine does not keep them."""
        return None

    # -- termination, for subclasses and their batch operations -------------------
    # (``_terminated`` itself is this class's own; subclasses go through these two.)
    def _set_terminated(self, terminated: bool) -> None:
        """Record whether a stop token was accepted (for engines walked outside :meth:`accept`)."""
        self._terminated = terminated

    def _unwind_stop(self, n: int) -> int:
        """Take an accepted stop token off a rollback of ``n``; return how many the engine must undo."""
        if n > 0 and self._terminated:
            self._terminated = False
            return n - 1
        return n

    # -- the normalised protocol -------------------------------------------------
    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the grammar does not allow it."""
        return self._accept_id(check_token(token, self.vocab))

    def validate(self, tokens: Sequence[int]) -> int:
        """Length of the prefix of ``tokens`` the grammar accepts; the state is left as it was."""
        vocab = self.vocab
        if tokens.__class__ in _SEQUENCES and plain_matcher_type(type(self)):
            return self._validate_run(tokens)
        toks = [check_token(t, vocab, f"tokens[{i}]") for i, t in enumerate(tokens)]
        n = 0
        try:
            for t in toks:
                if not self.accept(t):
                    break
                n += 1
        finally:
            if n:
                self.rollback(n)
        return n

    def _validate_run(self, tokens: Sequence[int]) -> int:
        """:meth:`validate` of a list or tuple on a class that keeps ``accept`` and ``rollback``.

        One frame for the run instead of a call per token: an engine validates a
        step's drafts for every request (vLLM: each step, in its scheduler),
        where a call per token cost as much as the engine's own work. The run
        checks each id it reaches (a bad one raises, naming it, with the run
        rolled back); the ids after where it stopped are checked after it, so
        every id is checked, as on the general path.
        """
        return self._accept_run(tokens, True, "tokens", True)

    def _validate_drafts(self, tokens: Sequence[int]) -> int:
        """:meth:`validate`, or 0 without a look at ``tokens`` once a stop token was accepted.

        What :func:`~maskplug.engines.sdk.draft_validator` hands an engine for
        a class that keeps ``accept``, ``rollback`` and ``validate``.
        """
        if self._terminated:
            return 0
        if tokens.__class__ in _SEQUENCES:
            # _validate_run's call, made here: one frame less on a call made for every request every step.
            return self._accept_run(tokens, True, "tokens", True)
        return self.validate(tokens)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (an accepted stop token counts as one)."""
        if isinstance(n, bool) or not hasattr(n, "__index__") or int(n) < 0:
            raise GrammarError(f"n: expected an int >= 0, got {n!r}")
        k = int(n)
        done = self.num_accepted
        if done is not None and k > done:
            raise GrammarError(f"n: expected at most the {done} accepted tokens, got {k}")
        self._rollback_walked(k)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed set into ``bitmask[row]``; False when it allows every token."""
        r = check_bitmask(bitmask, row, self.vocab)
        if self._terminated:
            if self._stop_row is None:
                self._stop_row = stop_row(self.vocab)
            bitmask[r].copy_(self._stop_row)
            return True
        restricts = self._fill(bitmask, r)
        if restricts is not None:
            return bool(restricts)
        return not bool((bitmask[r] == -1).all())

    # -- the protocol on arguments a producer has checked ---------------------------
    # A mask-row producer checks its bitmask and every draft id once per call; a walk
    # over a few requests spends most of its time on these calls, so it uses the
    # unchecked forms where the class keeps the public methods (:func:`plain_matcher_type`).
    def _fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """:meth:`fill` into a bitmask and row :func:`~maskplug.grammar.sdk.check_bitmask` passed."""
        if self._terminated:
            if self._stop_row is None:
                self._stop_row = stop_row(self.vocab)
            bitmask[row].copy_(self._stop_row)
            return
        self._fill(bitmask, row)

    def _accept_id(self, t: int) -> bool:
        """:meth:`accept` of an ``int`` already in ``[0, vocab_size)``."""
        if self._terminated:
            return False
        vocab = self.vocab
        if t in vocab.eos_ids:
            if self._is_complete():
                self._terminated = True
                return True
            return False
        if t in vocab.special_ids or t >= len(vocab.tokens):
            return False
        return self._accept(t)

    def _accept_run(
        self, tokens: Sequence[int], undo_on_error: bool = False, name: str | None = None, validating: bool = False
    ) -> int:
        """:func:`~maskplug.engines.sdk.accept_emitted` on this matcher: how many of ``tokens`` it took.

        :meth:`_accept_id` token by token, in one frame: an engine advances every
        grammar request by its emitted tokens every step, and between forward
        passes each Python call costs microseconds. An id that is not an
        ``int`` in ``[0, vocab_size)`` goes through :meth:`accept` (which
        raises :class:`~maskplug.GrammarError` for a bad one). With
        ``undo_on_error`` the tokens taken are rolled back before an
        exception leaves (:meth:`validate` leaves the state as it was). With
        ``name`` a bad id's error names it as ``name[i]``. ``validating``
        (with both) makes it :meth:`_validate_run`: the ids after where the run
        stopped are checked too, and the tokens taken are rolled back.
        """
        vocab = self.vocab
        eos, special, size, known = vocab.eos_ids, vocab.special_ids, vocab.vocab_size, len(vocab.tokens)
        accept = self._accept
        n = 0
        try:
            for t in tokens:
                if self._terminated:
                    break
                if t.__class__ is not int or not 0 <= t < size:
                    if name is not None:
                        check_token(t, vocab, f"{name}[{n}]")
                    if not self.accept(t):
                        break
                elif t in eos:
                    if not self._is_complete():
                        break
                    self._terminated = True
                elif t in special or t >= known or not accept(t):
                    break
                n += 1
        except BaseException:
            if undo_on_error and n:
                self._rollback_walked(n)
            raise
        if validating:
            try:
                for i in range(n, len(tokens)):
                    check_token(tokens[i], vocab, f"{name}[{i}]")
            finally:
                if n:
                    self._rollback_walked(n)
        return n

    def _rollback_walked(self, n: int) -> None:
        """:meth:`rollback` of ``n`` tokens this caller's walk accepted (an int, at most what was accepted)."""
        # Engines that keep no count (xgrammar) find out only when asked to undo
        # too much; their check comes before any change, so putting the stop
        # token back leaves the matcher exactly as it was.
        # _unwind_stop written out: every validate and every walk ends here, one call per request.
        was_terminated = self._terminated
        k = n
        if was_terminated and n > 0:
            self._terminated = False
            k = n - 1
        if k:
            try:
                self._rollback(k)
            except MaskplugError:
                self._set_terminated(was_terminated)
                raise
            except Exception as exc:
                self._set_terminated(was_terminated)
                raise GrammarError(f"n: the grammar engine cannot undo {n} tokens ({str(exc).strip()})") from exc

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted."""
        return self._terminated

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._reset()
        self._terminated = False

    def fork(self: _M) -> _M:
        """An independent matcher in the same state."""
        twin = self._fork()
        twin._set_terminated(self._terminated)
        return twin

    @property
    def num_accepted(self) -> int | None:
        """Tokens accepted so far, a stop token included (None when the engine does not keep count)."""
        text = self._accepted_count()
        return None if text is None else text + int(self._terminated)


_PLAIN: dict[type, bool] = {}
#: The sequence types :meth:`MatcherBase.validate` runs in one frame (anything else is copied through :func:`check_token`).
_SEQUENCES = frozenset({list, tuple})


def plain_matcher_type(cls: type) -> bool:
    """Whether ``cls`` is a :class:`MatcherBase` that keeps its ``fill``, ``accept`` and ``rollback``.

    A walk may then call the unchecked forms (``_fill_row``, ``_accept_id``,
    ``_rollback_walked``) on inputs it checked, with the same results. A
    class that overrides one of the public methods is always called through
    them. Asked once per class.
    """
    plain = _PLAIN.get(cls)
    if plain is None:
        plain = _PLAIN[cls] = (
            issubclass(cls, MatcherBase)
            and cls.fill is MatcherBase.fill
            and cls.accept is MatcherBase.accept
            and cls.rollback is MatcherBase.rollback
        )
    return plain


class BatchOpsBase:
    """:class:`BatchOps` as per-matcher calls; providers override what their engine does in bulk."""

    fills_forced: ClassVar[bool] = False
    """Whether ``fill_chains`` sets the single-token flags of the rows it writes (see :class:`ChainOps`)."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        """The vocabulary of the matchers."""

    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """``matchers[i].fill(bitmask, rows[i])`` for all ``i``."""
        for m, r in zip(matchers, rows, strict=True):
            m.fill(bitmask, int(r))

    def accept(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> list[bool]:
        """``matchers[i].accept(tokens[i])`` for all ``i``."""
        return [m.accept(int(t)) for m, t in zip(matchers, tokens, strict=True)]

    def rollback(self, matchers: Sequence[Matcher], counts: Sequence[int]) -> None:
        """``matchers[i].rollback(counts[i])`` for all ``i``."""
        for m, k in zip(matchers, counts, strict=True):
            if int(k):
                m.rollback(int(k))


M = TypeVar("M", bound=MatcherBase)


class Chains(NamedTuple):
    """The checked arguments of :meth:`ChainOpsBase.fill_chains`, as ``_fill_chains`` receives them."""

    bitmask: torch.Tensor
    """The CPU int32 buffer the rows go into (checked: every row below fits)."""
    rows: list[int]
    """Each request's first row: row ``rows[i] + p`` is the mask after ``drafts[i][:p]``."""
    drafts: Sequence[Sequence[int]]
    """Each request's draft tokens."""
    workers: int
    """Threads the walk may use (at least 1, at most one per request)."""
    forced: npt.NDArray[np.bool_] | None
    """One flag per bitmask row, for providers with ``fills_forced`` (None: not asked for)."""


class ChainOpsBase(BatchOpsBase, Generic[M]):
    """:class:`ChainOps` with the argument handling done: subclasses implement :meth:`_fill_chains`.

    ``fill_chains`` checks the buffer and the rows, and that every matcher is a
    live one of ``matcher_type``, before anything is written, then hands over.
    ``default_threads`` is the worker count when the caller gives none.

    A subclass written for the earlier hook, ``_fill_chains(matchers, bitmask,
    rows, drafts, workers, forced)``, keeps working: it is given the fields of
    :class:`Chains` one by one.
    """

    matcher_type: type[M]
    """The provider's matcher class; ``fill_chains`` refuses any other."""
    default_threads: int = 1
    """Threads ``fill_chains`` uses when the caller gives none."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        hook = cls.__dict__.get("_fill_chains")
        if hook is not None and len(inspect.signature(hook).parameters) == 2 + len(Chains._fields):
            spread = hook

            def _fill_chains(self: Any, matchers: list[Any], chains: Chains) -> list[int]:
                return spread(self, matchers, *chains)  # type: ignore[no-any-return]

            cls._fill_chains = _fill_chains  # type: ignore[method-assign]

    def fill_chains(
        self,
        matchers: Sequence[Matcher],
        bitmask: torch.Tensor,
        rows: Sequence[int],
        drafts: Sequence[Sequence[int]],
        threads: int | None = None,
        forced: npt.NDArray[np.bool_] | None = None,
    ) -> list[int]:
        """Fill each request's draft rows; return how many drafts each accepts (see :class:`ChainOps`)."""
        n = len(matchers)
        check_chain_args(bitmask, rows, drafts, n, self.vocab)
        owners: list[M] = []
        for i, m in enumerate(matchers):
            if not isinstance(m, self.matcher_type):
                raise GrammarError(
                    f"matchers[{i}]: fill_chains expects {self.matcher_type.__name__}, got {type(m).__name__}"
                )
            if m.is_terminated():
                raise GrammarError(f"matchers[{i}]: fill_chains expects live matchers, got a terminated one")
            owners.append(m)
        if not n:
            return []
        workers = min(n, self.default_threads if threads is None else max(1, int(threads)))
        return self._fill_chains(owners, Chains(bitmask, [int(r) for r in rows], drafts, workers, forced))

    def _fill_chains(self, matchers: list[M], chains: Chains) -> list[int]:
        """The engine's walk over checked arguments; how many drafts each matcher accepts.

        Row ``chains.rows[i] + p`` becomes the mask after ``chains.drafts[i][:p]``
        for every ``p`` up to that count: the walk stops at the first draft the
        mask refuses (its row is written) or just after an accepted stop token
        (the row after it is not). Matchers end where they started, also on
        error. ``chains.workers`` threads may be used.
        """
        raise NotImplementedError


class FailedMatcher:
    """A failed grammar's stand-in: every call that would move or read the engine raises its error.

    An engine integration that has marked one request's grammar as failed
    hands this to :func:`maskplug.fill_draft_masks` (or
    :func:`maskplug.fill_tree_masks`) in place of the real matcher: the
    request then gets the stop-only rows and is reported again in
    ``failed``, while the real matcher is never touched. ``vocab`` is the
    request's vocabulary (its stop tokens make the stop-only row; ``None``
    where the engine does not say). ``is_terminated`` answers False, so the
    producer asks for a row and meets the error.
    """

    batch_ops = None
    """No batch operations: the producer calls this matcher, and meets its error."""
    releases_gil = False
    """Nothing to run without the GIL."""

    def __init__(self, vocab: Vocab | None, error: GrammarError | str) -> None:
        self.vocab = vocab
        """The request's vocabulary (None where the engine does not say)."""
        self._text = str(error)

    def _error(self) -> GrammarError:
        return GrammarError(f"the grammar failed earlier: {self._text}")

    def accept(self, token: int) -> bool:
        """Raises the grammar's error."""
        raise self._error()

    def validate(self, tokens: Sequence[int]) -> int:
        """Raises the grammar's error."""
        raise self._error()

    def rollback(self, n: int) -> None:
        """Raises the grammar's error."""
        raise self._error()

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Raises the grammar's error (the producer then writes the stop-only row)."""
        raise self._error()

    def is_terminated(self) -> bool:
        """False: the producer asks for a row, and meets the error."""
        return False

    def reset(self) -> None:
        """Raises the grammar's error."""
        raise self._error()

    def fork(self) -> Matcher:
        """Raises the grammar's error."""
        raise self._error()
