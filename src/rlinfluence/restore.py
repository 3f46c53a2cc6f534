"""Restoring a trainer from files: ``PPO.load`` (one file written by ``PPO.save``) and
``PPO.resume`` (a run folder's newest loadable checkpoint), and the check of a state before any
of it is restored.

The functions take the trainer class as an argument, so that this module sits below
``rlinfluence.ppo`` (whose ``PPO.load`` and ``PPO.resume`` call them) and never imports it.
Every file is read with ``torch.load(weights_only=True)`` (``rlinfluence.rundir.load_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlinfluence import identity
from rlinfluence.config import PPOConfig
from rlinfluence.errors import UserError
from rlinfluence.rundir import CheckpointError, RunDirectory, load_checkpoint

if TYPE_CHECKING:
    from rlinfluence.filters import Filter
    from rlinfluence.ppo import PPO

STATE_KEYS = ("round", "env_steps", "train_seconds", "policy", "optimizer", "generator")
CHECKPOINT_FORMAT = "rlinfluence-ppo-v1"
"""The layout of ``PPO.state_dict`` this version writes and reads (a checkpoint without the key
predates it and is read as this one); another is refused rather than half-restored."""


def check_state(state: dict[str, Any], source: str) -> None:
    """``CheckpointError`` if ``state`` lacks an entry of ``PPO.state_dict`` or one is malformed."""
    if state.get("format", CHECKPOINT_FORMAT) != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{source} has checkpoint format {state.get('format')!r}; this version of rlinfluence "
                              f"reads format {CHECKPOINT_FORMAT} (upgrade rlinfluence to load it)")
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"{source} lacks {', '.join(missing)} (not a PPO checkpoint)")
    if not isinstance(state["round"], int) or state["round"] < 0:
        raise CheckpointError(f"{source} has a malformed round {state['round']!r}")
    if not isinstance(state["policy"], dict) or not all(isinstance(v, torch.Tensor) for v in state["policy"].values()):
        raise CheckpointError(f"{source} has a malformed policy state")
    for key in ("generator", "validation_generator"):
        if key in state:
            try:
                torch.Generator().set_state(state[key])
            except (RuntimeError, TypeError, ValueError):
                raise CheckpointError(f"{source} has a malformed RNG state ({key})") from None


def load(trainer_class: type[PPO], path: str | Path, filter: Filter | None = None, **config_overrides: Any) -> PPO:
    """A ``trainer_class`` restored from ``PPO.save``, writing no run directory."""
    state = load_checkpoint(path)
    if "config" not in state:
        raise UserError(f"{str(path)!r} has no config (it is a run checkpoint: use PPO.resume)")
    config = dataclasses.replace(PPOConfig.from_dict(state["config"]), **config_overrides)
    trainer = trainer_class(config, filter=filter, run_dir=False)
    trainer.load_state_dict(state, source=repr(str(path)))
    return trainer


def resume(trainer_class: type[PPO], run_dir: str | Path, filter: Filter | None = None) -> PPO:
    """Continue a run from its newest loadable checkpoint (same config, same directory).

    An unreadable checkpoint (corrupt, truncated, empty, malformed) is skipped, with a warning
    on stderr, for the next older one; one of another env or network is a ``UserError``, and so
    is a run trained with a filter object of another class than its config builds, resumed
    without ``filter=`` (it would continue silently with the wrong filter).
    """
    run = RunDirectory.open_existing(run_dir)
    run.check_writable()
    if run.identity is not None and run.identity.get("written_by") != identity.TRAIN:
        raise UserError(f"{str(run.path)!r} was written by {run.identity.get('written_by')}, not rlinfluence's trainer: "
                        "continue it with the trainer that wrote it")
    config = PPOConfig.from_dict(run.read_config(), source=repr(str(run.path / "config.json")))
    checkpoints = run.checkpoints()
    trainer = trainer_class(config, filter=filter, run_dir=run)
    skipped: list[str] = []
    for checkpoint in checkpoints:
        try:
            state = load_checkpoint(checkpoint)
            check_state(state, repr(str(checkpoint)))  # a file that is no checkpoint says so before whose it is
            identity.check_file(run.identity, state.get("run_id"), checkpoint, "checkpoint", CheckpointError)
            trainer.load_state_dict(state, source=repr(str(checkpoint)))
            break
        except CheckpointError as exc:
            skipped.append(f"{checkpoint.name} ({exc})")
    else:
        raise UserError(f"no checkpoint of {str(run.path)!r} loads; newest: {skipped[0]}")
    trained_with = state.get("filter_class")
    if filter is None and trained_with is not None and trained_with != trainer_class.filter_class(trainer.filter):
        raise UserError(f"{str(run.path)!r} was trained with the filter {trained_with}, not the "
                        f"{trainer_class.filter_class(trainer.filter)} its config builds: pass it, PPO.resume(run_dir, filter=...)")
    if skipped:
        print(f"warning: skipped unusable checkpoint {'; '.join(skipped)}; resuming from "
              f"{checkpoint.name}", file=sys.stderr)
    run.truncate(trainer.round)
    return trainer
