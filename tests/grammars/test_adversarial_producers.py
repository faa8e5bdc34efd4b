"""The draft and tree producers under adversarial use: pools, interrupts, shared matchers, odd inputs.

Each case is a bad or hostile use of :func:`maskplug.fill_draft_masks`,
:func:`maskplug.fill_tree_masks` or the grammar pool, checked for the
exact outcome: the named :class:`~maskplug.MaskplugError` with the bitmask
and every matcher untouched, or the result the same call gives without the
hostile part.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from grammar_testkit import PROVIDERS, small_vocab

from maskplug import GrammarRows, GrammarSpec, ScheduledLayout, fill_draft_masks, fill_tree_masks, grammar_provider
from maskplug.grammar import Vocab
from maskplug.grammar.pools import MAX_THREADS, shared_pool, spread_tasks
from maskplug.trees import DraftTree

pytestmark = pytest.mark.skipif(not PROVIDERS, reason="no grammar provider is installed")

# Providers whose matchers release the GIL: their requests are walked on the pool.
POOLED = [p for p in PROVIDERS if p in ("xgrammar", "llguidance")]
VOCAB: Vocab = small_vocab(extra=5)


def _matchers(provider: str, n: int) -> list[Any]:
    g = grammar_provider(provider, VOCAB).compile(GrammarSpec("regex", r"[a-z]{1,6}( [0-9]{1,2}){0,2}"))
    return [g.matcher() for _ in range(n)]


def _grammar_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("maskplug-grammar")]


def test_one_pool_serves_every_size() -> None:
    assert shared_pool(2) is shared_pool(7) is shared_pool(MAX_THREADS * 3)


def test_spread_tasks_keeps_the_thread_count_bounded() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        with lock:
            seen.append(i)

    for workers in [*range(2, 40), 200, 1000]:
        seen.clear()
        spread_tasks(task, workers + 3, workers)
        assert sorted(seen) == list(range(workers + 3))
        assert len(_grammar_threads()) <= MAX_THREADS
    assert all(t.name.startswith("maskplug-") for t in _grammar_threads())


@pytest.mark.parametrize("provider", POOLED)
def test_pooled_walks_of_every_size_reuse_a_bounded_set_of_threads(provider: str) -> None:
    before = threading.active_count()
    y = VOCAB.tokens.index(b"a")
    for size in [2, 9, 3, 17, 5, 33, 12]:
        ms = _matchers(provider, size)
        lay = ScheduledLayout([f"r{i}" for i in range(size)], [2] * size, [1] * size)
        rows = GrammarRows([f"r{i}" for i in range(size)])
        bm = VOCAB.new_bitmask(rows.num_rows(lay))
        for threads in (size, 2 * size + 1, 3):
            dm = fill_draft_masks(ms, [[y, y]] * size, bm, rows, lay, strategy="threads", threads=threads)
            assert dm.acceptable.tolist() == [2] * size
            tm = fill_tree_masks(ms, [[y, y]] * size, bm, rows, DraftTree(lay, [[-1, -1]] * size), threads=threads)
            assert tm.valid.all()
        assert len(_grammar_threads()) <= MAX_THREADS
    # The grammar pool's threads and nothing else have been added (the job pool has at most 4).
    assert threading.active_count() - before <= MAX_THREADS + 4
