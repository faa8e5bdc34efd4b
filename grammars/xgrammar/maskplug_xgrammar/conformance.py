"""xgrammar driven through its own API, for ``maskplug conformance`` (the engine path).

As serving integrations hand a tiktoken vocabulary to xgrammar: a
``TokenizerInfo`` of raw bytes per id (the control ids empty), a
``GrammarCompiler`` without its cache, and a ``GrammarMatcher`` whose bitmask
is filled before every token, as serving does before sampling. The
:class:`maskplug.GrammarSpec` options map to xgrammar's settings as the
provider maps them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr

from maskplug.grammar.sdk import GrammarSpec, Vocab

from .provider import capture_stderr

__all__ = ["XGrammarDriver"]


class XGrammarDriver:
    """xgrammar over ``vocab``'s tokenizer (``encoding``: its tiktoken encoding, ranks from ``maskplug_offset``)."""

    #: xgrammar compiles the schema itself.
    shares_compile = False

    def __init__(self, vocab: Vocab, encoding: Any) -> None:
        off = int(encoding.maskplug_offset)
        encoded = [b""] * off + [encoding.decode_single_token_bytes(r) for r in range(vocab.vocab_size - off)]
        self.eos = vocab.eos_ids[0]
        self.info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.RAW, vocab_size=vocab.vocab_size, stop_token_ids=[self.eos]
        )
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)

    def compile(self, spec: GrammarSpec, grammar: Any) -> Any:
        """xgrammar's compiled grammar for the JSON schema of ``spec`` (``grammar``, maskplug's, is not used)."""
        ws: dict[str, Any] = {"any_whitespace": spec.whitespace != "compact"}
        if spec.whitespace == "compact":
            ws["separators"] = (",", ":")
        with capture_stderr():  # xgrammar's warnings are counted on maskplug's path; keep the console clean
            return self.compiler.compile_json_schema(json.dumps(spec.source), strict_mode=spec.strict_keys, **ws)

    def feed(self, compiled: Any, ids: Sequence[int]) -> bool:
        """Whether a fresh ``GrammarMatcher`` takes ``ids`` and then the stop token."""
        m = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.info.vocab_size)
        for t in [*ids, self.eos]:
            m.fill_next_token_bitmask(bitmask, 0)  # as serving does before sampling each token
            if not m.accept_token(int(t)):
                return False
        return True
