"""The producer's strategy choice in :func:`maskplug_vllm.scheduler.fill_step_rows` changes no row.

Small batches are produced request by request (``strategy="serial"``), large
ones through the providers' chain operations (``"auto"``). Both must write the
same rows and report the same draft masks, with and without vLLM's ``-1``
draft padding, on either side of :data:`~maskplug_vllm.scheduler.SERIAL_BELOW`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tiny_model
import torch
from maskplug_vllm import scheduler as mp_sched
from maskplug_vllm.backend import MaskplugBackend, MaskplugGrammar
from test_scheduler_masks import NUM_SPEC, _vllm_config
from vllm.v1.structured_output.backend_types import StructuredOutputOptions


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tiny_model.build(tmp_path_factory.mktemp("tiny"))
    return tiny_model.load_tokenizer(folder)


def test_serial_and_batched_production_write_the_same_rows(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    vocab_size = tiny_model.VOCAB_SIZE
    eos = {int(tokenizer.eos_token_id)}
    backend = MaskplugBackend(_vllm_config(), tokenizer, vocab_size, "xgrammar")
    bases = [
        backend.compile_grammar(StructuredOutputOptions.JSON, p.read_text(), stop_token_ids=eos)
        for p in tiny_model.schema_paths()
    ]
    rng = np.random.default_rng(5)
    counts = set()
    threshold = mp_sched.SERIAL_BELOW
    sizes = [1, 2, 7, mp_sched.SERIAL_BELOW - 1, mp_sched.SERIAL_BELOW, mp_sched.SERIAL_BELOW + 9]
    for step, n in enumerate(sizes):
        ids = [f"s{step}-{i}" for i in range(n)]
        grammars, spec = [], {}
        for rid in ids:
            base = bases[int(rng.integers(0, len(bases)))]
            g = MaskplugGrammar(base.matcher.fork(), base.spec)
            tiny_model.walk(g, rng, int(rng.integers(0, 30)), len(tokenizer), frozenset(eos))
            probe = MaskplugGrammar(g.matcher.fork(), g.spec)
            drafts = tiny_model.walk(probe, rng, int(rng.integers(0, NUM_SPEC + 1)), vocab_size)
            if drafts and step % 2 == 0 and rng.random() < 0.5:
                drafts[int(rng.integers(0, len(drafts))) :] = [-1] * (len(drafts) - int(rng.integers(0, len(drafts))))
            if drafts:
                spec[rid] = drafts
            grammars.append(g)
        counts.add(n)
        rows = n + sum(len(v) for v in spec.values())
        out = {}
        for below in (0, 10**6):  # every batch through "auto", then every batch "serial"
            monkeypatch.setattr(mp_sched, "SERIAL_BELOW", below)
            bitmask = torch.zeros((rows + 3, (vocab_size + 31) // 32), dtype=torch.int32)
            total, dm = mp_sched.fill_step_rows(bitmask, grammars, ids, spec)
            out[below] = (total, dm, bitmask.clone())
        (t0, d0, b0), (t1, d1, b1) = out[0], out[10**6]
        assert t0 == t1 == rows
        assert torch.equal(b0, b1)
        assert not bool((b0[:rows] == 0).all(dim=1).any())  # every row written
        assert np.array_equal(d0.request, d1.request)
        assert np.array_equal(d0.acceptable, d1.acceptable)
        assert np.array_equal(d0.forced, d1.forced)
    assert max(counts) >= threshold > min(counts)
