"""Pieces that the chain and tree paths (and sibling classes) share behave alike on each of them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from maskplug import BudgetError, CostModel, DraftMasks, ScheduledLayout, choose_budget, compact
from maskplug.grammar.vocabs import SentencePieceEncoder, TokenizersEncoder
from maskplug.schedulers.no_spec import NoSpecScheduler
from maskplug.schedulers.verify_all import VerifyAllScheduler
from maskplug.trees import DraftTree, TreeMasks, choose_tree_budget, compact_tree, select_subtree

LAYOUT = ScheduledLayout(["a", "b", "c"], [2, 2, 2], [1, 1, 1])
TREE = DraftTree(LAYOUT, [[-1, 0], [-1, -1], [-1, 0]])
CONF = np.full((3, 2), 0.5)


def _chain(request: Any) -> None:
    g = np.asarray(request).reshape(-1).shape[0]
    choose_budget(
        CONF, LAYOUT, CostModel.linear(), grammar=DraftMasks(request, np.ones(g, np.int64), np.zeros((g, 3), bool))
    )


def _tree(request: Any) -> None:
    g = np.asarray(request).reshape(-1).shape[0]
    masks = TreeMasks(request, np.ones((g, 2), bool), np.zeros((g, 2), bool))
    choose_tree_budget(CONF, TREE, CostModel.linear(), grammar=masks)


@pytest.mark.parametrize("choose", [_chain, _tree], ids=["chain", "tree"])
@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (np.array([[0, 1]]), r"grammar.request: expected a 1-D array of batch indices, got shape \(1, 2\)"),
        (np.array([0.0, 1.0]), r"grammar.request: expected a 1-D array of batch indices, got dtype float64"),
        (np.array([0, 3]), r"grammar.request: expected batch indices in \[0, 3\), got 3"),
        (np.array([-1, 0]), r"grammar.request: expected batch indices in \[0, 3\), got -1"),
        (np.array([2, 0, 2]), r"grammar.request: expected unique batch indices, got 2 twice"),
    ],
)
def test_grammar_request_is_checked_alike_for_chains_and_trees(choose: Any, request_: Any, message: str) -> None:
    with pytest.raises(BudgetError, match=message):
        choose(request_)


def test_num_tokens_is_the_sum_of_tokens_per_request_for_chains_and_trees() -> None:
    chain = compact(LAYOUT, 3)
    assert chain.num_tokens == int(chain.num_tokens_per_req.sum()) == 3 + 3
    keep = select_subtree(CONF, TREE, 3)
    tree = compact_tree(TREE, keep)
    assert tree.num_tokens == int(tree.num_tokens_per_req.sum()) == 3 + 3


@pytest.mark.parametrize(("cls", "name"), [(NoSpecScheduler, "no-spec"), (VerifyAllScheduler, "verify-all")])
def test_stateless_schedulers_refuse_configuration_and_learn_nothing(cls: Any, name: str) -> None:
    with pytest.raises(BudgetError, match=rf"{name}: unexpected configuration \['alpha'\]"):
        cls(alpha=1)
    sched = cls()
    assert sched.name == name and sched.uses_grammar is False
    assert sched.observe(None) is None


@pytest.mark.parametrize(
    ("cls", "library"), [(TokenizersEncoder, "tokenizers"), (SentencePieceEncoder, "sentencepiece")]
)
def test_file_encoders_are_named_after_their_library_and_file(cls: Any, library: str, tmp_path: Any) -> None:
    # Nothing is loaded before the first call, so the file need not exist.
    enc = cls(tmp_path / "sub" / "tok.model")
    assert enc.name == f"{library}:tok.model"
