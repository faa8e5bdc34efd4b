"""Process-wide thread pools for grammar work (draft filling and providers' chain operations)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["shared_pool", "spread_tasks"]

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide thread pool per size (starting threads every step would cost more than the work)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="maskplug-grammar")
            _POOLS[workers] = pool
        return pool


def spread_tasks(task: Callable[[int], None], n: int, workers: int) -> None:
    """Run ``task(0..n-1)`` on ``workers`` threads (the caller and a pool), each taking the next index when free.

    Chains differ in cost by two orders of magnitude (grammar and state), so
    fixed shares would leave one worker with most of the work.
    """
    if workers <= 1:
        for i in range(n):
            task(i)
        return
    # next() on a shared itertools.count is atomic under the GIL.
    counter = itertools.count()

    def worker() -> None:
        for i in counter:
            if i >= n:
                return
            task(i)

    # The calling thread is one of the workers: it would only wait otherwise.
    futures = [shared_pool(workers - 1).submit(worker) for _ in range(workers - 1)]
    try:
        worker()
    finally:
        for f in futures:
            f.result()
