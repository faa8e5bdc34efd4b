r"""The outlines-core provider: regex and JSON-schema grammars as token automata.

outlines-core compiles a regular expression into an ``Index``, a deterministic
automaton over token ids, built eagerly for the whole vocabulary (from
milliseconds for a small regex to seconds for a JSON schema on a 131k-token
vocabulary, so compiled grammars are cached per provider and spec). A
``Guide`` walks one request through it.

What this module normalises, so callers see maskplug's matcher semantics:

* **Stop tokens.** outlines-core knows a single EOS id and ``Guide.advance``
  on it raises ``ValueError`` in a final state. The stop token never reaches
  the engine here: :class:`maskplug.grammar.sdk.MatcherBase` accepts it when
  the automaton is in a final state and terminates, and every stop id of the
  vocabulary is allowed in a final state (not only the first).
* **Rollback.** ``Guide.rollback_state`` is bounded by ``max_rollback``; past
  that bound the guide is rebuilt from the accepted tokens, so ``rollback`` is
  unlimited, and a stop token counts as one step like any other.
* **Buffer sizing.** ``write_mask_into`` checks the buffer against the number
  of vocabulary entries, not the largest token id, and silently drops allowed
  ids that fall beyond it. The buffer handed over is always the full
  ``ceil(vocab_size / 32)``-word row, so every id below ``vocab_size`` fits.
* **Special tokens** (and empty or padding tokens) are left out of the
  engine's vocabulary, so they are never allowed.
* **Continuations after a complete match.** outlines-core 0.2.14 builds its
  ``Index`` from a regex-automata DFA whose match states are entered one byte
  *after* a match ends, and keeps a token only when its end state is not
  such a match state or is a full match at the end of input. So from a state
  where the text is already complete, a token leading to an unfinished
  continuation is dropped: a top-level ``{"type": "number"}`` refused ``1.``
  of ``1.7`` and ``(0|[1-9][0-9]*)(\.[0-9]+)?`` refused ``12.25``, while
  inside an object (nothing complete yet) the same number worked. The DFA's
  leftmost-first matching also ends ``a|ab`` at ``a``. Both come from the
  regex being matchable at a proper prefix, so maskplug compiles ``(?:R)X``
  with a sentinel character ``X`` (:data:`SENTINEL`, U+10FFFF) that no text
  token can spell (tokens holding its lead byte ``F4``, which only starts
  characters of plane 16, a private-use plane, are left out of the engine's
  vocabulary) and a sentinel token carrying the first stop id: no text token
  then ever ends in a match state, and the text is complete exactly where
  the sentinel token leads to a final state. Rows are normalised: the stop
  ids are allowed exactly there, and the sentinel's bit (the first stop id,
  where ``X`` is only a character ``R`` could read) is cleared elsewhere.
  Regexes with ``^``/``$``/``\A``/``\z`` anywhere but a leading ``^`` or a
  trailing ``$`` (both no-ops under a whole-text match), or with the
  verbose flag ``x``, are compiled as they are (:func:`sentinel_pattern`).

Mask rows are cached per automaton state (:class:`MaskCache`): a row depends
on the state alone, and a grammar's walks revisit the same states all the
time (inside a JSON string, between digits, after a key), so a fill is mostly
a 16 KiB copy instead of the engine's walk over every allowed token.
:class:`OutlinesBatchOps` uses the same cache to write many rows with one
numpy copy.

Options of :class:`~maskplug.grammar.GrammarSpec` (``json_schema``):

* ``whitespace="flexible"`` with ``max_whitespace=N`` is the whitespace
  pattern ``[\x20\x0A\x0D\x09]{0,N}`` at each of outlines-core's
  whitespace positions (:func:`maskplug.grammar.sdk.json_whitespace_regex`,
  the llguidance provider's pattern), so pretty-printed JSON
  (``json.dumps(..., indent=2)``: a newline and the indentation) is taken
  and a run longer than ``N`` is refused; None is
  ``[\x20\x0A\x0D\x09]*`` (no bound), ``0`` and ``"compact"`` no whitespace
  at all. outlines-core's own default (``[ ]?``, one optional space) is not
  used. The bound costs automaton states: ``N`` per whitespace position, so
  the ``Index`` build takes about 4-7 times the CPU at ``N = 24`` that it
  takes with ``[ ]?`` (an unbounded run costs no more than ``[ ]?``):
  measured on JSONSchemaBench schemas, 0.14 s to 0.92 s for a 19 kB
  Snowplow schema over a 32k vocabulary and 2.4 s to 13.2 s over tekken's
  131k, past the default compile limit (set ``compile_limit_s`` higher, or
  ``max_whitespace`` lower, there). Known gap: outlines-core's regex writes no
  whitespace before an array's ``,`` (``[1 , 2]`` is refused; ``json.dumps``
  never writes it), and it writes two whitespace positions side by side in
  an empty array (after ``[`` and before ``]``), where a run of up to
  ``2N`` is taken;
* ``strict_keys=True`` is what outlines-core always does (only listed keys).
  Its regex builder writes ``allOf`` members one after another (two objects
  in a row) and ignores a parent's ``properties`` beside ``anyOf``/``oneOf``,
  so maskplug first folds ``allOf`` members, ``$ref``'d bases beside other
  keywords and a parent's keys into one object (one per branch of a single
  ``anyOf``/``oneOf``; :func:`merge_compositions`): the keys of every member
  are allowed where the schema names them, as for the other providers;
  compositions it cannot fold (members with clashing keywords, several
  disjunctions) are left to outlines-core;
  ``strict_keys=False`` raises :class:`GrammarError` naming ``strict_keys``
  for a schema with an object that would allow unlisted keys;
* ``unsupported``: outlines-core leaves keywords it does not know out without
  a word; maskplug checks the schema's keywords against those outlines-core's
  regex builder enforces (:data:`OUTLINES_KEYWORDS`) and reports the others in
  the grammar's ``warnings`` (``"ignore"``) or raises naming them
  (``"refuse"``).

Compile limits: with a ``compile_limit_s`` (default
:data:`OUTLINES_COMPILE_LIMIT_S`, CPU seconds) the ``Index`` is built in a
worker process killed at the limit and comes back pickled
(:class:`maskplug.grammar.sdk.CompileWorker`). About a third of
JSONSchemaBench's real schemas do not finish building within 5 CPU s over a
131k-token vocabulary, and some of those run for minutes (an untyped value
becomes outlines-core's nested any-JSON regex) or, for the largest regexes,
most of an hour; the default is set so that every schema measured to finish
does.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from maskplug import GrammarError, GrammarSpec, Matcher, Vocab
from maskplug.grammar.sdk import (
    ChainOpsBase,
    Chains,
    MatcherBase,
    ProviderBase,
    check_choice,
    json_whitespace_regex,
    resolve_ref,
    schema_dict,
    schema_keywords,
    schema_text,
    stop_row,
    text_ids,
)

__all__ = [
    "OUTLINES_COMPILE_LIMIT_S",
    "MaskCache",
    "OutlinesBatchOps",
    "OutlinesGrammar",
    "OutlinesMatcher",
    "OutlinesProvider",
    "choice_regex",
    "grammar_text_ids",
    "merge_compositions",
    "sentinel_pattern",
]

# Draft windows are a handful of tokens; deeper rollbacks rebuild the guide.
_MAX_ROLLBACK = 64

OUTLINES_COMPILE_LIMIT_S = 7200.0
"""outlines-core's default compile limit, in CPU seconds of its compile server. Its ``Index`` build walks
every token from every automaton state, and the whitespace bound adds states at every whitespace
position, so its compile times have a long tail. Over tekken's 131k tokens at the default bound, all
1,003 of the shared sample's JSONSchemaBench schemas measured one by one
(``benchmarks/compile_times/outlines-core.jsonl`` and ``outlines-core-7200.jsonl``, CPU seconds of the
compile server): 891 compile, median 2.3 s, p90 91 s, p99 554 s, the slowest JsonSchemaStore
jx-requirements after 3,325 s (a 25-million-character regex; next Github_hard o57801 1,317 s and
BFCL_java_64 1,085 s); 82 are refused up front (a keyword or format the regex builder lacks, or a regex it
cannot build); 30 pass the memory limit (half the machine's memory, 12 GB there) first, JsonSchemaStore
markdownlint and cypress among them after 2,569 and 3,588 s. The default sits above the slowest compile
that finishes with a margin of two for a busier machine's slower CPU seconds, so no schema of the sample
reaches it: what cannot finish there is stopped by the memory limit. ``auto`` tries llguidance first,
which compiles every one of those in a second or two. A server that takes arbitrary schemas may want a
lower limit (``compile_limit_s=``): past :data:`maskplug.grammar.sdk.DEFAULT_COMPILE_LIMIT_S` a request
waits for its compile, the engine's steps do not."""

# Default bound of each grammar's mask cache: 2,048 rows at a 131k vocabulary.
# Pages are only touched as states are cached.
DEFAULT_MASK_CACHE_BYTES = 32 << 20

# Characters with a meaning in outlines-core's (Rust regex-syntax) patterns.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~ ")

#: The character appended to a regex so that it only matches whole (see the module notes): U+10FFFF.
SENTINEL = "\U0010ffff"
SENTINEL_BYTES = SENTINEL.encode("utf-8")
# The lead byte of every character from U+100000 on: tokens holding it could spell the sentinel.
_SENTINEL_LEAD = SENTINEL_BYTES[:1]
_VERBOSE_FLAG = re.compile(r"\(\?[A-Za-z-]*x")


def sentinel_pattern(regex: str) -> str | None:
    """``(?:regex)`` followed by :data:`SENTINEL`, or None where that would change the language.

    A leading ``^`` and a trailing ``$`` are dropped (outlines-core matches the
    whole text, so they assert nothing); any other ``^``, ``$``, ``\\A`` or
    ``\\z`` would see the sentinel after it, and the verbose flag ``x`` could
    make a ``#`` comment swallow the closing parenthesis: those regexes are
    compiled as they are (None).
    """
    if _VERBOSE_FLAG.search(regex):
        return None
    anchors: list[int] = []
    depth = 0  # character class nesting
    i, n = 0, len(regex)
    while i < n:
        ch = regex[i]
        if ch == "\\":
            if i + 1 < n and depth == 0 and regex[i + 1] in "Az":
                return None
            i += 2
            continue
        if depth:
            if ch == "[":
                depth += 1
            elif ch == "]":
                depth -= 1
        elif ch == "[":
            depth = 1
            # A ']' right after '[' or '[^' is a literal member.
            j = i + 1
            if j < n and regex[j] == "^":
                j += 1
            if j < n and regex[j] == "]":
                j += 1
            i = j
            continue
        elif ch in "^$":
            anchors.append(i)
        i += 1
    start = 1 if anchors and anchors[0] == 0 and regex[0] == "^" else 0
    end = n - 1 if anchors and anchors[-1] == n - 1 and regex[-1] == "$" and n - 1 >= start else n
    if any(start <= a < end for a in anchors):
        return None
    return "(?:" + regex[start:end] + r")\x{10FFFF}"


# Ids whose bytes may appear in grammar text (the SDK's text_ids, under its earlier name here).
grammar_text_ids = text_ids


def choice_regex(choices: Any) -> str:
    """A regex matching exactly one of ``choices`` (a non-empty list of non-empty strings)."""
    # Escaping every meta character (and only those) keeps the pattern
    # valid for regex-syntax, which rejects escapes of ordinary letters.
    parts = ["".join("\\" + ch if ch in _REGEX_META else ch for ch in c) for c in check_choice(choices)]
    return "(" + "|".join(parts) + ")"


def single_token(row: npt.NDArray[np.int32]) -> bool:
    """Whether a mask row allows exactly one token."""
    nz = np.flatnonzero(row)
    if nz.size != 1:
        return False
    w = int(row[nz[0]]) & 0xFFFFFFFF
    return w & (w - 1) == 0


class MaskCache:
    """Normalised mask rows of one grammar, keyed by automaton state; bounded.

    A row is written once, straight from the engine into a slot of a
    preallocated block, and published (put in the state map) only after it is
    complete, so lookups need no lock. When the block is full a new
    generation (fresh map and block) starts; readers that still hold the old
    one keep reading valid rows. ``capacity == 0`` disables caching. Each
    slot also records whether its row restricts anything and whether it
    allows exactly one token.
    """

    def __init__(self, words: int, capacity: int) -> None:
        self.words = words
        self.capacity = max(0, int(capacity))
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self._new_generation()

    def _new_generation(self) -> None:
        # np.empty reserves address space only; a page is touched when a row is written.
        self.generation: tuple[dict[int, int], npt.NDArray[np.int32], npt.NDArray[np.bool_], npt.NDArray[np.bool_]] = (
            {},
            np.empty((self.capacity, self.words), dtype=np.int32),
            np.zeros(self.capacity, dtype=bool),
            np.zeros(self.capacity, dtype=bool),
        )

    def lookup(self, matcher: OutlinesMatcher) -> tuple[npt.NDArray[np.int32], int, bool] | None:
        """``(block, slot, restricts)`` of the row for ``matcher``'s current state (computed on a miss).

        None when caching is disabled.
        """
        if not self.capacity:
            return None
        state = matcher._guide.get_state()
        slots, block, restricts, _ = self.generation
        slot = slots.get(state)
        if slot is not None:
            self.hits += 1
            return block, slot, bool(restricts[slot])
        with self._lock:
            slots, block, restricts, forced = self.generation
            slot = slots.get(state)
            if slot is None:
                self.misses += 1
                if len(slots) >= self.capacity:
                    self._new_generation()
                    slots, block, restricts, forced = self.generation
                slot = len(slots)
                row = block[slot]
                matcher._write_engine_row(row)
                restricts[slot] = not bool((row == -1).all())
                forced[slot] = single_token(row)
                slots[state] = slot  # published last: the row is complete
            return block, slot, bool(restricts[slot])

    def forced_of(self, block: npt.NDArray[np.int32], slots: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
        """The single-token flags of ``slots`` of ``block`` (any generation still referenced)."""
        gen = self.generation
        if gen[1] is block:
            return gen[3][slots]
        return np.array([single_token(block[s]) for s in slots.tolist()], dtype=bool)

    def __len__(self) -> int:
        return len(self.generation[0])


class OutlinesGrammar:
    """A grammar compiled by outlines-core: the regex it became, its token ``Index`` and mask cache."""

    def __init__(
        self, provider: OutlinesProvider, spec: GrammarSpec, regex: str, index: Index, warnings: Sequence[str] = ()
    ) -> None:
        self.provider = provider
        self.spec = spec
        self.regex = regex
        self.index = index
        #: Whether the index was built from :func:`sentinel_pattern` (see the module notes).
        self.sentinel = sentinel_pattern(regex) is not None
        self._sentinel_id = provider.vocab.eos_ids[0]
        #: Schema keywords outlines-core does not enforce (``unsupported="ignore"``).
        self.warnings: list[str] = list(warnings)
        words = provider.vocab.mask_words
        self.masks = MaskCache(words, provider.mask_cache_bytes // (words * 4))

    def matcher(self) -> OutlinesMatcher:
        """A fresh matcher at the start of the grammar."""
        return OutlinesMatcher(self)

    def is_complete(self, state: int) -> bool:
        """Whether the text that led to automaton ``state`` is a whole match of the regex."""
        if not self.sentinel:
            return bool(self.index.is_final_state(state))
        after = self.index.get_next_state(state, self._sentinel_id)
        return after is not None and bool(self.index.is_final_state(after))


class OutlinesMatcher(MatcherBase):
    """One request's position in an :class:`OutlinesGrammar` (see the module notes)."""

    # write_mask_into holds the GIL and takes microseconds: threads gain nothing.
    releases_gil = False

    def __init__(self, grammar: OutlinesGrammar) -> None:
        super().__init__(grammar.provider.vocab)
        self.grammar = grammar
        self.batch_ops = grammar.provider.batch_ops
        self._index = grammar.index
        self._masks = grammar.masks
        self._guide = Guide(grammar.index, max_rollback=_MAX_ROLLBACK)
        self._tokens: list[int] = []
        self._extra_stops = grammar.provider._extra_stop_row
        self._stops = grammar.provider._stop_row

    # -- engine primitives --------------------------------------------------------
    def _accept(self, token: int) -> bool:
        # Looking the transition up first avoids the engine's exception path,
        # and a refused token leaves the guide untouched.
        if self._index.get_next_state(self._guide.get_state(), token) is None:
            return False
        self._guide.advance(token, return_tokens=False)
        self._tokens.append(token)
        return True

    def _rollback(self, n: int) -> None:
        if n <= self._guide.get_allowed_rollback():
            self._guide.rollback_state(n)
            del self._tokens[len(self._tokens) - n :]
        else:
            keep = self._tokens[: len(self._tokens) - n]
            self._replay(keep)

    def _replay(self, tokens: Sequence[int]) -> None:
        guide = Guide(self._index, max_rollback=_MAX_ROLLBACK)
        for t in tokens:
            guide.advance(t, return_tokens=False)
        self._guide = guide
        self._tokens = list(tokens)

    def _write_engine_row(self, out: npt.NDArray[np.int32]) -> None:
        """The engine's row for the current state, normalised, into ``out`` (one contiguous row)."""
        words = self.vocab.mask_words
        # The full row width, never the engine's entry count: ids up to
        # vocab_size - 1 must all fit.
        self._guide.write_mask_into(out.ctypes.data, words, 4)
        grammar = self.grammar
        if grammar.sentinel:
            # The sentinel token carries the first stop id: allowed where it
            # completes the match, cleared where X would only be read as a character.
            sid = grammar._sentinel_id
            if grammar.is_complete(self._guide.get_state()):
                np.bitwise_or(out, self._stops, out=out)
            else:
                words_u = out.view(np.uint32)
                words_u[sid >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (sid & 31)))
        elif self._extra_stops is not None and self._guide.is_finished():
            np.bitwise_or(out, self._extra_stops.numpy(), out=out)

    def _fill(self, bitmask: torch.Tensor, row: int) -> bool:
        hit = self._masks.lookup(self)
        target = bitmask.numpy()[row]
        if hit is None:
            self._write_engine_row(target)
            return not bool((target == -1).all())
        block, slot, restricts = hit
        target[:] = block[slot]
        return restricts

    def _is_complete(self) -> bool:
        return self.grammar.is_complete(self._guide.get_state())

    def _accepted_count(self) -> int:
        return len(self._tokens)

    def _reset(self) -> None:
        self._guide.reset()
        self._tokens.clear()

    def _fork(self) -> OutlinesMatcher:
        # Replayed: copying a Guide would copy its Index.
        twin = OutlinesMatcher(self.grammar)
        twin._replay(self._tokens)
        return twin


class _Pending:
    """Rows of one batch call: runs of cached rows to copy, and rows written directly by the engine."""

    def __init__(self) -> None:
        self.runs: list[tuple[MaskCache, npt.NDArray[np.int32], int, Sequence[Any]]] = []
        self.direct: list[int] = []

    def add(self, cache: MaskCache, block: npt.NDArray[np.int32], first: int, slots: Sequence[Any]) -> None:
        """Queue cached ``slots`` of ``block`` for the consecutive rows from ``first`` (every slot a found one)."""
        self.runs.append((cache, block, first, slots))

    def write(self, bitmask: torch.Tensor, forced: npt.NDArray[np.bool_] | None = None) -> None:
        """Copy every run in place (a block of an older cache generation is still valid)."""
        bm = bitmask.numpy()
        for cache, block, first, slots in self.runs:
            sl = np.asarray(slots, dtype=np.int64)
            end = first + sl.shape[0]
            # take(..., out=) writes straight into the rows: a fancy-indexed
            # assignment would build (and page in) a temporary copy first.
            # "clip" keeps numpy from buffering; the slots are valid anyway.
            np.take(block, sl, axis=0, out=bm[first:end], mode="clip")
            if forced is not None:
                forced[first:end] = cache.forced_of(block, sl)
        if forced is not None:
            for row in self.direct:
                forced[row] = single_token(bm[row])


class OutlinesBatchOps(ChainOpsBase[OutlinesMatcher]):
    """Batch operations over outlines-core matchers (see :class:`maskplug.grammar.ChainOps`).

    Every row comes from the grammars' :class:`MaskCache`, so many rows are
    written by one numpy copy; ``fill_chains`` walks each request's drafts
    once and writes all its draft rows the same way. ``accept`` and
    ``rollback`` are the per-matcher calls.
    """

    matcher_type = OutlinesMatcher
    # fill_chains reports which rows allow exactly one token.
    fills_forced = True

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        self._eos = frozenset(vocab.eos_ids)
        self._special = vocab.special_ids
        self._n_tokens = len(vocab.tokens)

    def _row(self, m: OutlinesMatcher, bitmask: torch.Tensor, row: int, pending: _Pending) -> None:
        hit = m._masks.lookup(m)
        if hit is None:
            m._write_engine_row(bitmask.numpy()[row])
            pending.direct.append(row)
        else:
            pending.add(m._masks, hit[0], row, [hit[1]])

    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill ``bitmask[rows[i]]`` for ``matchers[i]`` (the bitmask was already checked)."""
        pending = _Pending()
        for m, r in zip(matchers, rows, strict=True):
            if not isinstance(m, OutlinesMatcher) or m.is_terminated():
                m.fill(bitmask, int(r))
            else:
                self._row(m, bitmask, int(r), pending)
        pending.write(bitmask)

    def _fill_chains(self, matchers: list[OutlinesMatcher], chains: Chains) -> list[int]:
        """Write each request's draft rows in one walk; return how many drafts each accepts.

        ``chains.workers`` is not used: the walk holds the GIL and is mostly
        cache lookups. When ``chains.forced`` (one flag per bitmask row) is
        given, the flag of every written row is set to whether it allows
        exactly one token (known per cached state, so no scan of the rows is
        needed).
        """
        bitmask = chains.bitmask
        pending = _Pending()
        out: list[int] = []
        eos, special, n_tokens = self._eos, self._special, self._n_tokens
        for m, r0, seq in zip(matchers, chains.rows, chains.drafts, strict=True):
            d = [int(t) for t in seq] if not isinstance(seq, list) else seq
            # The walk follows the automaton's transitions without moving the
            # guide: nothing to roll back, and a row is a cache lookup by state.
            step = m._index.get_next_state
            state = m._guide.get_state()
            states = [state]
            stopped = False
            for t in d:
                if t in special or t >= n_tokens:
                    # The stop token is never given to the engine (see the module notes).
                    stopped = t in eos and m.grammar.is_complete(state)
                    break
                state = step(state, t)
                if state is None:
                    break
                states.append(state)
            cache = m._masks
            slots, block, _, _ = cache.generation
            hits = [slots.get(st) for st in states] if cache.capacity else [None] * len(states)
            if None not in hits:
                cache.hits += len(hits)
                pending.add(cache, block, r0, hits)
            else:
                for p, slot in enumerate(hits):
                    if slot is not None:
                        cache.hits += 1
                        pending.add(cache, block, r0 + p, [slot])
                    else:
                        self._row_after(m, d[:p], bitmask, r0 + p, pending)
            out.append(len(states) - 1 + int(stopped))
        pending.write(bitmask, chains.forced)
        return out

    def _row_after(
        self,
        m: OutlinesMatcher,
        prefix: Sequence[int],
        bitmask: torch.Tensor,
        row: int,
        pending: _Pending,
    ) -> None:
        """A cache miss inside a chain: move the guide along ``prefix`` (all accepted), fill, move it back."""
        took = 0
        try:
            for t in prefix:
                if not m._accept(int(t)):
                    raise GrammarError(f"outlines-core: the guide refused draft {int(t)} its automaton accepts")
                took += 1
            self._row(m, bitmask, row, pending)
        finally:
            if took:
                m._rollback(took)


class OutlinesProvider(ProviderBase[OutlinesGrammar]):
    """outlines-core bound to one :class:`~maskplug.grammar.Vocab`.

    Supports ``regex``, ``json_schema`` and ``choice``. ``ebnf`` and ``lark``
    are not regular, and ``json_object`` is not either: outlines-core can only
    approximate it by a regex of bounded nesting whose automaton takes many
    seconds to build (9 s on a 32k vocabulary here), so all three are refused
    with :class:`GrammarError`. JSON schemas become outlines-core's regex,
    with the spec's whitespace bound between items.

    ``mask_cache_bytes`` bounds each compiled grammar's :class:`MaskCache`
    (``0`` turns it off: every fill asks the engine).
    """

    name = "outlines-core"
    kinds = frozenset({"regex", "json_schema", "choice"})

    def __init__(
        self,
        vocab: Vocab,
        mask_cache_bytes: int = DEFAULT_MASK_CACHE_BYTES,
        compile_limit_s: float | None = OUTLINES_COMPILE_LIMIT_S,
    ) -> None:
        super().__init__(vocab)
        self._use_worker(compile_limit_s, worker_compiler, vocab.with_encoder(None), mask_cache_bytes)
        if isinstance(mask_cache_bytes, bool) or not isinstance(mask_cache_bytes, int) or mask_cache_bytes < 0:
            raise GrammarError(f"mask_cache_bytes: expected an int >= 0, got {mask_cache_bytes!r}")
        self.mask_cache_bytes = mask_cache_bytes
        self.batch_ops = OutlinesBatchOps(vocab)
        self._engine_vocab: Vocabulary | None = None
        self._raw_vocab: Vocabulary | None = None
        self._vocab_lock = threading.Lock()
        self._stop_row: npt.NDArray[np.int32] = stop_row(vocab).numpy().copy()
        # outlines-core sets the bit of its single EOS id in final states;
        # the other stop ids are or-ed in from this row.
        self._extra_stop_row: torch.Tensor | None = stop_row(vocab) if len(vocab.eos_ids) > 1 else None

    def engine_vocabulary(self) -> Vocabulary:
        """The outlines-core ``Vocabulary`` for sentinel patterns (built once; see the module notes).

        Grammar-text tokens without the sentinel's lead byte, plus the
        sentinel token :data:`SENTINEL_BYTES` under the first stop id; the
        engine's own EOS is ``vocab_size``, an id no state reached by text
        ever allows.
        """
        with self._vocab_lock:
            if self._engine_vocab is None:
                by_bytes: dict[bytes, list[int]] = {}
                for i in grammar_text_ids(self.vocab):
                    tok = self.vocab.tokens[i]
                    if _SENTINEL_LEAD not in tok:
                        by_bytes.setdefault(tok, []).append(i)
                by_bytes[SENTINEL_BYTES] = [self.vocab.eos_ids[0]]
                self._engine_vocab = Vocabulary(self.vocab.vocab_size, by_bytes)
            return self._engine_vocab

    def raw_vocabulary(self) -> Vocabulary:
        """The outlines-core ``Vocabulary`` for regexes compiled as they are: grammar-text tokens, first stop id as EOS."""
        with self._vocab_lock:
            if self._raw_vocab is None:
                by_bytes: dict[bytes, list[int]] = {}
                for i in grammar_text_ids(self.vocab):
                    by_bytes.setdefault(self.vocab.tokens[i], []).append(i)
                self._raw_vocab = Vocabulary(self.vocab.eos_ids[0], by_bytes)
            return self._raw_vocab

    def regex_for(self, spec: GrammarSpec) -> str:
        """The regular expression outlines-core compiles for ``spec``."""
        src = spec.source
        if spec.kind == "regex":
            if not isinstance(src, str):
                raise GrammarError(f"spec.source: expected a regex str, got {type(src).__name__}")
            return src
        if spec.kind == "json_schema":
            text = schema_text(src)
            schema = schema_dict(src)
            folded = merge_compositions(schema)
            if folded != schema:
                text = json.dumps(folded)
            # At most max_whitespace JSON whitespace characters at each position (see the module notes).
            ws = "" if spec.whitespace == "compact" else json_whitespace_regex(spec.max_whitespace)
            try:
                return str(build_regex_from_schema(text, whitespace_pattern=ws))
            except (ValueError, TypeError) as exc:
                raise GrammarError(
                    f"spec.source: outlines-core cannot turn this JSON schema into a regex: {exc}"
                ) from exc
        return choice_regex(src)

    def check_options(self, spec: GrammarSpec) -> list[str]:
        """Refuse options outlines-core cannot honour for ``spec``; return the keywords it leaves unenforced."""
        if spec.kind != "json_schema":
            return []
        schema = schema_dict(spec.source)
        if not spec.strict_keys and open_objects(schema):
            raise GrammarError(
                "strict_keys: outlines-core cannot honour strict_keys=False: it never allows keys an object "
                "schema does not list, and this schema has objects without 'additionalProperties': false"
            )
        missing = sorted(schema_keywords(schema) - OUTLINES_KEYWORDS)
        warns = [f"outlines-core does not enforce {k!r}" for k in missing]
        if warns and spec.unsupported == "refuse":
            raise GrammarError(
                "unsupported: outlines-core does not enforce the keywords "
                f"{missing} of this json_schema spec (unsupported='refuse')"
            )
        return warns

    def build(self, spec: GrammarSpec) -> tuple[str, Index, list[str]]:
        """The regex, the token index and the unenforced keywords for ``spec`` (the whole compile)."""
        warns = self.check_options(spec)
        regex = self.regex_for(spec)
        pattern = sentinel_pattern(regex)
        try:
            if pattern is None:
                index = Index(regex, self.raw_vocabulary())
            else:
                index = Index(pattern, self.engine_vocabulary())
        except (ValueError, TypeError) as exc:
            raise GrammarError(
                f"spec.source: outlines-core failed to compile {spec.kind} {regex[:200]!r}: {exc}"
            ) from exc
        return regex, index, warns

    def _compile(self, spec: GrammarSpec) -> OutlinesGrammar:
        limit = self._limit_for(spec)
        if limit is None:
            regex, index, warns = self.build(spec)
        else:
            self.check_options(spec)  # option errors without starting a worker
            regex, index, warns = self._run_in_worker(spec, limit)
        return OutlinesGrammar(self, spec, regex, index, warns)


#: JSON Schema keywords outlines-core's regex builder enforces (annotations aside); maskplug reports others.
OUTLINES_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "allOf",
        "$ref",
        "$defs",
        "definitions",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minItems",
        "maxItems",
    }
)


def open_objects(schema: Any) -> bool:
    """Whether some object schema with ``properties`` in ``schema`` does not say ``additionalProperties: false``."""
    if isinstance(schema, list):
        return any(open_objects(x) for x in schema)
    if not isinstance(schema, dict):
        return False
    if "properties" in schema and schema.get("additionalProperties", True) is not False:
        return True
    for k, v in schema.items():
        if k in ("enum", "const", "default", "examples", "required"):
            continue
        if k in ("properties", "$defs", "definitions", "patternProperties") and isinstance(v, dict):
            if any(open_objects(x) for x in v.values()):
                return True
        elif isinstance(v, (dict, list)) and open_objects(v):
            return True
    return False


def worker_compiler(vocab: Vocab, mask_cache_bytes: int) -> Callable[[GrammarSpec], tuple[str, Index, list[str]]]:
    """The compile function of a compile worker process: spec -> (regex, pickled index, warnings)."""
    provider = OutlinesProvider(vocab, mask_cache_bytes, compile_limit_s=None)
    provider.engine_vocabulary()  # built at the worker's start-up, not inside the first compile's limit
    return provider.build


# -- compositions ---------------------------------------------------------------------------------------------------
class _NoMerge(Exception):
    """Two schemas maskplug cannot intersect into one (the composition is left to outlines-core)."""


_COMPOSE = ("allOf", "anyOf", "oneOf", "$ref")
# Keywords that describe a value; intersecting schemas that both use one differently is not attempted.
_KEEP_FIRST = frozenset({"title", "description", "$comment", "examples", "default", "$schema", "$id", "id"})


def _intersect(a: dict[str, Any], b: dict[str, Any], root: dict[str, Any], depth: int) -> dict[str, Any]:
    """One schema that means ``a`` and ``b`` (both without compositions), or :class:`_NoMerge`.

    ``properties`` are merged (``a``'s first; a name in both gets the merge
    of its two schemas), ``required`` is the union, ``type`` the
    intersection; any other keyword must be the same in both.
    """
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif k == "properties" and isinstance(v, dict) and isinstance(out[k], dict):
            props = dict(out[k])
            for n, s in v.items():
                if n not in props or props[n] == s:
                    props[n] = s
                else:
                    props[n] = _merged({"allOf": [props[n], s]}, root, depth + 1)
                    if "allOf" in props[n]:
                        raise _NoMerge(n)
            out[k] = props
        elif k == "required" and isinstance(v, list) and isinstance(out[k], list):
            out[k] = list(dict.fromkeys([*out[k], *v]))
        elif k == "type":
            tb = v if isinstance(v, list) else [v]
            both = [t for t in (out[k] if isinstance(out[k], list) else [out[k]]) if t in tb]
            if not both:
                raise _NoMerge("type")
            out[k] = both[0] if len(both) == 1 else both
        elif k in _KEEP_FIRST or out[k] == v:
            continue
        else:
            raise _NoMerge(k)
    return out


def _merged(node: Any, root: dict[str, Any], depth: int = 0) -> Any:
    """``node`` with ``allOf`` and ``$ref``-beside-keywords folded into one object schema where possible.

    outlines-core's regex builder writes ``allOf`` members one after
    another (two objects in a row) and ignores a parent's ``properties``
    beside ``anyOf``/``oneOf``; this fold gives it one object (or one
    object per branch) instead, so the keys of every member are where JSON
    Schema puts them. Anything it cannot fold is left as it was.
    """
    if depth > 32 or not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {n: _merged(s, root, depth + 1) for n, s in v.items()}
        elif k in ("enum", "const", "default", "examples", "required") or k in _KEEP_FIRST:
            out[k] = v
        elif isinstance(v, dict):
            out[k] = _merged(v, root, depth + 1)
        elif isinstance(v, list) and k in ("allOf", "anyOf", "oneOf", "prefixItems", "items"):
            out[k] = [_merged(x, root, depth + 1) for x in v]
        else:
            out[k] = v
    try:
        return _fold(out, root, depth)
    except (_NoMerge, KeyError, IndexError, TypeError):
        return out


def _fold(node: dict[str, Any], root: dict[str, Any], depth: int) -> dict[str, Any]:
    members: list[dict[str, Any]] = []
    base = {k: v for k, v in node.items() if k not in _COMPOSE}
    ref = node.get("$ref")
    if isinstance(ref, str) and base.keys() - _KEEP_FIRST:
        target = _merged(resolve_ref(root, ref), root, depth + 1)
        if not isinstance(target, dict) or any(k in target for k in _COMPOSE):
            raise _NoMerge("$ref")
        members.append(target)
        ref = None
    all_of = node.get("allOf")
    if isinstance(all_of, list):
        for m in all_of:
            if not isinstance(m, dict):
                raise _NoMerge("allOf")
            if "$ref" in m and len(m) == 1:
                m = _merged(resolve_ref(root, m["$ref"]), root, depth + 1)
            if not isinstance(m, dict) or any(k in m for k in ("allOf", "$ref")):
                raise _NoMerge("allOf")
            members.append(m)
    if not members and not (base.keys() & {"properties", "required"} and ("anyOf" in node or "oneOf" in node)):
        return node
    # Members first (a base's keys before the keys the schema adds), then the schema's own.
    merged: dict[str, Any] = {}
    disjunctions = [node[k] for k in ("anyOf", "oneOf") if isinstance(node.get(k), list)]
    for m in members:
        own = {k: v for k, v in m.items() if k not in ("anyOf", "oneOf")}
        disjunctions.extend(m[k] for k in ("anyOf", "oneOf") if isinstance(m.get(k), list))
        merged = _intersect(merged, own, root, depth) if merged else dict(own)
    merged = _intersect(merged, base, root, depth) if merged else dict(base)
    if isinstance(ref, str):
        merged["$ref"] = ref
    if not disjunctions:
        return merged
    if len(disjunctions) > 1 or isinstance(ref, str):
        raise _NoMerge("anyOf")
    # One disjunction: each branch gets the rest of the object (a parent's properties stay in every branch).
    branches = []
    for b in disjunctions[0]:
        if not isinstance(b, dict) or any(k in b for k in _COMPOSE):
            raise _NoMerge("anyOf")
        branches.append(_intersect(dict(merged), b, root, depth))
    keep = {k: v for k, v in merged.items() if k in _KEEP_FIRST or k in ("$defs", "definitions")}
    return {**keep, "anyOf": branches}


def merge_compositions(schema: Any) -> Any:
    """``schema`` with the compositions outlines-core cannot read folded into plain objects (see :func:`_merged`)."""
    if not isinstance(schema, dict):
        return schema
    return _merged(schema, schema)
