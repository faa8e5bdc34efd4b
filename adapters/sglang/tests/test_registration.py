"""Registration through SGLang's own plugin loader, registry and command line.

SGLang's plugin loading is once per process, so each scenario runs in a fresh
interpreter: SGLang's ``load_plugins()`` (what ``sglang serve`` and the engine
call first), then its argument parser, then its ``create_grammar_backend``.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

SCRIPT = textwrap.dedent(
    """
    import argparse, json, sys, types
    from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES
    from sglang.srt.constrained import base_grammar_backend as base
    out = {"before": "maskplug" in base.GRAMMAR_BACKEND_REGISTRY or "maskplug" in GRAMMAR_BACKEND_CHOICES}
    from sglang.srt.plugins import load_plugins
    load_plugins()
    out["registered"] = "maskplug" in base.GRAMMAR_BACKEND_REGISTRY
    out["choice"] = "maskplug" in GRAMMAR_BACKEND_CHOICES
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    try:
        args = parser.parse_args(["--model-path", "unused", "--grammar-backend", "maskplug"])
        out["parsed"] = args.grammar_backend
    except SystemExit:
        out["parsed"] = None
    if out["registered"]:
        sys.path.insert(0, sys.argv[2])
        from conftest import load_hf_tokenizer
        tok = load_hf_tokenizer(sys.argv[1])
        # create_grammar_backend reads the chosen name from SGLang's runtime
        # context, which a full server publishes; only that one leaf is provided.
        base.get_exec = lambda: types.SimpleNamespace(kernel=types.SimpleNamespace(grammar_backend="maskplug"))
        backend = base.create_grammar_backend(args, tok, 832, {tok.eos_token_id})
        out["backend"] = type(backend).__module__ + "." + type(backend).__name__
        grammar = backend._init_value_dispatch(("json", '{"type": "integer"}'), False)
        mask = grammar.allocate_vocab_mask(832, 1, "cpu")
        grammar.fill_vocab_mask(mask, 0)
        digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
        out["digits_allowed"] = all(int(mask[0][t >> 5]) >> (t & 31) & 1 for t in digits)
        out["letter_allowed"] = bool(int(mask[0][tok.convert_tokens_to_ids("a") >> 5]) >> (tok.convert_tokens_to_ids("a") & 31) & 1)
    print("RESULT " + json.dumps(out))
    """
)


def _run(env_extra: dict[str, str], tokenizer_file: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(env_extra)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tokenizer_file), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]


def test_entry_point_is_declared_for_sglangs_plugin_group() -> None:
    eps = [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "maskplug"]
    assert len(eps) == 1
    assert eps[0].value == "maskplug_sglang.plugin:register"
    assert eps[0].dist is not None and eps[0].dist.name == "maskplug-sglang"


def test_sglang_loads_the_plugin_and_selects_the_backend(bpe_tokenizer_file: Path) -> None:
    out = _run({"SGLANG_PLUGINS": "maskplug"}, bpe_tokenizer_file)
    # Installing alone changes nothing until SGLang loads its plugins.
    assert out["before"] is False
    assert out["registered"] and out["choice"]
    assert out["parsed"] == "maskplug"
    assert out["backend"] == "maskplug_sglang.backend.MaskplugGrammarBackend"
    assert out["digits_allowed"] and not out["letter_allowed"]


def test_sglang_plugin_allow_list_can_leave_it_out(bpe_tokenizer_file: Path) -> None:
    out = _run({"SGLANG_PLUGINS": "some-other-plugin"}, bpe_tokenizer_file)
    assert not out["registered"] and not out["choice"]
    assert out["parsed"] is None  # argparse refuses the unknown choice


def test_unknown_provider_is_a_clear_plugin_error(bpe_tokenizer: Any) -> None:
    from maskplug_sglang.backend import MaskplugGrammarBackend

    from maskplug import PluginError

    with pytest.raises(PluginError, match=r"provider: expected one of the installed maskplug grammar providers"):
        MaskplugGrammarBackend(bpe_tokenizer, 832, {bpe_tokenizer.eos_token_id}, provider="no-such-provider")


def test_vocab_from_the_sglang_tokenizer(bpe_tokenizer: Any) -> None:
    """The vocabulary read from SGLang's tokenizer matches what the tokenizer decodes."""
    from maskplug_sglang.vocab import vocab_from_tokenizer

    v = vocab_from_tokenizer(bpe_tokenizer, 832, {bpe_tokenizer.eos_token_id})
    assert v.vocab_size == 832 and v.eos_ids == (bpe_tokenizer.eos_token_id,)
    assert len(v.tokens) == len(bpe_tokenizer)
    assert {bpe_tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "<pad>")} <= v.special_ids
    text = '{"street": "Main St 12", "zip": "04109"}\n'
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(v.tokens[i] for i in ids).decode() == text
    # The model's stop tokens win over the tokenizer's, as in SGLang's xgrammar backend.
    v2 = vocab_from_tokenizer(bpe_tokenizer, 832, {2})
    assert v2.eos_ids == (2,)


def test_vocab_refuses_an_unreadable_tokenizer() -> None:
    from maskplug_sglang.vocab import vocab_from_tokenizer

    from maskplug import GrammarError

    with pytest.raises(GrammarError, match="tokenizer: expected a Hugging Face fast tokenizer"):
        vocab_from_tokenizer(object(), 100, {0})
