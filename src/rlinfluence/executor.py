"""Running any top-level function of picklable arguments (``run_calls``: the saved rounds of
``audit`` and ``validate``, the pairs of ``compare``) one at a time, in a local process pool whose
workers die with their parent, or as Ray tasks of one CPU each. Below both ``rlinfluence.analysis``
and ``rlinfluence.experiments``."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

from rlinfluence.errors import UserError

T = TypeVar("T")

MAX_WORKERS = 256
"""More local worker processes than this would only exhaust the machine."""


def check_executor(workers: int, ray_address: str | None) -> None:
    """``UserError`` unless ``1 <= workers <= MAX_WORKERS`` and a ``HOST:PORT`` ``ray_address``
    answers (``check_reachable``); called before any work is done."""
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    if workers > MAX_WORKERS:
        raise UserError(f"--workers must be <= {MAX_WORKERS}, got {workers}")
    if ray_address:
        check_reachable(ray_address)


def run_calls(function: Callable[..., T], calls: Sequence[tuple[Any, ...]], workers: int, ray_address: str | None,
              on_done: Callable[[T], None] | None = None, keywords: Mapping[str, Any] | None = None) -> list[T]:
    """``[function(*args, **keywords) for args in calls]``: in this process if ``workers <= 1``,
    else in ``workers`` spawned local processes, or as Ray tasks of one CPU each on the cluster
    at ``ray_address`` (which replaces ``workers``). ``function`` must be a top-level function
    and its arguments picklable. ``on_done(result)`` is called as each call ends (in the order
    they end); the results are returned in the order of ``calls``, whichever ran them."""
    keywords = dict(keywords or {})
    done = on_done or (lambda _: None)
    if ray_address:
        return _run_ray(function, calls, keywords, ray_address, done)
    return _run_local(function, calls, keywords, workers, done)


def _run_local(function: Callable[..., T], calls: Sequence[tuple[Any, ...]], keywords: dict[str, Any],
               workers: int, on_done: Callable[[T], None]) -> list[T]:
    if workers <= 1:
        results = []
        for args in calls:
            results.append(function(*args, **keywords))
            on_done(results[-1])
        return results
    import multiprocessing

    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=start_worker, initargs=(os.getpid(),))
    try:
        futures = [pool.submit(function, *args, **keywords) for args in calls]
        for future in as_completed(futures):
            on_done(future.result())
        return [future.result() for future in futures]
    except BaseException:  # Ctrl-C or a failed call: the other calls stop now, not after they finish
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)


def start_worker(parent: int) -> None:
    """A local worker: Ctrl-C is the parent's to handle (it reaches the whole process group, and
    every worker would print its own traceback), and the worker dies with ``parent``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """Make this (worker) process end when ``parent`` does, however it ends: an orphaned worker
    would finish its pair after the comparison's folder lock is released.

    Linux: the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``); elsewhere a
    daemon thread that polls the parent pid.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0:  # 1 = PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before the signal was armed
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """``UserError`` if ``HOST:PORT`` accepts no connection within ``timeout`` seconds (Ray would
    retry for minutes); ``auto`` and other forms are left to Ray."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or address.startswith(("ray://", "auto")):
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise UserError(f"--ray-address {address}: no Ray cluster answers there ({exc.strerror or exc})") from None


def _run_ray(function: Callable[..., T], calls: Sequence[tuple[Any, ...]], keywords: dict[str, Any],
             address: str, on_done: Callable[[T], None]) -> list[T]:
    try:
        import ray
    except ImportError:
        raise UserError("--ray-address needs ray: pip install 'rlinfluence[ray]'") from None
    if not ray.is_initialized():
        check_reachable(address)
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(num_cpus=1)(function)
    refs = [remote.remote(*args, **keywords) for args in calls]
    results, pending = {}, list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            results[done[0]] = ray.get(done[0])
        except ray.exceptions.RayTaskError as exc:  # a bad value stays one line, not a worker's traceback
            if isinstance(exc.cause, UserError):
                raise exc.cause from None
            raise
        on_done(results[done[0]])
    return [results[ref] for ref in refs]
