"""Protocols and value types shared by every grammar provider."""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..errors import GrammarError
from ..plugins import get_registry

__all__ = [
    "SPEC_KINDS",
    "BatchOps",
    "CompileCache",
    "CompiledGrammar",
    "GrammarProvider",
    "GrammarSpec",
    "Matcher",
    "MatcherBase",
    "ProviderBase",
    "Vocab",
    "check_bitmask",
    "check_chain_args",
    "check_token",
    "grammar_provider",
    "grammar_providers",
    "shared_pool",
    "spread_tasks",
]

SPEC_KINDS = ("json_schema", "json_object", "regex", "ebnf", "lark", "choice")


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match.

    ``kind`` is one of :data:`SPEC_KINDS`. ``source`` is the schema (a JSON
    string or a dict) for ``json_schema``, ignored for ``json_object``, the
    pattern for ``regex``, the grammar text for ``ebnf``/``lark``, and a list
    of strings for ``choice``.
    """

    kind: str
    source: Any = None

    def __post_init__(self) -> None:
        if self.kind not in SPEC_KINDS:
            raise GrammarError(f"kind: expected one of {SPEC_KINDS}, got {self.kind!r}")

    def key(self) -> str:
        """A canonical string for caching (dict schemas are serialised with sorted keys)."""
        src = self.source
        if isinstance(src, (dict, list, tuple)):
            src = json.dumps(src, sort_keys=True, separators=(",", ":"))
        return f"{self.kind}:{src}"


class Vocab:
    """A model's vocabulary, as decoded bytes per token id.

    Args:
        tokens: ``tokens[i]`` is the byte string token ``i`` decodes to
            (special tokens: their literal text, they are never allowed by a
            grammar except as stop tokens).
        eos_ids: the stop tokens.
        special_ids: token ids that are control tokens (never grammar text).
        vocab_size: the model's padded logits width (``>= len(tokens)``); it
            fixes the mask width ``ceil(vocab_size / 32)``.
    """

    def __init__(
        self,
        tokens: Sequence[bytes],
        eos_ids: Iterable[int],
        special_ids: Iterable[int] = (),
        vocab_size: int | None = None,
    ) -> None:
        toks = list(tokens)
        for i, t in enumerate(toks):
            if not isinstance(t, (bytes, bytearray)):
                raise GrammarError(f"tokens[{i}]: expected bytes, got {type(t).__name__}")
        self.tokens: list[bytes] = [bytes(t) for t in toks]
        self.eos_ids: tuple[int, ...] = tuple(int(e) for e in eos_ids)
        if not self.eos_ids:
            raise GrammarError("eos_ids: expected at least one stop token, got none")
        self.special_ids: frozenset[int] = frozenset(int(s) for s in special_ids) | frozenset(self.eos_ids)
        size = len(self.tokens) if vocab_size is None else int(vocab_size)
        if size < len(self.tokens):
            raise GrammarError(f"vocab_size: expected >= len(tokens) = {len(self.tokens)}, got {size}")
        self.vocab_size: int = size
        for name, ids in (("eos_ids", self.eos_ids), ("special_ids", self.special_ids)):
            bad = [i for i in ids if not 0 <= i < len(self.tokens)]
            if bad:
                raise GrammarError(f"{name}: expected ids in [0, {len(self.tokens)}), got {bad[:5]}")
        self._fingerprint: str | None = None

    @property
    def mask_words(self) -> int:
        """Words per bitmask row: ``ceil(vocab_size / 32)``."""
        return (self.vocab_size + 31) // 32

    @property
    def fingerprint(self) -> str:
        """A digest of the tokens, stop and special ids and size (cache key)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for t in self.tokens:
                h.update(len(t).to_bytes(4, "little"))
                h.update(t)
            h.update(repr((self.eos_ids, sorted(self.special_ids), self.vocab_size)).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """A CPU int32 bitmask of ``rows`` rows, all tokens allowed."""
        return torch.full((rows, self.mask_words), -1, dtype=torch.int32)

    @classmethod
    def from_tokenizer_json(
        cls,
        path: Any,
        *,
        eos_tokens: Sequence[str] | None = None,
        vocab_size: int | None = None,
    ) -> Vocab:
        """Load a Hugging Face ``tokenizer.json`` (see :func:`maskplug.grammar.vocabs.load_tokenizer_json`)."""
        from .vocabs import load_tokenizer_json

        return load_tokenizer_json(path, eos_tokens=eos_tokens, vocab_size=vocab_size)

    @classmethod
    def from_tiktoken(
        cls,
        ranks: Any,
        special_tokens: Any = (),
        *,
        num_special_tokens: int | None = None,
        vocab_size: int | None = None,
        eos_ids: Sequence[int] | None = None,
    ) -> Vocab:
        """Build from tiktoken-format ranks (see :func:`maskplug.grammar.vocabs.load_tiktoken`)."""
        from .vocabs import load_tiktoken

        return load_tiktoken(
            ranks, special_tokens, num_special_tokens=num_special_tokens, vocab_size=vocab_size, eos_ids=eos_ids
        )

    @classmethod
    def from_sentencepiece(cls, path: Any, *, vocab_size: int | None = None) -> Vocab:
        """Load a SentencePiece ``.model`` file (see :func:`maskplug.grammar.vocabs.load_sentencepiece`)."""
        from .vocabs import load_sentencepiece

        return load_sentencepiece(path, vocab_size=vocab_size)

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Vocab({len(self.tokens)} tokens, eos={list(self.eos_ids)}, vocab_size={self.vocab_size})"


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


@dataclass
class _ProviderCache:
    by_key: dict[tuple[str, str], GrammarProvider] = field(default_factory=dict)


_cache = _ProviderCache()


def grammar_providers() -> list[str]:
    """Names of the registered grammar providers."""
    return sorted(get_registry().grammar_providers)


def grammar_provider(name: str, vocab: Vocab) -> GrammarProvider:
    """The provider ``name`` bound to ``vocab`` (one instance per vocabulary, so its compile cache is shared)."""
    if not isinstance(vocab, Vocab):
        raise GrammarError(f"vocab: expected a maskplug Vocab, got {type(vocab).__name__}")
    factories = get_registry().grammar_providers
    if name not in factories:
        raise GrammarError(f"name: expected one of the registered providers {sorted(factories)}, got {name!r}")
    key = (name, vocab.fingerprint)
    prov = _cache.by_key.get(key)
    if prov is None:
        prov = factories[name](vocab)
        _cache.by_key[key] = prov
    return prov


# --------------------------------------------------------------------------
# Helpers shared by the provider distributions. They hold the normalised
# semantics in one place, so every provider checks arguments the same way and
# raises the same errors before anything is written.
# --------------------------------------------------------------------------


def check_token(token: Any, vocab: Vocab, arg: str = "token") -> int:
    """``token`` as an int in ``[0, vocab.vocab_size)``, else :class:`GrammarError`.

    Ids in the padding (``len(vocab.tokens) <= id < vocab_size``) are valid
    input: no grammar ever allows them, so ``accept`` refuses them.
    """
    if isinstance(token, bool) or not hasattr(token, "__index__"):
        raise GrammarError(f"{arg}: expected an int token id, got {type(token).__name__}")
    t = int(token)
    if not 0 <= t < vocab.vocab_size:
        raise GrammarError(f"{arg}: expected a token id in [0, {vocab.vocab_size}), got {t}")
    return t


def check_bitmask(bitmask: Any, row: Any, vocab: Vocab, arg: str = "bitmask") -> int:
    """Validate a fill target: a contiguous CPU int32 2-D tensor exactly ``vocab.mask_words`` wide.

    Returns ``row`` as an int. Engines' fill routines ignore strides and trust
    the width, so a wrong buffer would be written out of place; it is refused
    instead, before any write.
    """
    if not isinstance(bitmask, torch.Tensor):
        raise GrammarError(f"{arg}: expected a torch.Tensor, got {type(bitmask).__name__}")
    if bitmask.dtype != torch.int32:
        raise GrammarError(f"{arg}: expected dtype torch.int32, got {bitmask.dtype}")
    if bitmask.device.type != "cpu":
        raise GrammarError(f"{arg}: expected a CPU tensor, got one on {bitmask.device}")
    if bitmask.dim() != 2:
        raise GrammarError(f"{arg}: expected a 2-D tensor (rows x words), got shape {tuple(bitmask.shape)}")
    if bitmask.shape[1] != vocab.mask_words:
        raise GrammarError(
            f"{arg}: expected exactly ceil(vocab_size/32) = {vocab.mask_words} words per row "
            f"(vocab_size {vocab.vocab_size}), got {bitmask.shape[1]}"
        )
    if not bitmask.is_contiguous():
        raise GrammarError(f"{arg}: expected a contiguous tensor, got strides {tuple(bitmask.stride())}")
    if isinstance(row, bool) or not hasattr(row, "__index__"):
        raise GrammarError(f"row: expected an int, got {type(row).__name__}")
    r = int(row)
    if not 0 <= r < bitmask.shape[0]:
        raise GrammarError(f"row: expected a row in [0, {bitmask.shape[0]}), got {r}")
    return r


def _stop_only_row(vocab: Vocab) -> torch.Tensor:
    """The mask row of a terminated matcher: only the stop tokens."""
    row = torch.zeros(vocab.mask_words, dtype=torch.int64)
    for e in vocab.eos_ids:
        row[e >> 5] |= 1 << (e & 31)
    # int64 arithmetic above keeps bit 31 positive; wrap to int32 on the way out.
    return torch.where(row >= 2**31, row - 2**32, row).to(torch.int32)


class CompileCache:
    """A thread-safe cache of compiled grammars, keyed by :meth:`GrammarSpec.key`.

    Only successes are stored: a spec that fails to compile raises again on
    the next attempt (and is recompiled then), so a transient failure never
    turns into a cached one. Concurrent compiles of the same key are
    serialised so the work is done once.
    """

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self.hits = 0
        self.misses = 0

    def get_or_compile(self, spec: GrammarSpec, compile_fn: Callable[[GrammarSpec], Any]) -> Any:
        """The cached value for ``spec``, compiling it with ``compile_fn`` on a miss."""
        key = spec.key()
        with self._lock:
            if key in self._items:
                self.hits += 1
                return self._items[key]
            klock = self._key_locks.setdefault(key, threading.Lock())
        with klock:
            with self._lock:
                if key in self._items:
                    self.hits += 1
                    return self._items[key]
                self.misses += 1
            value = compile_fn(spec)  # raises on failure: nothing is stored
            with self._lock:
                self._items[key] = value
                self._key_locks.pop(key, None)
            return value

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, spec: object) -> bool:
        return isinstance(spec, GrammarSpec) and spec.key() in self._items

    def clear(self) -> None:
        """Forget every compiled grammar."""
        with self._lock:
            self._items.clear()


class ProviderBase:
    """A convenience base for providers: kind checks and the compile cache.

    Subclasses set ``name`` and ``kinds`` and implement :meth:`_compile`,
    which raises :class:`GrammarError` with the engine's reason on failure.
    """

    name: ClassVar[str] = ""
    kinds: frozenset[str] = frozenset()

    def __init__(self, vocab: Vocab) -> None:
        if not isinstance(vocab, Vocab):
            raise GrammarError(f"vocab: expected a maskplug Vocab, got {type(vocab).__name__}")
        self.vocab = vocab
        self.cache = CompileCache()

    def supports(self, kind: str) -> bool:
        """Whether this provider compiles specs of ``kind``."""
        return kind in self.kinds

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile ``spec`` for this provider's vocabulary (cached; failures are not)."""
        if not isinstance(spec, GrammarSpec):
            raise GrammarError(f"spec: expected a GrammarSpec, got {type(spec).__name__}")
        if not self.supports(spec.kind):
            raise GrammarError(f"spec.kind: provider {self.name!r} supports {sorted(self.kinds)}, got {spec.kind!r}")
        return self.cache.get_or_compile(spec, self._compile)  # type: ignore[no-any-return]

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        raise NotImplementedError


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


class MatcherBase:
    """Normalised matcher semantics on top of a few engine primitives.

    Subclasses implement ``_accept(token) -> bool`` (False and no state change
    on refusal; a stop token is only offered when the engine should terminate),
    ``_rollback(n)`` (undo ``n`` accepted non-stop tokens), ``_fill(bitmask,
    row) -> None``, ``_is_complete() -> bool`` (the text so far is a full
    match) plus ``reset`` and ``fork``. This class tracks the stop token
    itself, so what ``rollback`` counts, how a stop token in a final state is
    handled and what a terminated matcher allows are the same everywhere:

    * ``accept(stop)`` succeeds exactly when the text is complete, and
      terminates; any token after that is refused;
    * ``rollback(n)`` counts an accepted stop token as one;
    * a terminated matcher's ``fill`` allows only the stop tokens.

    ``releases_gil`` tells :func:`maskplug.fill_draft_masks` whether a thread
    pool over matchers gains anything.
    """

    releases_gil: ClassVar[bool] = False
    batch_ops: BatchOps | None = None

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
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

    # -- the normalised protocol -------------------------------------------------
    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the grammar does not allow it."""
        t = check_token(token, self.vocab)
        if self._terminated:
            return False
        if t in self.vocab.eos_ids:
            if self._is_complete():
                self._terminated = True
                return True
            return False
        if t in self.vocab.special_ids or t >= len(self.vocab.tokens):
            return False
        return self._accept(t)

    def validate(self, tokens: Sequence[int]) -> int:
        """Length of the prefix of ``tokens`` the grammar accepts; the state is left as it was."""
        toks = [check_token(t, self.vocab, f"tokens[{i}]") for i, t in enumerate(tokens)]
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

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (an accepted stop token counts as one)."""
        if isinstance(n, bool) or not hasattr(n, "__index__") or int(n) < 0:
            raise GrammarError(f"n: expected an int >= 0, got {n!r}")
        k = int(n)
        if k == 0:
            return
        if self._terminated:
            self._terminated = False
            k -= 1
        if k:
            self._rollback(k)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed set into ``bitmask[row]``; False when it allows every token."""
        r = check_bitmask(bitmask, row, self.vocab)
        if self._terminated:
            if self._stop_row is None:
                self._stop_row = _stop_only_row(self.vocab)
            bitmask[r].copy_(self._stop_row)
            return True
        restricts = self._fill(bitmask, r)
        if restricts is not None:
            return bool(restricts)
        return not bool((bitmask[r] == -1).all())

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted."""
        return self._terminated


# -- helpers shared by providers' batch operations ------------------------------------

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide thread pool per size (starting threads every step would cost more than the work)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="maskplug-grammar")
            _POOLS[workers] = pool
        return pool


def spread_tasks(task: Callable[[int], None], n: int, workers: int) -> None:
    """Run ``task(0..n-1)`` on ``workers`` threads (the caller and a pool), each taking the next index when free.

    Chains differ in cost by two orders of magnitude (grammar and state), so
    fixed shares would leave one worker with most of the work.
    """
    if workers <= 1:
        for i in range(n):
            task(i)
        return
    # next() on a shared itertools.count is atomic under the GIL.
    counter = itertools.count()

    def worker() -> None:
        for i in counter:
            if i >= n:
                return
            task(i)

    # The calling thread is one of the workers: it would only wait otherwise.
    futures = [shared_pool(workers - 1).submit(worker) for _ in range(workers - 1)]
    try:
        worker()
    finally:
        for f in futures:
            f.result()


def check_chain_args(
    bitmask: torch.Tensor, rows: Sequence[int], drafts: Sequence[Sequence[int]], n: int, vocab: Vocab
) -> None:
    """Validate ``fill_chains`` arguments before anything is written (the fills trust the buffer)."""
    if len(rows) != n or len(drafts) != n:
        raise GrammarError(f"rows, drafts: expected {n} each (one per matcher), got {len(rows)} and {len(drafts)}")
    if n:
        first = min(int(r) for r in rows)
        last = max(int(r) + len(d) for r, d in zip(rows, drafts, strict=True))
        check_bitmask(bitmask, last, vocab)
        if first < 0:
            raise GrammarError(f"rows: expected first rows >= 0, got {first}")
