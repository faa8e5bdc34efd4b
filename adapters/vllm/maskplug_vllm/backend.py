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
from collections.abc import Iterable
from typing import Any

import torch

from maskplug import GrammarError, PluginError
from maskplug.grammar import GrammarSpec, Matcher, Vocab, grammar_provider, grammar_providers
from maskplug.grammar.vocabs import vocab_from_hf_tokenizer

__all__ = ["MaskplugBackend", "MaskplugGrammar", "provider_for", "spec_from_vllm", "vocab_from_tokenizer"]

logger = logging.getLogger(__name__)

# vLLM's backend names and the maskplug provider that does the same job.
_VLLM_TO_PROVIDER = {"xgrammar": "xgrammar", "guidance": "llguidance", "outlines": "outlines-core"}


def provider_for(vllm_backend: str | None) -> str:
    """The maskplug provider for a vLLM backend name; ``MASKPLUG_VLLM_PROVIDER`` overrides it."""
    chosen = os.environ.get("MASKPLUG_VLLM_PROVIDER", "").strip()
    if not chosen:
        chosen = _VLLM_TO_PROVIDER.get(vllm_backend or "", "xgrammar")
    names = grammar_providers()
    if chosen not in names:
        raise PluginError(
            f"MASKPLUG_VLLM_PROVIDER: expected one of the registered maskplug grammar providers {names}, "
            f"got {chosen!r} (vLLM backend {vllm_backend!r}); install its distribution, e.g. maskplug-{chosen}"
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


def spec_from_vllm(request_type: Any, grammar_spec: str) -> GrammarSpec:
    """Translate vLLM's ``(StructuredOutputOptions, str)`` request key into a :class:`GrammarSpec`."""
    name = getattr(request_type, "name", str(request_type))
    if name == "JSON":
        return GrammarSpec("json_schema", grammar_spec)
    if name == "JSON_OBJECT":
        return GrammarSpec("json_object", None)
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


class MaskplugGrammar(_Grammar):  # type: ignore[misc,valid-type]
    """One request's grammar state, as vLLM's scheduler sees it."""

    def __init__(self, matcher: Matcher, spec: GrammarSpec) -> None:
        self.matcher = matcher
        self.spec = spec
        self.num_processed_tokens = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance by the emitted tokens; tokens after termination are ignored (vLLM's convention)."""
        for t in tokens:
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept(int(t)):
                logger.error("maskplug grammar for request %s refused emitted token %s", request_id, t)
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts, without advancing."""
        if self.matcher.is_terminated() or not tokens:
            return []
        return list(tokens[: self.matcher.validate(tokens)])

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, batch_index: int) -> None:
        """Write this state's allowed tokens into ``bitmask[batch_index]``."""
        self.matcher.fill(bitmask, batch_index)

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted."""
        return bool(self.matcher.is_terminated())

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self.matcher.reset()
        self.num_processed_tokens = 0


class MaskplugBackend(_Backend):  # type: ignore[misc,valid-type]
    """vLLM structured-output backend that compiles with a maskplug grammar provider.

    Args:
        vllm_config, tokenizer, vocab_size: what vLLM passes to every backend.
        provider_name: the maskplug provider (see :func:`provider_for`).
    """

    def __init__(self, vllm_config: Any, tokenizer: Any, vocab_size: int, provider_name: str = "xgrammar") -> None:
        self.vllm_config = vllm_config
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.provider_name = provider_name
        self.vocab = vocab_from_tokenizer(tokenizer, self.vocab_size)
        self._lock = threading.Lock()
        self._providers: dict[tuple[int, ...], Any] = {}
        self.provider = self._provider(None)

    def _provider(self, stop_token_ids: Iterable[int] | None) -> Any:
        # vLLM hands each request its own stop set (EOS plus user stop ids),
        # allowed only where the grammar is complete; a provider is bound to
        # one stop set, so keep one per distinct set (normally just one).
        key = tuple(sorted({int(t) for t in stop_token_ids})) if stop_token_ids else ()
        if key == tuple(sorted(self.vocab.eos_ids)):
            key = ()
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
        spec = spec_from_vllm(request_type, grammar_spec)
        compiled = self._provider(stop_token_ids).compile(spec)
        return MaskplugGrammar(compiled.matcher(), spec)

    def allocate_token_bitmask(self, max_num_seqs: int) -> torch.Tensor:
        """A CPU int32 bitmask with ``max_num_seqs`` rows, all tokens allowed."""
        return self.vocab.new_bitmask(int(max_num_seqs))

    def destroy(self) -> None:
        """Drop the providers (their compile caches go with them)."""
        with self._lock:
            self._providers.clear()
