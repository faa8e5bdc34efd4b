"""The process-wide thread pool for grammar work (draft filling, tree walks and providers' chain operations).

One pool serves every caller, whatever the number of workers each asks for:
its threads (named ``maskplug-grammar_N``) are started only as concurrent
work needs them and never exceed :data:`MAX_THREADS`, so a process that
varies batch sizes and ``threads`` settings from step to step keeps a
bounded, reused set of threads instead of one pool per size.

:func:`spread_tasks` is how the grammar code runs work on it: the calling
thread is one of the workers, and nothing it started runs after it returns
or raises. When a task raises, or the caller is interrupted
(``KeyboardInterrupt``), the other workers take no new task, the tasks not
yet started are cancelled and the running ones are waited for; only then is
the first exception raised. So a caller that releases its matchers after
``spread_tasks`` raised never shares them with a walker still running.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

__all__ = ["MAX_THREADS", "shared_pool", "spread_tasks"]

#: The most threads the grammar pool ever runs (a bound, not a reservation: threads start on demand).
MAX_THREADS = max(8, min(64, 4 * (os.cpu_count() or 1)))

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def shared_pool(workers: int = MAX_THREADS) -> ThreadPoolExecutor:
    """The process-wide grammar pool (starting threads every step would cost more than the work).

    Every caller gets the same pool, of at most :data:`MAX_THREADS` threads
    started on demand; ``workers`` is how many tasks the caller means to run
    at once (kept for the callers written when there was one pool per size).
    The pool runs as many submitted tasks at once as it has threads: to keep
    a call to ``workers`` at a time, submit at most ``workers`` tasks, as
    :func:`spread_tasks` does.
    """
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="maskplug-grammar")
        return _POOL


def _join(futures: Sequence[Future[None]]) -> BaseException | None:
    """Cancel the futures not started and wait for the others; an interrupt meanwhile is returned, not raised.

    Waiting goes on through interrupts: returning early would leave a
    worker running on state the caller is about to give back.
    """
    pending = [f for f in futures if not f.cancel()]
    late: BaseException | None = None
    while pending:
        try:
            wait(pending)
        except BaseException as exc:  # an interrupt while joining: finish joining, then raise it
            late = late or exc
        pending = [f for f in pending if not f.done()]
    return late


def spread_tasks(task: Callable[[int], None], n: int, workers: int) -> None:
    """Run ``task(0..n-1)`` on ``workers`` threads (the caller and the pool), each taking the next index when free.

    Chains differ in cost by two orders of magnitude (grammar and state), so
    fixed shares would leave one worker with most of the work.

    The calling thread runs tasks too, except on the main thread, where it
    only waits: an interrupt (delivered there) then never stops a task half
    way. Every task has finished, or will never start, when this returns or
    raises. The first exception (the caller's own first, an interrupt
    included) stops the workers from taking new indices and is raised once
    the running tasks are done; indices not reached are not run.
    """
    workers = min(int(workers), n)
    if workers <= 1:
        for i in range(n):
            task(i)
        return
    # next() on a shared itertools.count is atomic under the GIL.
    counter = itertools.count()
    stop = threading.Event()

    def worker() -> None:
        for i in counter:
            if i >= n or stop.is_set():
                return
            try:
                task(i)
            except BaseException:
                stop.set()
                raise

    pool = shared_pool(workers)
    # Signals are handled on the main thread, between any two bytecodes: a task interrupted
    # there could stop between an engine call and the bookkeeping of what it did. So on the
    # main thread the tasks all run on the pool and the caller only waits (an interrupt lands
    # in the wait); elsewhere the calling thread is one of the workers (it would only wait).
    on_main = threading.current_thread() is threading.main_thread()
    futures: list[Future[None]] = []
    first: BaseException | None = None
    try:
        for _ in range(workers if on_main else workers - 1):
            try:
                futures.append(pool.submit(worker))
            except RuntimeError:  # interpreter shutting down: no new threads; the caller does the rest
                break
        if on_main and futures:
            wait(futures)
        else:
            worker()
    except BaseException as exc:
        stop.set()
        first = exc
    late = _join(futures)
    if first is None:
        first = next((f.exception() for f in futures if not f.cancelled() and f.exception() is not None), None)
    if first is None:
        first = late
    if first is not None:
        raise first
