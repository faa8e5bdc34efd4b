"""vLLM's ``disable_any_whitespace`` and maskplug's whitespace bound on the JSON grammars the backend compiles."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import tiny_model
from maskplug_vllm.backend import MaskplugBackend, spec_from_vllm
from vllm.v1.structured_output.backend_types import StructuredOutputOptions

from maskplug.errors import GrammarError
from maskplug.grammar import grammar_providers
from maskplug.grammar.spec import DEFAULT_MAX_WHITESPACE

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_model.load_tokenizer(tiny_model.build(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("kind", [StructuredOutputOptions.JSON, StructuredOutputOptions.JSON_OBJECT])
def test_spec_from_vllm_maps_whitespace(kind: Any) -> None:
    flexible = spec_from_vllm(kind, SCHEMA)
    assert flexible.whitespace == "flexible" and flexible.max_whitespace == DEFAULT_MAX_WHITESPACE
    compact = spec_from_vllm(kind, SCHEMA, disable_any_whitespace=True)
    assert compact.whitespace == "compact"
    assert spec_from_vllm(kind, SCHEMA, max_whitespace=3).max_whitespace == 3
    assert spec_from_vllm(kind, SCHEMA, max_whitespace=None).max_whitespace is None
    with pytest.raises(GrammarError, match="max_whitespace"):
        spec_from_vllm(kind, SCHEMA, max_whitespace=-1)


def test_non_json_kinds_keep_their_defaults() -> None:
    spec = spec_from_vllm(StructuredOutputOptions.REGEX, "[a-z]+", disable_any_whitespace=True)
    assert spec.kind == "regex" and spec.whitespace == "flexible"


def _accepts(backend: MaskplugBackend, text: str) -> bool:
    grammar = backend.compile_grammar(StructuredOutputOptions.JSON, SCHEMA)
    ids = [*backend.tokenizer.encode(text, add_special_tokens=False), backend.vocab.eos_ids[0]]
    return bool(grammar.accept_tokens("r", ids))


# The providers with a bounded flexible whitespace that this environment has installed.
BOUNDED = [p for p in ("xgrammar", "llguidance") if p in grammar_providers()]


@pytest.mark.parametrize("provider", BOUNDED)
def test_the_backend_reads_disable_any_whitespace(tokenizer: Any, provider: str) -> None:
    for compact in (False, True):
        config = SimpleNamespace(structured_outputs_config=SimpleNamespace(disable_any_whitespace=compact))
        backend = MaskplugBackend(config, tokenizer, tiny_model.VOCAB_SIZE, provider)
        assert _accepts(backend, '{"a":1}')
        assert _accepts(backend, '{"a": 1}') is not compact
        # The bound: a run of whitespace past DEFAULT_MAX_WHITESPACE is refused under flexible whitespace too.
        assert not _accepts(backend, '{"a":' + " " * (DEFAULT_MAX_WHITESPACE + 1) + "1}")
        assert _accepts(backend, '{"a":' + " " * DEFAULT_MAX_WHITESPACE + "1}") is not compact
