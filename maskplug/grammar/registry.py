"""Looking up registered grammar providers, one instance per provider and vocabulary.

Among the registered providers is the built-in ``"auto"``
(:class:`maskplug.grammar.auto.AutoProvider`, registered by its module as a
plugin), which compiles each spec with the registered provider best suited to it.
"""

from __future__ import annotations

import threading

from ..errors import GrammarError
from ..plugins import get_registry
from .protocols import GrammarProvider
from .spec import Vocab

__all__ = ["AUTO", "clear_provider_cache", "grammar_provider", "grammar_providers"]

#: The name of the provider that picks a registered provider per spec.
AUTO = "auto"

# (registry generation, provider name, vocabulary fingerprint) -> the provider bound to that vocabulary.
# A fresh registry (maskplug.reset_registry) has a new generation: the providers made by the old
# factories are never served again, and the first provider of the new one drops them.
_providers: dict[tuple[int, str, str], GrammarProvider] = {}
_lock = threading.Lock()


def grammar_providers() -> list[str]:
    """Names of the registered grammar providers (the built-in ``"auto"`` among them)."""
    return sorted(get_registry().grammar_providers)


def grammar_provider(name: str, vocab: Vocab) -> GrammarProvider:
    """The provider ``name`` bound to ``vocab`` (one instance per vocabulary, so its compile cache is shared)."""
    if not isinstance(vocab, Vocab):
        raise GrammarError(f"vocab: expected a maskplug Vocab, got {type(vocab).__name__}")
    if not isinstance(name, str):
        raise GrammarError(f"name: expected a provider name (str), got {type(name).__name__}")
    registry = get_registry()
    factories = registry.grammar_providers
    if name not in factories:
        raise GrammarError(f"name: expected one of the registered providers {sorted(factories)}, got {name!r}")
    key = (registry.generation, name, vocab.fingerprint)
    prov = _providers.get(key)
    if prov is None:
        made = factories[name](vocab)
        with _lock:
            for old in [k for k in _providers if k[0] != registry.generation]:
                del _providers[old]
            prov = _providers.setdefault(key, made)
    return prov


def clear_provider_cache() -> None:
    """Forget every provider instance (the next :func:`grammar_provider` call for each makes a new one).

    Not needed after :func:`maskplug.reset_registry`: instances are kept per registry.
    """
    with _lock:
        _providers.clear()
