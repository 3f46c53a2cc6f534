"""A training run's directory: ``config.json``, ``metrics.csv``, TensorBoard events,
per-round checkpoints and (optionally) per-round buffers.

Layout of ``runs/<env>__<method>__<seed>__<time>/``::

    config.json                     the PPOConfig of the run
    metrics.csv                     one row per completed round
    events.out.tfevents.*           TensorBoard scalars (charts/, losses/, time/, filter/)
    checkpoints/round_0003.pt       theta(3): the state after 3 completed rounds (round_0000 =
                                    the initial policy); torch.load(weights_only=True)
    buffers/round_0003.safetensors  round 3's records and update schedule (``save_buffers``)

Every file is written to a temporary name in the same folder and renamed into place, so a
killed run never leaves a half-written file; ``metrics.csv`` is rewritten whole each round.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlinfluence.errors import UserError

_TB_GROUPS = {
    "eval_return_mean": "charts", "eval_return_std": "charts", "train_return_mean": "charts",
    "steps_per_second": "charts", "kept_fraction": "charts",
    "policy_loss": "losses", "value_loss": "losses", "entropy": "losses", "approx_kl": "losses",
    "clip_fraction": "losses", "explained_variance": "losses",
}


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then rename it onto ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def round_name(round_index: int) -> str:
    return f"round_{round_index:04d}"


class RunDirectory:
    """Reads and writes one run's files; the trainer talks to it after every round."""

    def __init__(self, path: str | Path, tensorboard: bool = True):
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        self._tensorboard = tensorboard
        self._writer = None

    # -- creation ---------------------------------------------------------------------
    @classmethod
    def create(cls, root: str | Path, env: str, method: str, seed: int, tensorboard: bool = True) -> RunDirectory:
        """Make ``root/<env>__<method>__<seed>__<time>`` (unique); ``UserError`` if unwritable."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = Path(root) / f"{env.replace('/', '-').replace(':', '-')}__{method}__{seed}__{stamp}"
        path, n = base, 1
        while path.exists():
            path, n = base.with_name(f"{base.name}-{n}"), n + 1
        try:
            (path / "checkpoints").mkdir(parents=True)
        except OSError as exc:
            raise UserError(f"cannot create run directory {str(path)!r}: {exc.strerror}") from None
        if not os.access(path, os.W_OK):
            raise UserError(f"run directory {str(path)!r} is not writable")
        return cls(path, tensorboard)

    @classmethod
    def at(cls, path: str | Path, tensorboard: bool = True) -> RunDirectory:
        """Use ``path`` (created if needed) as a new run's directory; ``UserError`` if unwritable."""
        try:
            (Path(path) / "checkpoints").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create run directory {str(path)!r}: {exc.strerror}") from None
        return cls(path, tensorboard)

    @classmethod
    def open_existing(cls, path: str | Path, tensorboard: bool = True) -> RunDirectory:
        """An existing run directory (for resume/analysis); ``UserError`` if it is not one."""
        run = cls(path, tensorboard)
        if not (run.path / "config.json").is_file():
            raise UserError(f"{str(run.path)!r} is not a run directory (no config.json)")
        metrics = run.path / "metrics.csv"
        if metrics.is_file():
            with metrics.open(newline="") as f:
                run.rows = [_parse_row(row) for row in csv.DictReader(f)]
        return run

    # -- config -----------------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        text = json.dumps(config, indent=2, sort_keys=True)
        atomic_write(self.path / "config.json", lambda p: p.write_text(text))

    def read_config(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read {str(self.path / 'config.json')!r}: {exc}") from None

    # -- metrics ----------------------------------------------------------------------
    def log_round(self, metrics: dict[str, Any]) -> None:
        """Append one round's row to ``metrics.csv`` (rewritten atomically) and TensorBoard."""
        self.rows.append(metrics)
        columns = list(dict.fromkeys(key for row in self.rows for key in row))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write(self.path / "metrics.csv", lambda p: p.write_text(buf.getvalue()))
        if self._tensorboard:
            self._log_tensorboard(metrics)

    def truncate(self, n_rounds: int) -> None:
        """Forget rows of rounds >= ``n_rounds`` (used when resuming from a checkpoint)."""
        self.rows = [row for row in self.rows if int(row["round"]) < n_rounds]

    def _log_tensorboard(self, metrics: dict[str, Any]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.path))
        step = int(metrics["env_steps"])
        for key, value in metrics.items():
            if key in ("round", "env_steps") or not isinstance(value, (int, float)):
                continue
            group = "time" if key.endswith("_seconds") else _TB_GROUPS.get(key, "filter")
            self._writer.add_scalar(f"{group}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # -- checkpoints ------------------------------------------------------------------
    def checkpoint_path(self, n_rounds: int) -> Path:
        return self.path / "checkpoints" / f"{round_name(n_rounds)}.pt"

    def save_checkpoint(self, n_rounds: int, state: dict[str, Any]) -> Path:
        """State after ``n_rounds`` completed rounds; loadable with ``weights_only=True``."""
        path = self.checkpoint_path(n_rounds)
        atomic_write(path, lambda p: torch.save(state, p))
        return path

    def latest_checkpoint(self) -> Path:
        paths = sorted((self.path / "checkpoints").glob("round_*.pt"))
        if not paths:
            raise UserError(f"no checkpoint in {str(self.path / 'checkpoints')!r} to resume from")
        return paths[-1]

    # -- buffers ----------------------------------------------------------------------
    def buffer_path(self, round_index: int) -> Path:
        return self.path / "buffers" / f"{round_name(round_index)}.safetensors"

    def save_buffer(self, round_index: int, tensors: dict[str, torch.Tensor]) -> Path:
        from safetensors.torch import save_file

        path = self.buffer_path(round_index)
        path.parent.mkdir(exist_ok=True)
        atomic_write(path, lambda p: save_file(tensors, str(p)))
        return path

    def load_buffer(self, round_index: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = self.buffer_path(round_index)
        if not path.is_file():
            saved = sorted(int(p.stem.split("_")[1]) for p in (self.path / "buffers").glob("round_*.safetensors"))
            hint = f"saved rounds: {saved[0]}..{saved[-1]}" if saved else "train with --save-buffers"
            raise UserError(f"no saved buffer for round {round_index} in {str(self.path)!r} ({hint})")
        return load_file(str(path))


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` with a one-line ``UserError`` if it is unusable."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # corrupt zip, truncated file, unpickling refused...
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load checkpoint {str(path)!r}: {first_line}") from None
    if not isinstance(state, dict) or "policy" not in state:
        raise UserError(f"{str(path)!r} is not an rlinfluence checkpoint")
    return state


def _parse_row(row: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        try:
            number = float(value)
            out[key] = int(number) if number.is_integer() and "." not in value and "e" not in value else number
        except (TypeError, ValueError):
            out[key] = value
    return out
