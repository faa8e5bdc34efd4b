"""Run vLLM's CPU engine once with two faulty grammar requests in a batch, then without them; write JSON.

Usage: ``python fault_run.py MODEL_DIR OUT_JSON`` with ``MASKPLUG_VLLM=1``. The
engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
script can reach into it:

* the matcher of the request whose schema is titled ``maskplug-fault-fill``
  raises from its :data:`FILL_FAULT_AT`-th ``fill`` on (the mask-row
  producer meets it: :attr:`maskplug.DraftMasks.failed`);
* the matcher of the request titled ``maskplug-fault-commit`` raises at its
  :data:`COMMIT_FAULT_AT`-th commit, i.e. inside vLLM's call of
  ``MaskplugGrammar.accept_tokens`` after a step (the producer's own walks
  over its drafts are left alone).

Both batches are greedy and run on one engine, one after the other: the
batch with the faulty requests first, then the same good requests alone.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

NUM_SPEC = 3
MAX_TOKENS = 64
NUM_GOOD = 6
FILL_FAULT_AT = 9
COMMIT_FAULT_AT = 4
FILL_MARK = "maskplug-fault-fill"
COMMIT_MARK = "maskplug-fault-commit"

_committing = threading.local()


class FaultyMatcher:
    """A maskplug matcher that raises ``RuntimeError`` at a chosen call; every other call goes to ``inner``."""

    batch_ops = None
    releases_gil = False

    def __init__(self, inner: Any, mode: str, at: int) -> None:
        self.inner = inner
        self.mode = mode
        self.at = at
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _count(self, what: str) -> None:
        self.calls += 1
        if self.calls >= self.at:
            raise RuntimeError(f"injected fault: {what} call {self.calls}")

    def fill(self, bitmask: Any, row: int) -> bool:
        if self.mode == "fill":
            self._count("fill")
        return bool(self.inner.fill(bitmask, row))

    def accept(self, token: int) -> bool:
        if self.mode == "commit" and getattr(_committing, "on", False):
            self._count("commit")
        return bool(self.inner.accept(token))

    def validate(self, tokens: Any) -> int:
        return int(self.inner.validate(tokens))

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)

    def is_terminated(self) -> bool:
        return bool(self.inner.is_terminated())

    def reset(self) -> None:
        self.inner.reset()

    def fork(self) -> Any:
        return FaultyMatcher(self.inner.fork(), self.mode, self.at)


def _inject() -> dict[str, Any]:
    """Wrap the marked requests' matchers; record which grammars fail and how."""
    from maskplug_vllm import backend, common

    seen: dict[str, Any] = {"wrapped": [], "producer_failed": [], "log": []}
    real_compile = backend.MaskplugBackend.compile_grammar
    real_accept = backend.MaskplugGrammar.accept_tokens
    real_fail_requests = common.fail_requests

    def compile_grammar(self: Any, request_type: Any, grammar_spec: str, *args: Any, **kwargs: Any) -> Any:
        grammar = real_compile(self, request_type, grammar_spec, *args, **kwargs)
        for mark, mode, at in ((FILL_MARK, "fill", FILL_FAULT_AT), (COMMIT_MARK, "commit", COMMIT_FAULT_AT)):
            if mark in grammar_spec:
                grammar.matcher = FaultyMatcher(grammar.matcher, mode, at)
                seen["wrapped"].append(mode)
        return grammar

    def accept_tokens(self: Any, request_id: str, tokens: list[int]) -> bool:
        _committing.on = True
        try:
            return bool(real_accept(self, request_id, tokens))
        finally:
            _committing.on = False

    def fail_requests(grammars: Sequence[Any], request_ids: Sequence[str], failed: Mapping[int, Any]) -> None:
        seen["producer_failed"].extend(request_ids[g] for g in failed)
        real_fail_requests(grammars, request_ids, failed)

    backend.MaskplugBackend.compile_grammar = compile_grammar  # type: ignore[method-assign]
    backend.MaskplugGrammar.accept_tokens = accept_tokens  # type: ignore[method-assign]
    common.fail_requests = fail_requests

    class Records(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen["log"].append({"args": [str(a) for a in (record.args or ())], "message": record.getMessage()})

    log = logging.getLogger(backend.__name__)
    log.addHandler(Records(level=logging.ERROR))
    return seen


def main(model_dir: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_model

    if os.environ.get("MASKPLUG_VLLM") != "1":
        raise SystemExit("fault_run.py: expected MASKPLUG_VLLM=1 (the adapter's fault handling is under test)")
    seen = _inject()
    llm = tiny_model.ngram_engine(model_dir, NUM_SPEC, max_model_len=1024, max_num_seqs=16)
    schemas = [json.loads(p.read_text()) for p in tiny_model.schema_paths()]

    def request(i: int, schema: dict[str, Any]) -> tuple[str, Any]:
        prompt = f'{schema.get("title", "")} {i}: {{"name": "alice", "id": 12, "tags": ["a", "b"]}} -> '
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=schema)
        )
        return prompt, params

    good = [request(i, schemas[i % len(schemas)]) for i in range(NUM_GOOD)]
    faulty = [
        request(100, {**schemas[0], "title": FILL_MARK}),
        request(101, {**schemas[1], "title": COMMIT_MARK}),
    ]
    # The faulty requests sit inside the batch, between good ones.
    mixed = [*good[:2], faulty[0], *good[2:4], faulty[1], *good[4:]]
    names = ["good"] * 2 + ["fill"] + ["good"] * 2 + ["commit"] + ["good"] * (NUM_GOOD - 4)

    def run(batch: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        outputs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
        return [
            {
                "token_ids": list(o.outputs[0].token_ids),
                "text": o.outputs[0].text,
                "finish_reason": o.outputs[0].finish_reason,
                "stop_reason": None if o.outputs[0].stop_reason is None else str(o.outputs[0].stop_reason),
            }
            for o in outputs
        ]

    with_faults = run(mixed)
    without = run(good)
    core = llm.llm_engine.engine_core.engine_core
    result = {
        "names": names,
        "with_faults": with_faults,
        "without": without,
        "wrapped": seen["wrapped"],
        "producer_failed": seen["producer_failed"],
        "log": seen["log"],
        "requests_left": len(core.scheduler.requests),
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
