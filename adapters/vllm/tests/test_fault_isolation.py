"""One failing grammar request ends as that request's error; the engine and the rest of the batch go on.

The engine test (about 20 s on two cores) runs vLLM's CPU engine once
(``fault_run.py``) on a greedy batch of JSON-schema requests, two of whose
matchers raise: one inside the mask-row producer (its fill), one when vLLM
commits a step's tokens (``MaskplugGrammar.accept_tokens``). The unit tests
pin :class:`~maskplug_vllm.backend.MaskplugGrammar`'s failed state and the
producer's handling of :attr:`maskplug.DraftMasks.failed` without an engine.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any

import maskplug_vllm.scheduler as mp_sched
import numpy as np
import pytest
import tiny_model
import torch
from maskplug_vllm.backend import ERROR_PREFIX, MaskplugGrammar, bind_grammars, fail_requests
from vllm_release import needs_v032

from maskplug import GrammarError
from maskplug.grammar import GrammarSpec, grammar_provider
from maskplug.grammar.rows import stop_row
from maskplug.grammar.vocabs import vocab_from_hf_tokenizer

VLLM_RELEASES = ("0.32.0", "0.33.0")
"""The grammar and both releases' producers run under either; the engine only under 0.32 (``needs_v032``)."""


# -- without an engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tiny_model.build(tmp_path_factory.mktemp("tok") / "model")
    return vocab_from_hf_tokenizer(tiny_model.load_tokenizer(folder), tiny_model.VOCAB_SIZE)


@pytest.fixture(scope="module")
def compiled(vocab: Any) -> Any:
    schema = json.loads(tiny_model.schema_paths()[0].read_text())
    return grammar_provider("xgrammar", vocab).compile(GrammarSpec("json_schema", json.dumps(schema)))


class FakeRequest:
    """The parts of vLLM's ``Request`` the grammar touches (weakly referable, like vLLM's)."""

    def __init__(self, request_id: str, grammar: Any = None) -> None:
        self.request_id = request_id
        self.stop_reason: int | str | None = None
        self.structured_output_request = SimpleNamespace(grammar=grammar)


class Raising:
    """A matcher whose ``what`` method raises; the rest go to ``inner``."""

    batch_ops = None
    releases_gil = False

    def __init__(self, inner: Any, what: str) -> None:
        self.inner, self.what, self.vocab = inner, what, inner.vocab

    def _call(self, name: str, *args: Any) -> Any:
        if name == self.what:
            raise RuntimeError(f"boom in {name}")
        return getattr(self.inner, name)(*args)

    def accept(self, token: int) -> bool:
        return bool(self._call("accept", token))

    def validate(self, tokens: Any) -> int:
        return int(self._call("validate", tokens))

    def rollback(self, n: int) -> None:
        self._call("rollback", n)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        return bool(self._call("fill", bitmask, row))

    def is_terminated(self) -> bool:
        return bool(self._call("is_terminated"))

    def reset(self) -> None:
        self._call("reset")

    def fork(self) -> Any:
        return Raising(self.inner.fork(), self.what)


def _walk(g: MaskplugGrammar, vocab: Any, steps: int, seed: int = 0) -> list[int]:
    """A random history the grammar accepts (never a stop token), taken by ``g``."""
    return tiny_model.walk(g, np.random.default_rng(seed), steps, vocab.vocab_size, frozenset(vocab.eos_ids))


@pytest.mark.parametrize("what", ["accept", "validate", "rollback", "fill", "is_terminated", "reset"])
def test_a_raising_matcher_fails_its_grammar_not_the_caller(what: str, compiled: Any, vocab: Any) -> None:
    g = MaskplugGrammar(Raising(compiled.matcher(), what), GrammarSpec("json_object", None), vocab)
    request = FakeRequest("req-7")
    g.bind(request)
    bm = vocab.new_bitmask(2)
    calls = {
        "accept": lambda: g.accept_tokens("req-7", [int(next(iter(vocab.eos_ids)))]),
        "validate": lambda: g.validate_tokens([1, 2]),
        "rollback": lambda: g.rollback(1),
        "fill": lambda: g.fill_bitmask(bm, 1),
        "is_terminated": lambda: g.is_terminated(),
        "reset": lambda: g.reset(),
    }
    calls[what]()  # nothing raises
    assert isinstance(g.error, GrammarError)
    assert "RuntimeError in" in str(g.error) and f"boom in {what}" in str(g.error)
    # Failed: stop-only rows, no drafts, no tokens, the matcher is not called again.
    g.matcher = None  # any call on it would now raise AttributeError
    g.fill_bitmask(bm, 0)
    assert torch.equal(bm[0], stop_row(vocab))
    assert g.validate_tokens([1, 2, 3]) == []
    assert not g.is_terminated()
    g.rollback(2)
    g.reset()
    assert g.accept_tokens("req-7", [5]) is False
    assert request.stop_reason == f"{ERROR_PREFIX}{g.error}"


def test_a_failed_grammar_is_logged_once_naming_its_request(
    compiled: Any, vocab: Any, caplog: pytest.LogCaptureFixture
) -> None:
    g = MaskplugGrammar(compiled.matcher(), GrammarSpec("json_object", None), vocab)
    request = FakeRequest("req-9")
    g.bind(request)
    with caplog.at_level(logging.ERROR, logger="maskplug_vllm.backend"):
        g.fail(GrammarError("first"))
        g.fail(GrammarError("second"))
        g.accept_tokens("req-9", [3])
        g.fill_bitmask(vocab.new_bitmask(1), 0)
    records = [r for r in caplog.records if r.name == "maskplug_vllm.backend"]
    assert len(records) == 1
    assert "req-9" in records[0].getMessage() and "first" in records[0].getMessage()
    assert str(g.error) == "request 'req-9': first"


def test_fill_step_rows_gives_a_failing_request_stop_rows_and_leaves_the_others(compiled: Any, vocab: Any) -> None:
    """The producer's DraftMasks.failed in the adapter's step: the same rows for the others as without it."""
    base = [MaskplugGrammar(compiled.matcher(), GrammarSpec("json_object", None), vocab) for _ in range(4)]
    for k, g in enumerate(base):
        _walk(g, vocab, 2 + k, k)
    ids = ["a", "b", "c", "d"]
    rng = np.random.default_rng(0)
    spec: dict[str, list[int]] = {}
    for r, g in zip(ids, base, strict=True):
        probe = MaskplugGrammar(g.matcher.fork(), g.spec, vocab)
        spec[r] = _walk(probe, vocab, 3, 10) or [int(rng.integers(0, vocab.vocab_size))]
    spec["c"] = [*spec["c"][:2], -1][: len(spec["c"])]  # vLLM's padding on one request

    def rows(grammars: list[MaskplugGrammar], req_ids: list[str]) -> tuple[torch.Tensor, Any]:
        bm = vocab.new_bitmask(32)
        total, dm = mp_sched.fill_step_rows(bm, grammars, req_ids, spec)
        return bm[:total].clone(), dm

    clean, dm_clean = rows(base, ids)
    assert not dm_clean.failed
    bad = MaskplugGrammar(Raising(base[1].matcher.fork(), "fill"), base[1].spec, vocab)
    grammars = [base[0], bad, base[2], base[3]]
    got, dm = rows(grammars, ids)
    assert set(dm.failed) == {1} and isinstance(dm.failed[1], GrammarError)
    n = [len(spec[r]) + 1 for r in ids]
    start = np.concatenate([[0], np.cumsum(n)])
    stop = stop_row(vocab)
    for k in range(4):
        block = got[start[k] : start[k + 1]]
        if k == 1:
            assert all(torch.equal(row, stop) for row in block)
            assert int(dm.acceptable[k]) == 0 and not dm.forced[k].any()
        else:
            assert torch.equal(block, clean[start[k] : start[k + 1]])
            assert int(dm.acceptable[k]) == int(dm_clean.acceptable[k])
            assert np.array_equal(dm.forced[k], dm_clean.forced[k])
    # The adapter fails the grammar (logged once, request named); its matcher is not called again.
    request = FakeRequest("b", bad)
    assert bind_grammars({"b": request}, ["b"]) == [bad]
    fail_requests(grammars, ids, dm.failed)
    assert bad.error is not None and "request 'b'" in str(bad.error)
    bad.matcher = None
    again, dm2 = rows(grammars, ids)
    assert torch.equal(again, got) and set(dm2.failed) == {1}
    assert bad.accept_tokens("b", [1]) is False and str(request.stop_reason).startswith(ERROR_PREFIX)


def test_v033_fixed_rows_give_a_failing_request_stop_rows_and_leave_the_others(compiled: Any, vocab: Any) -> None:
    """vLLM 0.33's fixed-stride producer: the same for its blocks."""
    from maskplug_vllm import v0_33

    stride = 4
    base = [MaskplugGrammar(compiled.matcher(), GrammarSpec("json_object", None), vocab) for _ in range(3)]
    for k, g in enumerate(base):
        _walk(g, vocab, 1 + 2 * k, k)
    ids = ["x", "y", "z"]
    spec = {
        r: _walk(MaskplugGrammar(g.matcher.fork(), g.spec, vocab), vocab, 3) for r, g in zip(ids, base, strict=True)
    }
    spec["x"] = spec["x"][:1]

    def rows(grammars: list[MaskplugGrammar]) -> tuple[torch.Tensor, Any]:
        bm = vocab.new_bitmask(3 * stride)
        total, dm = v0_33.fill_step_rows(bm, grammars, ids, spec, stride)
        assert total == 3 * stride
        return bm.clone(), dm

    clean, _ = rows(base)
    bad = MaskplugGrammar(Raising(base[2].matcher.fork(), "accept"), base[2].spec, vocab)
    got, dm = rows([base[0], base[1], bad])
    assert set(dm.failed) == {2}
    assert torch.equal(got[: 2 * stride], clean[: 2 * stride])
    stop = stop_row(vocab)
    assert all(torch.equal(row, stop) for row in got[2 * stride : 2 * stride + len(spec["z"]) + 1])
    assert v0_33.fill_step_bitmask(vocab.new_bitmask(3 * stride), base, ids, spec, stride) == 3 * stride


# -- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("faults")
    model = tiny_model.build(folder / "model")
    out = folder / "faults.json"
    return tiny_model.run_script("fault_run.py", model, out, env={"MASKPLUG_VLLM": "1"})


@needs_v032
def test_engine_the_faulty_requests_finish_with_their_error(run: dict[str, Any]) -> None:
    assert sorted(run["wrapped"]) == ["commit", "fill"]
    by_name = dict(zip(run["names"], run["with_faults"], strict=True))
    for name, text in (("fill", "injected fault: fill call"), ("commit", "injected fault: commit call")):
        out = by_name[name]
        assert out["finish_reason"] == "error", out
        assert out["stop_reason"].startswith(ERROR_PREFIX) and text in out["stop_reason"], out
        assert len(out["token_ids"]) < 64
    # The fill fault reached the adapter through the producer's DraftMasks.failed; the commit fault did not.
    assert len(run["producer_failed"]) == 1
    # Logged once each, naming the request.
    assert len(run["log"]) == 2, run["log"]
    messages = " | ".join(r["message"] for r in run["log"])
    assert "injected fault: fill call" in messages and "injected fault: commit call" in messages
    assert run["producer_failed"][0] in messages
    assert run["requests_left"] == 0


@needs_v032
def test_engine_the_other_requests_are_token_identical_to_the_batch_without_them(run: dict[str, Any]) -> None:
    good = [o for name, o in zip(run["names"], run["with_faults"], strict=True) if name == "good"]
    assert len(good) == len(run["without"]) == 6
    for k, (a, b) in enumerate(zip(good, run["without"], strict=True)):
        assert a["token_ids"] == b["token_ids"], f"request {k}: {a['text']!r} != {b['text']!r}"
        assert a["finish_reason"] == b["finish_reason"] != "error"
    # The good requests did real structured work (not all cut at once).
    assert sum(len(o["token_ids"]) for o in good) > 6 * 8


def test_the_producer_wrapper_fails_only_the_faulty_request(
    vocab: Any, tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's ``grammar_bitmask`` as the adapter wraps it (this release's): one request's matcher raises."""
    from maskplug_vllm import patches
    from maskplug_vllm.backend import MaskplugBackend
    from vllm.v1.structured_output import StructuredOutputManager

    impl = patches.implementations()
    fill = impl.make_grammar_bitmask(patches.original(StructuredOutputManager, "grammar_bitmask"))
    num_spec = 3
    config = SimpleNamespace(
        structured_outputs_config=SimpleNamespace(disable_any_whitespace=False),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="llama"), is_diffusion=False),
        speculative_config=SimpleNamespace(num_speculative_tokens=num_spec),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
        num_speculative_tokens=num_spec,
    )
    folder = tiny_model.build(tmp_path_factory.mktemp("wrap") / "model")
    backend = MaskplugBackend(config, tiny_model.load_tokenizer(folder), tiny_model.VOCAB_SIZE, "xgrammar")
    manager = object.__new__(StructuredOutputManager)
    for name, value in (
        ("vllm_config", config),
        ("backend", backend),
        ("_grammar_bitmask", None),
        ("reasoner_cls", None),
        ("enable_in_reasoning", False),
    ):
        setattr(manager, name, value)
    schemas = tiny_model.schema_texts()
    ids = ["a", "b", "c"]
    requests = {
        r: FakeRequest(r, backend.compile_grammar(SimpleNamespace(name="JSON"), schemas[k])) for k, r in enumerate(ids)
    }
    spec: dict[str, list[int]] = {}
    for k, r in enumerate(ids):
        g = requests[r].structured_output_request.grammar
        _walk(g, vocab, 2, k)
        spec[r] = _walk(MaskplugGrammar(g.matcher.fork(), g.spec, vocab), vocab, num_spec, 20 + k)
    clean = fill(manager, requests, ids, spec).copy()
    bad = requests["b"].structured_output_request.grammar
    bad.matcher = Raising(bad.matcher, "fill")
    with caplog.at_level(logging.ERROR, logger="maskplug_vllm.backend"):
        got = fill(manager, requests, ids, spec).copy()
        again = fill(manager, requests, ids, spec).copy()  # a later step: the failed matcher is not called
    assert got.shape == clean.shape and np.array_equal(again, got)
    n = [len(spec[r]) + 1 for r in ids]
    starts = [0, n[0], n[0] + n[1]] if impl.layout == "ragged" else [0, num_spec + 1, 2 * (num_spec + 1)]
    stop = stop_row(vocab).numpy()
    for k in range(3):
        block = slice(starts[k], starts[k] + n[k])
        if k == 1:
            assert all(np.array_equal(row, stop) for row in got[block])
        else:
            assert np.array_equal(got[block], clean[block])
    assert isinstance(bad.error, GrammarError) and "request 'b'" in str(bad.error)
    records = [r for r in caplog.records if r.name == "maskplug_vllm.backend"]
    assert len(records) == 1 and "'b'" in records[0].getMessage()
    # When the step's tokens come back, vLLM's scheduler learns of it: a False accept, the text as stop_reason.
    assert bad.accept_tokens("b", [int(next(iter(vocab.eos_ids)))]) is False
    assert requests["b"].stop_reason == bad.error_text and str(bad.error_text).startswith(ERROR_PREFIX)
    assert all(requests[r].structured_output_request.grammar.error is None for r in ("a", "c"))
