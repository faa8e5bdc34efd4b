"""The scheduler side: maskplug's grammar backend and producer against vLLM's own xgrammar path.

Same tokenizer, same schemas, same token histories and drafts: vLLM's
``XgrammarBackend`` grammars driven by vLLM's unmodified
``StructuredOutputManager.grammar_bitmask``, against maskplug's xgrammar
provider behind :class:`~maskplug_vllm.backend.MaskplugBackend` driven by the
patched producer (:func:`maskplug.fill_draft_masks`). The mask rows must be
identical bit for bit: that is what makes the engine's output token-for-token
the same. The two places where the producers deliberately differ are pinned
down in ``test_difference_*``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import tiny_model
import torch
from maskplug_vllm import patches
from maskplug_vllm import scheduler as mp_sched
from maskplug_vllm.backend import MaskplugBackend
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.structured_output.backend_types import StructuredOutputOptions
from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

from maskplug import PluginError

NUM_SPEC = 3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tiny_model.build(tmp_path_factory.mktemp("tiny"))
    return tiny_model.load_tokenizer(folder)


def _vllm_config() -> SimpleNamespace:
    return SimpleNamespace(
        structured_outputs_config=SimpleNamespace(disable_any_whitespace=False),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="llama"), is_diffusion=False),
        speculative_config=SimpleNamespace(num_speculative_tokens=NUM_SPEC),
        scheduler_config=SimpleNamespace(max_num_seqs=16),
        num_speculative_tokens=NUM_SPEC,
    )


def _manager(backend: Any) -> StructuredOutputManager:
    m = object.__new__(StructuredOutputManager)
    m.vllm_config = _vllm_config()
    m.backend = backend
    m._grammar_bitmask = None
    m._full_mask = torch.tensor(-1, dtype=torch.int32)
    m.fill_bitmask_parallel_threshold = 128
    m.enable_in_reasoning = False
    m.reasoner_cls = None
    return m


def _request(grammar: Any) -> SimpleNamespace:
    return SimpleNamespace(structured_output_request=SimpleNamespace(grammar=grammar, reasoning_ended=True))


def test_rows_identical_to_vllm_xgrammar_path(tokenizer: Any) -> None:
    vocab_size = tiny_model.VOCAB_SIZE
    theirs_backend = XgrammarBackend(_vllm_config(), tokenizer=tokenizer, vocab_size=vocab_size)
    ours_backend = MaskplugBackend(_vllm_config(), tokenizer, vocab_size, "xgrammar")
    theirs_mgr, ours_mgr = _manager(theirs_backend), _manager(ours_backend)
    ours_mgr_fill = mp_sched.make_grammar_bitmask(patches.original(StructuredOutputManager, "grammar_bitmask"))
    rng = np.random.default_rng(21)
    schemas = tiny_model.schema_texts()
    checked_rows = 0
    for step in range(150):
        # Histories never end the grammar (finished requests are not scheduled; see the
        # terminated-grammar difference below); drafts may.
        ids, theirs_req, ours_req, spec = tiny_model.random_requests(
            rng, step, tokenizer, theirs_backend, ours_backend, schemas, _request, NUM_SPEC
        )
        order = [ids[i] for i in rng.permutation(len(ids))]
        want = StructuredOutputManager.grammar_bitmask(theirs_mgr, theirs_req, order, spec).copy()
        got = ours_mgr_fill(ours_mgr, ours_req, order, spec).copy()
        assert got.shape == want.shape == (sum(1 + len(spec.get(r, ())) for r in order), (vocab_size + 31) // 32)
        assert np.array_equal(got, want)
        checked_rows += got.shape[0]
        # Both producers leave every grammar where it was: the next fill agrees too.
        again = ours_mgr_fill(ours_mgr, ours_req, order, spec).copy()
        assert np.array_equal(again, want)
    assert checked_rows > 300


def test_difference_rows_after_a_refused_draft(tokenizer: Any) -> None:
    """A draft the grammar refuses (vLLM's schedulers validate drafts first, so only an engine bug
    gets here): vLLM repeats the refused draft's row for the rest of the window; maskplug leaves those
    rows open, since advancing stopped and the verifier never accepts past the refused draft."""
    eos = {int(tokenizer.eos_token_id)}
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    theirs_backend = XgrammarBackend(_vllm_config(), tokenizer=tokenizer, vocab_size=tiny_model.VOCAB_SIZE)
    ours_backend = MaskplugBackend(_vllm_config(), tokenizer, tiny_model.VOCAB_SIZE, "xgrammar")
    bad = tokenizer.convert_tokens_to_ids("a")  # an object cannot start with a letter
    spec = {"r": [bad, bad, bad]}
    want = StructuredOutputManager.grammar_bitmask(
        _manager(theirs_backend),
        {"r": _request(theirs_backend.compile_grammar(StructuredOutputOptions.JSON, schema, eos))},
        ["r"],
        spec,
    ).copy()
    got = mp_sched.make_grammar_bitmask(patches.original(StructuredOutputManager, "grammar_bitmask"))(
        _manager(ours_backend),
        {"r": _request(ours_backend.compile_grammar(StructuredOutputOptions.JSON, schema, eos))},
        ["r"],
        spec,
    ).copy()
    assert np.array_equal(got[0], want[0])  # the refused draft's own row: the same constraint
    assert all(np.array_equal(want[p], want[0]) for p in range(1, 4))
    assert bool((got[1:] == -1).all())


def test_difference_terminated_grammar_rows(tokenizer: Any) -> None:
    """A grammar that already accepted its stop token: vLLM fills open rows for it; maskplug's
    terminated matcher allows only the stop tokens (a finished request emits nothing else)."""
    eos = int(tokenizer.eos_token_id)
    backend = MaskplugBackend(_vllm_config(), tokenizer, tiny_model.VOCAB_SIZE, "xgrammar")
    g = backend.compile_grammar(StructuredOutputOptions.REGEX, "ab", {eos})
    toks = tokenizer.encode("ab", add_special_tokens=False)
    assert g.accept_tokens("r", [*toks, eos]) and g.is_terminated()
    rows = mp_sched.make_grammar_bitmask(patches.original(StructuredOutputManager, "grammar_bitmask"))(
        _manager(backend), {"r": _request(g)}, ["r"], {}
    )
    assert tiny_model.allowed(rows[0], tiny_model.VOCAB_SIZE).tolist() == [eos]
    theirs_backend = XgrammarBackend(_vllm_config(), tokenizer=tokenizer, vocab_size=tiny_model.VOCAB_SIZE)
    t = theirs_backend.compile_grammar(StructuredOutputOptions.REGEX, "ab", {eos})
    assert t.accept_tokens("r", [*toks, eos]) and t.is_terminated()
    theirs = StructuredOutputManager.grammar_bitmask(_manager(theirs_backend), {"r": _request(t)}, ["r"], {})
    assert bool((theirs[0] == -1).all())


def test_difference_special_tokens_are_not_text(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM's xgrammar path builds its vocabulary with ``TokenizerInfo.from_huggingface``, which keeps
    special tokens other than the stop token (``<s>``, ``<unk>``) as literal text, so a JSON string
    may contain them (and detokenization later drops them). maskplug's vocabulary marks every special
    token as a control token that no grammar allows."""
    folder = tiny_model.build(tmp_path_factory.mktemp("specials"), specials=("<unk>", "<s>", "</s>"))
    tok = tiny_model.load_tokenizer(folder)
    eos = {int(tok.eos_token_id)}
    schema = json.dumps({"type": "string"})
    theirs = XgrammarBackend(_vllm_config(), tokenizer=tok, vocab_size=tiny_model.VOCAB_SIZE)
    ours = MaskplugBackend(_vllm_config(), tok, tiny_model.VOCAB_SIZE, "xgrammar")
    a = theirs.compile_grammar(StructuredOutputOptions.JSON, schema, eos)
    b = ours.compile_grammar(StructuredOutputOptions.JSON, schema, eos)
    quote = tok.encode('"', add_special_tokens=False)
    assert a.accept_tokens("r", quote) and b.accept_tokens("r", quote)
    x = torch.zeros(1, ours.vocab.mask_words, dtype=torch.int32)
    y = torch.zeros_like(x)
    a.fill_bitmask(x, 0)
    b.fill_bitmask(y, 0)
    in_string_theirs = set(tiny_model.allowed(x[0].numpy(), tiny_model.VOCAB_SIZE).tolist())
    in_string_ours = set(tiny_model.allowed(y[0].numpy(), tiny_model.VOCAB_SIZE).tolist())
    specials = {tok.convert_tokens_to_ids(t) for t in ("<unk>", "<s>")}
    assert specials <= in_string_theirs
    assert not specials & in_string_ours
    assert in_string_theirs - specials == in_string_ours


def test_grammar_interface_matches_vllm_xgrammar_grammar(tokenizer: Any) -> None:
    """accept/validate/rollback/termination through vLLM's grammar interface agree with vLLM's backend."""
    eos = int(tokenizer.eos_token_id)
    ours_b = MaskplugBackend(_vllm_config(), tokenizer, tiny_model.VOCAB_SIZE, "xgrammar")
    theirs_b = XgrammarBackend(_vllm_config(), tokenizer=tokenizer, vocab_size=tiny_model.VOCAB_SIZE)
    rng = np.random.default_rng(22)
    for kind, src in [
        (StructuredOutputOptions.REGEX, "[a-c]{2,4}"),
        (StructuredOutputOptions.JSON, tiny_model.schema_texts()[0]),
        (StructuredOutputOptions.CHOICE, json.dumps(["yes", "no"])),
    ]:
        ours = ours_b.compile_grammar(kind, src, {eos})
        history = tiny_model.walk(ours, rng, 12, len(tokenizer))
        ours.reset()
        theirs = theirs_b.compile_grammar(
            StructuredOutputOptions.GRAMMAR if kind == StructuredOutputOptions.CHOICE else kind,
            _choice_ebnf(src) if kind == StructuredOutputOptions.CHOICE else src,
            {eos},
        )
        probe = [*history, eos, 5]
        assert ours.validate_tokens(probe) == theirs.validate_tokens(probe)
        assert ours.accept_tokens("r", history) == theirs.accept_tokens("r", history)
        assert ours.is_terminated() == theirs.is_terminated()
        if history and not ours.is_terminated():
            ours.rollback(1)
            theirs.rollback(1)
            a = torch.zeros(1, ours_b.vocab.mask_words, dtype=torch.int32)
            b = torch.zeros_like(a)
            ours.fill_bitmask(a, 0)
            theirs.fill_bitmask(b, 0)
            assert torch.equal(a, b)


def _choice_ebnf(src: str) -> str:
    from vllm.v1.structured_output.utils import choice_as_grammar

    return choice_as_grammar(json.loads(src))


def test_unknown_provider_is_refused_with_the_registered_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from maskplug_vllm.backend import provider_for

    monkeypatch.setenv("MASKPLUG_VLLM_PROVIDER", "no-such-provider")
    with pytest.raises(PluginError, match=r"registered maskplug grammar providers \[.*'xgrammar'.*\]"):
        provider_for("xgrammar")
    monkeypatch.delenv("MASKPLUG_VLLM_PROVIDER")
    assert provider_for("xgrammar") == "xgrammar"
    # vLLM's "guidance" maps to maskplug's llguidance provider, which this environment lacks.
    with pytest.raises(PluginError, match=r"got 'llguidance'.*maskplug-llguidance"):
        provider_for("guidance")


def test_schemas_folder_holds_the_shared_schemas() -> None:
    assert len(tiny_model.schema_paths()) >= 10, tiny_model.SCHEMA_DIR
