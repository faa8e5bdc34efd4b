"""The simulator's records and checks on their own: the config record, the result, the step state, the verdicts."""

from __future__ import annotations

import numpy as np
import pytest

from maskplug.grammar import GrammarSpec
from maskplug.sim import RunResult, SimConfig, WorkloadMix
from maskplug.sim.checks import allowed, output_verdict, row_allowed
from maskplug.sim.stages import StepRequests
from maskplug.sim.workload import RequestSpec


def test_the_config_record_keeps_its_fields_and_order() -> None:
    cfg = SimConfig(steps=7, mix=WorkloadMix(0.5, 0.5, 0.0), seed=3, overlap=True, check_rows=9)
    got = cfg.as_json()
    assert list(got) == [
        "steps", "concurrency", "drafts", "tokenizer", "provider", "backend", "noise", "margin", "tempt_rate",
        "max_batch_tokens", "squeeze_every", "mix",
    ]  # fmt: skip
    assert got["steps"] == 7 and got["max_batch_tokens"] == 192
    assert got["mix"] == {"json": 0.5, "regex": 0.5, "free": 0.0}
    # The seed is reported beside the config, and the check and overlap settings not at all.
    assert not {"seed", "check_rows", "overlap", "schema_dir"} & set(got)


def test_violations_are_listed_up_to_fifty_then_counted() -> None:
    res = RunResult("dspark")
    for i in range(53):
        res.violation(i, f"check {i}")
    assert res.violations[0] == "step 0: check 0" and res.violations[49] == "step 49: check 49"
    assert res.violations[50:] == ["..."] * 3


def test_run_result_derived_figures() -> None:
    res = RunResult("x", steps=4, tokens=10, accepted=6, verify_events=3, sim_ms=20.0)
    assert res.tokens_per_step == 2.5 and res.accepted_length == 3.0 and res.goodput == 500.0
    assert res.forward_ms == res.sim_ms
    assert RunResult("empty").accepted_length == 0.0 and RunResult("empty").goodput == 0.0


def _requests(prefill: list[bool], length: list[int], limit: list[int]) -> StepRequests:
    n = len(prefill)
    return StepRequests(
        rid=np.arange(n), slots=np.arange(n), length=np.asarray(length), prefill=np.asarray(prefill),
        on_track=np.ones(n, dtype=bool), limit=np.asarray(limit), prompt=np.full(n, 17), skill=np.zeros(n),
        sampled=np.zeros(n, dtype=bool), has_g=np.zeros(n, dtype=bool), window=np.zeros((n, 2), dtype=np.int64),
    )  # fmt: skip


def test_step_depth_stops_at_prefill_and_the_token_limit() -> None:
    q = _requests(prefill=[True, False, False, False], length=[0, 3, 8, 9], limit=[20, 20, 10, 10])
    # Prefilling: none; room to spare: all; one token left before the limit: none (the bonus takes it).
    assert q.depth(4).tolist() == [0, 4, 1, 0]
    assert q.non_draft.tolist() == [17, 1, 1, 1]


def _spec(kind: str, schema: dict[str, object] | None = None, pattern: str | None = None) -> RequestSpec:
    grammar = None if kind == "free" else GrammarSpec("regex", pattern or "x")
    return RequestSpec(0, kind, kind, grammar, schema, pattern, "", 1, False, 0.5, False)


@pytest.mark.parametrize(
    ("spec", "body", "verdict"),
    [
        (_spec("json", {"type": "object", "required": ["a"]}), b'{"a": 1}', "valid"),
        (_spec("json", {"type": "object", "required": ["a"]}), b'{"b": 1}', "invalid"),
        (_spec("json", {"type": "object"}), b'{"a": ', "invalid"),
        (_spec("regex", pattern="[0-9]{3}"), b"123", "valid"),
        (_spec("regex", pattern="[0-9]{3}"), b"1234", "invalid"),
        (_spec("free"), "café".encode(), "valid"),
        (_spec("free"), b"\xff\xfe", "invalid"),
    ],
)
def test_output_verdicts(spec: RequestSpec, body: bytes, verdict: str) -> None:
    assert output_verdict(spec, body) == verdict


def test_the_bit_tests_agree() -> None:
    rng = np.random.default_rng(5)
    bm = rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    vocab = 4 * 32 - 5
    for r in range(3):
        row = row_allowed(bm[r], vocab)
        tokens = np.arange(vocab, dtype=np.int64)
        assert np.array_equal(allowed(bm, np.full(vocab, r), tokens), row)
        assert row.tolist() == [bool((int(bm[r, t >> 5]) >> (t & 31)) & 1) for t in range(vocab)]
