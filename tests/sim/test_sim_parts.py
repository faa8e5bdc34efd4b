"""The simulator's parts: regex sampling, schema instances, tokenizers, randomness, progress."""

from __future__ import annotations

import io

import jsonschema
import numpy as np
import pytest
import regex
from hypothesis import given
from hypothesis import strategies as st

from maskplug import GrammarError
from maskplug.console import Progress
from maskplug.data import load_schemas, load_tokenizer
from maskplug.sim.models import hash64, uniform
from maskplug.sim.regexgen import sample_regex
from maskplug.sim.workload import REGEXES, WorkloadMix, make_request, sample_instance

SCHEMAS = load_schemas()


def _patterns(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        return own + [p for v in node.values() for p in _patterns(v)]
    if isinstance(node, list):
        return [p for v in node for p in _patterns(v)]
    return []


PATTERNS = [p for _, p in REGEXES] + [p for _, sc in SCHEMAS for p in _patterns(sc)]


@given(st.integers(0, 2**32 - 1), st.sampled_from(PATTERNS))
def test_regex_samples_match(seed: int, pattern: str) -> None:
    s = sample_regex(pattern, np.random.default_rng(seed))
    assert regex.fullmatch(pattern, s), (pattern, s)


@pytest.mark.parametrize("bad", ["[^a]", "a{x}", "(ab", "*a"])
def test_regex_sampler_refuses_what_it_cannot_serve(bad: str) -> None:
    with pytest.raises(GrammarError, match="pattern"):
        sample_regex(bad, np.random.default_rng(0))


@given(st.integers(0, 2**32 - 1), st.sampled_from(SCHEMAS))
def test_schema_instances_are_valid(seed: int, named: tuple[str, dict]) -> None:
    _, schema = named
    value = sample_instance(schema, np.random.default_rng(seed))
    jsonschema.validate(value, schema)


def test_request_stream_is_a_function_of_seed_and_index() -> None:
    mix = WorkloadMix()
    a = [make_request(5, i, SCHEMAS, mix)[0] for i in range(30)]
    b = [make_request(5, i, SCHEMAS, mix)[0] for i in range(30)]
    c = [make_request(6, i, SCHEMAS, mix)[0] for i in range(30)]
    assert a == b and a != c
    assert {r.kind for r in a} == {"json", "regex", "free"}


@pytest.mark.parametrize("name", ["tekken", "spm"])
def test_tokenizer_encodes_exactly(name: str) -> None:
    tok = load_tokenizer(name)
    for text in ['{"city": "Zoë", "n": [1, 2]}', "2024-05-17", "Hello world. Über café."]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text.encode()
        assert tok.eos not in ids
    assert tok.vocab.vocab_size == (131072 if name == "tekken" else 32000)


def test_counter_randomness_is_keyed_not_stateful() -> None:
    u1 = uniform(1, 2, np.arange(5), 7)
    u2 = uniform(1, 2, np.arange(5), 7)
    assert np.array_equal(u1, u2) and np.all((u1 >= 0) & (u1 < 1))
    assert not np.array_equal(uniform(1, 3, np.arange(5), 7), u1)
    assert hash64(0, 1, 5)[0] != hash64(0, 1, 6)[0]
    big = uniform(9, 1, np.arange(20000))
    assert abs(float(big.mean()) - 0.5) < 0.02


def test_progress_without_terminal_prints_tenths() -> None:
    buf = io.StringIO()
    bar = Progress(50, "demo", stream=buf)
    for i in range(1, 51):
        bar.update(i, "dspark: 3 [valid]")
    bar.close()
    lines = buf.getvalue().splitlines()
    assert 1 <= len(lines) <= 11
    assert lines[-1].startswith("demo ") and "50/50" in lines[-1] and "dspark: 3 [valid]" in lines[-1]
    assert "\x1b" not in buf.getvalue()  # no terminal control codes in a log
    quiet = io.StringIO()
    Progress(5, "x", stream=quiet, enabled=False).update(5)
    assert quiet.getvalue() == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_redraws_in_place() -> None:
    term = _Terminal()
    bar = Progress(4, "selftest", stream=term)
    for i in range(1, 5):
        bar.update(i, "kernel torch")
    bar.close()
    out = term.getvalue()
    # The line is redrawn in place (carriage return, erase line), not appended.
    assert "\r\x1b[2K" in out
    last = out.rsplit("\r\x1b[2K", 1)[1]
    assert "4/4" in last and "selftest" in last and "kernel torch" in last and "\n" in last


def test_progress_gives_the_terminal_back_when_the_work_fails() -> None:
    term = _Terminal()
    with pytest.raises(RuntimeError, match="work failed"), Progress(3, "demo", stream=term) as bar:
        bar.update(1, "first")
        raise RuntimeError("work failed")
    out = term.getvalue()
    assert "1/3" in out
    assert out.endswith("\x1b[?25h")  # the live display stopped and showed the cursor again
