"""maskplug-sglang: maskplug as an SGLang grammar backend.

Install it beside SGLang and start the server with ``--grammar-backend
maskplug``; ``MASKPLUG_SGLANG_PROVIDER`` picks the maskplug grammar provider
(default ``xgrammar``). Installing alone changes nothing in SGLang.

The backend classes are imported lazily, so importing this package (as SGLang
does at start-up, through the entry point) stays cheap.
"""

from __future__ import annotations

from typing import Any

from .plugin import BACKEND_NAME, TESTED_SGLANG, register

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAME",
    "TESTED_SGLANG",
    "MaskplugGrammar",
    "MaskplugGrammarBackend",
    "TokenRejected",
    "__version__",
    "register",
    "vocab_from_tokenizer",
]

_LAZY = {
    "MaskplugGrammar": "backend",
    "MaskplugGrammarBackend": "backend",
    "TokenRejected": "backend",
    "vocab_from_tokenizer": "vocab",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'maskplug_sglang' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)
