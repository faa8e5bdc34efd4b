"""The pieces of adaptive verification that serve a multi-process engine, without an engine.

* :class:`~maskplug_vllm.confidences.DraftConfidences`: live and two-steps-old
  confidences per request, new requests at 1, finished ones forgotten;
* the drafter wrappers: the ids vLLM's greedy sampler picks, and the
  probability of each, per request and position, carried on ``DraftTokenIds``
  (and through pickling, as vLLM's executor sends it);
* the counter files and the Prometheus collector (:mod:`maskplug_vllm.metrics`),
  and :func:`maskplug_vllm.step_stats` read from them in a process that does
  not schedule;
* :func:`maskplug_vllm.adaptive.check_config`: each refused setting named.
"""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable
from pathlib import Path
from types import MethodType, SimpleNamespace
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from maskplug_vllm import adaptive, confidences, metrics
from vllm.v1.outputs import DraftTokenIds

from maskplug import CostModel, PluginError
from maskplug.schedulers import GoodputScheduler, VerifyAllScheduler


def test_confidences_live_and_two_steps_old() -> None:
    dc = confidences.DraftConfidences()
    spec = {"a": [1, 2, 3], "b": [4]}
    assert dc.for_step(["a", "b"], spec) == (None, None)  # nothing recorded: no confidence head
    dc.record(["a", "b"], [[0.9, 0.5, 0.2], [0.3, 0.1, 0.1]])
    stale, live = dc.for_step(["a", "b", "c"], {**spec, "c": [5, 6]})
    assert stale is not None and live is not None
    # The first recording is live; nothing older exists, so the stale rows read as confidence 1.
    assert live.tolist() == [[0.9, 0.5, 0.2], [0.3, 0.1, 0.1], [1.0, 1.0, 1.0]]
    assert stale.tolist() == [[1.0] * 3] * 3
    dc.record(["a"], [[0.4, 0.4, 0.4]])
    stale, live = dc.for_step(["a", "b"], spec)
    assert stale is not None and live is not None
    assert live.tolist() == [[0.4, 0.4, 0.4], [0.3, 0.1, 0.1]]
    assert stale[0].tolist() == [0.9, 0.5, 0.2] and stale[1].tolist() == [1.0] * 3
    dc.forget(["a"])
    stale, live = dc.for_step(["a"], spec)
    assert stale is not None and live is not None and live.tolist() == [[1.0] * 3]
    # Out-of-range values never reach a scheduler.
    dc.record(["b"], [[1.5, -0.5]])
    _, live = dc.for_step(["b"], {"b": [1, 2]})
    assert live is not None and live.tolist() == [[1.0, 0.0]]


class _Drafter:
    """Just what the wrappers read of vLLM's ``SpecDecodeBaseProposer``."""

    use_local_argmax_reduction = False
    use_heterogeneous_vocab = False

    def __init__(self, logits: list[torch.Tensor]) -> None:
        self.steps = iter(logits)
        self.model = SimpleNamespace(compute_logits=lambda hidden: hidden)

    def _greedy_sample(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.argmax(dim=-1)

    def propose(self, k: int) -> torch.Tensor:
        return torch.stack([self._greedy_sample(next(self.steps)) for _ in range(k)], dim=1)


def test_drafter_records_the_probability_of_each_proposed_token() -> None:
    rng = np.random.default_rng(0)
    logits = [torch.from_numpy(rng.standard_normal((4, 50)).astype(np.float32)) for _ in range(3)]
    plain = _Drafter(logits).propose(3)

    class Recording(_Drafter):
        _greedy_sample = confidences.make_greedy_sample(_Drafter._greedy_sample)
        propose = confidences.make_propose(_Drafter.propose)

    d = Recording(logits)
    ids = d.propose(3)
    assert torch.equal(ids, plain)  # the drafts are vLLM's own
    conf = getattr(d, "_maskplug_confidences")  # noqa: B009 - set by the wrapper, unknown to the type
    expect = torch.stack([torch.softmax(x, -1).max(-1).values for x in logits], dim=1)
    assert conf.shape == (4, 3) and torch.allclose(conf, expect)

    class Runner:
        drafter = d

        def take_draft_token_ids(self) -> DraftTokenIds:
            return DraftTokenIds(["r0", "r1", "r2"], ids[:3].tolist())

    take = confidences.make_take_draft_token_ids(Runner.take_draft_token_ids)
    out = pickle.loads(pickle.dumps(take(Runner())))  # as the multiprocess executor returns it
    got = getattr(out, confidences.CONFIDENCES_ATTR)
    assert np.allclose(got, expect[:3].numpy()) and out.draft_token_ids == ids[:3].tolist()
    # A drafter path that records nothing sends nothing.
    setattr(d, "_maskplug_confidences", None)  # noqa: B010
    assert not hasattr(take(Runner()), confidences.CONFIDENCES_ATTR)


def _stats(steps: int) -> dict[str, Any]:
    return {
        "steps": steps,
        "regimes": {"full": 1, "partial": 2, "zero": 3},
        "drafts_scheduled": 40,
        "drafts_verified": 25,
        "drafts_accepted": 20,
        "tokens_emitted": 90,
        "structured_steps": 6,
    }


def test_counter_files_and_the_prometheus_collector(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    w = metrics.StepMetrics(tmp_path, 0, "goodput")
    w.publish(_stats(7), budget=5)
    metrics.StepMetrics(tmp_path, 1, "goodput").publish(_stats(3), budget=0)
    got = metrics.read_metrics(tmp_path)
    assert got["0"]["steps"] == 7 and got["0"]["budget"] == 5 and got["0"]["regime_zero"] == 3
    assert got["1"]["steps"] == 3 and got["0"]["scheduler"] == "goodput"
    w.set_scheduler("no-spec")
    reg = CollectorRegistry()
    reg.register(metrics._Collector(tmp_path))
    text = generate_latest(reg).decode()
    assert 'maskplug_steps_total{engine="0"} 7.0' in text
    assert 'maskplug_steps_total{engine="1"} 3.0' in text
    assert 'maskplug_regime_steps_total{engine="0",regime="partial"} 2.0' in text
    assert 'maskplug_drafts_verified_total{engine="0"} 25.0' in text
    assert 'maskplug_budget{engine="0"} 5.0' in text
    assert 'maskplug_scheduler_info{engine="0",name="no-spec"} 1.0' in text


def test_step_stats_in_a_process_that_does_not_schedule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(
        adaptive, "_controller", adaptive._Controller(GoodputScheduler(), "goodput", CostModel.linear())
    )
    w = metrics.StepMetrics(tmp_path, 0, "goodput")
    w.publish(_stats(7), budget=5)
    st = adaptive.step_stats()
    assert (st["steps"], st["drafts_verified"], st["regimes"]["zero"], st["scheduler"]) == (7, 25, 3, "goodput")
    adaptive.reset_step_stats()
    assert adaptive.step_stats()["steps"] == 0
    w.publish(_stats(9), budget=1)
    assert adaptive.step_stats()["steps"] == 2
    # The scheduler of an engine core in another process cannot be switched from here: refused, not ignored.
    with pytest.raises(PluginError, match=r"set_scheduler: the engine core runs in another process"):
        adaptive.set_scheduler("no-spec")
    with pytest.raises(PluginError, match=r"set_cost_model: the engine core runs in another process"):
        adaptive.set_cost_model(CostModel.linear())


def _sums(steps: list[tuple[int, int, int, int, bool, str]]) -> dict[str, Any]:
    """The counters of :func:`adaptive.step_stats` for these steps (scheduled, verified, accepted, emitted, ...)."""
    structured = [regime for *_, s, regime in steps if s]
    return {
        "steps": len(steps),
        "regimes": {r: structured.count(r) for r in ("full", "partial", "zero")},
        "drafts_scheduled": sum(x[0] for x in steps),
        "drafts_verified": sum(x[1] for x in steps),
        "drafts_accepted": sum(x[2] for x in steps),
        "tokens_emitted": sum(x[3] for x in steps),
        "structured_steps": len(structured),
    }


def test_steps_are_counted_in_batches_and_published_before_the_engine_idles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``maskplug_step_end`` listeners the metrics file is written in batches.

    The counters move on every step; at most :data:`adaptive.FOLD_EVERY`
    steps wait to be published; the end of a step in which a request
    finished, an empty step, a read of :func:`step_stats` and a reset publish
    everything at once; the totals equal a sum of every step's figures.
    """
    ctl = adaptive._Controller(GoodputScheduler(), "goodput", CostModel.linear())
    monkeypatch.setattr(adaptive, "_controller", ctl)
    ctl.metrics = metrics.StepMetrics(tmp_path, 0, "goodput")
    rng = np.random.default_rng(3)
    seen: list[tuple[int, int, int, int, bool, str]] = []
    sched = SimpleNamespace(vllm_config=None, finished_req_ids=set(), requests={})
    # vLLM's update_from_output, wrapped: a step that ran the model but maskplug holds no plan for,
    # counted as a verify-all step; its figures are drawn below and tallied in place of finish_all's.
    so_step = SimpleNamespace(total_num_scheduled_tokens=4)
    update = adaptive._make_update_from_output(lambda self, so, out: None)
    figures: list[Any] = []
    monkeypatch.setattr(ctl, "finish_all", lambda requests, so, out: ctl._tally(*figures))
    published = 0
    for step in range(300):
        nd = int(rng.integers(0, 9))
        b = int(rng.integers(0, nd + 1))
        acc, emitted = int(rng.integers(0, b + 1)), int(rng.integers(1, 9))
        structured = bool(rng.random() < 0.7)
        regime = "zero" if b == 0 else "full" if b == nd else "partial"
        finished = rng.random() < 0.05
        # The step's outcome, counted where vLLM's update_from_output runs (an unplanned verify-all step).
        sched.finished_req_ids = {"done"} if finished else set()
        figures[:] = [nd, b, emitted, acc, structured, regime, 4, 2, 0]
        update(sched, so_step, None)
        seen.append((nd, b, acc, emitted, structured, regime))
        assert ctl.unpublished < adaptive.FOLD_EVERY
        on_file = metrics.read_metrics(tmp_path)["0"]
        if finished:
            assert ctl.unpublished == 0 and on_file["steps"] == step + 1 and on_file["budget"] == b
        assert on_file["steps"] == step + 1 - ctl.unpublished
        published += on_file["steps"] == step + 1
        if step == 150:
            assert {k: v for k, v in adaptive.step_stats().items() if k != "scheduler"} == _sums(seen)
            assert ctl.unpublished == 0
    assert published < 150  # most steps waited
    # vLLM's empty step after the last request ends: everything is counted and published.
    so = SimpleNamespace(total_num_scheduled_tokens=0, finished_req_ids=set())
    adaptive._make_schedule(lambda self: so, lambda self, so: None)(sched)
    want = _sums(seen)
    assert ctl.unpublished == 0 and ctl.stats == want
    on_file = metrics.read_metrics(tmp_path)["0"]
    assert (on_file["steps"], on_file["drafts_accepted"], on_file["regime_partial"]) == (
        300,
        want["drafts_accepted"],
        want["regimes"]["partial"],
    )
    ctl._tally(3, 3, 4, 3, True, "full", 1, 1, 0)
    adaptive.reset_step_stats()
    assert ctl.unpublished == 0 and adaptive.step_stats()["steps"] == 0
    assert metrics.read_metrics(tmp_path)["0"]["steps"] == 0


def _vllm_scheduler(requests: dict[str, Any]) -> SimpleNamespace:
    """A stand-in for vLLM's scheduler with maskplug's ``make_spec_decoding_stats`` (vLLM's statistics off)."""
    sched = SimpleNamespace(vllm_config=None, finished_req_ids=set(), requests=requests, log_stats=False)

    from maskplug_vllm import patches
    from vllm.v1.core.sched.scheduler import Scheduler

    # vLLM's own method, never called with its statistics off (the wrapper answers None itself).
    own = patches.original(Scheduler, "make_spec_decoding_stats")
    sched.make_spec_decoding_stats = MethodType(adaptive._make_make_spec_decoding_stats(own), sched)
    return sched


def test_make_spec_decoding_stats_is_wrapped_only_as_vllm_declares_it() -> None:
    """vLLM's method takes the parameters the wrapper passes on; another signature is refused at install."""
    from maskplug_vllm import patches
    from vllm.v1.core.sched.scheduler import Scheduler

    own = patches.original(Scheduler, "make_spec_decoding_stats")
    assert tuple(inspect.signature(own).parameters) == adaptive.SPEC_STATS_PARAMS
    wrapped = adaptive._make_make_spec_decoding_stats(own)
    assert tuple(inspect.signature(wrapped).parameters) == adaptive.SPEC_STATS_PARAMS
    with pytest.raises(PluginError, match=r"make_spec_decoding_stats: expected the parameters self, .* got self, a, b"):
        adaptive._make_make_spec_decoding_stats(lambda self, a, b: None)
    # vLLM's own update_from_output hands every drafted request to it, by these names, with its accepted drafts.
    source = inspect.getsource(patches.original(Scheduler, "update_from_output"))
    call = source[source.index("self.make_spec_decoding_stats(") :]
    call = call[: call.index(")")]
    for name in adaptive.SPEC_STATS_PARAMS[2:]:
        assert f"{name}=" in call
    assert "num_accepted = max(len(generated_token_ids) - num_sampled, 0)" in source


def _vllm_update(seen: list[Any], stopping: list[str] | None = None) -> Callable[[Any, Any, Any], None]:
    """What vLLM 0.32's ``update_from_output`` does that a ``verify-all`` count reads, in its order.

    For each scheduled request: with drafts and sampled tokens,
    ``make_spec_decoding_stats`` gets its drafts and its sampled tokens less
    one (``test_vllm_hands_every_drafted_request_to_make_spec_decoding_stats``
    checks vLLM's code says so); then a stopping request's list is trimmed
    in place to one token and the request freed (``stopping``: the requests
    that stop in this step), and the scheduler's set says which finished.
    """

    def update(self: Any, so: Any, out: Any) -> None:
        seen.append(so)
        if not so.total_num_scheduled_tokens:
            return  # a step that ran nothing
        sampled, index = out.sampled_token_ids, out.req_id_to_index
        for r in so.num_scheduled_tokens:
            drafts = so.scheduled_spec_decode_tokens.get(r)
            generated = sampled[index[r]] if sampled else []
            if drafts and generated:
                self.make_spec_decoding_stats(
                    None,
                    num_draft_tokens=len(drafts),
                    num_accepted_tokens=max(len(generated) - 1, 0),
                    num_invalid_spec_tokens=None,
                    request_id=r,
                )
            if stopping and r in stopping:
                del generated[1:]
                del self.requests[r]
        self.finished_req_ids = set(stopping or ())

    return update


def test_a_verify_all_step_is_counted_from_the_scheduler_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine core's three wrappers under ``verify-all``, in vLLM's order for each step.

    ``schedule`` and ``get_grammar_bitmask`` hand vLLM's outputs back
    untouched and keep nothing (in the engine vLLM's own methods run there
    instead); ``update_from_output`` counts the step from the scheduler
    output, the runner's output and the scheduler's map of requests (also
    when the scheduler was switched in between), forgets the requests that finished,
    and on a step that ran nothing counts what waited.
    """
    from maskplug.schedulers import VerifyAllScheduler

    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(tmp_path))
    ctl = adaptive._Controller(VerifyAllScheduler(), "verify-all", CostModel.linear())
    monkeypatch.setattr(adaptive, "_controller", ctl)
    assert ctl.verifies_all
    ctl.confidences.record(["a", "b"], [[0.5, 0.5], [0.5, 0.5]])
    # "a" is a grammar request, "b" is not, "c" is one in a prefill chunk.
    requests = {r: SimpleNamespace(use_structured_output=r != "b", is_prefill_chunk=r == "c") for r in ("a", "b", "c")}
    sched = _vllm_scheduler(requests)
    schedule = adaptive._make_schedule(lambda self, so: so, lambda self, so: pytest.fail("rows in schedule"))
    grammar_output = SimpleNamespace(structured_output_request_ids=["a"])
    rows = adaptive._make_get_grammar_bitmask(lambda self, so: grammar_output)
    seen: list[Any] = []
    update = adaptive._make_update_from_output(_vllm_update(seen))

    def step(spec: dict[str, list[int]], emitted: dict[str, int], finished: tuple[str, ...] = ()) -> Any:
        nst = {r: len(d) + 1 for r, d in spec.items()}
        so = SimpleNamespace(
            num_scheduled_tokens=nst,
            scheduled_spec_decode_tokens={r: d for r, d in spec.items() if d},
            total_num_scheduled_tokens=sum(nst.values()),
            finished_req_ids=set(finished),
            has_structured_output_requests=True,
        )
        assert schedule(sched, so) is so and not hasattr(sched, adaptive._STEPS_ATTR)
        return so, SimpleNamespace(
            sampled_token_ids=[[7] * emitted[r] for r in spec], req_id_to_index={r: i for i, r in enumerate(spec)}
        )

    # Step 1: both requests drafted; "a" (a grammar request) had 2 of 3 accepted, "b" none of 2.
    so, out = step({"a": [1, 2, 3], "b": [4, 5]}, {"a": 3, "b": 1})
    before = set(vars(so))
    assert rows(sched, so) is grammar_output
    update(sched, so, out)
    assert set(vars(so)) == before  # nothing of maskplug's on vLLM's output
    # Step 2: the scheduler is switched between the rows and the outcome; the step is still counted.
    so, out = step({"a": [1], "b": []}, {"a": 2, "b": 1}, finished=("b",))
    assert rows(sched, so) is grammar_output
    ctl.scheduler = GoodputScheduler()
    assert not ctl.verifies_all
    update(sched, so, out)
    ctl.scheduler = VerifyAllScheduler()
    assert ctl.confidences.for_step(["a", "b"], {"a": [1, 2], "b": [3, 4]})[1].tolist() == [
        [0.5, 0.5],
        [1.0, 1.0],  # "b" finished: forgotten, so it reads as new
    ]
    # Step 3: drafts only for requests without rows (no grammar, a prefill chunk): not a structured step.
    so, out = step({"b": [4], "c": [5, 6]}, {"b": 2, "c": 1})
    update(sched, so, out)
    # An empty step announcing a finished request: what waited is counted and published.
    empty = SimpleNamespace(total_num_scheduled_tokens=0, finished_req_ids={"a"})
    rows(sched, empty)
    assert ctl.unpublished
    update(sched, empty, None)
    assert ctl.unpublished == 0 and len(seen) == 4
    assert ctl.confidences.for_step(["a"], {"a": [1, 2]})[1].tolist() == [[1.0, 1.0]]
    want = {"steps": 3, "drafts_scheduled": 9, "drafts_verified": 9, "drafts_accepted": 4, "tokens_emitted": 10}
    assert {k: ctl.stats[k] for k in want} == want
    assert ctl.stats["structured_steps"] == 2 and ctl.stats["regimes"]["full"] == 2
    assert metrics.read_metrics(tmp_path)["0"]["steps"] == 3


def _config(**over: Any) -> SimpleNamespace:
    cfg = {
        "speculative_config": SimpleNamespace(num_speculative_tokens=3, method="ngram"),
        "scheduler_config": SimpleNamespace(async_scheduling=False),
        "parallel_config": SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=2),
    }
    cfg.update(over)
    return SimpleNamespace(**cfg)


@pytest.mark.parametrize(
    ("scheduler", "config", "message"),
    [
        ("goodput", _config(speculative_config=None), r"without speculative decoding.*--speculative-config"),
        ("goodput", _config(scheduler_config=SimpleNamespace(async_scheduling=True)), r"async_scheduling=True"),
        (
            "goodput",
            _config(parallel_config=SimpleNamespace(pipeline_parallel_size=2)),
            r"pipeline_parallel_size=2.*--tensor-parallel-size",
        ),
        ("dspark", _config(), r"=dspark.*confidences.*'ngram'.*draft_model"),
        ("grammar-aware:dspark", _config(), r"=grammar-aware:dspark.*confidences.*'ngram'"),
    ],
)
def test_check_config_names_what_is_refused(scheduler: str, config: SimpleNamespace, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        adaptive.check_config(config, scheduler)


@pytest.mark.parametrize("scheduler", ["goodput", "grammar-aware:goodput", "verify-all", "no-spec"])
def test_check_config_accepts_tensor_parallel_and_drafters(scheduler: str) -> None:
    adaptive.check_config(_config(), scheduler)
    draft = _config(speculative_config=SimpleNamespace(num_speculative_tokens=3, method="draft_model"))
    adaptive.check_config(draft, scheduler)
    adaptive.check_config(draft, "dspark")
    adaptive.check_config(draft, "grammar-aware:dspark")


def test_whitespace_bound_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from maskplug_vllm import backend

    from maskplug.grammar.sdk import DEFAULT_MAX_WHITESPACE

    monkeypatch.delenv(backend.MAX_WHITESPACE_ENV, raising=False)
    assert backend.max_whitespace_from_env() == DEFAULT_MAX_WHITESPACE
    for raw, want in (("none", None), ("NONE", None), ("0", 0), (" 40 ", 40)):
        monkeypatch.setenv(backend.MAX_WHITESPACE_ENV, raw)
        assert backend.max_whitespace_from_env() == want
    for bad in ("-1", "2.5", "many"):
        monkeypatch.setenv(backend.MAX_WHITESPACE_ENV, bad)
        with pytest.raises(PluginError, match=r"MASKPLUG_VLLM_MAX_WHITESPACE: expected a whole number"):
            backend.max_whitespace_from_env()


@st.composite
def _runner_steps(draw: st.DrawFn) -> tuple[dict[str, list[int]], dict[str, int], list[list[int]], dict[str, int]]:
    """A step as vLLM's scheduler and runner report it: drafts, tokens, sampled lists in batch order.

    A request emits its accepted drafts and one token more, or nothing (a
    prefill chunk); the runner's rows are in any order.
    """
    n = draw(st.integers(0, 12))
    ids = [f"req-{i}" for i in range(n)]
    spec: dict[str, list[int]] = {}
    nst: dict[str, int] = {}
    emitted: dict[str, int] = {}
    for r in ids:
        nd = draw(st.integers(0, 5))
        if nd:
            spec[r] = [7] * nd
        nst[r] = nd + draw(st.integers(1, 3))
        emitted[r] = draw(st.one_of(st.just(0), st.integers(1, nd + 1)))
    order = draw(st.permutations(range(n)))
    sampled: list[list[int]] = [[] for _ in ids]
    index = {}
    for i, r in enumerate(ids):
        sampled[order[i]] = [3] * emitted[r]
        index[r] = order[i]
    return spec, nst, sampled, index


@given(step=_runner_steps(), drop=st.booleans(), gids_given=st.booleans(), listened=st.booleans())
def test_a_verify_all_count_is_the_sum_over_requests(
    step: tuple[dict[str, list[int]], dict[str, int], list[list[int]], dict[str, int]],
    drop: bool,
    gids_given: bool,
    listened: bool,
) -> None:
    """``finish_all``'s count equals the per-request sums, on vLLM's usual step and on one the runner's rows miss.

    On vLLM's usual step (one sampled list per scheduled request) the count
    takes C-level passes over the lists; when a scheduled request is missing
    from the runner's index it reads each request. Both give, per request,
    ``len(drafts)`` scheduled and verified, ``len(sampled)`` emitted and
    ``max(0, min(emitted - 1, drafts))`` accepted. The grammar requests,
    when not given, are read off the scheduler's map as vLLM reads them
    (a prefill chunk has no rows): all of them for the listeners' record,
    only those with drafts without listeners; the step counts as structured
    alike.
    """
    spec, nst, sampled, index = step
    if drop and index:
        del index[next(iter(index))]  # a request the runner no longer holds: it emitted nothing
    chunks = set(list(nst)[2::3])  # grammar requests in a prefill chunk (drafts or not: the map decides)
    gids = [r for r in list(nst)[::2] if r not in chunks]
    so = SimpleNamespace(
        num_scheduled_tokens=nst,
        scheduled_spec_decode_tokens=spec,
        finished_req_ids=set(),
        has_structured_output_requests=bool(gids),
    )
    requests = {
        r: SimpleNamespace(use_structured_output=r in gids or r in chunks, is_prefill_chunk=r in chunks) for r in nst
    }
    ctl = adaptive._Controller(VerifyAllScheduler(), "verify-all", CostModel.linear())
    records: list[tuple[Any, ...]] = []
    if listened:
        ctl.hooks = [None]  # pluggy's list of listeners, as the controller holds it: someone listens
        ctl._tally = _recording(ctl._tally, records)  # type: ignore[method-assign]
    ctl.finish_all(
        requests, so, SimpleNamespace(sampled_token_ids=sampled, req_id_to_index=index), gids if gids_given else None
    )
    emitted = {r: len(sampled[j]) for r, j in index.items()}
    want = {
        "steps": 1,
        "drafts_scheduled": sum(map(len, spec.values())),
        "drafts_verified": sum(map(len, spec.values())),
        "tokens_emitted": sum(emitted.values()),
        "drafts_accepted": sum(max(0, min(e - 1, len(spec.get(r, ())))) for r, e in emitted.items()),
        "structured_steps": int(any(spec.get(r) for r in gids)),
    }
    assert {k: ctl.stats[k] for k in want} == want
    assert ctl.stats["regimes"] == {"full": want["structured_steps"], "partial": 0, "zero": 0}
    assert ctl.counts[-1] == want["drafts_verified"]  # the step's budget, for the metrics file
    if listened:
        assert [r[7] for r in records] == [len(gids)]  # the record's number of grammar requests


def _recording(tally: Callable[..., None], records: list[tuple[Any, ...]]) -> Callable[..., None]:
    def record(*args: Any) -> None:
        records.append(args)
        tally(*args)

    return record


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        # (the step, whether a request stops in it, which requests have grammars)
        st.tuples(_runner_steps(), st.integers(0, 3).map(lambda x: x == 0), st.booleans()),
        min_size=1,
        max_size=40,
    )
)
def test_a_verify_all_step_counted_as_vllm_goes_is_counted_as_finish_all_counts_it(
    steps: list[tuple[tuple[dict[str, list[int]], dict[str, int], list[list[int]], dict[str, int]], bool, bool]],
) -> None:
    """``update_from_output`` under ``verify-all`` without listeners counts through vLLM's own calls.

    Each step runs through the wrapper around :func:`_vllm_update`, which
    hands each drafted request to ``make_spec_decoding_stats`` and then does
    what the count must not see: it trims a stopping request's sampled list
    and frees the request. The counters equal those of
    :meth:`~maskplug_vllm.adaptive._Controller.finish_all` counting every
    step before vLLM's method ran, after every step (the metrics file, once
    a request finished, too); at most ``FOLD_EVERY - 1`` steps wait to be
    written; the finished requests are forgotten at once.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, patch.object(adaptive, "_controller", None):
        ctl = adaptive._Controller(VerifyAllScheduler(), "verify-all", CostModel.linear())
        ctl.metrics = metrics.StepMetrics(Path(tmp), 0, "verify-all")
        adaptive._controller = ctl
        ref = adaptive._Controller(VerifyAllScheduler(), "verify-all", CostModel.linear())
        assert not ctl.hooks and not ref.hooks
        sched = _vllm_scheduler({})
        stopping: list[str] = []
        update = adaptive._make_update_from_output(_vllm_update([], stopping))
        finished_before: set[str] = set()
        for i, ((spec, nst, sampled, index), stops, grammar_odd) in enumerate(steps):
            for r, j in index.items():
                if spec.get(r) and not sampled[j]:
                    sampled[j].append(3)  # vLLM samples at least one token for a request with drafts
            # Grammar requests (every other one) and plain ones; a request without drafts may be in a
            # prefill chunk.
            sched.requests = {
                r: SimpleNamespace(
                    use_structured_output=(j % 2 == 1) == grammar_odd, is_prefill_chunk=r not in spec and j % 3 == 0
                )
                for j, r in enumerate(nst)
            }
            so = SimpleNamespace(
                num_scheduled_tokens=nst,
                scheduled_spec_decode_tokens=spec,
                total_num_scheduled_tokens=sum(nst.values()),
                finished_req_ids=finished_before,
                has_structured_output_requests=True,
            )
            if not nst:
                continue  # vLLM's empty step: nothing counted (test_a_verify_all_step_is_counted_...)
            out = SimpleNamespace(sampled_token_ids=sampled, req_id_to_index=index)
            stopping[:] = [r for r, j in index.items() if len(sampled[j]) > 1][:1] if stops else []
            # Counted at once, before vLLM's method changes anything.
            before = SimpleNamespace(sampled_token_ids=[list(x) for x in sampled], req_id_to_index=index)
            ref.finish_all(dict(sched.requests), so, before)
            gone = sorted(finished_before)
            if gone:
                ctl.confidences.record(gone, [[0.5]] * len(gone))
            update(sched, so, out)
            assert ctl.counts == ref.counts, i
            if gone:
                live = ctl.confidences.for_step(gone, {r: [1] for r in gone})[1]
                assert live is not None and live.tolist() == [[1.0]] * len(gone)  # forgotten: read as new
            assert ctl.unpublished < adaptive.FOLD_EVERY
            if stopping:
                assert ctl.unpublished == 0
                assert metrics.read_metrics(Path(tmp))["0"]["steps"] == ctl.counts[0]
            finished_before = set(stopping)
        assert ctl.stats == ref.stats
