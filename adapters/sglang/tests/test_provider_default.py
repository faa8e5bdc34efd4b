"""Which maskplug provider serves SGLang's ``--grammar-backend maskplug``: ``auto`` unless one is named."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import BPE_VOCAB_SIZE

from maskplug import PluginError
from maskplug.grammar import grammar_providers


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASKPLUG_SGLANG_PROVIDER", raising=False)


def _backend(tokenizer: Any, **kw: Any) -> Any:
    from maskplug_sglang.backend import MaskplugGrammarBackend

    return MaskplugGrammarBackend(tokenizer, BPE_VOCAB_SIZE, {tokenizer.eos_token_id}, **kw)


def test_auto_is_the_default_provider(bpe_tokenizer: Any) -> None:
    from maskplug_sglang.backend import DEFAULT_PROVIDER, MaskplugGrammar

    assert DEFAULT_PROVIDER == "auto"
    backend = _backend(bpe_tokenizer)
    assert backend.provider.name == "auto"
    grammar = backend.dispatch_regex("[0-9]{1,4}")
    assert isinstance(grammar, MaskplugGrammar)
    assert grammar.compiled.served_by in grammar_providers()
    # The grammar holds: digits are allowed first, letters are not.
    mask = grammar.allocate_vocab_mask(BPE_VOCAB_SIZE, 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    digit, letter = (bpe_tokenizer.convert_tokens_to_ids(t) for t in ("7", "a"))
    row = mask[0].tolist()
    assert (row[digit >> 5] >> (digit & 31)) & 1 and not (row[letter >> 5] >> (letter & 31)) & 1


def test_a_named_provider_still_pins(bpe_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _backend(bpe_tokenizer, provider="xgrammar").provider.name == "xgrammar"
    monkeypatch.setenv("MASKPLUG_SGLANG_PROVIDER", "xgrammar")
    assert _backend(bpe_tokenizer).provider.name == "xgrammar"
    assert _backend(bpe_tokenizer, provider="auto").provider.name == "auto"  # the argument wins over the variable
    monkeypatch.setenv("MASKPLUG_SGLANG_PROVIDER", "no-such-provider")
    with pytest.raises(PluginError, match=r"provider: expected one of the installed maskplug grammar providers"):
        _backend(bpe_tokenizer)
