"""The same agreement on a real 32,000-token SentencePiece vocabulary (mistral-common's v1 model).

SGLang reaches it through its ``init_xgrammar`` hook (a raw vocabulary with
control pieces as empty bytes), so here the masks must agree on every bit,
control tokens included.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import allowed_ids, compile_pair, schema_texts
from maskplug_sglang.backend import MaskplugGrammar

KEYS = [("json", schema_texts()[i]) for i in (0, 4, 7)] + [
    ("json", "$$ANY$$"),
    ("regex", r"\(\d{3}\) \d{3}-\d{4}"),
    ("ebnf", 'root ::= "yes" | "no" | "maybe " [0-9]+'),
]


@pytest.mark.parametrize("key", KEYS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(KEYS)])
def test_sentencepiece_walks_agree_bit_for_bit(sp_backends: tuple[Any, Any, Any], key: tuple[str, str]) -> None:
    theirs, ours = compile_pair(sp_backends, key)
    assert isinstance(ours, MaskplugGrammar)
    size = ours.vocab.vocab_size
    eos = ours.vocab.eos_ids[0]
    mt = theirs.allocate_vocab_mask(size, 1, "cpu")
    mo = ours.allocate_vocab_mask(size, 1, "cpu")
    rng = np.random.default_rng(11)
    accepted = 0
    for step in range(40):
        theirs.fill_vocab_mask(mt, 0)
        ours.fill_vocab_mask(mo, 0)
        assert torch.equal(mt, mo), f"step {step}: masks differ"
        ok = allowed_ids(mo[0], size)
        # A token outside the mask is refused by both; the next comparison checks the state is unchanged.
        refused = np.setdiff1d(rng.integers(0, size, 16), ok)
        if refused.size:
            for obj in (theirs, ours):
                with pytest.raises(ValueError):
                    obj.accept_token(int(refused[0]))
        ok = ok[ok != eos]
        if ok.size == 0:
            break
        if step % 9 == 8 and accepted >= 2:
            theirs.rollback(2)
            ours.rollback(2)
            accepted -= 2
            continue
        t = int(rng.choice(ok))
        theirs.accept_token(t)
        ours.accept_token(t)
        accepted += 1
