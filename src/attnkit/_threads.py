"""One process-wide worker pool for attnkit's CPU kernels (the ``decode`` backend and the paged
cache's attention), which split a call into independent units and run them on T threads.

While a call runs threaded it sets torch's intra-op thread count to 1 (process-wide), so at most
one call does so at a time: :func:`run_split` takes a lock without waiting and, when another call
holds it, runs its units on the calling thread alone. Slot numbers let callers keep per-thread
scratch buffers: slot ``t`` is used by one thread at a time, and only while the lock is held.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

__all__ = ["run_split", "at_fork"]

_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_pool_lock = threading.Lock()  # guards creation of the pool
_run_lock = threading.Lock()  # one threaded call at a time (it changes torch's thread count)
_fork_hooks: list[Callable[[], None]] = []


def at_fork(hook: Callable[[], None]) -> None:
    """Call ``hook`` in a forked child (e.g. to drop scratch buffers tied to the parent's threads)."""
    _fork_hooks.append(hook)


def _reset_after_fork() -> None:
    global _pool, _pool_workers, _pool_lock, _run_lock
    _pool, _pool_workers = None, 0
    _pool_lock, _run_lock = threading.Lock(), threading.Lock()
    for hook in _fork_hooks:
        hook()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnkit")
            _pool_workers = workers
        return _pool


def run_split(parts: Sequence[list], work: Callable[[list, int | None], None]) -> None:
    """Run ``work(parts[t], t)`` for every t: ``parts[0]`` on this thread, the rest on pooled
    threads, torch's intra-op threads set to 1 meanwhile (restored after). If another call holds
    the pool, run ``work(all units, None)`` here instead (slot None: use fresh buffers).

    Grad and inference modes are thread-local: ``work`` must set the caller's on pool threads."""
    if not _run_lock.acquire(blocking=False):
        work([u for p in parts for u in p], None)
        return
    try:
        if len(parts) <= 1:
            work(parts[0] if parts else [], 0)
            return
        pool = _get_pool(len(parts) - 1)
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            futs = [pool.submit(work, parts[t], t) for t in range(1, len(parts))]
            try:
                work(parts[0], 0)
            finally:
                for f in futs:
                    f.result()
        finally:
            torch.set_num_threads(saved)
    finally:
        _run_lock.release()
