"""maskplug-sglang: maskplug as an SGLang grammar backend.

Install it beside SGLang and start the server with ``--grammar-backend
maskplug``; ``MASKPLUG_SGLANG_PROVIDER`` picks the maskplug grammar provider
(default ``xgrammar``). Installing alone changes nothing in SGLang.

With ``MASKPLUG_SGLANG_DSPARK=1`` (SGLang 0.5.23 only) a maskplug scheduler
(``MASKPLUG_SCHEDULER``) also chooses DSpark's verify lengths, and the grammar
mask is filled only for the rows the verify layout keeps (:mod:`.dspark`,
:mod:`.patches`).

The backend and DSpark classes are imported lazily, so importing this package
(as SGLang does at start-up, through the entry point) stays cheap.
"""

from __future__ import annotations

from typing import Any

from .plugin import BACKEND_NAME, TESTED_SGLANG, register

__version__ = "0.1.0"

__all__ = [
    "BACKEND_NAME",
    "TESTED_SGLANG",
    "DSparkBudgetPlanner",
    "MaskplugGrammar",
    "MaskplugGrammarBackend",
    "TokenRejected",
    "TreeWindows",
    "VerifyPlan",
    "__version__",
    "build_verify_mask",
    "check_sglang_version",
    "fill_draft_trees",
    "fill_verify_rows",
    "register",
    "vocab_from_tokenizer",
]

_LAZY = {
    "DSparkBudgetPlanner": "dspark",
    "MaskplugGrammar": "backend",
    "MaskplugGrammarBackend": "backend",
    "TokenRejected": "backend",
    "TreeWindows": "trees",
    "VerifyPlan": "dspark",
    "build_verify_mask": "dspark",
    "check_sglang_version": "dspark",
    "fill_draft_trees": "trees",
    "fill_verify_rows": "dspark",
    "vocab_from_tokenizer": "vocab",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'maskplug_sglang' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{mod}", __name__), name)
