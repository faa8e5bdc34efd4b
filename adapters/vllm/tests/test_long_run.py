"""A long run of vLLM's CPU engine under maskplug's adaptive verification (``long_run.py``).

300 requests (JSON schema, regex, unconstrained) arrive while others decode;
some are aborted, some cut off by ``max_tokens``; the scheduler changes every
25 steps while requests arrive (``grammar-aware:goodput``, ``goodput``, a
random-budget scheduler), so full, partial and zero-budget steps all occur,
and a fresh ``grammar-aware:goodput`` sees the last ones through. About 40 s
on two cores, in a fresh process.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import tiny_model

NUM_REQUESTS = 300


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("long")
    model = tiny_model.build(folder / "model")
    out = folder / "out.json"
    env = {"MASKPLUG_VLLM": "1", "MASKPLUG_VLLM_SCHEDULER": "grammar-aware:goodput"}
    return tiny_model.run_script("long_run.py", model, out, "--requests", str(NUM_REQUESTS), env=env)


def test_every_request_ended_and_the_traffic_had_every_kind_of_ending(run: dict[str, Any]) -> None:
    reqs = run["requests"]
    info = run["info"]
    assert info["adaptive"] is True
    assert len(reqs) == NUM_REQUESTS
    assert info["steps"] > 100 and info["max_in_flight"] > 32  # a queue formed: requests waited for room
    aborted = [r for r in reqs if "aborted" in r]
    ended = [r for r in reqs if "aborted" not in r]
    assert all(r.get("finish_reason") in ("stop", "length") for r in ended)
    cut = [r for r in ended if r["finish_reason"] == "length"]
    for r in cut:
        assert r["num_tokens"] == r["max_tokens"]
    assert len(aborted) >= 5
    assert sum(r["max_tokens"] < 20 for r in cut) >= 30  # cut off mid-output by a small max_tokens
    assert sum(r["finish_reason"] == "stop" and r["kind"] != "free" for r in ended) >= 30


def test_the_engine_holds_nothing_afterwards(run: dict[str, Any]) -> None:
    info = run["info"]
    assert info["free_blocks_end"] == info["free_blocks_start"]
    assert info["engine_requests_left"] == info["engine_running_left"] == info["engine_waiting_left"] == 0


def test_every_regime_occurred_and_the_counters_add_up(run: dict[str, Any]) -> None:
    stats = run["info"]["stats"]
    assert all(stats["regimes"][k] > 0 for k in ("full", "partial", "zero")), stats
    assert sum(stats["regimes"].values()) == stats["structured_steps"] <= stats["steps"]
    assert 0 < stats["drafts_accepted"] <= stats["drafts_verified"] < stats["drafts_scheduled"]


def test_every_finished_structured_output_is_valid(run: dict[str, Any]) -> None:
    schemas = {p.stem: json.loads(p.read_text()) for p in tiny_model.schema_paths()}
    checked = {"json": 0, "regex": 0}
    for r in run["requests"]:
        if r.get("finish_reason") != "stop" or r["kind"] == "free":
            continue
        if r["kind"] == "regex":
            assert re.fullmatch(r["regex"], r["text"]), (r["regex"], r["text"])
        else:
            # Read as xgrammar admits it: raw control characters (TAB included) in length-bounded strings.
            jsonschema.validate(tiny_model.xgrammar_json(r["text"]), schemas[r["schema"]])
        checked[r["kind"]] += 1
    assert checked["json"] >= 5 and checked["regex"] >= 20, checked


def test_the_scheduler_keeps_no_state_for_ended_requests(run: dict[str, Any]) -> None:
    """After the engine went idle, maskplug's scheduler tracks no request (nothing leaks over long runs).

    The last requests finish or are aborted in a step that schedules no tokens (the engine draining):
    their ids must reach the scheduler all the same."""
    info = run["info"]
    assert info["scheduler"] == "grammar-aware:goodput"
    # goodput keeps per-request state, and held some while the last requests ran: the check means something.
    assert info["scheduler_tracked_ids"] is not None and info["scheduler_tracked_ids_draining_max"] > 0
    assert info["scheduler_tracked_ids"] == []
