"""The xgrammar provider: every spec kind, compiled by xgrammar's grammar compiler.

Everything is built offline from a :class:`maskplug.Vocab`.

How xgrammar's behaviour is normalised to maskplug's matcher contract:

* the vocabulary is handed over as ``VocabType.RAW`` with every control token
  (stop tokens included) as empty bytes: xgrammar only recognises special
  tokens of a raw vocabulary that way, and would otherwise treat their literal
  text (``"</s>"``) as grammar text;
* stop tokens never reach xgrammar's matcher: :class:`maskplug.grammar.sdk.MatcherBase`
  accepts one exactly when the text is complete and tracks termination itself,
  so ``rollback`` counts it as one token like every other provider;
* fills go into a checked CPU int32 tensor exactly ``ceil(vocab_size/32)``
  words wide (xgrammar ignores strides and trusts the width);
* ids outside ``[0, vocab_size)`` raise :class:`maskplug.GrammarError` before
  xgrammar sees them;
* a matcher's accept, fill and rollback call the C++ object behind xgrammar's
  ``GrammarMatcher`` directly, as its Python methods do (checked once per
  process, :func:`_direct_calls`): two Python frames less on every row, draft
  and emitted token;
* many rows are filled on xgrammar's C++ thread pool (``BatchGrammarMatcher``);
* a request's whole draft chain is filled by one ``traverse_draft_tree`` call
  (accept, fill and roll back in C++, without the GIL), requests spread over
  a small thread pool (:meth:`XGrammarBatchOps.fill_chains`).

Options of :class:`~maskplug.grammar.GrammarSpec` (JSON kinds):

* ``whitespace="flexible"`` is ``any_whitespace=True`` (xgrammar's and
  vLLM's default); ``"compact"`` is ``any_whitespace=False`` with separators
  ``(",", ":")``;
* ``max_whitespace=N`` is ``max_whitespace_cnt=N`` (None: no bound, xgrammar's
  and vLLM's default; ``0``: the compact grammar); ``json_object`` with a bound
  is compiled as the schema ``{"type": "object"}`` (xgrammar's builtin JSON
  grammar takes no whitespace options). xgrammar keeps a token-mask cache for
  each position of each bounded run, so a grammar's memory grows with the
  bound: about 7 MiB per schema of maskplug's JSONSchemaBench subset over
  tekken's 131k tokens at the default 24, 0.2 MiB unbounded
  (``benchmarks/RESULTS.md``);
* ``strict_keys`` is xgrammar's ``strict_mode`` (True is its default and what
  vLLM passes: no unlisted object keys or array items unless the schema says
  so);
* ``unsupported``: xgrammar compiles a schema whose keywords it does not
  enforce and only warns (``minLength`` next to ``format``, ``multipleOf`` on
  numbers, ``oneOf`` read as ``anyOf``, ...). Those C++ warnings are captured
  (the process's stderr is redirected while xgrammar compiles), never reach
  the console, go to the ``maskplug.xgrammar`` logger at WARNING and into the
  compiled grammar's ``warnings``; ``"refuse"`` raises :class:`GrammarError`
  with them instead.

Compile limits: with a ``compile_limit_s`` (the default
:data:`XGRAMMAR_COMPILE_LIMIT_S`, in CPU seconds), compiles run in a
worker process (:class:`maskplug.grammar.sdk.CompileWorker`) that is killed
at the limit; the compiled grammar comes back serialized
(``CompiledGrammar.serialize_json``), unless compiling it again in the
calling process is quicker than that round trip (:data:`TRANSFER_BYTES_PER_S`):
then the worker only vouches that the compile ends within the limit.
``compile_limit_s=None`` compiles in the calling process with no limit.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import torch
import xgrammar as xgr

from maskplug import GrammarError, GrammarSpec, Matcher, Vocab
from maskplug.grammar.sdk import (
    SPEC_KINDS,
    ChainOpsBase,
    Chains,
    MatcherBase,
    ProviderBase,
    check_choice,
    schema_text,
    spread_tasks,
)

__all__ = [
    "KINDS",
    "TRANSFER_BYTES_PER_S",
    "XGRAMMAR_COMPILE_LIMIT_S",
    "XGrammarBatchOps",
    "XGrammarCompiled",
    "XGrammarGrammar",
    "XGrammarMatcher",
    "XGrammarProvider",
    "capture_stderr",
    "choice_ebnf",
]

KINDS = frozenset(SPEC_KINDS)

XGRAMMAR_COMPILE_LIMIT_S = 600.0
"""xgrammar's default compile limit, in CPU seconds of its compile server. xgrammar precomputes token
masks for every grammar state at compile time, so a few real schemas take long over a large
vocabulary: of JSONSchemaBench's 1,003 sample schemas over tekken's 131k tokens, the slowest
(JsonSchemaStore aerleon-definitions) took 177-305 CPU s here, idle and loaded, dbt_project 98 s and
six more 11-21 s, all past :data:`maskplug.grammar.sdk.DEFAULT_COMPILE_LIMIT_S` (median 0.4 s). Engines compile off the step path, so a limit
there only has to stop what is stuck; this one leaves about twice the slowest real compile."""

logger = logging.getLogger("maskplug.xgrammar")
# Nothing on the console unless the application configures logging.
logger.addHandler(logging.NullHandler())
logger.propagate = True

_STDERR_LOCK = threading.Lock()
_WARNING = re.compile(r"^(?:\[[\d:]+\]\s+\S+:\d+:\s*)?Warning:\s*(.*)$")


@contextmanager
def capture_stderr() -> Iterator[list[str]]:
    """Redirect the process's stderr (file descriptor 2) into a temporary file for the block.

    The list it yields is filled with the captured lines when the block
    ends. Captures are serialised (descriptor 2 is process-wide).
    """
    lines: list[str] = []
    with _STDERR_LOCK:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield lines
            finally:
                try:
                    sys.stderr.flush()
                finally:
                    os.dup2(saved, 2)
                    os.close(saved)
                tmp.seek(0)
                lines.extend(tmp.read().decode("utf-8", errors="replace").splitlines())


def engine_warnings(lines: Sequence[str]) -> list[str]:
    """xgrammar's warning messages among captured stderr lines (its ``[time] file:line:`` prefix dropped)."""
    out = []
    for ln in lines:
        m = _WARNING.match(ln.strip())
        if m:
            out.append(m.group(1).strip())
    return out


def compile_raw(
    compiler: Any, spec: GrammarSpec, capture: bool = True, printed: list[str] | None = None
) -> tuple[Any, list[str]]:
    """Compile ``spec`` with xgrammar's ``compiler``; return the compiled grammar and xgrammar's warnings.

    ``capture=False`` leaves the process's stderr alone (and returns no warnings): for a compile
    already seen to print nothing (the compile worker's, :func:`worker_compiler`), so that other
    threads' output is never swallowed while it runs. ``printed`` receives every captured line.
    """
    compile_fn: Callable[[], Any]
    kind, src = spec.kind, spec.source
    # max_whitespace=0 allows no whitespace: the compact grammar.
    compact = spec.whitespace == "compact" or spec.max_whitespace == 0
    ws: dict[str, Any] = {"any_whitespace": not compact}
    if compact:
        ws["separators"] = (",", ":")
    elif spec.max_whitespace is not None:
        ws["max_whitespace_cnt"] = spec.max_whitespace
    if kind == "json_schema":
        text = schema_text(src)
        compile_fn = lambda: compiler.compile_json_schema(text, strict_mode=spec.strict_keys, **ws)  # noqa: E731
    elif kind == "json_object":
        if compact or spec.max_whitespace is not None:
            # The builtin JSON grammar takes no whitespace options.
            obj = json.dumps({"type": "object"})
            compile_fn = lambda: compiler.compile_json_schema(obj, strict_mode=False, **ws)  # noqa: E731
        else:
            compile_fn = compiler.compile_builtin_json_grammar
    elif kind == "choice":
        ebnf = choice_ebnf(src)
        compile_fn = lambda: compiler.compile_grammar(ebnf)  # noqa: E731
    else:
        if not isinstance(src, str):
            raise GrammarError(f"spec.source: expected a str for kind {kind!r}, got {type(src).__name__}")
        methods: dict[str, Callable[[str], Any]] = {
            "regex": compiler.compile_regex,
            "ebnf": compiler.compile_grammar,
            "lark": compiler.compile_lark,
        }
        method, rtext = methods[kind], src
        compile_fn = lambda: method(rtext)  # noqa: E731
    lines: list[str] = []
    try:
        if capture:
            with capture_stderr() as lines:
                raw = compile_fn()
        else:
            raw = compile_fn()
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar reports every grammar error as RuntimeError/ValueError
        msgs = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        # Drop xgrammar's "[hh:mm:ss] /path/file.cc:123:" prefix; keep the reason.
        reason = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msgs[-1]) if msgs else type(exc).__name__
        raise GrammarError(f"spec.source: xgrammar could not compile this {kind} spec: {reason}") from exc
    if printed is not None:
        printed.extend(lines)
    return raw, engine_warnings(lines)


def _tokenizer_info(vocab: Vocab) -> Any:
    # Control tokens as empty bytes: the only way xgrammar recognises them in a raw vocabulary.
    encoded = [b"" if i in vocab.special_ids else t for i, t in enumerate(vocab.tokens)]
    return xgr.TokenizerInfo(
        encoded, xgr.VocabType.RAW, vocab_size=vocab.vocab_size, stop_token_ids=list(vocab.eos_ids)
    )


TRANSFER_BYTES_PER_S = 30e6
"""How fast a compiled grammar travels back from the compile worker, in bytes of its
``memory_size_bytes`` per second: serialized to JSON there, parsed again here. Measured over the
44 schemas of maskplug's JSONSchemaBench subset with tekken's 131k tokens (2-core machine): a median of
23–27 MB/s at maskplug's default options over two runs, the transfer 12.9 s in all against 1.9 s for the
compiles themselves, since the default whitespace bound makes the grammars about 30 times larger
(``benchmarks/xgrammar_transfer.py`` measures it). The worker sends a grammar only
when its compile took more CPU time than the transfer would take at this rate; otherwise the caller
compiles it again (the compile is deterministic and has just been seen to end within the limit)."""


def worker_compiler(
    vocab: Vocab, max_threads: int, bytes_per_s: float = TRANSFER_BYTES_PER_S
) -> Callable[[GrammarSpec], tuple[str | None, list[str]]]:
    """The compile function of a compile worker process: spec -> (serialized grammar, warnings).

    The grammar is None when compiling it again in the caller is quicker than its transfer
    (:data:`TRANSFER_BYTES_PER_S`; ``bytes_per_s=math.inf`` always sends it, ``0`` only one whose
    compile printed something).
    """
    compiler = xgr.GrammarCompiler(_tokenizer_info(vocab), max_threads=max_threads, cache_enabled=False)

    def run(spec: GrammarSpec) -> tuple[str | None, list[str]]:
        printed: list[str] = []
        # CPU time (every thread of this process, which only compiles): what the caller's compile will
        # cost, at most, whatever the machine's load; the transfer's estimate does not depend on it either.
        began = time.process_time()
        raw, warns = compile_raw(compiler, spec, printed=printed)
        took = time.process_time() - began
        # A compile that printed anything (a warning) is sent: compiled again in the caller, what it
        # prints would reach the console.
        if not printed and took * bytes_per_s < raw.memory_size_bytes:
            return None, warns
        return str(raw.serialize_json()), warns

    return run


def choice_ebnf(source: Any) -> str:
    """An EBNF grammar whose language is exactly the given strings (the empty string included)."""
    items = check_choice(source, allow_empty=True)
    # JSON string literals are valid EBNF string literals for xgrammar; keeping
    # non-ASCII characters raw avoids surrogate-pair escapes.
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in items)


class XGrammarGrammar:
    """A grammar compiled by xgrammar for one vocabulary."""

    def __init__(
        self, provider: XGrammarProvider, spec: GrammarSpec, compiled: Any, warnings: Sequence[str] = ()
    ) -> None:
        self.provider = provider
        self.spec = spec
        self.raw = compiled
        #: What xgrammar warned while compiling: constraints of the spec it does not enforce.
        self.warnings: list[str] = list(warnings)

    def matcher(self) -> XGrammarMatcher:
        """A fresh matcher at the start of the grammar."""
        raw = xgr.GrammarMatcher(self.raw, terminate_without_stop_token=False, max_rollback_tokens=-1)
        return XGrammarMatcher(self.provider, raw)


# The earlier name of XGrammarGrammar.
XGrammarCompiled = XGrammarGrammar


class XGrammarMatcher(MatcherBase):
    """One request's state, with maskplug's normalised semantics (see the module docstring)."""

    # xgrammar's fill and accept run in C++ without the GIL.
    releases_gil = True

    def __init__(self, provider: XGrammarProvider, raw: Any) -> None:
        super().__init__(provider.vocab)
        self.provider = provider
        self.raw = raw
        self.batch_ops = provider.batch_ops

    @property
    def raw(self) -> Any:
        """The xgrammar ``GrammarMatcher`` this matcher drives."""
        return self._raw

    @raw.setter
    def raw(self, raw: Any) -> None:
        self._raw = raw
        fast = ("_accept", "_fill", "_rollback")
        if type(raw) is xgr.GrammarMatcher:
            # xgrammar's own accept, fill and rollback take and return what maskplug's do (a bool
            # for accept, "need apply" for fill): bound here, every accept of an emitted token or a
            # draft, every mask row and every walk's rollback (an engine's per-step work) runs one
            # Python frame less; two less where the C++ object under xgrammar's class takes the
            # calls as its Python methods pass them (_direct_calls).
            calls = _direct_calls(raw, self.vocab.mask_words)
            if calls is None:
                calls = (raw.accept_token, raw.fill_next_token_bitmask, raw.rollback)
            for name, call in zip(fast, calls, strict=True):
                setattr(self, name, call)
        else:
            # Anything else (a subclass, a stand-in) is called through the methods below, which
            # make the same calls on whatever ``raw`` holds.
            for name in fast:
                self.__dict__.pop(name, None)

    def _accept(self, token: int) -> bool:
        return bool(self.raw.accept_token(token))

    def _rollback(self, n: int) -> None:
        self.raw.rollback(n)

    def _fill(self, bitmask: torch.Tensor, row: int) -> bool:
        # xgrammar returns whether the row restricts anything ("need apply").
        return bool(self.raw.fill_next_token_bitmask(bitmask, row))

    def _is_complete(self) -> bool:
        return bool(self.raw.is_completed())

    def _reset(self) -> None:
        self.raw.reset()

    def _fork(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.provider, self.raw.fork())


#: Whether xgrammar's matcher objects take accept, fill and rollback straight from maskplug (found once
#: per process by :func:`_direct_calls`; None: not yet looked at).
_DIRECT: bool | None = None


def _direct_calls(raw: Any, words: int) -> tuple[Callable[..., Any], ...] | None:
    """``raw``'s accept, fill and rollback on the C++ object its Python methods call, or None.

    xgrammar's ``GrammarMatcher.accept_token``, ``fill_next_token_bitmask``
    and ``rollback`` each read the object behind a property and pass it the
    same arguments with ``debug_print=False``; calling that object (as
    ``_handle``) saves two Python frames per call, on every row, draft and
    emitted token of every step. Tried once per process on a fork of the
    first matcher (its answers compared with the public methods' on another
    fork): an xgrammar that has moved on keeps the public methods.
    """
    global _DIRECT
    handle = getattr(raw, "_handle", None)
    if _DIRECT is None:
        _DIRECT = _direct_calls_agree(raw, words)
    if not _DIRECT or handle is None:
        return None
    fill_h, accept_h = handle.fill_next_token_bitmask, handle.accept_token

    def accept(token: int) -> bool:
        return accept_h(token, False)  # type: ignore[no-any-return]

    def fill(bitmask: torch.Tensor, row: int) -> bool:
        return fill_h(bitmask, row, False)  # type: ignore[no-any-return]

    return accept, fill, handle.rollback


def _direct_calls_agree(raw: Any, words: int) -> bool:
    """Whether ``raw._handle`` takes :func:`_direct_calls`' calls and answers as the public methods do.

    The public methods must also be what :func:`_direct_calls` assumes, each
    a call of the object's method of the same name and nothing else (the
    names their code reads): a later xgrammar that converts or checks
    arguments there keeps its methods even if the probe below would pass.
    """
    for name in ("accept_token", "fill_next_token_bitmask", "rollback"):
        code = getattr(getattr(type(raw), name, None), "__code__", None)
        if code is None or set(code.co_names) != {"_handle", name}:
            return False
    try:
        public, direct = raw.fork(), raw.fork()
        h = direct._handle
        a, b = torch.zeros((1, words), dtype=torch.int32), torch.zeros((1, words), dtype=torch.int32)
        if public.fill_next_token_bitmask(a, 0) != h.fill_next_token_bitmask(b, 0, False) or not torch.equal(a, b):
            return False
        # The first token the row allows (or token 0): both forks accept it or neither does.
        allowed = (a[0].numpy().view(np.uint32) != 0).nonzero()[0]
        word = int(allowed[0]) if allowed.size else 0
        bits = int(a[0, word].item()) & 0xFFFFFFFF
        token = 32 * word + ((bits & -bits).bit_length() - 1 if bits else 0)
        took = public.accept_token(token)
        if h.accept_token(token, False) is not took:
            return False
        if took:
            public.rollback(1)
            h.rollback(1)
        a.zero_()
        b.zero_()
        public.fill_next_token_bitmask(a, 0)
        h.fill_next_token_bitmask(b, 0, False)
        return bool(torch.equal(a, b))
    except Exception:  # any failure: the public methods are the way in
        return False


def _raw(m: Matcher) -> Any:
    """The xgrammar ``GrammarMatcher`` of one of this provider's matchers."""
    return cast(XGrammarMatcher, m).raw


class XGrammarBatchOps(ChainOpsBase[XGrammarMatcher]):
    """Batch fill/accept/rollback and draft chains over xgrammar matchers (see :class:`maskplug.grammar.ChainOps`)."""

    matcher_type = XGrammarMatcher

    def __init__(self, vocab: Vocab, max_threads: int) -> None:
        super().__init__(vocab)
        self.max_threads = max_threads
        self.default_threads = max_threads
        self.batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self._eos = frozenset(vocab.eos_ids)
        self._eos_arr = np.asarray(sorted(vocab.eos_ids), dtype=np.int64)
        self._special = vocab.special_ids
        self._n_tokens = len(vocab.tokens)
        # A chain of k drafts is a draft tree whose node i has child i + 1 and no sibling.
        self._trees: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tree(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        tree = self._trees.get(k)
        if tree is None:
            child = torch.arange(1, k + 2, dtype=torch.int64)
            child[k] = -1
            tree = (child, torch.full((k + 1,), -1, dtype=torch.int64))
            self._trees[k] = tree
        return tree

    def fill_tree(
        self,
        matcher: Matcher,
        next_child: torch.Tensor,
        next_sibling: torch.Tensor,
        tokens: torch.Tensor,
        bitmask: torch.Tensor,
    ) -> None:
        """One request's draft tree in one native ``traverse_draft_tree`` call (:class:`~maskplug.grammar.sdk.TreeOps`)."""
        _raw(matcher).traverse_draft_tree(next_child, next_sibling, tokens, bitmask)

    def _fill_chains(self, matchers: list[XGrammarMatcher], chains: Chains) -> list[int]:
        """Fill each request's draft rows with one ``traverse_draft_tree`` call; return the accepted counts.

        xgrammar checks each draft against the row it just filled, so the
        accepted counts are read back from the rows, vectorised. Requests run
        on ``chains.workers`` threads (the calls release the GIL).
        """
        bitmask, drafts = chains.bitmask, chains.drafts
        n = len(matchers)
        lens = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=n)
        width = int(lens.max())
        # Node 0 of every tree is the current state (its token is not fed).
        toks = torch.zeros((n, width + 1), dtype=torch.int64)
        tok_np = toks.numpy()
        for i, d in enumerate(drafts):
            tok_np[i, 1 : 1 + len(d)] = d
        raws = [m.raw for m in matchers]
        starts = chains.rows

        def one(i: int) -> None:
            k = int(lens[i])
            child, sibling = self._tree(k)
            raws[i].traverse_draft_tree(child, sibling, toks[i, : k + 1], bitmask[starts[i] : starts[i] + k + 1])

        spread_tasks(one, n, chains.workers)

        # Accepted count: leading drafts whose bit is set in the row before them,
        # cut just after the first accepted stop token.
        if width == 0:
            return [0] * n
        fed = tok_np[:, 1:]
        valid = np.arange(width)[None, :] < lens[:, None]
        r = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(width)[None, :]
        r = np.where(valid, r, 0)
        dd = np.where(valid, fed, 0)
        words = bitmask.numpy()[r, dd >> 5].view(np.uint32)
        ok = (((words >> (dd & 31).astype(np.uint32)) & 1) == 1) & valid
        lead = np.cumprod(ok, axis=1).astype(bool)
        took = lead.sum(axis=1)
        stop = lead & np.isin(fed, self._eos_arr)
        has_stop = stop.any(axis=1)
        first_stop = np.argmax(stop, axis=1)
        took = np.where(has_stop, np.minimum(took, first_stop + 1), took)
        return [int(t) for t in took]

    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill ``bitmask[rows[i]]`` for ``matchers[i]``; terminated matchers get their stop-only row."""
        live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
        if len(live) != len(matchers):
            for i, m in enumerate(matchers):
                if m.is_terminated():
                    m.fill(bitmask, rows[i])
        if live:
            handles = [_raw(matchers[i]) for i in live]
            self.batch.batch_fill_next_token_bitmask(handles, bitmask, [int(rows[i]) for i in live])

    def accept(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> list[bool]:
        """``matchers[i].accept(tokens[i])`` for all ``i``; plain text tokens go through xgrammar's batch call."""
        out = [False] * len(matchers)
        plain: list[int] = []
        for i, (m, t) in enumerate(zip(matchers, tokens, strict=True)):
            t = int(t)
            if m.is_terminated() or t in self._special or t >= self._n_tokens or t < 0:
                # Stop tokens, control tokens, padding and bad ids take the checked path.
                out[i] = m.accept(t)
            else:
                plain.append(i)
        if plain:
            res = xgr.BatchGrammarMatcher.batch_accept_token(
                [_raw(matchers[i]) for i in plain],
                [int(tokens[i]) for i in plain],
            )
            for i, ok in zip(plain, res, strict=True):
                out[i] = bool(ok)
        return out

    def rollback(self, matchers: Sequence[Matcher], counts: Sequence[int]) -> None:
        """``matchers[i].rollback(counts[i])`` for all ``i``, the engine's part in one batch call."""
        raw: list[Any] = []
        ks: list[int] = []
        for m, k in zip(matchers, counts, strict=True):
            k = int(k)
            if k <= 0:
                continue
            # The stop token was never given to xgrammar: it is undone here.
            k = cast(XGrammarMatcher, m)._unwind_stop(k)
            if k:
                raw.append(_raw(m))
                ks.append(k)
        if raw:
            xgr.BatchGrammarMatcher.batch_rollback(raw, ks)


class XGrammarProvider(ProviderBase[XGrammarGrammar]):
    """xgrammar bound to one vocabulary; compiles every spec kind of :data:`maskplug.grammar.SPEC_KINDS`."""

    name = "xgrammar"
    kinds = KINDS

    def __init__(
        self,
        vocab: Vocab,
        max_threads: int | None = None,
        compile_limit_s: float | None = XGRAMMAR_COMPILE_LIMIT_S,
    ) -> None:
        super().__init__(vocab)
        self.tokenizer_info = _tokenizer_info(vocab)
        threads = max_threads if max_threads is not None else min(8, os.cpu_count() or 1)
        # xgrammar's own cache would answer a repeated compile without its warnings; maskplug caches instead.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads, cache_enabled=False)
        self.batch_ops = XGrammarBatchOps(vocab, threads)
        #: Grammars the worker compiled within the limit and this process compiled again (see
        #: :data:`TRANSFER_BYTES_PER_S`).
        self._compiled_again = 0
        self._use_worker(compile_limit_s, worker_compiler, vocab.with_encoder(None), threads)

    def _compile(self, spec: GrammarSpec) -> XGrammarGrammar:
        limit = self._limit_for(spec)
        if limit is None:
            raw, warns = compile_raw(self.compiler, spec)
        else:
            ser, warns = self._run_in_worker(spec, limit)
            if ser is None:
                # Quicker to compile again than to receive (worker_compiler): the same compiler settings.
                raw, _ = compile_raw(self.compiler, spec, capture=False)
                self._compiled_again += 1
            else:
                raw = xgr.CompiledGrammar.deserialize_json(ser, self.tokenizer_info)
        for w in warns:
            logger.warning("xgrammar: %s (%s spec)", w, spec.kind)
        if warns and spec.unsupported == "refuse":
            raise GrammarError(
                f"unsupported: xgrammar does not enforce part of this {spec.kind} spec (unsupported='refuse'): "
                + "; ".join(warns)
            )
        return XGrammarGrammar(self, spec, raw, warns)
