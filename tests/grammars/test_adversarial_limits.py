"""Compile limits count CPU time, stop only what is stuck, and refuse limits no timeout can hold.

The compile functions below run in a compile worker's server process (they
are imported there by name), so each behaves exactly as described whatever
the test machine's load: ``_sleepy`` waits without computing, ``_spinning``
computes without end.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from maskplug_llguidance import LLGuidanceProvider
from maskplug_outlines import OutlinesProvider
from maskplug_xgrammar import XGrammarProvider

from maskplug.errors import GrammarError
from maskplug.grammar import GrammarSpec, grammar_provider
from maskplug.grammar import limits as limits_mod
from maskplug.grammar.limits import (
    MAX_COMPILE_LIMIT_S,
    CompileWorker,
    check_limit,
    cpu_seconds,
    effective_limit,
    wall_backstop,
)
from maskplug.grammar.vocabs import mistral_sentencepiece

# Time the caller may take past a limit or backstop to kill and reap the server (a loaded machine).
SLACK = 2.0


def _sleepy(seconds: float) -> Callable[[GrammarSpec], Any]:
    """A compile that waits ``seconds`` without using CPU (as one slowed by a busy machine), then answers."""

    def run(spec: GrammarSpec) -> str:
        time.sleep(seconds)
        return f"slept for {spec.source}"

    return run


def _spinning() -> Callable[[GrammarSpec], Any]:
    """A compile that computes forever (as one stuck in a native loop)."""

    def run(spec: GrammarSpec) -> str:
        x = 0
        while True:
            x += 1

    return run


def _hungry(step_mb: int, most_mb: int) -> Callable[[GrammarSpec], Any]:
    """A compile that keeps taking memory, ``step_mb`` every few milliseconds up to ``most_mb`` (or "small")."""

    def run(spec: GrammarSpec) -> str:
        if spec.source == "small":
            return "answered"
        held = []
        for _ in range(most_mb // step_mb):
            held.append(b"\x01" * (step_mb << 20))  # written, so resident
            time.sleep(0.005)
        return f"held {len(held) * step_mb} MB"

    return run


def _killed() -> Callable[[GrammarSpec], Any]:
    """A compile whose process is killed (as by the kernel's out-of-memory killer)."""

    def run(spec: GrammarSpec) -> str:
        os.kill(os.getpid(), signal.SIGKILL)
        return "never"

    return run


def _stuck_start_up(seconds: float) -> Callable[[GrammarSpec], Any]:
    """A start-up that takes ``seconds`` (as an engine import or tokenizer build that hangs)."""
    time.sleep(seconds)
    return _sleepy(0.0)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# -- bad limits: a named GrammarError, never OverflowError ------------------------------------

BAD_LIMITS = [0, -1, -1e-9, float("nan"), float("-inf"), "5", True, 1e10, 1e12, 10**400, 1e300]


@pytest.mark.parametrize("bad", BAD_LIMITS, ids=repr)
def test_check_limit_refuses_what_no_timeout_can_hold(bad: object) -> None:
    with pytest.raises(GrammarError, match=r"^compile_limit_s: expected"):
        check_limit(bad, "compile_limit_s")


@pytest.mark.parametrize("good", [1e-3, 0.3, 5, MAX_COMPILE_LIMIT_S, math.inf, None])
def test_check_limit_accepts_every_holdable_limit(good: float | None) -> None:
    got = check_limit(good, "compile_limit_s")
    assert got == (None if good is None else float(good))
    if good is not None and not math.isinf(good):
        # Every wait the worker may make fits the OS's poll timeout (a C int of milliseconds).
        assert wall_backstop(float(good)) * 1000 < 2**31 - 1


@pytest.mark.parametrize("too_big", [1e10, MAX_COMPILE_LIMIT_S * 2])
@pytest.mark.parametrize("cls", [XGrammarProvider, LLGuidanceProvider, OutlinesProvider])
def test_a_spec_limit_too_large_is_a_grammar_error_in_every_provider(cls: type, too_big: float) -> None:
    """GrammarSpec accepts any finite number; the compile names the argument instead of overflowing."""
    p = cls(mistral_sentencepiece())
    spec = GrammarSpec("regex", "[a-c]+", compile_limit_s=too_big)
    with pytest.raises(GrammarError, match=r"spec\.compile_limit_s: expected at most 100000 seconds"):
        p.compile(spec)
    with pytest.raises(GrammarError, match=r"spec\.compile_limit_s"):
        effective_limit(5.0, spec)
    assert len(p.cache) == 0
    assert p.worker.started == 0  # refused before any process was started


def test_a_spec_limit_too_large_is_a_grammar_error_for_auto() -> None:
    auto = grammar_provider("auto", mistral_sentencepiece())
    with pytest.raises(GrammarError, match=r"spec\.compile_limit_s: expected at most"):
        auto.compile(GrammarSpec("regex", "[a-d]+", compile_limit_s=1e10))


@pytest.mark.parametrize("cls", [XGrammarProvider, LLGuidanceProvider, OutlinesProvider])
def test_a_provider_limit_too_large_is_refused_at_construction(cls: type) -> None:
    with pytest.raises(GrammarError, match=r"^compile_limit_s: expected at most"):
        cls(mistral_sentencepiece(), compile_limit_s=1e10)


def test_the_largest_limit_compiles() -> None:
    p = XGrammarProvider(mistral_sentencepiece(), compile_limit_s=MAX_COMPILE_LIMIT_S)
    g = p.compile(GrammarSpec("regex", "[a-c]+"))
    assert g.matcher() is not None
    p.worker.close()


# -- the limit counts CPU time ----------------------------------------------------------------


def test_cpu_seconds_reads_this_process() -> None:
    before = cpu_seconds(os.getpid())
    assert before is not None
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    after = cpu_seconds(os.getpid())
    assert after is not None and after - before >= 0.15
    assert cpu_seconds(2**22 + 12345) is None  # no such process


def test_a_compile_that_waits_is_not_stopped_at_its_limit() -> None:
    """1.5 s wall-clock but no CPU: a 0.3 s limit does not stop it (a busy machine is not a stuck compile)."""
    w = CompileWorker("sleepy", _sleepy, (1.5,))
    w.start()
    began = time.monotonic()
    assert w.run(GrammarSpec("regex", "a"), 0.3) == "slept for a"
    assert time.monotonic() - began >= 1.5
    assert w.killed == 0 and w.compiles == 1
    assert w.last_cpu_s is not None and w.last_cpu_s < 0.3
    assert w.last_wall_s is not None and w.last_wall_s >= 1.5
    w.close()


def test_a_compile_that_computes_past_its_limit_is_stopped_on_time() -> None:
    w = CompileWorker("spinning", _spinning, ())
    w.start()
    pid = w.pid
    assert pid is not None
    began = time.monotonic()
    with pytest.raises(
        GrammarError, match=r"within its limit of 0\.3 s; the compile was stopped after 0\.\d\d s of CPU"
    ):
        w.run(GrammarSpec("regex", "a"), 0.3)
    took = time.monotonic() - began
    assert 0.3 <= took < 0.3 + SLACK
    assert _gone(pid) and w.killed == 1 and w.compiles == 0
    assert w.last_cpu_s is not None and 0.3 <= w.last_cpu_s < 0.3 + SLACK
    w.close()


def test_a_compile_past_its_wall_clock_backstop_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits_mod, "WALL_BACKSTOP_FACTOR", 3.0)
    monkeypatch.setattr(limits_mod, "WALL_BACKSTOP_MIN_S", 0.5)
    assert wall_backstop(0.2) == pytest.approx(0.7)
    w = CompileWorker("sleepy", _sleepy, (30.0,))
    w.start()
    pid = w.pid
    assert pid is not None
    began = time.monotonic()
    with pytest.raises(GrammarError, match=r"within its limit of 0\.2 s; the compile was stopped at its wall-clock "):
        w.run(GrammarSpec("regex", "a"), 0.2)
    assert 0.7 <= time.monotonic() - began < 0.7 + SLACK
    assert _gone(pid) and w.killed == 1
    w.close()


def test_the_default_backstop_is_far_above_the_limit() -> None:
    for limit in (0.1, 1.0, 5.0, 60.0):
        assert wall_backstop(limit) >= max(10 * limit, limit + 10)


# -- start-up is bounded by the request's backstop ---------------------------------------------


def test_a_stuck_start_up_fails_a_request_within_its_backstop_and_keeps_starting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start-up process is not killed for one request: it may be ready for the next."""
    monkeypatch.setattr(limits_mod, "WALL_BACKSTOP_FACTOR", 2.0)
    monkeypatch.setattr(limits_mod, "WALL_BACKSTOP_MIN_S", 1.0)
    w = CompileWorker("stuck", _stuck_start_up, (4.0,))
    began = time.monotonic()
    with pytest.raises(GrammarError, match=r"compile worker was still starting after .* wall-clock backstop of 2 s"):
        w.run(GrammarSpec("regex", "a"), 1.0)
    assert time.monotonic() - began < 2.0 + SLACK
    zygote = w._proc
    assert zygote is not None and zygote.poll() is None  # still starting
    # A later request with room enough finds it ready and compiles.
    assert w.run(GrammarSpec("regex", "b"), 30.0) == "slept for b"
    assert w._proc is zygote and w.started == 1
    w.close()


def test_start_with_a_timeout_gives_up_waiting_but_not_starting() -> None:
    w = CompileWorker("stuck", _stuck_start_up, (3.0,))
    began = time.monotonic()
    with pytest.raises(GrammarError, match=r"stuck: the compile worker was still starting after"):
        w.start(0.5)
    assert time.monotonic() - began < 0.5 + SLACK
    w.start(60.0)
    assert w.pid is not None
    w.close()


def test_a_start_up_past_the_start_up_limit_is_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits_mod, "STARTUP_LIMIT_S", 1.0)
    w = CompileWorker("stuck", _stuck_start_up, (60.0,))
    with pytest.raises(GrammarError, match=r"stuck: the compile worker did not start within 1 s"):
        w.run(GrammarSpec("regex", "a"), 5.0)
    assert w._proc is None  # ended: the next compile starts a new one
    w.close()


# -- nothing outlives the caller ----------------------------------------------------------------

_CLIENT = """
import sys, threading, time
sys.path.insert(0, {here!r})
from test_adversarial_limits import _spinning
from maskplug.grammar import GrammarSpec
from maskplug.grammar.limits import CompileWorker

w = CompileWorker("spinning", _spinning, ())
w.start()
threading.Thread(target=w.run, args=(GrammarSpec("regex", "a"), 1000.0), daemon=True).start()
while w.pid is None:
    time.sleep(0.01)
print(w.pid, w._proc.pid, flush=True)
time.sleep(1000)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the death signal is Linux's PR_SET_PDEATHSIG")
def test_a_caller_killed_mid_compile_leaves_nothing_running() -> None:
    """A caller killed while a compile runs (limit 1000 s) takes the compile server and start-up process with it."""
    here = os.path.dirname(os.path.abspath(__file__))
    client = subprocess.Popen([sys.executable, "-c", _CLIENT.format(here=here)], stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None
        server, zygote = (int(x) for x in client.stdout.readline().split())
        deadline = time.monotonic() + 30.0
        while (cpu_seconds(server) or 0.0) < 0.2:  # the server is computing
            assert time.monotonic() < deadline and not _gone(server)
            time.sleep(0.05)
    finally:
        client.kill()
        client.wait()
    deadline = time.monotonic() + 5.0 + SLACK
    while not (_gone(server) and _gone(zygote)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(zygote), "the start-up process outlived its caller"
    assert _gone(server), "the compile server kept compiling after its caller was killed"


# -- memory: a compile that holds too much is stopped, naming the limit ---------------------------


def test_a_compile_past_its_memory_limit_is_stopped_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    w = CompileWorker("hungry", _hungry, (32, 4096))
    w.start()
    assert w.run(GrammarSpec("regex", "small"), 30.0) == "answered"  # a server, at its resting size
    pid = w.pid
    assert pid is not None
    usage = limits_mod._usage(pid)
    assert usage is not None
    resting = usage[1]
    # 256 MiB above what the server holds at rest; the compile would take 4 GiB.
    limit_mib = resting // 2**20 + 256
    monkeypatch.setenv(limits_mod.MEMORY_LIMIT_ENV, str(limit_mib))
    with pytest.raises(GrammarError, match=r"stopped compiling this regex spec at its memory limit: the compile held"):
        w.run(GrammarSpec("regex", "big"), 60.0)
    assert _gone(pid) and w.killed == 1
    assert limit_mib << 20 < w.last_rss_bytes < (limit_mib + 768) << 20  # stopped soon after, not at 4 GiB
    # The next compile gets a new server; with no limit the same compile completes.
    assert w.run(GrammarSpec("regex", "small"), 30.0) == "answered"
    monkeypatch.setenv(limits_mod.MEMORY_LIMIT_ENV, "none")
    w2 = CompileWorker("hungry", _hungry, (32, 320))
    w2.start()
    assert w2.run(GrammarSpec("regex", "big"), 60.0) == "held 320 MB"
    w.close()
    w2.close()


@pytest.mark.parametrize("bad", ["0", "-5", "lots", "nan", "inf", "1e400"])
def test_a_bad_memory_limit_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(limits_mod.MEMORY_LIMIT_ENV, bad)
    with pytest.raises(GrammarError, match=rf"{limits_mod.MEMORY_LIMIT_ENV}: expected a number of MiB > 0 or 'none'"):
        limits_mod.compile_memory_limit()
    w = CompileWorker("hungry", _hungry, (32, 64))
    with pytest.raises(GrammarError, match=limits_mod.MEMORY_LIMIT_ENV):
        w.run(GrammarSpec("regex", "small"), 30.0)
    assert w.started == 0 and w.compiles == 0  # refused before anything ran
    w.close()


def test_the_default_memory_limit_is_half_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(limits_mod.MEMORY_LIMIT_ENV, raising=False)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert limits_mod.compile_memory_limit() == total // 2
    monkeypatch.setenv(limits_mod.MEMORY_LIMIT_ENV, " None ")
    assert limits_mod.compile_memory_limit() is None
    monkeypatch.setenv(limits_mod.MEMORY_LIMIT_ENV, "1.5")
    assert limits_mod.compile_memory_limit() == int(1.5 * 2**20)


def test_a_compile_worker_killed_from_outside_fails_its_request_saying_so() -> None:
    w = CompileWorker("killed", _killed, ())
    w.start()
    with pytest.raises(GrammarError, match=r"the killed compile worker died compiling this regex spec \(after .* MiB"):
        w.run(GrammarSpec("regex", "a"), 30.0)
    with pytest.raises(GrammarError, match="died compiling"):  # the next request gets a new server, and fails alike
        w.run(GrammarSpec("regex", "a"), 30.0)
    w.close()
