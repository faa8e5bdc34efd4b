"""vLLM's structured-output backend interface, served by a maskplug grammar provider.

:class:`MaskplugBackend` implements vLLM's ``StructuredOutputBackend``
(``compile_grammar``, ``allocate_token_bitmask``, ``destroy``) and
:class:`MaskplugGrammar` its ``StructuredOutputGrammar`` (``accept_tokens``,
``validate_tokens``, ``rollback``, ``fill_bitmask``, ``is_terminated``,
``reset``) on top of maskplug's normalised :class:`~maskplug.grammar.Matcher`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from maskplug import GrammarError, PluginError
from maskplug.engines.sdk import GuardedGrammar, draft_validator, emitted_acceptor
from maskplug.grammar.sdk import (
    AUTO,
    DEFAULT_MAX_WHITESPACE,
    CompileCache,
    GrammarSpec,
    Matcher,
    Vocab,
    grammar_provider,
    grammar_providers,
    vocab_from_hf_tokenizer,
)

__all__ = [
    "ERROR_PREFIX",
    "MaskplugBackend",
    "MaskplugGrammar",
    "bind_grammars",
    "fail_requests",
    "producer_matcher",
    "provider_for",
    "spec_from_vllm",
    "vocab_from_tokenizer",
]

logger = logging.getLogger(__name__)

ERROR_PREFIX = "maskplug grammar error: "
"""How the ``stop_reason`` of a request whose grammar failed begins (the error text follows)."""

# vLLM's backend names and the maskplug provider that does the same job; vLLM's own default,
# "auto" (it picks a backend per request), is maskplug's auto (it picks a provider per grammar).
_VLLM_TO_PROVIDER = {"auto": AUTO, "xgrammar": "xgrammar", "guidance": "llguidance", "outlines": "outlines-core"}


def provider_for(vllm_backend: str | None, *, was_auto: bool = False) -> str:
    """The maskplug provider for vLLM's structured-output backend.

    ``vllm_backend`` is the backend name vLLM gives the request and
    ``was_auto`` whether vLLM chose it itself because its config does not pin
    one (``structured_outputs_config.backend="auto"``, vLLM's default, which
    vLLM resolves per request before the backend sees it). Unpinned, and for
    names without a maskplug counterpart, maskplug's ``auto`` serves; an
    explicit ``"xgrammar"``, ``"guidance"`` or ``"outlines"`` pins xgrammar,
    llguidance or outlines-core. ``MASKPLUG_VLLM_PROVIDER`` overrides both.
    """
    chosen = os.environ.get("MASKPLUG_VLLM_PROVIDER", "").strip()
    if not chosen:
        chosen = AUTO if was_auto else _VLLM_TO_PROVIDER.get(vllm_backend or "", AUTO)
    names = grammar_providers()
    if chosen != AUTO and chosen not in names:
        raise PluginError(
            f"MASKPLUG_VLLM_PROVIDER: expected {AUTO!r} or one of the registered maskplug grammar providers "
            f"{names}, got {chosen!r} (vLLM backend {vllm_backend!r}); install its distribution, "
            f"e.g. maskplug-{chosen}"
        )
    return chosen


def vocab_from_tokenizer(tokenizer: Any, vocab_size: int) -> Vocab:
    """A maskplug :class:`Vocab` for a vLLM (Hugging Face fast) tokenizer, ``vocab_size`` wide.

    The loader both engine adapters share
    (:func:`maskplug.grammar.vocabs.vocab_from_hf_tokenizer`): the token bytes
    and the encoder come from the tokenizer's own ``tokenizer.json``
    description, so they decode and encode exactly as the model's tokenizer
    does; the stop token is the tokenizer's EOS.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise PluginError(
            f"tokenizer: maskplug-vllm reads the vocabulary of a Hugging Face fast tokenizer, got "
            f"{type(tokenizer).__name__}; use vLLM's own structured-output backends for this tokenizer"
        )
    return vocab_from_hf_tokenizer(tokenizer, vocab_size)


MAX_WHITESPACE_ENV = "MASKPLUG_VLLM_MAX_WHITESPACE"
"""The bound on whitespace runs in JSON grammars: an int >= 0, or ``none`` for vLLM's own unbounded whitespace."""


def max_whitespace_from_env() -> int | None:
    """:data:`MAX_WHITESPACE_ENV`'s bound (unset: :data:`maskplug.grammar.spec.DEFAULT_MAX_WHITESPACE`).

    Raises:
        PluginError: a value that is neither ``none`` nor a whole number >= 0, naming the variable.
    """
    raw = os.environ.get(MAX_WHITESPACE_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_WHITESPACE
    if raw.lower() == "none":
        return None
    if not raw.isdigit():
        raise PluginError(f"{MAX_WHITESPACE_ENV}: expected a whole number >= 0 or 'none', got {raw!r}")
    return int(raw)


def spec_from_vllm(
    request_type: Any,
    grammar_spec: str,
    *,
    disable_any_whitespace: bool = False,
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
) -> GrammarSpec:
    """Translate vLLM's ``(StructuredOutputOptions, str)`` request key into a :class:`GrammarSpec`.

    JSON kinds: vLLM's ``structured_outputs_config.disable_any_whitespace``
    is ``whitespace="compact"``; ``max_whitespace`` is the spec's bound on
    whitespace runs (default :data:`maskplug.grammar.spec.DEFAULT_MAX_WHITESPACE`;
    vLLM's own backends set no bound).
    """
    name = getattr(request_type, "name", str(request_type))
    ws: dict[str, Any] = {
        "whitespace": "compact" if disable_any_whitespace else "flexible",
        "max_whitespace": max_whitespace,
    }
    if name == "JSON":
        return GrammarSpec("json_schema", grammar_spec, **ws)
    if name == "JSON_OBJECT":
        return GrammarSpec("json_object", None, **ws)
    if name == "REGEX":
        return GrammarSpec("regex", grammar_spec)
    if name == "CHOICE":
        return GrammarSpec("choice", json.loads(grammar_spec))
    if name == "GRAMMAR":
        from vllm.v1.structured_output.utils import grammar_is_likely_lark

        return GrammarSpec("lark" if grammar_is_likely_lark(grammar_spec) else "ebnf", grammar_spec)
    raise GrammarError(
        f"request_type: maskplug serves JSON, JSON_OBJECT, REGEX, CHOICE and GRAMMAR requests, got {name}"
    )


def _base_classes() -> tuple[type, type]:
    from vllm.v1.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar

    return StructuredOutputBackend, StructuredOutputGrammar


_Backend, _Grammar = _base_classes()


class MaskplugGrammar(GuardedGrammar, _Grammar):  # type: ignore[misc,valid-type]
    """One request's grammar state, as vLLM's scheduler sees it.

    A grammar can fail: the producer reports it (:attr:`maskplug.DraftMasks.failed`),
    or its matcher raises inside one of the methods below. It then holds the
    :class:`~maskplug.GrammarError` in :attr:`error` and never calls its
    matcher again (:class:`maskplug.engines.sdk.GuardedGrammar`): its mask
    rows allow only the request's stop tokens, it validates no draft, and
    :meth:`accept_tokens` returns False, which makes vLLM's scheduler finish
    the request with ``FinishReason.ERROR``; the error text becomes the
    request's ``stop_reason`` (see :meth:`fail`). No exception from a
    matcher reaches vLLM's scheduler.

    Args:
        matcher: the request's maskplug matcher.
        spec: the grammar it matches.
        vocab: the vocabulary with the request's stop tokens (the stop-only
            row of a failed grammar); default: the matcher's own.
    """

    def __init__(self, matcher: Matcher, spec: GrammarSpec, vocab: Vocab | None = None) -> None:
        self.matcher = matcher
        self.spec = spec
        self.num_processed_tokens = 0
        self.vocab: Vocab | None = vocab if vocab is not None else getattr(matcher, "vocab", None)
        self.error: GrammarError | None = None
        self.request_id: str | None = None
        self._request: Callable[[], Any] | None = None
        # The emitted-token loop and the drafts' check, looked up once per matcher (accept_tokens and
        # validate_tokens run for every grammar request every step, between model steps, where each
        # Python call costs microseconds); kept with the matcher they serve, so a replaced
        # ``matcher`` gets its own.
        self._calls = _bound_calls(matcher)

    # -- failure -----------------------------------------------------------------
    @property
    def error_text(self) -> str | None:
        """What the request's output reports as its ``stop_reason`` once the grammar failed."""
        return None if self.error is None else f"{ERROR_PREFIX}{self.error}"

    def bind(self, request: Any) -> None:
        """Remember vLLM's ``Request`` this grammar serves (weakly), for its id and ``stop_reason``."""
        if self._request is None or self._request() is not request:
            try:
                self._request = weakref.ref(request)
            except TypeError:  # an object without weak references (vLLM's Request has them)
                self._request = lambda: request
            self.request_id = str(getattr(request, "request_id", self.request_id))

    def fail(self, error: BaseException, request_id: str | None = None) -> None:
        """Fail this grammar with ``error`` (a no-op once failed): logged once, naming the request.

        From then on the matcher is not called again; the request finishes
        with ``FinishReason.ERROR`` at its next emitted tokens, its
        ``stop_reason`` the error text.
        """
        if self.error is not None:
            return
        if request_id is not None:
            self.request_id = request_id
        super().fail(error)

    def _describe(self, text: str) -> str:
        return text if self.request_id is None else f"request {self.request_id!r}: {text}"

    def _failed_now(self, error: GrammarError) -> None:
        logger.error("maskplug: a grammar failed, its request finishes with an error: %s", error)
        self._report()

    def _report(self) -> None:
        req = self._request() if self._request is not None else None
        if req is not None and self.error is not None:
            req.stop_reason = self.error_text

    # -- vLLM's grammar interface ----------------------------------------------------
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by the emitted tokens; tokens after termination are ignored (vLLM's convention).

        False for a refused token (vLLM then finishes the request with an
        error) and for a failed grammar, whose error text becomes the
        request's ``stop_reason``.
        """
        if self.error is None:
            m = self.matcher
            try:
                # Called for every request every step: the SDK's loop skips the per-call id checks.
                calls = self._calls
                if calls[0] is not m:
                    calls = self._calls = _bound_calls(m)
                n = calls[1](tokens)
                self.num_processed_tokens += n
                if n < len(tokens) and not m.is_terminated():
                    logger.error("maskplug grammar for request %s refused emitted token %s", request_id, tokens[n])
                    return False
                return True
            except Exception as exc:
                self.request_id = request_id
                self._raised(exc, f"accepting emitted tokens {list(tokens)[:16]}")
        self._report()
        return False

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts, without advancing (none once failed or ended)."""
        if self.error is not None or not tokens:
            return []
        m = self.matcher
        try:
            # Called for every grammar request every step (vLLM's scheduler checks the next drafts).
            calls = self._calls
            if calls[0] is not m:
                calls = self._calls = _bound_calls(m)
            n = calls[2](tokens)
        except Exception as exc:
            self._raised(exc, "validating drafts")
            return []
        head = tokens[:n]  # a new list (vLLM's own grammars return a copy too)
        return head if head.__class__ is list else list(head)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (nothing once failed)."""
        if self.error is not None:
            return
        try:
            self.matcher.rollback(num_tokens)
        except Exception as exc:
            self._raised(exc, f"rolling back {num_tokens} tokens")
            return
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        """Write this state's allowed tokens into ``bitmask[batch_index]`` (the stop-only row once failed)."""
        self.fill_row(bitmask, batch_index)

    def reset(self) -> None:
        """Back to the start of the grammar (a failed grammar stays failed)."""
        if self.error is not None:
            return
        try:
            self.matcher.reset()
        except Exception as exc:
            self._raised(exc, "reset")
            return
        self.num_processed_tokens = 0


def _bound_calls(
    matcher: Matcher,
) -> tuple[Matcher, Callable[[Sequence[int]], int], Callable[[Sequence[int]], int]]:
    """``(matcher, its emitted-token acceptor, its drafts' validator)`` (see :mod:`maskplug.engines.sdk`)."""
    return matcher, emitted_acceptor(matcher), draft_validator(matcher)


def producer_matcher(grammar: Any) -> Any:
    """The matcher the mask-row producer gets for one request's grammar (a raising stand-in once it failed)."""
    if isinstance(grammar, MaskplugGrammar):
        return grammar.producer_matcher()
    return grammar.matcher


def bind_grammars(requests: Mapping[str, Any], request_ids: Sequence[str]) -> list[Any]:
    """The step's grammars in ``request_ids`` order, each maskplug grammar bound to its vLLM ``Request``."""
    out = []
    for r in request_ids:
        req = requests[r]
        g = req.structured_output_request.grammar
        if isinstance(g, MaskplugGrammar) and (g._request is None or g._request() is not req):
            g.bind(req)
        out.append(g)
    return out


def fail_requests(grammars: Sequence[Any], request_ids: Sequence[str], failed: Mapping[int, GrammarError]) -> None:
    """Fail the grammars the producer reported (``failed``: index in ``request_ids`` → error), each logged once."""
    for g, err in failed.items():
        gr = grammars[g]
        if isinstance(gr, MaskplugGrammar):
            gr.fail(err, request_ids[g])


class MaskplugBackend(_Backend):  # type: ignore[misc,valid-type]
    """vLLM structured-output backend that compiles with a maskplug grammar provider.

    Args:
        vllm_config, tokenizer, vocab_size: what vLLM passes to every backend.
        provider_name: the maskplug provider (see :func:`provider_for`).
    """

    def __init__(self, vllm_config: Any, tokenizer: Any, vocab_size: int, provider_name: str = AUTO) -> None:
        self.vllm_config = vllm_config
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.provider_name = provider_name
        self.vocab = vocab_from_tokenizer(tokenizer, self.vocab_size)
        self._lock = threading.Lock()
        self._providers: dict[tuple[int, ...], Any] = {}
        self.provider = self._provider(None)

    def _stop_key(self, stop_token_ids: Iterable[int] | None) -> tuple[int, ...]:
        key = tuple(sorted({int(t) for t in stop_token_ids})) if stop_token_ids else ()
        return () if key == tuple(sorted(self.vocab.eos_ids)) else key

    def _provider(self, stop_token_ids: Iterable[int] | None) -> Any:
        # vLLM hands each request its own stop set (EOS plus user stop ids),
        # allowed only where the grammar is complete; a provider is bound to
        # one stop set, so keep one per distinct set (normally just one).
        key = self._stop_key(stop_token_ids)
        with self._lock:
            prov = self._providers.get(key)
            if prov is None:
                vocab = (
                    self.vocab
                    if not key
                    else Vocab(self.vocab.tokens, key, self.vocab.special_ids, self.vocab.vocab_size)
                )
                prov = grammar_provider(self.provider_name, vocab)
                self._providers[key] = prov
        return prov

    def compile_grammar(
        self, request_type: Any, grammar_spec: str, stop_token_ids: set[int] | None = None
    ) -> MaskplugGrammar:
        """Compile (cached by the provider) and start a matcher for one request."""
        spec = self._spec(request_type, grammar_spec)
        provider = self._provider(stop_token_ids)
        compiled = provider.compile(spec)
        return MaskplugGrammar(compiled.matcher(), spec, provider.vocab)

    def compiled_grammar(
        self, request_type: Any, grammar_spec: str, stop_token_ids: Iterable[int] | None = None
    ) -> MaskplugGrammar | None:
        """:meth:`compile_grammar` when the spec was compiled before for this stop set, else ``None``.

        Nothing is compiled: the grammar comes from the provider's cache (a
        provider with a :class:`~maskplug.grammar.bases.CompileCache`, for a
        stop set seen before) and a matcher is started on it, which costs
        microseconds (see :func:`~maskplug_vllm.common.make_grammar_init`).
        """
        with self._lock:
            prov = self._providers.get(self._stop_key(stop_token_ids))
        cache = getattr(prov, "cache", None)
        if prov is None or not isinstance(cache, CompileCache):
            return None
        spec = self._spec(request_type, grammar_spec)
        compiled = cache.get(spec)
        if compiled is None:
            return None
        return MaskplugGrammar(compiled.matcher(), spec, prov.vocab)

    def _spec(self, request_type: Any, grammar_spec: str) -> GrammarSpec:
        """The maskplug spec of a request key, with the engine's whitespace options."""
        so = getattr(self.vllm_config, "structured_outputs_config", None)
        return spec_from_vllm(
            request_type,
            grammar_spec,
            disable_any_whitespace=bool(getattr(so, "disable_any_whitespace", False)),
            max_whitespace=max_whitespace_from_env(),
        )

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """A CPU int32 bitmask with ``max_num_seqs`` rows, all tokens allowed."""
        return self.vocab.new_bitmask(int(max_num_seqs))

    def destroy(self) -> None:
        """Drop the providers (their compile caches go with them)."""
        with self._lock:
            self._providers.clear()
