"""Compile limits that hold: compiles run in a server process that is killed when one runs too long.

A grammar engine's compile is native code that no Python thread can
interrupt (a thread left running past a timeout keeps its CPU and memory).
:class:`CompileWorker` runs compiles in a separate process instead: the
caller waits at most the limit, and a compile past it is ended by killing the
process (and waiting until it is gone), so nothing keeps running behind the
failed request.

Two kinds of process serve one provider. A start-up process (a fresh
interpreter, ``python -m maskplug.grammar.limits``) imports the engine and
builds what every compile needs (the engine's tokenizer or vocabulary), once;
it never compiles. Each compile server is forked from it, so the server
killed at a limit is replaced in milliseconds by another fork (a fresh
interpreter took seconds, as much as the limit itself on a loaded machine).
Neither start-up is counted against any request's limit.

A provider gives the worker a *build* function (importable at module level)
that returns the function compiling one :class:`~maskplug.grammar.GrammarSpec`
into something picklable (xgrammar's serialized grammar, outlines-core's
index, llguidance's checked grammar text); the provider turns that back into
its compiled grammar in the calling process.

Limits: :data:`DEFAULT_COMPILE_LIMIT_S` unless the provider sets its own
``compile_limit_s`` (``None``: compile in the calling process, no limit), and
``GrammarSpec.compile_limit_s`` for one call (``math.inf``: no limit for this
call). A finite limit is at most :data:`MAX_COMPILE_LIMIT_S`.

What a limit counts: the compile server's own **CPU time** (all its
threads, read from ``/proc/<pid>/stat`` while the caller waits), so a compile
that is merely slowed by a busy machine is not stopped; only one that keeps
computing past the limit is. A **wall-clock backstop** far above the limit
(:func:`wall_backstop`: ``limit * WALL_BACKSTOP_FACTOR``, at least
``limit + WALL_BACKSTOP_MIN_S``) bounds everything the caller waits for
after getting the worker: the start-up process still starting, the fork and
the compile. Waiting for another caller's compile counts against the limit
itself (wall-clock): a request never queues behind a slow one for longer
than its own limit. Where ``/proc`` is not available the limit is
wall-clock, as before.

What a compile may hold: a server whose resident memory passes
:func:`compile_memory_limit` (``MASKPLUG_COMPILE_MEMORY_MB``; by default half
of the machine's memory) is killed and its request fails with a
:class:`~maskplug.GrammarError` naming the limit, read from the same
``/proc`` line as the CPU time. Some schemas make an engine build automata
of many gigabytes (one JSONSchemaBench schema took outlines-core past 17 GB
here); without the limit the kernel's out-of-memory killer ends whichever
process it picks, which on a server may be the engine itself.

A start-up process that is still starting when a request's backstop runs
out is left running (it is not the request's fault and the next compile
may use it); it is ended only after :data:`STARTUP_LIMIT_S` in all.
"""

from __future__ import annotations

import builtins
import math
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..errors import GrammarError
from .spec import GrammarSpec

__all__ = [
    "DEFAULT_COMPILE_LIMIT_S",
    "IDLE_EXIT_S",
    "MAX_COMPILE_LIMIT_S",
    "MEMORY_LIMIT_ENV",
    "STARTUP_LIMIT_S",
    "WALL_BACKSTOP_FACTOR",
    "WALL_BACKSTOP_MIN_S",
    "CompileWorker",
    "check_limit",
    "compile_memory_limit",
    "cpu_seconds",
    "effective_limit",
    "wall_backstop",
]

DEFAULT_COMPILE_LIMIT_S = 10.0
"""CPU seconds a compile may take unless the provider or the call says otherwise: twenty times the
slowest of JSONSchemaBench's 1,003 sample schemas llguidance compiles over tekken (0.5 CPU s). A
provider whose real compiles take longer sets its own default (xgrammar's and outlines-core's do)."""
MAX_COMPILE_LIMIT_S = 1e5
"""The largest finite limit (about 28 hours): its wall-clock backstop must fit the OS's timeouts
(``poll`` takes a C int of milliseconds, about 24.8 days); ``math.inf`` means no limit."""
WALL_BACKSTOP_FACTOR = 10.0
"""The wall-clock backstop is this many times the limit (:func:`wall_backstop`) ..."""
WALL_BACKSTOP_MIN_S = 10.0
"""... and at least this many seconds above it (start-up and a loaded machine on short limits)."""
STARTUP_LIMIT_S = 180.0
"""Seconds the start-up process may take in all (import the engine, build the tokenizer); a request
waits for it at most its own wall-clock backstop."""
IDLE_EXIT_S = 120.0
"""A compile server with no compile, or a start-up process with no fork, for this long exits."""

MEMORY_LIMIT_ENV = "MASKPLUG_COMPILE_MEMORY_MB"
"""Environment variable: the resident memory, in MiB, a compile server may hold (``none``: no limit)."""

BuildFn = Callable[..., Callable[[GrammarSpec], Any]]


def compile_memory_limit() -> int | None:
    """Bytes of resident memory a compile server may hold before it is killed; ``None``: no limit.

    :data:`MEMORY_LIMIT_ENV` when set (a number of MiB > 0, or ``none``),
    else half of this machine's physical memory (``None`` where the OS does
    not say). Read at every compile, so a process may change it.

    Raises:
        GrammarError: the variable holds anything else, naming it.
    """
    raw = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
    if raw:
        if raw.lower() == "none":
            return None
        try:
            mib = float(raw)
        except ValueError:
            mib = math.nan
        if not (math.isfinite(mib) and mib > 0):
            raise GrammarError(f"{MEMORY_LIMIT_ENV}: expected a number of MiB > 0 or 'none', got {raw!r}")
        return int(mib * 2**20)
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 2
    except (AttributeError, ValueError, OSError):
        return None


def check_limit(value: Any, arg: str) -> float | None:
    """``value`` as a compile limit in seconds: ``None``, ``math.inf``, or a number in ``(0, MAX_COMPILE_LIMIT_S]``."""
    if value is None:
        return None
    # No float() before the comparisons: an int too large for a float is a bad limit, not an OverflowError.
    nan = isinstance(value, float) and math.isnan(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or nan or value <= 0:
        raise GrammarError(f"{arg}: expected a number of seconds > 0 or None, got {value!r}")
    if value != math.inf and value > MAX_COMPILE_LIMIT_S:
        raise GrammarError(
            f"{arg}: expected at most {MAX_COMPILE_LIMIT_S:g} seconds (or math.inf for no limit), got {value!r}"
        )
    return float(value)


def effective_limit(provider_limit: float | None, spec: GrammarSpec) -> float | None:
    """The limit for compiling ``spec``: the call's own, else the provider's; ``None`` for no limit.

    Both are checked here (:func:`check_limit`), so a limit too large for the
    OS's timeouts is a :class:`GrammarError` naming it before any compile.
    """
    if spec.compile_limit_s is not None:
        limit = check_limit(spec.compile_limit_s, "spec.compile_limit_s")
    else:
        limit = check_limit(provider_limit, "compile_limit_s")
    if limit is None or math.isinf(limit):
        return None
    return limit


def wall_backstop(limit_s: float) -> float:
    """Wall-clock seconds a compile limited to ``limit_s`` CPU seconds may take in all (start-up included)."""
    return max(limit_s * WALL_BACKSTOP_FACTOR, limit_s + WALL_BACKSTOP_MIN_S)


_TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) process ``pid`` has used; None when the OS does not say."""
    usage = _usage(pid)
    return None if usage is None else usage[0]


def _usage(pid: int) -> tuple[float, int] | None:
    """CPU seconds and resident bytes of process ``pid`` (one read of ``/proc/<pid>/stat``); None without it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # Fields 14, 15 (utime, stime) and 24 (rss, pages) of proc(5); fields[0] is field 3 (state).
        return (int(fields[11]) + int(fields[12])) * _TICK_S, int(fields[21]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def _serve(conn: Connection, compile_fn: Callable[[GrammarSpec], Any]) -> None:
    """A compile server: answer one spec at a time on ``conn`` until it closes or stays idle."""
    while True:
        try:
            if not conn.poll(IDLE_EXIT_S):
                return  # idle: free the memory; the provider starts a new one when needed
            spec = conn.recv()
        except (EOFError, OSError):
            return
        if spec is None:
            return
        try:
            conn.send(("ok", compile_fn(spec)))
        except GrammarError as exc:
            cause = exc.__cause__
            why = (type(cause).__name__, str(cause)) if cause is not None else None
            conn.send(("err", (str(exc), why)))
        except Exception as exc:  # an engine's own failure: reported as the request's error
            conn.send(("err", (f"spec.source: {type(exc).__name__}: {exc}", (type(exc).__name__, str(exc)))))


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _death_signal() -> Callable[[], None] | None:
    """A function that makes the calling process receive SIGKILL when its parent ends (Linux; None elsewhere).

    Loaded once in the start-up process, so a fork pays one C call for it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _zygote_main(ctl_fd: int) -> None:
    """The start-up process: build the compile function once, then fork a compile server per request for one.

    A server forked from here starts in milliseconds with everything built
    (engine imported, vocabulary or tokenizer ready); a server killed at a
    limit is replaced by another fork instead of a fresh interpreter. This
    process never compiles, so nothing it runs can exceed a limit. Servers are
    reaped here as they end (``SIGCHLD`` ignored).

    Nothing outlives the caller: this process ends when the caller's end of
    the control connection closes (the caller exited, was killed, or shut the
    worker down), and every server it forked is killed by the kernel when this
    process ends (Linux: ``PR_SET_PDEATHSIG``), mid-compile included: a
    caller killed while a schema compiles no longer leaves the compile
    running. Idle for :data:`IDLE_EXIT_S` without a fork request, it ends only
    once no server it forked is alive (a server reused for many compiles
    needs no fork).
    """
    ctl = socket.socket(fileno=ctl_fd)
    conn = Connection(os.dup(ctl_fd))
    try:
        build, args = conn.recv()
        compile_fn = build(*args)
    except BaseException as exc:  # report why start-up failed, then stop
        conn.send(("fail", f"{type(exc).__name__}: {exc}"))
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    die_with_parent = _death_signal()
    me = os.getpid()
    servers: list[int] = []
    conn.send(("ready", None))
    while True:
        try:
            if not conn.poll(IDLE_EXIT_S):
                servers = [pid for pid in servers if not _gone(pid)]
                if servers:
                    continue
                return
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg != "fork":
            return
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the compile server
            code = 0
            try:
                if die_with_parent is not None:
                    die_with_parent()
                if os.getppid() != me:
                    return  # the start-up process ended before the death signal was set (finally: exit)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                conn.close()
                ctl.close()
                mine.close()
                _serve(Connection(theirs.detach()), compile_fn)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        servers = [p for p in servers if not _gone(p)] + [pid]
        socket.send_fds(ctl, [struct.pack("<q", pid)], [mine.fileno()])
        mine.close()


def _rebuild_cause(why: tuple[str, str] | None) -> BaseException | None:
    """The engine's exception behind a worker's GrammarError, when it is a builtin exception type."""
    if why is None:
        return None
    cls = getattr(builtins, why[0], None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(why[1])
    return RuntimeError(f"{why[0]}: {why[1]}")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _end(pid: int | None, wait_s: float = 5.0) -> None:
    """Kill compile server ``pid`` and wait (up to ``wait_s``) until it is gone."""
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.001)


def _stop(proc: subprocess.Popen[bytes], conns: tuple[Any, ...], server: list[int | None]) -> None:
    _end(server[0])
    server[0] = None
    for c in conns:
        try:
            c.close()
        except OSError:
            pass
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


class CompileWorker:
    """A compile server process for one provider, killed when a compile runs past its limit.

    A start-up process (started once, on the first compile or :meth:`start`)
    imports the engine and builds what every compile needs; each compile
    server is forked from it, so replacing a server killed at a limit takes
    milliseconds instead of a fresh interpreter's start-up. Compiles are
    served one at a time; a caller waiting for an earlier compile counts that
    wait against its own limit. The limit counts the server's CPU time; the
    caller gets control back within the compile's wall-clock backstop
    (:func:`wall_backstop`) in any case. ``started`` counts compile servers
    started, ``killed`` those ended for running too long, ``compiles`` the
    compiles answered; ``last_cpu_s`` and ``last_wall_s`` are the CPU and
    wall-clock seconds of the latest compile sent to the server (answered or
    stopped).
    """

    def __init__(self, name: str, build: BuildFn, args: tuple[Any, ...]) -> None:
        """``name``: the provider's; ``build(*args)``, run once in the start-up process, returns the compile function
        (``build`` must be importable by its module and name, and ``args`` picklable)."""
        self.name = name
        """The provider's name, in error messages."""
        self._build = build
        self._args = args
        self._lock = threading.Lock()
        self._proc: Any = None  # the start-up process
        self._ctl: Connection | None = None  # its messages
        self._ctl_sock: socket.socket | None = None  # its replies carrying a server's socket
        self._ready = False  # whether the start-up process reported that it has built everything
        self._launched_at = -math.inf
        self._server: list[int | None] = [None]  # the live compile server's pid
        self._conn: Connection | None = None
        self._recv: Connection | None = None
        self._finalizer: Any = None
        self.started = 0
        """Compile servers started."""
        self.killed = 0
        """Compile servers ended for running past a limit (CPU time or memory) or a backstop."""
        self.compiles = 0
        """Compiles answered (successes and the engine's errors)."""
        self.last_cpu_s: float | None = None
        """CPU seconds of the latest compile sent to the server (answered or stopped)."""
        self.last_wall_s: float | None = None
        """Wall-clock seconds of the latest compile sent to the server (answered or stopped)."""
        self.last_rss_bytes = 0
        """The server's resident memory when last read during a compile (bytes; 0 before any reading)."""
        self._last_used = -math.inf
        self._forked_at = -math.inf

    @property
    def pid(self) -> int | None:
        """The live compile server's process id (None when none is running)."""
        pid = self._server[0]
        return pid if pid is not None and not _gone(pid) else None

    def _launch_zygote(self) -> None:
        # A fresh interpreter (``python -m maskplug.grammar.limits``): no inherited engine threads or
        # locks, and the caller's main script is never re-run (as multiprocessing's spawn would).
        here, there = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "maskplug.grammar.limits", str(there.fileno())],
                pass_fds=(there.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
                # The caller's import path, so the worker finds the same maskplug and provider modules.
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
        finally:
            there.close()
        ctl = Connection(os.dup(here.fileno()))
        self._proc, self._ctl, self._ctl_sock = proc, ctl, here
        self._ready = False
        self._launched_at = time.monotonic()
        self._finalizer = weakref.finalize(self, _stop, proc, (ctl, here), self._server)
        try:
            ctl.send((self._build, self._args))
        except OSError as exc:
            self._shutdown()
            raise GrammarError(f"{self.name}: the compile worker did not start: {exc}") from exc

    def _await_ready(self, deadline: float | None) -> None:
        """Wait for the start-up process to be ready, until ``deadline`` (it keeps starting past it)."""
        ctl = self._ctl
        assert ctl is not None
        end = self._launched_at + STARTUP_LIMIT_S
        until = end if deadline is None else min(end, deadline)
        if not ctl.poll(max(until - time.monotonic(), 0.0)):
            now = time.monotonic()
            if now >= end:
                self._shutdown()
                raise GrammarError(f"{self.name}: the compile worker did not start within {STARTUP_LIMIT_S:g} s")
            raise _StillStarting(now - self._launched_at)
        try:
            kind, detail = ctl.recv()
        except (EOFError, OSError) as exc:
            self._shutdown()
            raise GrammarError(f"{self.name}: the compile worker died while starting") from exc
        if kind != "ready":
            self._shutdown()
            raise GrammarError(f"{self.name}: the compile worker could not start: {detail}")
        self._ready = True
        self._forked_at = time.monotonic()

    def _start(self, deadline: float | None) -> Connection:
        now = time.monotonic()
        fresh = now - self._last_used < IDLE_EXIT_S - 10.0  # well before the server's idle exit
        if fresh and self._conn is not None and self.pid is not None:
            self._last_used = now
            return self._conn
        self._end_server()
        # The start-up process exits when idle as long (once ready): start a new one well before that.
        alive = self._proc is not None and self._proc.poll() is None
        if not (alive and (not self._ready or now - self._forked_at < IDLE_EXIT_S - 10.0)):
            self._shutdown()
            self._launch_zygote()
        if not self._ready:
            self._await_ready(deadline)
        ctl, sock = self._ctl, self._ctl_sock
        assert ctl is not None and sock is not None
        # A fork takes milliseconds: a start-up process that does not answer in time is broken.
        wait = STARTUP_LIMIT_S if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            ctl.send("fork")
            ready, _, _ = select.select([sock], [], [], wait)
            if not ready:
                raise OSError(f"no compile server within {wait:.3g} s")
            msg, fds, _, _ = socket.recv_fds(sock, 8, 1)
            if len(msg) != 8 or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise OSError("the start-up process ended")
        except OSError as exc:
            self._shutdown()
            raise GrammarError(f"{self.name}: the compile worker did not start: {exc}") from exc
        self._forked_at = time.monotonic()
        self._server[0] = struct.unpack("<q", msg)[0]
        conn = Connection(fds[0])
        self.started += 1
        self._conn = self._recv = conn
        self._last_used = time.monotonic()
        return conn

    def _end_server(self) -> None:
        """Kill the compile server (if any) and wait until it is gone."""
        _end(self._server[0])
        self._server[0] = None
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
        self._conn = self._recv = None

    def _shutdown(self) -> None:
        self._end_server()
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = None
        self._proc = self._ctl = self._ctl_sock = None
        self._ready = False

    def close(self) -> None:
        """Stop the compile server and the start-up process (a later compile starts new ones)."""
        with self._lock:
            self._shutdown()

    def kill(self) -> None:
        """Kill the compile server now, from any thread (a compile in progress fails with GrammarError)."""
        pid = self._server[0]
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def start(self, timeout_s: float | None = None) -> None:
        """Start a compile server now (otherwise the first compile does, outside its limit).

        Waits for the start-up process at most ``timeout_s`` seconds (default:
        :data:`STARTUP_LIMIT_S`); past it, :class:`GrammarError`, and the
        start-up goes on for the next call.
        """
        deadline = None if timeout_s is None else time.monotonic() + max(float(timeout_s), 0.0)
        with self._lock:
            try:
                self._start(deadline)
            except _StillStarting as exc:
                raise GrammarError(
                    f"{self.name}: the compile worker was still starting after {exc.elapsed:.1f} s "
                    f"(start-up goes on, for at most {STARTUP_LIMIT_S:g} s in all)"
                ) from None

    def _wait(
        self, recv: Connection, pid: int, limit_s: float, deadline: float, memory: int | None = None
    ) -> tuple[str, float, float]:
        """Wait for the server's answer: ``("answer" | "limit" | "memory" | "backstop", cpu_s, wall_s)``.

        The limit counts the server's CPU time, polled while waiting (the
        poll interval shrinks as the compile nears its limit); where the OS
        does not report it, the limit is wall-clock. ``memory``: the resident
        bytes the server may hold (read with the CPU time; the last reading
        is :attr:`last_rss_bytes`).
        """
        t0 = time.monotonic()
        cpu0 = cpu_seconds(pid)
        used = 0.0
        while True:
            now = time.monotonic()
            if cpu0 is None:  # no CPU figures: the limit is wall-clock
                left = min(t0 + limit_s, deadline) - now
                got = left > 0 and recv.poll(left)
                wall = time.monotonic() - t0
                return ("answer" if got else "limit"), wall, wall
            usage = _usage(pid)
            if usage is not None:
                used = usage[0] - cpu0
                self.last_rss_bytes = usage[1]
                if memory is not None and usage[1] > memory:
                    return "memory", used, now - t0
            if used >= limit_s:
                return "limit", used, now - t0
            if now >= deadline:
                return "backstop", used, now - t0
            step = min(0.05, max(0.002, (limit_s - used) / 4), deadline - now)
            if recv.poll(step):
                cpu = cpu_seconds(pid)
                return "answer", (cpu - cpu0 if cpu is not None else used), time.monotonic() - t0

    def run(self, spec: GrammarSpec, limit_s: float) -> Any:
        """What the worker's compile function returns for ``spec``, or :class:`GrammarError`.

        Raises :class:`GrammarError` when the compile runs past ``limit_s``
        seconds of CPU time or holds more memory than
        :func:`compile_memory_limit`, when waiting for an earlier compile takes
        longer than ``limit_s``, or when everything after that (start-up, fork,
        compile) runs past the wall-clock backstop; the server is killed then.
        A bad :data:`MEMORY_LIMIT_ENV` is refused before anything runs.
        """
        asked = time.monotonic()
        backstop = wall_backstop(limit_s)
        memory = compile_memory_limit()  # a bad setting fails here, before anything runs
        if not self._lock.acquire(timeout=limit_s):
            raise GrammarError(
                f"spec: {self.name} could not start compiling this {spec.kind} spec within its limit of "
                f"{limit_s:g} s (other compiles were running)"
            )
        try:
            deadline = asked + backstop  # the wait for the lock included
            try:
                conn = self._start(deadline)  # start-up is not the request's CPU time, but within its backstop
            except _StillStarting as exc:
                raise GrammarError(
                    f"spec: the {self.name} compile worker was still starting after {exc.elapsed:.1f} s when "
                    f"this {spec.kind} spec's wall-clock backstop of {backstop:g} s (limit {limit_s:g} s) ran out; "
                    f"start-up goes on for the next compile (at most {STARTUP_LIMIT_S:g} s in all)"
                ) from None
            recv, pid = self._recv, self._server[0]
            assert recv is not None and pid is not None
            conn.send(spec)
            outcome, cpu, wall = self._wait(recv, pid, limit_s, deadline, memory)
            self.last_cpu_s, self.last_wall_s = cpu, wall
            if outcome != "answer":
                self.killed += 1
                self._end_server()  # gone before the caller gets control back; the start-up process stays
                if outcome == "memory":
                    assert memory is not None
                    raise GrammarError(
                        f"spec: {self.name} stopped compiling this {spec.kind} spec at its memory limit: the "
                        f"compile held {self.last_rss_bytes / 2**20:.1f} MiB, more than its {memory / 2**20:.1f} MiB, "
                        f"after {cpu:.2f} s of CPU time (set {MEMORY_LIMIT_ENV} to allow more; the default is "
                        "half of this machine's memory)"
                    )
                if outcome == "limit":
                    raise GrammarError(
                        f"spec: {self.name} did not compile this {spec.kind} spec within its limit of {limit_s:g} s; "
                        f"the compile was stopped after {cpu:.2f} s of CPU time ({wall:.2f} s wall-clock) "
                        "(set compile_limit_s on the provider or the spec to allow more)"
                    )
                raise GrammarError(
                    f"spec: {self.name} did not compile this {spec.kind} spec within its limit of {limit_s:g} s; "
                    f"the compile was stopped at its wall-clock backstop of {backstop:g} s after only {cpu:.2f} s "
                    "of CPU time (an overloaded machine, or a compile waiting on something)"
                )
            try:
                kind, value = recv.recv()
            except (EOFError, OSError) as exc:
                self._end_server()
                raise GrammarError(
                    f"spec: the {self.name} compile worker died compiling this {spec.kind} spec (after "
                    f"{cpu:.2f} s of CPU time, holding {self.last_rss_bytes / 2**20:.0f} MiB when last read; "
                    "the machine may have run out of memory)"
                ) from exc
            self.compiles += 1
        finally:
            self._lock.release()
        if kind == "err":
            message, why = value
            cause = _rebuild_cause(why)
            if cause is not None:
                raise GrammarError(message) from cause
            raise GrammarError(message)
        return value


class _StillStarting(Exception):
    """The start-up process had not finished by the caller's deadline (it keeps starting)."""

    def __init__(self, elapsed: float) -> None:
        super().__init__(elapsed)
        self.elapsed = elapsed


if __name__ == "__main__":  # the start-up process (see CompileWorker._launch_zygote)
    _zygote_main(int(sys.argv[1]))
    # Nothing to flush (no output), and the interpreter's tear-down of an imported engine can take
    # seconds on a busy machine, all the while its compile servers (killed only when it ends) run on.
    os._exit(0)
