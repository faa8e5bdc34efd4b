"""The demo's grammar provider: ``auto`` by default; a grammar that does not compile fails that request alone."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sim_testkit import simulation

from maskplug import GrammarError, reset_registry
from maskplug.cli import build_parser, main
from maskplug.data import load_schemas
from maskplug.grammar import GrammarSpec, Vocab, grammar_provider
from maskplug.plugins import get_registry
from maskplug.sim import SimConfig, run_demo
from maskplug.sim.run import format_json, format_table
from maskplug.sim.workload import WorkloadMix, make_request


def first_json_request() -> str:
    """The schema of the first JSON request of seed 0's stream (the one the provider below stops)."""
    schemas = load_schemas()
    for i in range(1000):
        spec, _ = make_request(0, i, schemas, WorkloadMix())
        if spec.kind == "json":
            return spec.name
    raise AssertionError("no JSON request in the first 1,000")


TARGET = first_json_request()


class StopsOneSchema:
    """xgrammar, except that the compile of one JSON schema (or of every spec) is stopped as at its limit."""

    name = "test-stops-one"
    every = False

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.inner = grammar_provider("xgrammar", vocab)
        self.kinds = self.inner.kinds
        self.stopped = 0
        (self.target,) = [s for n, s in load_schemas() if n == TARGET]

    def supports(self, kind: str) -> bool:
        return bool(self.inner.supports(kind))

    def compile(self, spec: GrammarSpec) -> Any:
        source = spec.source
        schema = json.loads(source) if spec.kind == "json_schema" and isinstance(source, str) else source
        if self.every or (spec.kind == "json_schema" and schema == self.target):
            self.stopped += 1
            raise GrammarError(f"spec: {self.name} did not compile this {spec.kind} spec within its limit of 5 s")
        return self.inner.compile(spec)


class StopsEverySpec(StopsOneSchema):
    name = "test-stops-every"
    every = True


@pytest.fixture
def stopping_providers() -> Any:
    reset_registry()
    try:
        for cls in (StopsOneSchema, StopsEverySpec):
            get_registry().grammar_providers[cls.name] = cls
        yield
    finally:
        reset_registry()


def test_auto_is_the_default_provider() -> None:
    assert SimConfig().provider == "auto"
    assert build_parser().parse_args(["demo"]).provider == "auto"
    assert build_parser().parse_args(["demo", "--provider", "outlines-core"]).provider == "outlines-core"


def test_the_default_run_compiles_every_grammar_through_auto() -> None:
    sim = simulation(SimConfig(steps=30, concurrency=4, tokenizer="spm"), "dspark")
    res = sim.run()
    assert sim.work.provider is not None and sim.work.provider.name == "auto"
    served = [p.compiled.served_by for p in sim.work._cache.values() if p.compiled is not None]
    assert served and set(served) <= {"llguidance", "xgrammar", "outlines-core"}
    assert res.failed == 0 and sim.work.failures == {}
    assert res.violations == [] and res.invalid == 0 and res.valid > 0


def test_a_grammar_stopped_at_its_limit_fails_that_request_alone(stopping_providers: Any) -> None:
    cfg = SimConfig(steps=30, concurrency=4, tokenizer="spm", provider=StopsOneSchema.name)
    rep = run_demo(cfg, ["verify-all", "dspark"], progress=False)
    assert rep.failures, "the run reached no request of the stopped schema"
    assert {name for name, _ in rep.failures.values()} == {TARGET}
    assert all("within its limit" in why for _, why in rep.failures.values())
    # One compile per grammar: every later request of that schema fails without compiling again.
    provider = grammar_provider(StopsOneSchema.name, rep_vocab(cfg))
    assert isinstance(provider, StopsOneSchema) and provider.stopped == 1
    for name, r in rep.results.items():
        assert r.failed > 0, name
        assert r.violations == [] and r.invalid == 0 and r.valid > 0, (name, r.violations, r.invalid_samples)
        # Nothing lost: a failed request is never admitted.
        assert r.admitted == r.valid + r.invalid + r.cut_off + r.in_flight
    # Reported in the demo's output: the table lists each failed request with its error; so does the JSON.
    table = format_table(rep)
    assert f"failed requests: {len(rep.failures)}, each alone" in table
    first = next(iter(rep.failures))
    assert f"  request {first} ({TARGET}): spec: " in table
    data = json.loads(format_json(rep, timing=False))
    assert set(data["failed_requests"]) == {str(i) for i in rep.failures}
    assert data["failed_requests"][str(first)] == {"request": TARGET, "error": rep.failures[first][1]}
    assert data["schedulers"]["dspark"]["failed"] == rep.results["dspark"].failed


def rep_vocab(cfg: SimConfig) -> Vocab:
    from maskplug.data import load_tokenizer

    return load_tokenizer(cfg.tokenizer).vocab


def test_the_demo_command_ends_with_exit_0_when_a_request_fails(
    stopping_providers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["demo", "--steps", "30", "--concurrency", "4", "--tokenizer", "spm", "--no-progress"]
    assert main([*args, "--provider", StopsOneSchema.name, "--scheduler", "dspark"]) == 0
    out = capsys.readouterr().out
    assert "failed requests: " in out and f"({TARGET}): spec: {StopsOneSchema.name} did not compile" in out


def test_a_run_whose_every_grammar_fails_stops_with_a_clear_error(stopping_providers: Any) -> None:
    cfg = SimConfig(steps=3, concurrency=2, tokenizer="spm", provider=StopsEverySpec.name, mix=WorkloadMix(1, 0, 0))
    with pytest.raises(GrammarError, match=r"^workload: 1000 requests in a row failed; the last: spec: "):
        run_demo(cfg, ["no-spec"], progress=False)


def test_references_follow_a_provider_that_holds_forced_text_to_the_tokenizers_spelling() -> None:
    """llguidance (auto's first choice) allows one of the ids that spell the same bytes (a piece or its byte
    token) in forced text; the workload's reference takes that one, so every request of the stream is served."""
    from maskplug.data import load_tokenizer
    from maskplug.sim import Workload

    cfg = SimConfig(tokenizer="spm", provider="llguidance")
    tok = load_tokenizer(cfg.tokenizer)
    work = Workload(cfg, tok, grammar_provider("llguidance", tok.vocab))
    dup: dict[bytes, list[int]] = {}
    for i, t in enumerate(tok.vocab.tokens):
        if t and i not in tok.vocab.special_ids:
            dup.setdefault(t, []).append(i)
    assert any(len(ids) > 1 for ids in dup.values())  # the vocabulary has such spellings
    served = [work.get(i) for i in range(40)]
    assert work.failures == {}
    for prep in served:
        if prep.compiled is not None:  # the reference is what the grammar accepts, to the stop token
            assert prep.compiled.matcher().validate(prep.ref.tolist()) == len(prep.ref)
