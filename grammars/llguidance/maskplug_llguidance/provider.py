"""The llguidance provider: Earley-parsed grammars of every spec kind.

llguidance parses with a lexer plus an Earley parser and computes token masks
over a token trie. The tokenizer is built offline from the
:class:`~maskplug.grammar.Vocab`'s bytes. Its encoder, which llguidance uses
for text the grammar forces (property names, constants), is the model's own
tokenizer when the vocabulary carries one (:attr:`Vocab.has_encoder`:
tiktoken/tekken, Hugging Face ``tokenizers``, SentencePiece), so forced text is
held to the spelling the model itself produces. A bare byte table determines
no encoder; llguidance's greedy longest match over the same bytes stands in,
and then a model's natural spelling of forced text can be refused. Encoder
answers that do not spell the text exactly fall back to the greedy match.

What this module normalises, so callers see maskplug's matcher semantics:

* **No sticky error states.** ``LLMatcher`` never raises on a bad token: it
  enters an error state it never leaves. Here a token is only handed to the
  engine when the current mask allows it, so ``accept`` returns False with the
  state untouched instead; if the engine still refused a token, the matcher
  is rebuilt from the accepted tokens rather than left broken.
* **accept agrees with the mask.** llguidance keeps forced text to its
  canonical tokenisation in the mask (after ``{"name":"`` of a ``const``
  only the canonical first token of the constant is allowed) while its
  ``consume_token`` would take other spellings. ``accept`` checks the mask,
  so both say the same.
* **Stop tokens and rollback.** Accepting EOS in llguidance does not count
  towards its ``rollback``; the stop token never reaches the engine here
  (:class:`maskplug.grammar.sdk.MatcherBase` tracks it), so a stop token
  counts as one step like every other token.
* **Special and padding ids.** The engine sees a vocabulary padded to
  ``vocab_size`` with every control, empty and padding id marked special, so
  mask rows are exactly ``ceil(vocab_size/32)`` words and never allow them;
  stop ids are allowed exactly when the text is complete.
* **Options** of :class:`~maskplug.grammar.GrammarSpec` (JSON kinds):
  ``whitespace="flexible"`` is llguidance's ``whitespace_flexible`` (its
  default; vLLM's too); ``"compact"`` turns it off with separators ``,`` and
  ``:``. ``strict_keys=True`` closes every object to the keys the schema
  names for it anywhere (across ``allOf``/``anyOf``/``oneOf`` branches and
  ``$ref`` targets, :func:`maskplug.grammar.sdk.strict_keys_schema`); a
  plain ``"additionalProperties": false`` on each object schema (what
  vLLM's ``guidance_disable_additional_properties`` does) made compositions
  whose required keys sit in another branch unsatisfiable. False leaves the
  schema as it is (llguidance follows JSON Schema: unlisted keys allowed).
  ``max_whitespace=N`` is the JSON option ``whitespace_pattern``
  ``[\x20\x0a\x0d\x09]{0,N}`` (:func:`maskplug.grammar.sdk.json_whitespace_regex`;
  None: llguidance's own unbounded whitespace; ``0``: the compact grammar).
  ``unsupported="ignore"`` is llguidance's ``lenient`` (unimplemented keywords
  are left out; its warnings, e.g. ``Unimplemented keys: ["uniqueItems"]``, go
  into the compiled grammar's ``warnings``); ``"refuse"`` is llguidance's
  default (it refuses them).
* **Compile limits**: with a ``compile_limit_s`` (default
  :data:`maskplug.grammar.sdk.DEFAULT_COMPILE_LIMIT_S`) the grammar is
  built and checked in a worker process killed at the limit
  (:class:`maskplug.grammar.sdk.CompileWorker`); the checked grammar text
  comes back and the matcher template is made from it here (the same work the
  worker just finished within the limit).
* **Batch fills** run on llguidance's ``LLExecutor`` thread pool without the
  GIL (:class:`LLGuidanceBatchOps`); whole draft chains are walked request by
  request straight on the engines, writing each row in place, on a small
  thread pool (:meth:`LLGuidanceBatchOps.fill_chains`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.gbnf_to_lark import any_to_lark

from maskplug import GrammarError, GrammarSpec, Matcher, Vocab
from maskplug.grammar.sdk import (
    DEFAULT_COMPILE_LIMIT_S,
    ChainOpsBase,
    Chains,
    MatcherBase,
    ProviderBase,
    bits_row,
    check_choice,
    json_whitespace_regex,
    schema_dict,
    spread_tasks,
    strict_keys_schema,
    text_ids,
)

__all__ = ["LLGuidanceBatchOps", "LLGuidanceGrammar", "LLGuidanceMatcher", "LLGuidanceProvider", "bits_row"]


class _Encoder:
    """The encoder llguidance tokenises forced text with (see the module notes).

    The vocabulary's own encoder where it has one, its answer checked to
    spell the text; otherwise (or when the check fails) llguidance's greedy
    longest match, linked once the tokenizer exists. ``TokenizerWrapper``
    probes the callable once before the ``LLTokenizer`` is built; that probe
    gets an empty answer.
    """

    def __init__(self, vocab: Vocab, tokens: list[bytes], special: list[int]) -> None:
        self.vocab = vocab
        self.eos_token_id = vocab.eos_ids[0]
        self.bos_token_id = None
        self.tokens = tokens
        self.special_token_ids = special
        self.special = frozenset(special)
        self.tokenizer: LLTokenizer | None = None
        self.fallbacks = 0  # encoder answers that did not spell the text

    def __call__(self, text: bytes | str) -> list[int]:
        if self.tokenizer is None:
            return []
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        if self.vocab.has_encoder:
            try:
                ids: list[int] | None = self.vocab.encode(s)
            except Exception:  # a tokenizer library's own failure: the greedy match stands in
                ids = None
            toks = self.tokens
            if ids is not None and all(i not in self.special for i in ids):
                if b"".join(toks[i] for i in ids) == s.encode("utf-8"):
                    return ids
            self.fallbacks += 1
        return list(self.tokenizer.greedy_tokenize(s))


class LLGuidanceGrammar:
    """A grammar compiled by llguidance: its serialized form and a template matcher to copy from."""

    def __init__(
        self,
        provider: LLGuidanceProvider,
        spec: GrammarSpec,
        grammar: str,
        template: LLMatcher,
        warnings: Sequence[str] = (),
    ) -> None:
        self.provider = provider
        self.spec = spec
        self.grammar = grammar
        self.template = template
        #: llguidance's warnings for this grammar (with ``unsupported="ignore"``: the keywords it leaves out).
        self.warnings: list[str] = list(warnings)

    def matcher(self) -> LLGuidanceMatcher:
        """A fresh matcher at the start of the grammar."""
        return LLGuidanceMatcher(self, self.template.deep_copy())


class LLGuidanceMatcher(MatcherBase):
    """One request's parser state (see the module notes)."""

    # Mask computation drops the GIL; the executor fills many rows in parallel.
    releases_gil = True

    def __init__(self, grammar: LLGuidanceGrammar, engine: LLMatcher) -> None:
        super().__init__(grammar.provider.vocab)
        self.grammar = grammar
        self.provider = grammar.provider
        self.batch_ops = grammar.provider.batch_ops
        self.engine = engine
        self._tokens: list[int] = []
        # The normalised mask of the current state, kept so that ``accept``
        # right after ``fill`` (the draft-row pattern) costs a bit lookup.
        self._mask = np.zeros(self.vocab.mask_words, dtype=np.int32)
        self._mask_ok = False
        # The mask before the last accepted token: accept-then-rollback(1)
        # (validating, probing) gets it back without asking the engine again.
        self._prev_mask = np.zeros_like(self._mask)
        self._prev_depth = -1

    # -- helpers --------------------------------------------------------------------
    def _normalise(self, row: npt.NDArray[np.int32]) -> None:
        """Clear control/padding ids; allow the stop ids exactly when the text is complete."""
        np.bitwise_and(row, self.provider._text_row, out=row)
        if self.engine.is_accepting():
            np.bitwise_or(row, self.provider._stop_row, out=row)

    def _compute_mask(self) -> None:
        self.engine.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        self._normalise(self._mask)
        self._mask_ok = True

    def _rebuild(self) -> None:
        """Replay the accepted tokens into a fresh engine (leaves any error state behind)."""
        engine = self.grammar.template.deep_copy()
        if self._tokens and not engine.consume_tokens(self._tokens):
            raise GrammarError(
                f"llguidance: could not replay {len(self._tokens)} accepted tokens: {engine.get_error()}"
            )
        self.engine = engine
        self._mask_ok = False
        self._prev_depth = -1

    # -- engine primitives --------------------------------------------------------
    def _accept(self, token: int) -> bool:
        if not self._mask_ok:
            self._compute_mask()
        if not (int(self._mask[token >> 5]) >> (token & 31)) & 1:
            return False
        return self._consumed(token, bool(self.engine.consume_token(token)))

    def _consumed(self, token: int, ok: bool) -> bool:
        """Book-keeping after the engine consumed ``token`` (a mask-allowed one) with result ``ok``."""
        self._mask_ok = False
        if not ok:
            # The mask allowed it but the engine refused: never keep the error state.
            self._prev_depth = -1
            self._rebuild()
            return False
        self._mask, self._prev_mask = self._prev_mask, self._mask
        self._prev_depth = len(self._tokens)
        self._tokens.append(token)
        return True

    def _rollback(self, n: int) -> None:
        if not self.engine.rollback(n):
            raise GrammarError(f"n: llguidance could not roll back {n} tokens: {self.engine.get_error()}")
        del self._tokens[len(self._tokens) - n :]
        self._mask_ok = False
        if self._prev_depth == len(self._tokens):
            self._mask, self._prev_mask = self._prev_mask, self._mask
            self._mask_ok = True
        self._prev_depth = -1

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if not self._mask_ok:
            self._compute_mask()
        bitmask[row].numpy()[:] = self._mask

    def _is_complete(self) -> bool:
        return bool(self.engine.is_accepting())

    def _accepted_count(self) -> int:
        return len(self._tokens)

    def _reset(self) -> None:
        self.engine = self.grammar.template.deep_copy()
        self._tokens.clear()
        self._mask_ok = False
        self._prev_depth = -1

    def _fork(self) -> LLGuidanceMatcher:
        twin = LLGuidanceMatcher(self.grammar, self.engine.deep_copy())
        twin._tokens = list(self._tokens)
        if self._mask_ok:
            twin._mask[:] = self._mask
            twin._mask_ok = True
        return twin


class LLGuidanceBatchOps(ChainOpsBase[LLGuidanceMatcher]):
    """Batch operations over llguidance matchers (see :class:`maskplug.grammar.ChainOps`).

    ``fill`` computes every row in one ``LLExecutor`` call (a native thread
    pool, GIL released) and ``accept`` consumes every token in one more;
    rollback is per matcher (a short native call each).
    """

    matcher_type = LLGuidanceMatcher

    def __init__(self, provider: LLGuidanceProvider, num_threads: int | None) -> None:
        super().__init__(provider.vocab)
        self.provider = provider
        self.num_threads = num_threads
        self._executor: LLExecutor | None = None
        self._lock = threading.Lock()

    @property
    def executor(self) -> LLExecutor:
        """The shared ``LLExecutor`` (made on first use)."""
        with self._lock:
            if self._executor is None:
                self._executor = LLExecutor(self.num_threads)
            return self._executor

    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill ``bitmask[rows[i]]`` for ``matchers[i]`` (the bitmask is already checked)."""
        todo: list[tuple[LLMatcher, int]] = []
        owners: list[LLGuidanceMatcher] = []
        for m, r in zip(matchers, rows, strict=True):
            if not isinstance(m, LLGuidanceMatcher) or m.is_terminated() or m._mask_ok:
                m.fill(bitmask, int(r))
            else:
                todo.append((m.engine, int(r)))
                owners.append(m)
        if not todo:
            return
        self.executor.unsafe_compute_mask_ptr(todo, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
        bm = bitmask.numpy()
        idx = np.fromiter((r for _, r in todo), dtype=np.int64, count=len(todo))
        accepting = np.fromiter((m.engine.is_accepting() for m in owners), dtype=bool, count=len(owners))
        block = bm[idx] & self.provider._text_row
        block[accepting] |= self.provider._stop_row
        bm[idx] = block
        for m, r in zip(owners, idx.tolist(), strict=True):
            m._mask[:] = bm[r]
            m._mask_ok = True

    def accept(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> list[bool]:
        """``matchers[i].accept(tokens[i])`` for all ``i``.

        Plain text tokens of matchers whose mask is at hand (right after a
        fill) are checked against it here and consumed in one parallel
        executor call; everything else takes the matcher's own checked path.
        """
        out = [False] * len(matchers)
        todo: list[int] = []
        vocab = self.provider.vocab
        n_text = len(vocab.tokens)
        for i, (m, t) in enumerate(zip(matchers, tokens, strict=True)):
            if (
                not isinstance(m, LLGuidanceMatcher)
                or not m._mask_ok
                or m.is_terminated()
                or isinstance(t, bool)
                or not 0 <= int(t) < n_text
                or int(t) in vocab.special_ids
            ):
                out[i] = m.accept(t)
            elif (int(m._mask[int(t) >> 5]) >> (int(t) & 31)) & 1:
                todo.append(i)
        if not todo:
            return out
        owners = [cast(LLGuidanceMatcher, matchers[i]) for i in todo]
        done = self.executor.consume_token_par([(m.engine, int(tokens[i])) for m, i in zip(owners, todo, strict=True)])
        for m, i, ok in zip(owners, todo, done, strict=True):
            out[i] = m._consumed(int(tokens[i]), bool(ok))
        return out

    def _fill_chains(self, matchers: list[LLGuidanceMatcher], chains: Chains) -> list[int]:
        """Walk each request's drafts straight on its engine; return how many drafts each accepts.

        Each row is computed by the engine into the bitmask in place and
        normalised there; a draft is taken exactly when
        :meth:`LLGuidanceMatcher.accept` would take it (its bit in the
        normalised row, then the engine's consume). The engine is rolled back
        at the end, so the matcher's own state and cached masks stay valid.
        Requests run on ``chains.workers`` threads: mask computation releases
        the GIL. llguidance's executor is not used here: on the 2-core
        benchmark machine it spent more CPU per step for the same masks than
        this walk (``benchmarks/RESULTS.md``).
        """
        drafts, rows = chains.drafts, chains.rows
        n = len(matchers)
        owners = matchers
        bm = chains.bitmask.numpy()
        text_row, stop_row = self.provider._text_row, self.provider._stop_row
        eos = frozenset(self.provider.vocab.eos_ids)
        nbytes = bm.shape[1] * 4
        base = bm.ctypes.data
        out = [0] * n

        def walk(i: int) -> None:
            m, d, r0 = owners[i], drafts[i], rows[i]
            engine = m.engine
            took = 0
            fed = 0
            try:
                for p in range(len(d) + 1):
                    row = bm[r0 + p]
                    if p == 0 and m._mask_ok:
                        row[:] = m._mask  # the state's mask is at hand (as for a plain fill)
                    else:
                        engine.unsafe_compute_mask_ptr(base + (r0 + p) * nbytes, nbytes)
                        np.bitwise_and(row, text_row, out=row)
                        if engine.is_accepting():
                            np.bitwise_or(row, stop_row, out=row)
                    if p == len(d):
                        break
                    t = int(d[p])
                    if not (int(row[t >> 5]) >> (t & 31)) & 1:
                        break
                    if t in eos:
                        took += 1  # accepted (the text is complete); nothing follows a stop token
                        break
                    if not engine.consume_token(t):
                        # The mask allowed it but the engine refused: the matcher
                        # refuses it too; the engine is rebuilt below.
                        fed = -1
                        break
                    took += 1
                    fed += 1
            finally:
                if fed > 0:
                    if not engine.rollback(fed):
                        fed = -1
                if fed < 0:
                    m._rebuild()
            out[i] = took

        spread_tasks(walk, n, chains.workers)
        return out


class LLGuidanceProvider(ProviderBase[LLGuidanceGrammar]):
    """llguidance bound to one :class:`~maskplug.grammar.Vocab`; supports every spec kind.

    ``ebnf`` takes GBNF (``root ::= ...``, as llama.cpp and xgrammar write it)
    and ``lark`` takes llguidance's Lark dialect; ``json_object`` is any JSON
    object. ``num_threads`` sizes the executor for batch fills (default:
    llguidance's choice, 80% of the CPUs).
    """

    name = "llguidance"
    kinds = frozenset({"json_schema", "json_object", "regex", "ebnf", "lark", "choice"})

    def __init__(
        self,
        vocab: Vocab,
        num_threads: int | None = None,
        compile_limit_s: float | None = DEFAULT_COMPILE_LIMIT_S,
    ) -> None:
        super().__init__(vocab)
        self._use_worker(compile_limit_s, worker_compiler, vocab.with_encoder(None))
        words = vocab.mask_words
        self._text_row = bits_row(text_ids(vocab), words)
        self._stop_row = bits_row(vocab.eos_ids, words)
        self._tokenizer: LLTokenizer | None = None
        self._tok_lock = threading.Lock()
        self.batch_ops = LLGuidanceBatchOps(self, num_threads)

    @property
    def tokenizer(self) -> LLTokenizer:
        """The ``LLTokenizer`` for this vocabulary (built once, offline)."""
        with self._tok_lock:
            if self._tokenizer is None:
                v = self.vocab
                text = set(i for i, t in enumerate(v.tokens) if t and i not in v.special_ids)
                # Padding ids become empty control tokens, so the engine's
                # mask is exactly as wide as maskplug's rows.
                tokens = list(v.tokens) + [b""] * (v.vocab_size - len(v.tokens))
                special = [i for i in range(v.vocab_size) if i not in text]
                enc = _Encoder(v, tokens, special)
                tok = LLTokenizer(TokenizerWrapper(enc), eos_token=list(v.eos_ids))
                enc.tokenizer = tok
                self._tokenizer = tok
            return self._tokenizer

    def grammar_for(self, spec: GrammarSpec) -> str:
        """llguidance's serialized grammar for ``spec`` (not yet checked)."""
        return grammar_text(spec)

    def check(self, spec: GrammarSpec) -> tuple[str, list[str]]:
        """Build and check ``spec``'s grammar; return it with llguidance's warnings, or raise GrammarError."""
        grammar = grammar_text(spec)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            reason = messages[0].strip().splitlines()[0] if messages else "unknown error"
            if spec.unsupported == "refuse" and reason.startswith("Unimplemented keys"):
                raise GrammarError(
                    f"unsupported: llguidance does not enforce part of this {spec.kind} spec "
                    f"(unsupported='refuse'): {reason}"
                )
            raise GrammarError(f"spec.source: llguidance could not compile this {spec.kind} spec: {reason}")
        return grammar, [m.strip() for m in messages if m.strip()]

    def _template(self, spec: GrammarSpec, grammar: str) -> LLMatcher:
        template = LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(
                f"spec.source: llguidance could not compile this {spec.kind} spec: {template.get_error()}"
            )
        return template

    def _compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        limit = self._limit_for(spec)
        if limit is None:
            grammar, warns = self.check(spec)
        else:
            grammar, warns = self._run_in_worker(spec, limit)
        return LLGuidanceGrammar(self, spec, grammar, self._template(spec, grammar), warns)


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's serialized grammar for ``spec`` with its options mapped (not yet checked)."""
    kind, src = spec.kind, spec.source
    options: dict[str, Any] = {"lenient": spec.unsupported == "ignore"}
    if spec.whitespace == "compact" or spec.max_whitespace == 0:
        options.update(whitespace_flexible=False, item_separator=",", key_separator=":")
    else:
        options.update(whitespace_flexible=True)
        if spec.max_whitespace is not None:
            options.update(whitespace_pattern=json_whitespace_regex(spec.max_whitespace))
    try:
        if kind == "json_schema":
            schema = schema_dict(src)
            if spec.strict_keys:
                schema = strict_keys_schema(schema)
            return str(LLMatcher.grammar_from_json_schema(schema, overrides=options))  # type: ignore[arg-type]
        if kind == "json_object":
            return str(LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options))  # type: ignore[arg-type]
        if kind == "choice":
            # JSON string literals are Lark string literals for llguidance.
            choices = check_choice(src)
            return str(LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices)))
        if not isinstance(src, str):
            raise GrammarError(f"spec.source: expected a str for kind {kind!r}, got {type(src).__name__}")
        if kind == "regex":
            return str(LLMatcher.grammar_from_regex(src))
        if kind == "lark":
            return str(LLMatcher.grammar_from_lark(src))
        return str(LLMatcher.grammar_from_lark(any_to_lark(src)))
    except GrammarError:
        raise
    except Exception as exc:  # llguidance's converters raise ValueError and friends
        raise GrammarError(f"spec.source: llguidance could not read this {kind} spec: {exc}") from exc


def worker_compiler(vocab: Vocab) -> Callable[[GrammarSpec], tuple[str, list[str]]]:
    """The compile function of a compile worker process: spec -> (checked grammar, warnings)."""
    provider = LLGuidanceProvider(vocab, compile_limit_s=None)
    _ = provider.tokenizer  # built at the worker's start-up, not inside the first compile's limit

    def run(spec: GrammarSpec) -> tuple[str, list[str]]:
        grammar, warns = provider.check(spec)
        provider._template(spec, grammar)  # the full build, so the limit covers it
        return grammar, warns

    return run
