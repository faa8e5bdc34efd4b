"""maskplug-llguidance: the llguidance grammar provider for maskplug.

Installing this distribution registers the provider ``"llguidance"`` through
the ``maskplug`` entry-point group; use it with
``maskplug.grammar.grammar_provider("llguidance", vocab)``.
"""

from __future__ import annotations

from .provider import LLGuidanceBatchOps, LLGuidanceGrammar, LLGuidanceMatcher, LLGuidanceProvider

__all__ = ["LLGuidanceBatchOps", "LLGuidanceGrammar", "LLGuidanceMatcher", "LLGuidanceProvider"]
