"""Compile limits that hold: compiles run in a worker process that is killed when one runs too long.

A grammar engine's compile is native code that no Python thread can
interrupt (a thread left running past a timeout keeps its CPU and memory).
:class:`CompileWorker` runs compiles in a separate process instead: the
caller waits at most the limit, and a compile past it is ended by killing the
process, so nothing keeps running behind the failed request. The next
compile starts a fresh worker (its start-up is not counted against any
request's limit).

A provider gives the worker a *build* function (importable at module level)
that returns the function compiling one :class:`~maskplug.grammar.GrammarSpec`
inside the worker into something picklable (xgrammar's serialized grammar,
outlines-core's index, llguidance's checked grammar text); the provider turns
that back into its compiled grammar in the calling process.

Limits: :data:`DEFAULT_COMPILE_LIMIT_S` unless the provider sets its own
``compile_limit_s`` (``None``: compile in the calling process, no limit), and
``GrammarSpec.compile_limit_s`` for one call (``math.inf``: no limit for this
call).
"""

from __future__ import annotations

import builtins
import math
import os
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
    "STARTUP_LIMIT_S",
    "CompileWorker",
    "check_limit",
    "effective_limit",
]

#: Seconds a compile may take unless the provider or the call says otherwise.
DEFAULT_COMPILE_LIMIT_S = 5.0
#: Seconds a worker may take to start (import its engine, build the tokenizer); not a request's time.
STARTUP_LIMIT_S = 180.0
#: A worker with no compile for this long exits (the next compile starts a fresh one).
IDLE_EXIT_S = 120.0

BuildFn = Callable[..., Callable[[GrammarSpec], Any]]


def check_limit(value: Any, arg: str) -> float | None:
    """``value`` as a compile limit in seconds (``None`` or a number > 0, ``math.inf`` allowed)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise GrammarError(f"{arg}: expected a number of seconds > 0 or None, got {value!r}")
    return float(value)


def effective_limit(provider_limit: float | None, spec: GrammarSpec) -> float | None:
    """The limit for compiling ``spec``: the call's own, else the provider's; ``None`` for no limit."""
    limit = spec.compile_limit_s if spec.compile_limit_s is not None else provider_limit
    if limit is None or math.isinf(limit):
        return None
    return limit


def _worker_main(inbox: Connection, conn: Connection) -> None:
    """The worker process: build the compile function, then answer one spec at a time."""
    try:
        build, args = inbox.recv()
        compile_fn = build(*args)
    except BaseException as exc:  # report why start-up failed, then stop
        conn.send(("fail", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            if not inbox.poll(IDLE_EXIT_S):
                return  # idle: free the memory; the provider starts a new worker when needed
            spec = inbox.recv()
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


def _rebuild_cause(why: tuple[str, str] | None) -> BaseException | None:
    """The engine's exception behind a worker's GrammarError, when it is a builtin exception type."""
    if why is None:
        return None
    cls = getattr(builtins, why[0], None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(why[1])
    return RuntimeError(f"{why[0]}: {why[1]}")


def _stop(proc: subprocess.Popen[bytes], conns: tuple[Connection, Connection]) -> None:
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
    """A worker process that compiles for one provider, killed when a compile runs past its limit.

    Compiles are served one at a time; a caller waiting for an earlier
    compile counts that wait against its own limit, so every caller gets
    control back within its limit. ``started`` counts worker processes
    started, ``killed`` those ended for running too long.
    """

    def __init__(self, name: str, build: BuildFn, args: tuple[Any, ...]) -> None:
        self.name = name
        self._build = build
        self._args = args
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Connection | None = None
        self._recv: Connection | None = None
        self._finalizer: Any = None
        self.started = 0
        self.killed = 0
        self._last_used = -math.inf

    @property
    def pid(self) -> int | None:
        """The live worker's process id (None when none is running)."""
        p = self._proc
        return int(p.pid) if p is not None and p.poll() is None else None

    def _start(self) -> Connection:
        fresh = time.monotonic() - self._last_used < IDLE_EXIT_S - 10.0  # well before the worker's idle exit
        if fresh and self._proc is not None and self._proc.poll() is None and self._conn is not None:
            self._last_used = time.monotonic()
            return self._conn
        self._shutdown()
        # A fresh interpreter (``python -m maskplug.grammar.limits``): no inherited engine threads or
        # locks, and the caller's main script is never re-run (as multiprocessing's spawn would).
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "maskplug.grammar.limits", str(down_r), str(up_w)],
                pass_fds=(down_r, up_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                close_fds=True,
                # The caller's import path, so the worker finds the same maskplug and provider modules.
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
        finally:
            os.close(down_r)
            os.close(up_w)
        send, recv = Connection(down_w, readable=False), Connection(up_r, writable=False)
        self.started += 1
        self._proc, self._conn, self._recv = proc, send, recv
        self._finalizer = weakref.finalize(self, _stop, proc, (send, recv))
        try:
            send.send((self._build, self._args))
        except OSError as exc:
            self._shutdown()
            raise GrammarError(f"{self.name}: the compile worker did not start: {exc}") from exc
        if not recv.poll(STARTUP_LIMIT_S):
            self._shutdown()
            raise GrammarError(f"{self.name}: the compile worker did not start within {STARTUP_LIMIT_S:g} s")
        try:
            kind, detail = recv.recv()
        except (EOFError, OSError) as exc:
            self._shutdown()
            raise GrammarError(f"{self.name}: the compile worker died while starting") from exc
        if kind != "ready":
            self._shutdown()
            raise GrammarError(f"{self.name}: the compile worker could not start: {detail}")
        self._last_used = time.monotonic()
        return send

    def _shutdown(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = None
        self._proc = self._conn = self._recv = None

    def close(self) -> None:
        """Stop the worker process (a later compile starts a new one)."""
        with self._lock:
            self._shutdown()

    def kill(self) -> None:
        """Kill the worker process now, from any thread (a compile in progress fails with GrammarError)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def start(self) -> None:
        """Start the worker now (otherwise the first compile does, outside its limit)."""
        with self._lock:
            self._start()

    def run(self, spec: GrammarSpec, limit_s: float) -> Any:
        """What the worker's compile function returns for ``spec``, or :class:`GrammarError`.

        Raises :class:`GrammarError` when the compile (waiting for the
        worker included) runs past ``limit_s``; the worker is killed then.
        """
        asked = time.monotonic()
        if not self._lock.acquire(timeout=limit_s):
            raise GrammarError(
                f"spec: {self.name} could not start compiling this {spec.kind} spec within its limit of "
                f"{limit_s:g} s (other compiles were running)"
            )
        try:
            waited = time.monotonic() - asked
            conn = self._start()  # start-up (first compile, or after a kill) is not the request's time
            left = limit_s - waited
            recv = self._recv
            assert recv is not None
            conn.send(spec)
            if left <= 0 or not recv.poll(max(left, 0.0)):
                self.killed += 1
                self._shutdown()
                raise GrammarError(
                    f"spec: {self.name} did not compile this {spec.kind} spec within its limit of {limit_s:g} s; "
                    "the compile was stopped (set compile_limit_s on the provider or the spec to allow more)"
                )
            try:
                kind, value = recv.recv()
            except (EOFError, OSError) as exc:
                self._shutdown()
                raise GrammarError(
                    f"spec: the {self.name} compile worker died compiling this {spec.kind} spec"
                ) from exc
        finally:
            self._lock.release()
        if kind == "err":
            message, why = value
            cause = _rebuild_cause(why)
            if cause is not None:
                raise GrammarError(message) from cause
            raise GrammarError(message)
        return value


if __name__ == "__main__":  # the worker process (see CompileWorker._start)
    _worker_main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
