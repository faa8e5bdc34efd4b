"""SGLang's ``constrained_json_disable_any_whitespace`` and maskplug's whitespace bound on JSON grammars."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from conftest import BPE_VOCAB_SIZE

from maskplug.errors import GrammarError
from maskplug.grammar.spec import DEFAULT_MAX_WHITESPACE

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


def _accepts(backend: Any, tokenizer: Any, text: str) -> bool:
    grammar = backend.dispatch_json(SCHEMA)
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    return all(grammar.matcher.accept(t) for t in ids)


def test_the_factory_reads_sglangs_flag(bpe_tokenizer: Any) -> None:
    from maskplug_sglang.backend import create_backend

    for compact in (False, True):
        args = SimpleNamespace(constrained_json_disable_any_whitespace=compact)
        backend = create_backend(args, bpe_tokenizer, BPE_VOCAB_SIZE, {bpe_tokenizer.eos_token_id})
        assert backend.json_options == {
            "whitespace": "compact" if compact else "flexible",
            "max_whitespace": DEFAULT_MAX_WHITESPACE,
        }
    # Older SGLang releases have no such flag: flexible, bounded.
    backend = create_backend(SimpleNamespace(), bpe_tokenizer, BPE_VOCAB_SIZE, {bpe_tokenizer.eos_token_id})
    assert backend.json_options["whitespace"] == "flexible"


def test_json_grammars_carry_the_options(bpe_tokenizer: Any) -> None:
    from maskplug_sglang.backend import MaskplugGrammarBackend

    eos = {bpe_tokenizer.eos_token_id}
    for compact in (False, True):
        backend = MaskplugGrammarBackend(
            bpe_tokenizer, BPE_VOCAB_SIZE, eos, provider="xgrammar", disable_any_whitespace=compact
        )
        assert backend.dispatch_json(SCHEMA).compiled.spec.whitespace == ("compact" if compact else "flexible")
        assert backend.dispatch_json("$$ANY$$").compiled.spec.max_whitespace == DEFAULT_MAX_WHITESPACE
        assert _accepts(backend, bpe_tokenizer, '{"a":1}')
        assert _accepts(backend, bpe_tokenizer, '{"a": 1}') is not compact
        assert not _accepts(backend, bpe_tokenizer, '{"a":' + " " * (DEFAULT_MAX_WHITESPACE + 1) + "1}")
    bounded = MaskplugGrammarBackend(bpe_tokenizer, BPE_VOCAB_SIZE, eos, provider="xgrammar", max_whitespace=2)
    assert _accepts(bounded, bpe_tokenizer, '{"a":  1}')
    assert not _accepts(bounded, bpe_tokenizer, '{"a":   1}')


def test_a_bad_bound_is_refused_by_name(bpe_tokenizer: Any) -> None:
    from maskplug_sglang.backend import MaskplugGrammarBackend

    with pytest.raises(GrammarError, match="max_whitespace"):
        MaskplugGrammarBackend(bpe_tokenizer, BPE_VOCAB_SIZE, {bpe_tokenizer.eos_token_id}, max_whitespace=-1)
