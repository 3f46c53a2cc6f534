"""Running (method, seed) pairs, or any top-level function of picklable arguments (``run_calls``:
the saved rounds of ``audit`` and ``validate``), one at a time, in a local process pool, or as Ray tasks.

A pair is a top-level function of plain data (its ``PPOConfig`` as a dict and its folder), so
the executor does not change its result. A finished pair (``done.json``) is skipped; an
unfinished one is trained again from its start (pairs are short). A pair may fail as a result (a learning rate so
large that the values diverge): it then ends with ``failed.json`` (round and reason) instead of
stopping the comparison; a failed tuning candidate is never chosen, and a failed evaluation pair
counts with the worst return of the comparison (``comparison.load_curves``). Local workers die with
the comparison's process (even on kill -9), so its folder lock covers every pair it started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from rlinfluence.errors import UserError
from rlinfluence.experiments.specs import config_difference
from rlinfluence.ppo import PPO, PPOConfig

Job = tuple[dict[str, Any], str]
T = TypeVar("T")

MAX_WORKERS = 256
"""More local worker processes than this would only exhaust the machine."""


def check_existing(jobs: list[Job]) -> None:
    """``UserError`` if a pair's folder was started with other settings than ``jobs`` ask for:
    its results would silently stand for a different method."""
    for config, run_dir in jobs:
        path = Path(run_dir) / "config.json"
        if not path.is_file():
            continue
        try:
            saved = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            raise UserError(f"{str(path)!r} is unreadable; remove {run_dir!r} to rerun that pair") from None
        changed = config_difference(saved, config)
        if changed:
            detail = ", ".join(f"{k}: {saved.get(k)!r} -> {config.get(k)!r}" for k in changed[:4])
            raise UserError(f"{run_dir} was run with other settings ({detail}); use another --out")


def finished(run_dir: str | Path) -> bool:
    """Whether a pair has ended, completed (``done.json``) or failed (``failed.json``)."""
    return (Path(run_dir) / "done.json").exists() or (Path(run_dir) / "failed.json").exists()


def failure(run_dir: str | Path) -> dict[str, Any] | None:
    """A failed pair's ``{"round": k, "error": reason}``; None if it did not fail."""
    path = Path(run_dir) / "failed.json"
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        record = None
    if not isinstance(record, dict) or "error" not in record:
        raise UserError(f"{str(path)!r} is unreadable or not a failure record; remove {str(run_dir)!r} to rerun "
                        "that pair")
    return record


def run_pair(config: dict[str, Any], run_dir: str, may_fail: bool = False) -> str:
    """Train one (method, seed) pair into ``run_dir``. An unfinished pair (killed part-way) is
    trained again from its first round: a resumed run re-seeds its env resets and so would differ
    from an uninterrupted one, and a pair must be a pure function of its config.

    A training failure (``UserError`` from a round, e.g. non-finite advantages, or the
    ``ValueError`` / ``RuntimeError`` torch raises on a policy whose weights became NaN) is
    recorded in ``failed.json`` if ``may_fail``; a ``UserError`` is otherwise raised naming the pair.
    """
    path = Path(run_dir)
    if finished(path):
        return run_dir
    check_existing([(config, run_dir)])
    if path.exists():
        shutil.rmtree(path)
    trainer = PPO(PPOConfig.from_dict(config), run_dir=path)
    try:
        trainer.learn()
    except (UserError, ValueError, RuntimeError) as exc:
        if not may_fail:
            if isinstance(exc, UserError):
                raise UserError(f"{run_dir}: {exc}") from None
            raise
        if trainer.run is not None:
            trainer.run.close()
        (path / "failed.json").write_text(json.dumps({"round": trainer.round, "error": str(exc)}))
        return run_dir
    (path / "done.json").write_text(json.dumps({"round": trainer.round, "train_seconds": trainer.train_seconds}))
    return run_dir


def run_jobs(jobs: list[Job], workers: int, ray_address: str | None, on_done: Callable[[str], None],
             may_fail: bool = False) -> None:
    """Run every job not yet finished, calling ``on_done(run_dir)`` as each ends."""
    todo = [(config, run_dir, may_fail) for config, run_dir in jobs if not finished(run_dir)]
    run_calls(run_pair, todo, workers, ray_address, on_done)


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

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        futures = [pool.submit(function, *args, **keywords) for args in calls]
        for future in as_completed(futures):
            on_done(future.result())
        return [future.result() for future in futures]


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


@contextmanager
def folder_lock(out: Path) -> Iterator[None]:
    """Exclusive lock on ``out`` while a comparison runs (``out/.lock``, released however the
    process ends): two comparisons writing the same pairs would interleave their files."""
    from filelock import FileLock, Timeout

    lock = FileLock(out / ".lock", timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise UserError(f"another comparison is running in {str(out)!r}") from None
    try:
        yield
    finally:
        lock.release()
