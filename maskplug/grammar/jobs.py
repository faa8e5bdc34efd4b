"""Who is using a matcher, and draft-mask jobs that run while the caller does something else.

A matcher is one request's grammar state and serves one call at a time.
:func:`maskplug.fill_draft_masks` and :func:`maskplug.commit` claim the
matchers they were given for as long as they use them (a dictionary lookup
per matcher under one process-wide lock, nothing per row) and give them back
on every way out, errors included:

* a matcher claimed by a call running on another thread is refused with
  :class:`~maskplug.errors.MatcherInUse` (nothing is written, no state is
  touched): two threads driving one matcher would corrupt it;
* a matcher claimed by a :class:`DraftMasksJob` (``fill_draft_masks(...,
  wait=False)``) still in flight is waited for: the job was started first, so
  the later call (the step's ``commit``, or the next step's fill) runs after
  it, whatever thread it comes from.

A :class:`DraftMasksJob` produces the rows on a job thread, which hands the
providers' parallel work to the shared grammar pools
(:mod:`maskplug.grammar.pools`) as the synchronous call does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..draftmasks import DraftMasks
from ..errors import MatcherInUse

__all__ = ["Claim", "DraftMasksJob", "claim", "release"]


class Claim:
    """The matchers one call holds (kept alive while held, so their ids stay theirs)."""

    __slots__ = ("ident", "job", "keys", "matchers")

    def __init__(self, matchers: Sequence[Any], keys: list[int], job: DraftMasksJob | None) -> None:
        self.matchers = matchers
        self.keys = keys
        self.job = job
        # The thread's ident, its name only when an error names it: looking the name up on every
        # claim costs more than the rest of the claim between an engine's forward passes.
        self.ident = threading.get_ident()

    @property
    def thread(self) -> str:
        """The name of the thread that made the claim (its ident once that thread has ended)."""
        for t in threading.enumerate():
            if t.ident == self.ident:
                return t.name
        return f"<ended thread {self.ident}>"


_LOCK = threading.Lock()
_HELD: dict[int, Claim] = {}


def claim(matchers: Sequence[Any], keys: list[int], arg: str, job: DraftMasksJob | None = None) -> Claim:
    """Claim ``matchers`` (``keys`` are their ids) for one call, all or none.

    Waits for a :class:`DraftMasksJob` in flight that holds one of them; raises
    :class:`MatcherInUse`, naming ``arg[i]`` (or ``arg`` for one matcher),
    when a call on another thread holds one.
    """
    c = Claim(matchers, keys, job)
    held = _HELD
    while True:
        with _LOCK:
            if not held or held.keys().isdisjoint(keys):
                for k in keys:
                    held[k] = c
                return c
            i = next(i for i, k in enumerate(keys) if k in _HELD)
            other = _HELD[keys[i]]
            holder = other.job
            if holder is None:
                name = arg if len(keys) == 1 and arg == "matcher" else f"{arg}[{i}]"
                raise MatcherInUse(
                    f"{name}: expected a matcher no other call is using, got one in use by a "
                    f"fill_draft_masks or commit call on thread {other.thread!r} (a matcher serves one call at a time)"
                )
        # Outside the lock: the job gives its matchers back before it completes.
        holder.wait()


def release(c: Claim) -> None:
    """Give back what :func:`claim` took."""
    held = _HELD
    with _LOCK:
        # The keys are this claim's alone (claim() takes all or none), each once (distinct matchers).
        for k in c.keys:
            del held[k]


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _job_pool() -> ThreadPoolExecutor:
    """The threads that drive jobs: separate from the grammar pools, which jobs wait on."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="maskplug-draft-job")
        return _POOL


class DraftMasksJob:
    """The rows of one step, in production: ``result()`` waits for them and returns the :class:`DraftMasks`.

    Returned by ``fill_draft_masks(..., wait=False)``. Until the job is done,
    the rows of its bitmask belong to it (do not read or write them) and its
    matchers are claimed: a :func:`~maskplug.commit` or another
    ``fill_draft_masks`` on one of them waits for the job first. The job is
    done, and its matchers are back where they started and free, before
    ``result()`` returns or raises. A request whose matcher fails is
    reported in the result's :attr:`~maskplug.DraftMasks.failed` like the
    synchronous call's (the other requests are served); when production as
    a whole is stopped (an exception that is not an ``Exception``, such as
    ``KeyboardInterrupt``), the bitmask rows it was given are restored to
    what they held before, the matchers are restored, and ``result()``
    raises it.
    """

    __slots__ = ("_future", "_span")

    def __init__(self) -> None:
        self._future: Future[DraftMasks] = Future()
        self._span: tuple[float, float] | None = None

    def _start(self, work: Callable[[], DraftMasks]) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            try:
                value = work()
            except BaseException as exc:  # handed to result()
                self._span = (t0, time.perf_counter())
                self._future.set_exception(exc)
            else:
                self._span = (t0, time.perf_counter())
                self._future.set_result(value)

        try:
            _job_pool().submit(run)
        except RuntimeError:  # interpreter shutting down: no new threads; do it here
            run()

    def result(self, timeout: float | None = None) -> DraftMasks:
        """The step's :class:`DraftMasks`, once produced (raises what production raised; ``TimeoutError``)."""
        return self._future.result(timeout)

    def done(self) -> bool:
        """Whether the rows are produced (or production failed) and the matchers are free."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What production raised, or None; waits like :meth:`result`."""
        return self._future.exception(timeout)

    def elapsed(self) -> float | None:
        """Seconds the job thread spent producing the rows (None until done): the host cost it took off the caller."""
        return None if self._span is None else self._span[1] - self._span[0]

    def finished_at(self) -> float | None:
        """When production ended, on :func:`time.perf_counter`'s clock (None until done)."""
        return None if self._span is None else self._span[1]

    def wait(self) -> None:
        """Wait until the job is done, without raising its error."""
        self._future.exception()
