"""Compile limits hold: a compile past its limit fails that request on time and leaves nothing running."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest
from grammar_testkit import SLOW_OUTLINES as SLOW
from maskplug_llguidance import LLGuidanceProvider
from maskplug_outlines import OUTLINES_COMPILE_LIMIT_S, OutlinesProvider
from maskplug_xgrammar import XGRAMMAR_COMPILE_LIMIT_S, XGrammarProvider

from maskplug.errors import GrammarError
from maskplug.grammar import GrammarSpec
from maskplug.grammar.auto import AutoProvider
from maskplug.grammar.limits import DEFAULT_COMPILE_LIMIT_S, CompileWorker
from maskplug.grammar.vocabs import mistral_sentencepiece, mistral_tekken

LIMIT = 0.3
# Time the caller may take past the limit to kill and reap the worker (a loaded test machine).
SLACK = 2.0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_each_provider_has_its_default_limit() -> None:
    """The SDK's default is a few seconds; xgrammar and outlines-core, whose real compiles take longer, set their own."""
    v = mistral_sentencepiece()
    assert 1.0 <= DEFAULT_COMPILE_LIMIT_S <= 10.0
    assert LLGuidanceProvider(v).compile_limit_s == DEFAULT_COMPILE_LIMIT_S
    assert XGrammarProvider(v).compile_limit_s == XGRAMMAR_COMPILE_LIMIT_S
    assert OutlinesProvider(v).compile_limit_s == OUTLINES_COMPILE_LIMIT_S
    assert DEFAULT_COMPILE_LIMIT_S < XGRAMMAR_COMPILE_LIMIT_S < OUTLINES_COMPILE_LIMIT_S
    # Above the slowest real schema measured to finish with each (benchmarks/RESULTS.md), with margin:
    # xgrammar's next-slowest 98 s (its slowest 177-305 s), outlines-core's jx-requirements 3,325 CPU s.
    assert XGRAMMAR_COMPILE_LIMIT_S >= 2 * 98.0 and OUTLINES_COMPILE_LIMIT_S >= 2 * 3325.0
    # auto: each candidate under its own provider's limit unless told otherwise.
    assert AutoProvider(v).compile_limit_s is None


def test_compile_past_its_limit_fails_on_time_and_the_worker_is_killed() -> None:
    p = OutlinesProvider(mistral_tekken(), compile_limit_s=LIMIT)
    p.worker.start()  # start-up is not a request's time
    pid = p.worker.pid
    assert pid is not None and not _gone(pid)
    threads = threading.active_count()
    began = time.monotonic()
    with pytest.raises(GrammarError, match=r"within its limit of 0.3 s; the compile was stopped"):
        p.compile(SLOW)
    took = time.monotonic() - began
    assert LIMIT <= took < LIMIT + SLACK
    assert _gone(pid)  # killed and reaped: nothing keeps compiling behind the failed request
    assert p.worker.pid is None and p.worker.killed == 1
    assert threading.active_count() == threads  # no thread left behind either
    assert len(p.cache) == 0  # a failure is never cached


def test_per_call_limit_overrides_the_providers() -> None:
    v = mistral_tekken()
    p = OutlinesProvider(v, compile_limit_s=None)
    spec = GrammarSpec(SLOW.kind, SLOW.source, compile_limit_s=LIMIT)
    began = time.monotonic()
    with pytest.raises(GrammarError, match=r"limit of 0\.3 s"):
        p.compile(spec)
    assert time.monotonic() - began < LIMIT + SLACK + 60  # includes starting the worker
    # math.inf: no limit for this call (compiled in the calling process, no worker).
    q = OutlinesProvider(v, compile_limit_s=LIMIT)
    g = q.compile(GrammarSpec("regex", "[a-c]+x", compile_limit_s=math.inf))
    assert q.worker.started == 0 and g.regex == "[a-c]+x"
    # The limit is not part of the spec's identity: the cache serves both.
    assert q.compile(GrammarSpec("regex", "[a-c]+x")) is g


def test_after_a_kill_the_next_compile_gets_a_fresh_worker() -> None:
    p = XGrammarProvider(mistral_sentencepiece(), compile_limit_s=30.0)
    spec = GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})
    g = p.compile(spec)
    first = p.worker.pid
    assert first is not None and p.worker.started == 1
    p.worker.close()
    assert _gone(first)
    g2 = p.compile(GrammarSpec("regex", "[0-9]+"))
    assert p.worker.started == 2 and p.worker.pid not in (None, first)
    m = g.matcher()
    v = mistral_sentencepiece()
    assert all(m.accept(t) for t in v.encode('{"a": 12}')) and m.accept(v.eos_ids[0])
    m2 = g2.matcher()
    assert all(m2.accept(t) for t in v.encode("42"))
    p.worker.close()


@pytest.mark.parametrize("cls", [XGrammarProvider, LLGuidanceProvider, OutlinesProvider])
def test_engine_reasons_come_back_through_the_worker(cls: type) -> None:
    """The worker's GrammarError reads exactly as the in-process one, with the engine's exception type as cause."""
    v = mistral_sentencepiece()
    p, here = cls(v, compile_limit_s=60.0), cls(v, compile_limit_s=None)
    for spec in (GrammarSpec("regex", "a(b"), GrammarSpec("json_schema", {"type": "strin"})):
        with pytest.raises(GrammarError, match=r"spec\.source") as info:
            p.compile(spec)
        with pytest.raises(GrammarError) as local:
            here.compile(spec)
        assert str(info.value) == str(local.value)
        assert type(info.value.__cause__) is type(local.value.__cause__)
    assert len(p.cache) == 0 and p.worker.started == 1
    p.worker.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "5", True])
def test_bad_limits_name_the_argument(bad: object) -> None:
    with pytest.raises(GrammarError, match="compile_limit_s"):
        GrammarSpec("regex", "a", compile_limit_s=bad)  # type: ignore[arg-type]
    with pytest.raises(GrammarError, match="compile_limit_s"):
        XGrammarProvider(mistral_sentencepiece(), compile_limit_s=bad)  # type: ignore[arg-type]


def test_waiting_for_the_worker_counts_against_the_limit() -> None:
    from maskplug_outlines.provider import worker_compiler

    v = mistral_tekken()
    w = CompileWorker("outlines-core", worker_compiler, (v.with_encoder(None), 0))
    w.start()
    results: list[BaseException | None] = []

    def slow() -> None:
        try:
            w.run(SLOW, 30.0)
            results.append(None)
        except GrammarError as exc:
            results.append(exc)

    t = threading.Thread(target=slow)
    t.start()
    while not w._lock.locked():  # the slow compile holds the worker
        time.sleep(0.001)
    began = time.monotonic()
    with pytest.raises(GrammarError, match=r"other compiles were running|limit of 0\.3 s"):
        w.run(GrammarSpec("regex", "a+"), LIMIT)
    assert time.monotonic() - began < LIMIT + SLACK
    w.kill()  # end the slow compile too: it fails, it does not hang
    t.join(60)
    assert not t.is_alive() and len(results) == 1
    assert results[0] is None or "died" in str(results[0])
    w.close()


@pytest.mark.parametrize(
    ("module", "cls", "attr"),
    [
        ("maskplug_llguidance.provider", LLGuidanceProvider, "tokenizer"),
        ("maskplug_outlines.provider", OutlinesProvider, "engine_vocabulary"),
    ],
)
def test_a_worker_builds_its_engine_vocabulary_at_start_up(
    module: str, cls: type, attr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's tokenizer (llguidance) or vocabulary (outlines-core) is built before the first spec arrives.

    Built lazily, it would be part of the first compile after every worker start, inside that request's limit
    (seconds for a 131k vocabulary on a loaded machine).
    """
    import importlib

    built: list[object] = []
    real = getattr(cls, attr)
    if isinstance(real, property):
        getter = real.fget
        assert getter is not None

        def counted_get(self: object) -> object:
            built.append(self)
            return getter(self)

        monkeypatch.setattr(cls, attr, property(counted_get))
    else:

        def counted(self: object) -> object:
            built.append(self)
            return real(self)

        monkeypatch.setattr(cls, attr, counted)
    mod = importlib.import_module(module)
    args = (mistral_sentencepiece(),) if cls is LLGuidanceProvider else (mistral_sentencepiece(), 0)
    compile_fn = mod.worker_compiler(*args)
    assert len(built) == 1  # at start-up, before any spec
    compile_fn(GrammarSpec("regex", "[a-z]{1,4}"))
    assert all(isinstance(p, cls) for p in built)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_server_killed_at_its_limit_is_replaced_by_a_fork_of_the_start_up_process() -> None:
    """Restarting after a kill forks the process that already built everything: no new interpreter."""
    p = OutlinesProvider(mistral_tekken(), compile_limit_s=LIMIT)
    w = p.worker
    w.start()
    zygote = w._proc.pid
    first = w.pid
    assert first is not None and _parent(first) == zygote
    for n in (1, 2):
        old = w.pid
        assert old is not None
        with pytest.raises(GrammarError, match=r"within its limit of 0.3 s"):
            p.compile(GrammarSpec(SLOW.kind, {**SLOW.source, "title": f"fresh {n}"}))
        assert _gone(old) and w.pid is None and w.killed == n
        # The start-up process stays (idle: it never compiles) and forks the next server.
        assert w._proc.pid == zygote and not _gone(zygote)
        w.start()
        new = w.pid
        assert new is not None and new != old and _parent(new) == zygote and w.started == n + 1
    g = p.compile(GrammarSpec("regex", "[a-c]+x"))  # a forked server compiles like the first one
    v = mistral_tekken()
    m = g.matcher()
    assert all(m.accept(t) for t in v.encode("abcx")) and m.accept(v.eos_ids[0])
    server = w.pid
    assert server is not None
    w.close()  # nothing keeps running: neither the server nor the start-up process
    assert _gone(server) and _gone(zygote) and w.pid is None
