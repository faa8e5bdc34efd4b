"""Which maskplug provider serves vLLM's structured outputs: ``auto`` unless vLLM's config pins a backend.

vLLM's own default backend is ``"auto"``: vLLM resolves it per request (to
``xgrammar``, ``guidance`` or ``outlines``) and marks the request
``_backend_was_auto``. The adapter then serves with maskplug's ``auto``
provider, which picks a provider per grammar; an explicit backend name pins
the matching provider; ``MASKPLUG_VLLM_PROVIDER`` overrides both.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import tiny_model
from maskplug_vllm import scheduler as mp_sched
from maskplug_vllm import v0_33
from maskplug_vllm.backend import MaskplugBackend, provider_for
from vllm.config import StructuredOutputsConfig
from vllm.v1.structured_output.backend_types import StructuredOutputOptions

from maskplug import PluginError
from maskplug.grammar import grammar_providers


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASKPLUG_VLLM_PROVIDER", raising=False)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_model.load_tokenizer(tiny_model.build(tmp_path_factory.mktemp("tiny")))


def test_vllms_own_default_backend_is_auto() -> None:
    assert StructuredOutputsConfig().backend == "auto"


def test_unpinned_backends_map_to_auto() -> None:
    assert provider_for("auto") == "auto"
    assert provider_for(None) == "auto"
    assert provider_for("lm-format-enforcer") == "auto"  # no maskplug counterpart
    # vLLM resolved "auto" itself for this request: the name it chose pins nothing.
    for resolved in ("xgrammar", "guidance", "outlines"):
        assert provider_for(resolved, was_auto=True) == "auto"


def test_explicit_backends_still_pin_their_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    assert provider_for("xgrammar") == "xgrammar"
    for name, provider in (("guidance", "llguidance"), ("outlines", "outlines-core")):
        if provider in grammar_providers():
            assert provider_for(name) == provider
        else:  # not installed beside this vLLM: refused by name, not replaced by another provider
            with pytest.raises(PluginError, match=rf"got {provider!r}"):
                provider_for(name)


def test_the_environment_overrides_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASKPLUG_VLLM_PROVIDER", "xgrammar")
    assert provider_for("auto") == "xgrammar" and provider_for("guidance", was_auto=True) == "xgrammar"
    monkeypatch.setenv("MASKPLUG_VLLM_PROVIDER", "auto")
    assert provider_for("xgrammar") == "auto"
    monkeypatch.setenv("MASKPLUG_VLLM_PROVIDER", "no-such-provider")
    with pytest.raises(PluginError, match=r"expected 'auto' or one of the registered maskplug grammar providers"):
        provider_for("auto")


def test_the_backend_serves_with_auto_by_default(tokenizer: Any) -> None:
    config = SimpleNamespace(structured_outputs_config=SimpleNamespace(disable_any_whitespace=False))
    backend = MaskplugBackend(config, tokenizer, tiny_model.VOCAB_SIZE)
    assert backend.provider_name == "auto" and backend.provider.name == "auto"
    schema = tiny_model.schema_texts()[0]
    grammar = backend.compile_grammar(StructuredOutputOptions.JSON, schema)
    (compiled,) = backend.provider.cache._items.values()
    assert compiled.served_by in grammar_providers()
    # The grammar works as the pinned provider's does: the same first row.
    pinned = MaskplugBackend(config, tokenizer, tiny_model.VOCAB_SIZE, compiled.served_by)
    theirs = pinned.compile_grammar(StructuredOutputOptions.JSON, schema)
    a, b = backend.allocate_token_bitmask(1), pinned.allocate_token_bitmask(1)
    grammar.fill_bitmask(a, 0)
    theirs.fill_bitmask(b, 0)
    assert a.equal(b) and not bool((a == -1).all())


@pytest.mark.parametrize("module", [mp_sched, v0_33], ids=["vllm-0.32", "vllm-0.33"])
@pytest.mark.parametrize(
    ("resolved", "was_auto", "want"), [("xgrammar", True, "auto"), ("xgrammar", False, "xgrammar")]
)
def test_grammar_init_asks_for_auto_when_vllm_chose_the_backend(
    module: Any, resolved: str, was_auto: bool, want: str, tokenizer: Any
) -> None:
    seen: list[Any] = []
    init = module.make_grammar_init(lambda self, request: seen.append(self.backend))
    config = SimpleNamespace(
        structured_outputs_config=SimpleNamespace(disable_any_whitespace=False),
        model_config=SimpleNamespace(get_vocab_size=lambda: tiny_model.VOCAB_SIZE),
    )
    manager = SimpleNamespace(backend=None, vllm_config=config, tokenizer=tokenizer)
    structured = SimpleNamespace(_backend=resolved, _backend_was_auto=was_auto)
    request = SimpleNamespace(
        structured_output_request=SimpleNamespace(), sampling_params=SimpleNamespace(structured_outputs=structured)
    )
    init(manager, request)
    assert isinstance(manager.backend, MaskplugBackend) and manager.backend.provider_name == want
    assert seen == [manager.backend]


def _run(model: Path, out: Path, enabled: bool, backend: str) -> dict[str, Any]:
    env = {"MASKPLUG_VLLM": "1"} if enabled else {}
    return tiny_model.run_script("engine_run.py", model, out, "--backend", backend, env=env)


def test_engine_with_vllms_default_config_is_served_by_auto(tmp_path: Path) -> None:
    """vLLM's engine with its default structured-output config: maskplug's auto serves every grammar.

    Here only xgrammar is installed beside vLLM, so auto compiles every grammar with it and the
    outputs are token for token those of vLLM's own path on the same config (which resolves to xgrammar).
    """
    model = tiny_model.build(tmp_path / "model")
    ours = _run(model, tmp_path / "maskplug.json", True, "auto")
    theirs = _run(model, tmp_path / "vllm.json", False, "auto")
    assert ours["runner"]["backend_is_maskplug"] and ours["runner"]["runner_apply_is_maskplug"]
    assert ours["runner"]["provider"] == {"name": "auto", "served_by": ["xgrammar"]}
    assert ours["counts"]["fill_calls"] > 0 and ours["counts"]["draft_rows"] > 0
    schemas = {p.stem: json.loads(p.read_text()) for p in tiny_model.schema_paths()}
    mine, vllm = ours["sets"]["greedy"], theirs["sets"]["greedy"]
    assert [o["token_ids"] for o in mine] == [o["token_ids"] for o in vllm]
    finished = [o for o in mine if o["finish_reason"] == "stop"]
    assert finished
    for o in finished:
        jsonschema.validate(tiny_model.xgrammar_json(o["text"]), schemas[o["schema"]])
