"""maskplug-outlines: the outlines-core grammar provider for maskplug.

Installing this distribution registers the provider ``"outlines-core"``
through the ``maskplug`` entry-point group; use it with
``maskplug.grammar.grammar_provider("outlines-core", vocab)``.
"""

from __future__ import annotations

from .provider import OUTLINES_COMPILE_LIMIT_S, OutlinesBatchOps, OutlinesGrammar, OutlinesMatcher, OutlinesProvider

__all__ = ["OUTLINES_COMPILE_LIMIT_S", "OutlinesBatchOps", "OutlinesGrammar", "OutlinesMatcher", "OutlinesProvider"]
