"""Running (method, seed) pairs of a comparison through the executor (``rlinfluence.executor``:
one at a time, in a local process pool, or as Ray tasks), and the comparison folder's lock.

A pair is a top-level function of plain data (its ``PPOConfig`` as a dict and its folder), so
the executor does not change its result. A finished pair (``done.json``) is skipped; an
unfinished one is trained again from its start (pairs are short). A pair may fail as a result (a learning rate so
large that the values diverge): it then ends with ``failed.json`` (round and reason) instead of
stopping the comparison; a failed tuning candidate is never chosen, and a failed evaluation pair
counts with the worst return of the comparison (``summary.load_curves``). Local workers die with
the comparison's process (even on kill -9), so its folder lock covers every pair it started.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlinfluence.errors import UserError
from rlinfluence.executor import run_calls
from rlinfluence.experiments.specs import config_difference
from rlinfluence.ppo import PPO, PPOConfig
from rlinfluence.rundir import atomic_write

Job = tuple[dict[str, Any], str]

def check_existing(jobs: list[Job]) -> None:
    """``UserError`` if a pair's folder was started with other settings than ``jobs`` ask for:
    its results would silently stand for a different method; or if a pair's folder is a link
    (planted, or left by hand): a pair is trained and read in a real folder of the comparison."""
    for config, run_dir in jobs:
        if Path(run_dir).is_symlink():
            raise UserError(f"{str(run_dir)!r} is a link (-> {os.readlink(run_dir)!r}): a comparison's pairs live in "
                            "real folders inside it; remove the link to run that pair")
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
    """Whether a pair has ended, completed (``done.json``) or failed (``failed.json``). An empty
    record (a disk that filled up as an earlier version wrote it) is no end: the pair runs again."""
    return any(_non_empty(Path(run_dir) / name) for name in ("done.json", "failed.json"))


def _non_empty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def failure(run_dir: str | Path) -> dict[str, Any] | None:
    """A failed pair's ``{"round": k, "error": reason}``; None if it did not fail."""
    path = Path(run_dir) / "failed.json"
    if not _non_empty(path):
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
        record = json.dumps({"round": trainer.round, "error": str(exc)})
        atomic_write(path / "failed.json", lambda p: p.write_text(record))  # a full disk: one line, no 0-byte record
        return run_dir
    record = json.dumps({"round": trainer.round, "train_seconds": trainer.train_seconds})
    atomic_write(path / "done.json", lambda p: p.write_text(record))
    return run_dir


def run_jobs(jobs: list[Job], workers: int, ray_address: str | None, on_done: Callable[[str], None],
             may_fail: bool = False) -> None:
    """Run every job not yet finished, calling ``on_done(run_dir)`` as each ends."""
    todo = [(config, run_dir, may_fail) for config, run_dir in jobs if not finished(run_dir)]
    run_calls(run_pair, todo, workers, ray_address, on_done)


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
