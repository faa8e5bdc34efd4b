"""vLLM 0.33 specifics: the fixed-block producer, the one-backend check, and rows end to end.

vLLM 0.33 gives every grammar request a block of ``mask_stride =
num_speculative_tokens + 1`` rows. These tests drive vLLM 0.33's own code
(its ``StructuredOutputManager`` with its xgrammar backend, its scatter apply,
its ``StructuredOutputsWorker`` with the kernel launch recorded) against the
adapter's 0.33 implementations (:mod:`maskplug_vllm.v0_33`) on the same
tokenizer, schemas, histories and drafts. vLLM 0.33 ships no CPU build, so
no engine runs here; the whole-engine tests run against vLLM 0.32.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import tiny_model
import torch
from maskplug_vllm import patches, v0_33
from maskplug_vllm import scheduler as mp_sched_v032
from maskplug_vllm.backend import MaskplugBackend, MaskplugGrammar
from vllm_release import V033, no_pinned_memory, v033_kernel_mapping, v033_worker

from maskplug import LayoutError, reference

VLLM_RELEASES = ("0.33.0",)

pytestmark = pytest.mark.skipif(not V033, reason=f"vLLM 0.33 only (installed: vLLM {patches.vllm_version()})")

if V033:
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.core.sched.output import GrammarOutput
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output import utils as so_utils
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

NUM_SPEC = 3
STRIDE = NUM_SPEC + 1


@pytest.fixture(scope="module", autouse=True)
def _host_memory() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as m:
        no_pinned_memory(m)
        yield


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tiny_model.build(tmp_path_factory.mktemp("tiny"))
    return tiny_model.load_tokenizer(folder)


def _vllm_config() -> SimpleNamespace:
    return SimpleNamespace(
        structured_outputs_config=SimpleNamespace(disable_any_whitespace=False),
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(model_type="llama"),
            is_diffusion=False,
            get_vocab_size=lambda: tiny_model.VOCAB_SIZE,
        ),
        speculative_config=SimpleNamespace(num_speculative_tokens=NUM_SPEC),
        scheduler_config=SimpleNamespace(max_num_seqs=16),
        num_speculative_tokens=NUM_SPEC,
    )


def _manager(backend: Any, tokenizer: Any = None) -> Any:
    """vLLM 0.33's manager without its ``__init__`` (thread pools, tokenizer loading), synchronous compiles."""
    m = object.__new__(StructuredOutputManager)
    m.vllm_config = _vllm_config()
    m.backend = backend
    m.backend_name = None
    m.tokenizer = tokenizer
    m._use_async_grammar_compilation = False
    m._grammar_bitmask = None
    m._full_mask = torch.tensor(-1, dtype=torch.int32)
    m.fill_bitmask_parallel_threshold = 128
    m.enable_in_reasoning = False
    m.reasoner_cls = None
    return m


def _request(grammar: Any) -> SimpleNamespace:
    return SimpleNamespace(
        structured_output_request=SimpleNamespace(
            grammar=grammar, reasoning_ended=True, masked_reasoning_end_ids=None, reasoner=None
        )
    )


def _ours_fill() -> Any:
    return v0_33.make_grammar_bitmask(patches.original(StructuredOutputManager, "grammar_bitmask"))


def _used(spec: dict[str, list[int]], order: list[str]) -> np.ndarray:
    """Which rows of a fixed-layout bitmask a request uses (``len(drafts) + 1`` at the front of its block)."""
    pos = np.tile(np.arange(STRIDE), len(order))
    need = np.repeat([1 + len(spec.get(r, ())) for r in order], STRIDE)
    return pos < need


# ----------------------------------------------------------------- producer --


def test_fixed_rows_identical_to_vllm_033_xgrammar_path(tokenizer: Any) -> None:
    """Every row a request uses is bit for bit vLLM 0.33's; the rest of its block is all-allowed
    (vLLM leaves whatever an earlier step wrote there; neither consumer ever applies those rows)."""
    theirs_backend = XgrammarBackend(_vllm_config(), tokenizer=tokenizer, vocab_size=tiny_model.VOCAB_SIZE)
    ours_backend = MaskplugBackend(_vllm_config(), tokenizer, tiny_model.VOCAB_SIZE, "xgrammar")
    theirs_mgr, ours_mgr = _manager(theirs_backend), _manager(ours_backend)
    fill = _ours_fill()
    rng = np.random.default_rng(41)
    schemas = tiny_model.schema_texts()
    checked_rows = unused_rows = 0
    for step in range(150):
        ids, theirs_req, ours_req, spec = tiny_model.random_requests(
            rng, step, tokenizer, theirs_backend, ours_backend, schemas, _request, NUM_SPEC
        )
        order = [ids[i] for i in rng.permutation(len(ids))]
        want = StructuredOutputManager.grammar_bitmask(theirs_mgr, theirs_req, order, spec).copy()
        got = fill(ours_mgr, ours_req, order, spec).copy()
        assert got.shape == want.shape == (STRIDE * len(order), (tiny_model.VOCAB_SIZE + 31) // 32)
        used = _used(spec, order)
        assert np.array_equal(got[used], want[used])
        assert bool((got[~used] == -1).all())
        checked_rows += int(used.sum())
        unused_rows += int((~used).sum())
        # Both producers leave every grammar where it was: the next fill agrees too.
        again = fill(ours_mgr, ours_req, order, spec).copy()
        assert np.array_equal(again, got)
    assert checked_rows > 300 and unused_rows > 100


def test_difference_rows_after_a_refused_draft(tokenizer: Any) -> None:
    """A draft the grammar refuses (vLLM's scheduler validates drafts first, so only an engine bug gets
    here): vLLM 0.33 repeats the refused draft's row for the rest of the request's rows; maskplug leaves
    them open, since advancing stopped and the verifier never accepts past the refused draft."""
    eos = {int(tokenizer.eos_token_id)}
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    theirs_backend = XgrammarBackend(_vllm_config(), tokenizer=tokenizer, vocab_size=tiny_model.VOCAB_SIZE)
    ours_backend = MaskplugBackend(_vllm_config(), tokenizer, tiny_model.VOCAB_SIZE, "xgrammar")
    bad = tokenizer.convert_tokens_to_ids("a")  # an object cannot start with a letter
    spec = {"r": [bad, bad]}
    want = StructuredOutputManager.grammar_bitmask(
        _manager(theirs_backend),
        {"r": _request(theirs_backend.compile_grammar(StructuredOutputOptions.JSON, schema, eos))},
        ["r"],
        spec,
    ).copy()
    got = _ours_fill()(
        _manager(ours_backend),
        {"r": _request(ours_backend.compile_grammar(StructuredOutputOptions.JSON, schema, eos))},
        ["r"],
        spec,
    ).copy()
    assert got.shape == want.shape == (STRIDE, (tiny_model.VOCAB_SIZE + 31) // 32)
    assert np.array_equal(got[0], want[0])  # the refused draft's own row: the same constraint
    assert not bool((want[0] == -1).all())
    assert all(np.array_equal(want[p], want[0]) for p in (1, 2))  # rows 0..len(drafts) are vLLM's to fill
    assert bool((got[1:] == -1).all())


def test_fixed_producer_refuses_more_drafts_than_the_block(tokenizer: Any) -> None:
    backend = MaskplugBackend(_vllm_config(), tokenizer, tiny_model.VOCAB_SIZE, "xgrammar")
    eos = {int(tokenizer.eos_token_id)}
    g = backend.compile_grammar(StructuredOutputOptions.REGEX, "[a-c]+", eos)
    a = tokenizer.convert_tokens_to_ids("a")
    bitmask = backend.allocate_token_bitmask(2 * STRIDE)
    before = bitmask.clone()
    with pytest.raises(LayoutError, match=r"scheduled_spec_decode_tokens: expected at most 3 drafts .* got 4"):
        v0_33.fill_step_bitmask(bitmask, [g], ["r"], {"r": [a] * STRIDE}, STRIDE)
    assert torch.equal(bitmask, before)


# ------------------------------------------------------------- grammar_init --


def _structured_request(backend_name: str, spec: str) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r",
        structured_output_request=SimpleNamespace(
            grammar=None, structured_output_key=(StructuredOutputOptions.REGEX, spec)
        ),
        sampling_params=SimpleNamespace(
            structured_outputs=SimpleNamespace(_backend=backend_name, _backend_was_auto=False),
            all_stop_token_ids={0},
        ),
    )


def test_grammar_init_keeps_vllm_one_backend_check(tokenizer: Any) -> None:
    """maskplug's backend is installed under the name the first request resolved to, so vLLM 0.33's own
    one-backend-per-engine check refuses a later request that resolved to another backend."""
    init = v0_33.make_grammar_init(patches.original(StructuredOutputManager, "grammar_init"))
    m = _manager(None, tokenizer)
    first = _structured_request("xgrammar", "[a-c]+")
    init(m, first)
    assert isinstance(m.backend, MaskplugBackend) and m.backend_name == "xgrammar"
    assert isinstance(first.structured_output_request.grammar, MaskplugGrammar)
    backend = m.backend
    same = _structured_request("xgrammar", "[0-9]+")
    init(m, same)
    assert isinstance(same.structured_output_request.grammar, MaskplugGrammar) and m.backend is backend
    other = _structured_request("guidance", "[0-9]+")
    with pytest.raises(VLLMValidationError, match="already using 'xgrammar'"):
        init(m, other)
    assert other.structured_output_request.grammar is None and m.backend is backend


def test_difference_a_backend_set_before_vllm_skips_its_one_backend_check(tokenizer: Any) -> None:
    """vLLM 0.33 records ``backend_name`` only when it creates the backend itself, so a wrapper that
    sets ``backend`` first (as the 0.32 wrapper does) silently turns the check off."""
    init = mp_sched_v032.make_grammar_init(patches.original(StructuredOutputManager, "grammar_init"))
    m = _manager(None, tokenizer)
    init(m, _structured_request("xgrammar", "[a-c]+"))
    assert isinstance(m.backend, MaskplugBackend) and m.backend_name is None
    other = _structured_request("guidance", "[0-9]+")
    init(m, other)  # accepted: vLLM never learnt which backend the engine uses
    assert isinstance(other.structured_output_request.grammar, MaskplugGrammar)


# ---------------------------------------------------------- rows end to end --


def _logits_for(rng: np.random.Generator, ids: list[str], spec: dict[str, list[int]]) -> torch.Tensor:
    rows = len(ids) + sum(len(spec.get(r, ())) for r in ids)
    return torch.from_numpy(rng.standard_normal((rows, tiny_model.VOCAB_SIZE))).to(torch.float32)


def test_rows_end_to_end_match_vllm_033_on_both_consumers(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """maskplug's producer into maskplug's consumers equals vLLM 0.33's producer into vLLM 0.33's
    consumers: the scatter path bit for bit, the compacted worker by vLLM's kernel rule on its own
    mapping, in every budget regime."""
    theirs_backend = XgrammarBackend(_vllm_config(), tokenizer=tokenizer, vocab_size=tiny_model.VOCAB_SIZE)
    ours_backend = MaskplugBackend(_vllm_config(), tokenizer, tiny_model.VOCAB_SIZE, "xgrammar")
    theirs_mgr, ours_mgr = _manager(theirs_backend), _manager(ours_backend)
    fill = _ours_fill()
    vllm_scatter = patches.original(so_utils, "apply_grammar_bitmask")
    rng = np.random.default_rng(43)
    schemas = tiny_model.schema_texts()
    regimes = {"full": 0, "partial": 0, "zero": 0}
    for step in range(60):
        ids, theirs_req, ours_req, spec = tiny_model.random_requests(
            rng, step, tokenizer, theirs_backend, ours_backend, schemas, _request, NUM_SPEC
        )
        # Batch order differs from the producer's order; one request without a grammar.
        plain = f"plain{step}"
        batch_ids = [*ids, plain]
        batch_ids = [batch_ids[i] for i in rng.permutation(len(batch_ids))]
        order = [ids[i] for i in rng.permutation(len(ids))]
        want_rows = StructuredOutputManager.grammar_bitmask(theirs_mgr, theirs_req, order, spec).copy()
        got_rows = fill(ours_mgr, ours_req, order, spec).copy()
        logits = _logits_for(rng, batch_ids, spec)

        sched = SimpleNamespace(scheduled_spec_decode_tokens=spec)
        want, got = logits.clone(), logits.clone()
        vllm_scatter(sched, GrammarOutput(order, want_rows), SimpleNamespace(req_ids=batch_ids), want)
        v0_33.apply_scatter(sched, GrammarOutput(order, got_rows), SimpleNamespace(req_ids=batch_ids), got)
        assert torch.equal(got, want)

        nd = np.array([len(spec.get(r, ())) for r in batch_ids])
        regime = ["full", "partial", "zero"][step % 3]
        cap = {"full": nd, "zero": np.zeros_like(nd), "partial": rng.integers(0, nd + 1)}[regime]
        regimes[regime] += 1
        cu = np.concatenate([[0], np.cumsum(cap + 1)]).astype(np.int32)
        batch = SimpleNamespace(
            req_ids=batch_ids,
            num_draft_tokens_per_req=nd.astype(np.int32),
            cu_num_logits=torch.from_numpy(cu),
            cu_num_logits_np=cu if regime == "zero" else np.concatenate([[0], np.cumsum(nd + 1)]).astype(np.int32),
        )
        compacted = logits[: int(cu[-1])].clone()
        worker = v033_worker(STRIDE, 16 * STRIDE, tiny_model.VOCAB_SIZE)
        flat, _ = v033_kernel_mapping(monkeypatch, worker, compacted.clone(), batch, order, want_rows)
        want = compacted.clone()
        rows = ((flat // STRIDE).astype(np.int32), (flat % STRIDE).astype(np.int32))
        reference.apply_grammar_bitmask(want, torch.from_numpy(want_rows), rows, cu)
        got = compacted.clone()
        v0_33.apply_compacted(SimpleNamespace(mask_stride=STRIDE), got, batch, order, got_rows)
        assert torch.equal(got, want)
    assert min(regimes.values()) >= 20


def test_difference_ragged_rows_through_vllm_033_scatter_path(tokenizer: Any) -> None:
    """Why the adapter is dispatched by release: maskplug's 0.32 producer (ragged rows) handed to
    vLLM 0.33's scatter path, which steps through the bitmask in whole blocks, lands rows on the
    wrong requests; the 0.33 producer's fixed blocks land where vLLM's own rows do."""
    backend = MaskplugBackend(_vllm_config(), tokenizer, tiny_model.VOCAB_SIZE, "xgrammar")
    eos = {int(tokenizer.eos_token_id)}
    digit = tokenizer.convert_tokens_to_ids("1")
    letter = tokenizer.convert_tokens_to_ids("a")
    reqs = {
        "digits": _request(backend.compile_grammar(StructuredOutputOptions.REGEX, "[0-9]+", eos)),
        "letters": _request(backend.compile_grammar(StructuredOutputOptions.REGEX, "[a-z]+", eos)),
    }
    spec = {"digits": [digit, digit, digit]}  # three drafts for one request, none for the other
    order = ["digits", "letters"]
    batch = SimpleNamespace(req_ids=order)
    sched = SimpleNamespace(scheduled_spec_decode_tokens=spec)
    vllm_scatter = patches.original(so_utils, "apply_grammar_bitmask")
    ragged = mp_sched_v032.make_grammar_bitmask(patches.original(StructuredOutputManager, "grammar_bitmask"))(
        _manager(backend), reqs, order, spec
    )
    fixed = _ours_fill()(_manager(backend), reqs, order, spec)
    assert ragged.shape[0] == 5 and fixed.shape[0] == 2 * STRIDE
    logits = torch.zeros(5, tiny_model.VOCAB_SIZE)
    wrong, right = logits.clone(), logits.clone()
    vllm_scatter(sched, GrammarOutput(order, ragged.copy()), batch, wrong)
    vllm_scatter(sched, GrammarOutput(order, fixed.copy()), batch, right)
    # "letters" owns logits row 4: the ragged bitmask has 5 rows, so vLLM reads it as blocks of
    # 5 // 2 = 2 rows and hands "letters" row 2 (a "digits" row) instead of row 4.
    assert bool(torch.isfinite(right[4, letter])) and not bool(torch.isfinite(right[4, digit]))
    assert bool(torch.isfinite(wrong[4, digit])) and not bool(torch.isfinite(wrong[4, letter]))


def test_batch_sharded_sampling_splits_maskplug_rows_by_request(tokenizer: Any) -> None:
    """vLLM 0.33's batch-sharded sampling hands each rank the blocks of the grammar requests it owns
    (``_shard_grammar_output`` reshapes the bitmask into one block per request); maskplug's fixed rows
    split into exactly the used rows vLLM's own producer gives each rank."""
    from vllm.v1.worker.gpu.sample.batch_shard import _shard_grammar_output

    theirs_backend = XgrammarBackend(_vllm_config(), tokenizer=tokenizer, vocab_size=tiny_model.VOCAB_SIZE)
    ours_backend = MaskplugBackend(_vllm_config(), tokenizer, tiny_model.VOCAB_SIZE, "xgrammar")
    theirs_mgr, ours_mgr = _manager(theirs_backend), _manager(ours_backend)
    fill = _ours_fill()
    rng = np.random.default_rng(45)
    schemas = tiny_model.schema_texts()
    split = 0
    for step in range(30):
        ids, theirs_req, ours_req, spec = tiny_model.random_requests(
            rng, step, tokenizer, theirs_backend, ours_backend, schemas, _request, NUM_SPEC
        )
        order = [ids[i] for i in rng.permutation(len(ids))]
        want_rows = StructuredOutputManager.grammar_bitmask(theirs_mgr, theirs_req, order, spec).copy()
        got_rows = fill(ours_mgr, ours_req, order, spec).copy()
        acceptable = [len(so_utils.strip_speculative_padding(spec.get(r, []))) for r in order]
        local = [r for r in ids if rng.random() < 0.5]
        theirs = _shard_grammar_output(GrammarOutput(order, want_rows, acceptable), local)
        ours = _shard_grammar_output(GrammarOutput(order, got_rows, acceptable), local)
        if theirs is None:
            assert ours is None and not set(local) & set(order)
            continue
        assert ours is not None
        assert ours.structured_output_request_ids == theirs.structured_output_request_ids
        assert ours.num_acceptable_drafts == theirs.num_acceptable_drafts
        used = _used(spec, ours.structured_output_request_ids)
        assert ours.grammar_bitmask.shape == theirs.grammar_bitmask.shape
        assert np.array_equal(ours.grammar_bitmask[used], theirs.grammar_bitmask[used])
        split += 1
    assert split > 10


def test_reasoning_gate_falls_back_to_vllm_033_loop_over_maskplug_grammars(tokenizer: Any) -> None:
    """With a reasoning parser that gates the grammar, vLLM 0.33's own loop (its 4-tuple
    ``_fill_bitmasks``) drives the maskplug grammars; once reasoning has ended its rows are
    maskplug's producer rows."""
    ours_backend = MaskplugBackend(_vllm_config(), tokenizer, tiny_model.VOCAB_SIZE, "xgrammar")
    theirs_backend = XgrammarBackend(_vllm_config(), tokenizer=tokenizer, vocab_size=tiny_model.VOCAB_SIZE)
    gated, plain = _manager(ours_backend), _manager(ours_backend)
    gated.reasoner_cls = object  # any parser: the adapter hands the step to vLLM's loop
    fill = _ours_fill()
    calls: list[int] = []
    vllm_fill = StructuredOutputManager._fill_bitmasks

    def counting_fill(self: Any, batch: Any) -> None:
        batch = list(batch)
        assert all(len(entry) == 4 for entry in batch)
        calls.append(len(batch))
        vllm_fill(self, batch)

    rng = np.random.default_rng(47)
    schemas = tiny_model.schema_texts()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(StructuredOutputManager, "_fill_bitmasks", counting_fill)
        for step in range(20):
            ids, _, ours_req, spec = tiny_model.random_requests(
                rng, step, tokenizer, theirs_backend, ours_backend, schemas, _request, NUM_SPEC
            )
            order = [ids[i] for i in rng.permutation(len(ids))]
            before = len(calls)
            via_vllm = fill(gated, ours_req, order, spec).copy()
            assert len(calls) > before
            calls_after = len(calls)
            ours = fill(plain, ours_req, order, spec).copy()
            assert len(calls) == calls_after  # maskplug's own producer never calls vLLM's fill
            used = _used(spec, order)
            assert np.array_equal(via_vllm[used], ours[used])
