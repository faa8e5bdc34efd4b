"""A request whose grammar was compiled before gets it at once, not through vLLM's compile pool.

vLLM 0.32's ``grammar_init`` hands every compile to a thread pool; the
request waits (the engine loop spinning on empty steps) until that thread
gets the GIL, even when the provider's cache already holds the grammar. The
0.32 wrapper serves such a request itself: the same grammar (a fresh matcher
on the cached one), the same rows; anything not compiled yet for the
request's spec and stop set goes vLLM's way.
"""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import tiny_model
from maskplug_vllm import scheduler as mp_sched
from maskplug_vllm import v0_33
from maskplug_vllm.backend import MaskplugBackend, MaskplugGrammar
from vllm.v1.structured_output.backend_types import StructuredOutputOptions


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_model.load_tokenizer(tiny_model.build(tmp_path_factory.mktemp("tiny")))


def _manager(tokenizer: Any) -> SimpleNamespace:
    config = SimpleNamespace(
        structured_outputs_config=SimpleNamespace(disable_any_whitespace=False),
        model_config=SimpleNamespace(get_vocab_size=lambda: tiny_model.VOCAB_SIZE),
    )
    return SimpleNamespace(backend=None, vllm_config=config, tokenizer=tokenizer)


def _request(kind: Any, spec: str, stop: set[int]) -> SimpleNamespace:
    return SimpleNamespace(
        structured_output_request=SimpleNamespace(grammar=None, structured_output_key=(kind, spec)),
        sampling_params=SimpleNamespace(
            structured_outputs=SimpleNamespace(_backend="xgrammar", _backend_was_auto=False),
            all_stop_token_ids=stop,
        ),
    )


def _rows(grammar: Any, tokens: list[int], backend: MaskplugBackend) -> list[list[int]]:
    """The grammar's first row, then its row after each token (it must accept them)."""
    out = []
    bitmask = backend.allocate_token_bitmask(1)
    for t in [None, *tokens]:
        if t is not None:
            assert grammar.accept_tokens("r", [t])
        grammar.fill_bitmask(bitmask, 0)
        out.append(bitmask[0].tolist())
    return out


def test_a_grammar_compiled_before_is_ready_at_once(tokenizer: Any) -> None:
    vllm_calls: list[Any] = []
    init = mp_sched.make_grammar_init(lambda self, request: vllm_calls.append(request))
    m = _manager(tokenizer)
    eos = set(tokenizer.eos_token_id if isinstance(tokenizer.eos_token_id, list) else [tokenizer.eos_token_id])
    # A schema no other test compiles: providers, and their caches, are shared within the process.
    schema = json.dumps({"type": "object", "properties": {f"k{uuid.uuid4().hex}": {"type": "integer"}}})

    # Not compiled yet: vLLM's own path (its pool compiles it; here the test does).
    first = _request(StructuredOutputOptions.JSON, schema, eos)
    init(m, first)
    assert vllm_calls == [first] and first.structured_output_request.grammar is None
    backend = m.backend
    assert isinstance(backend, MaskplugBackend)
    theirs = backend.compile_grammar(StructuredOutputOptions.JSON, schema, stop_token_ids=eos)
    hits = backend.provider.cache.hits

    # Compiled: ready at once, a matcher of its own on the cached grammar, counted as a cache hit.
    again = _request(StructuredOutputOptions.JSON, schema, eos)
    init(m, again)
    ours = again.structured_output_request.grammar
    assert vllm_calls == [first] and isinstance(ours, MaskplugGrammar)
    assert ours.matcher is not theirs.matcher and backend.provider.cache.hits == hits + 1
    text = tokenizer.encode('{"', add_special_tokens=False)
    assert _rows(ours, text, backend) == _rows(theirs, text, backend)

    # Another spec, another stop set (a provider of its own, nothing compiled for it) or a request
    # without a readable key: vLLM's path, which compiles or reports.
    other_spec = _request(StructuredOutputOptions.REGEX, f"{uuid.uuid4().hex}[a-c]+", eos)
    other_stop = _request(StructuredOutputOptions.JSON, schema, eos | {5})
    keyless = SimpleNamespace(structured_output_request=SimpleNamespace(), sampling_params=first.sampling_params)
    for r in (other_spec, other_stop, keyless):
        init(m, r)
    assert vllm_calls == [first, other_spec, other_stop, keyless]
    assert other_spec.structured_output_request.grammar is None and other_stop.structured_output_request.grammar is None


def test_vllm_033s_wrapper_leaves_every_compile_to_vllm(tokenizer: Any) -> None:
    """Only the 0.32 wrapper takes the cached grammar: 0.33's own ``grammar_init`` is kept whole."""
    vllm_calls: list[Any] = []
    init = v0_33.make_grammar_init(lambda self, request: vllm_calls.append(request))
    m = _manager(tokenizer)
    regex = f"{uuid.uuid4().hex}[a-c]+"
    r = _request(StructuredOutputOptions.REGEX, regex, set())
    init(m, r)
    m.backend.compile_grammar(StructuredOutputOptions.REGEX, regex)
    again = _request(StructuredOutputOptions.REGEX, regex, set())
    init(m, again)
    assert vllm_calls == [r, again] and again.structured_output_request.grammar is None
