"""The draft-tree producer, at the path it was first published under.

:func:`fill_tree_masks` and :func:`native_tree_walker` live in
:mod:`maskplug.grammar.trees`, beside the chain producer
(:mod:`maskplug.grammar.draft`) whose argument checks and row writers they
share; this module re-exports them.
"""

from __future__ import annotations

from .grammar.trees import fill_tree_masks, native_tree_walker

__all__ = ["fill_tree_masks", "native_tree_walker"]
