"""Restoring a trainer from files: ``PPO.load`` (one file written by ``PPO.save``) and
``PPO.resume`` (a run folder's newest loadable checkpoint), and the check of a state before any
of it is restored.

The functions take the trainer (a ``Restorable``) or its class as an argument, so that this module
sits below ``rlinfluence.ppo`` (whose ``PPO.load``, ``PPO.resume``, ``state_dict`` and
``load_state_dict`` call them) and never imports it. Also here: what a round's buffer file holds
(``round_tensors``) and what a round writes (``bytes_per_round``).
Every file is read with ``torch.load(weights_only=True)`` (``rlinfluence.rundir.load_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import torch

from rlinfluence import identity
from rlinfluence.buffer import RolloutBuffer
from rlinfluence.config import PPOConfig
from rlinfluence.errors import UserError
from rlinfluence.rundir import CheckpointError, RunDirectory, load_checkpoint
from rlinfluence.seeding import derived_seed

if TYPE_CHECKING:
    from collections import deque

    import gymnasium as gym

    from rlinfluence.buffer import MinibatchStep
    from rlinfluence.envs import EnvStream
    from rlinfluence.filters import Filter
    from rlinfluence.influence import TracInRecorder
    from rlinfluence.policies import ActorCritic


class Restorable(Protocol):
    """What saving and restoring use of a trainer (``rlinfluence.ppo.PPO`` is one)."""

    config: PPOConfig
    policy: ActorCritic
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    filter: Filter
    round: int
    env_steps: int
    validation_env_steps: int
    train_seconds: float
    train_cpu_seconds: float
    validation_stream: EnvStream | None
    past_policies: deque[Any]
    obs_statistics: dict[str, Any] | None
    tracin: TracInRecorder | None
    schedule: list[MinibatchStep]

    @property
    def env(self) -> gym.vector.VectorEnv: ...

    def _reset_envs(self, seed: int) -> None: ...

    def load_state_dict(self, state: dict[str, Any], source: str = "checkpoint") -> None: ...


TrainerT = TypeVar("TrainerT", bound=Restorable)

STATE_KEYS = ("round", "env_steps", "train_seconds", "policy", "optimizer", "generator")
OBS_STATISTICS = ("mean", "var", "epsilon")
"""A round's observation statistics (``obs_norm_clip``): ``envs.NormalizedObservation``'s."""
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


def load(trainer_class: type[TrainerT], path: str | Path, filter: Filter | None = None, **config_overrides: Any) -> TrainerT:
    """A ``trainer_class`` restored from ``PPO.save``, writing no run directory."""
    state = load_checkpoint(path)
    if "config" not in state:
        raise UserError(f"{str(path)!r} has no config (it is a run checkpoint: use PPO.resume)")
    config = dataclasses.replace(PPOConfig.from_dict(state["config"]), **config_overrides)
    trainer = trainer_class(config, filter=filter, run_dir=False)
    trainer.load_state_dict(state, source=repr(str(path)))
    return trainer


def resume(trainer_class: type[TrainerT], run_dir: str | Path, filter: Filter | None = None) -> TrainerT:
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
    if state["env_steps"] != state["round"] * config.rollout_size:  # what a run from before run ids can still tell
        raise UserError(f"{checkpoint.name} holds {state['env_steps']} env steps after {state['round']} rounds, but "
                        f"config.json's rounds are n_steps * n_envs = {config.rollout_size} steps (was config.json "
                        "edited?): restore it")
    trained_with = state.get("filter_class")
    if filter is None and trained_with is not None and trained_with != filter_class(trainer.filter):
        raise UserError(f"{str(run.path)!r} was trained with the filter {trained_with}, not the "
                        f"{filter_class(trainer.filter)} its config builds: pass it, PPO.resume(run_dir, filter=...)")
    if skipped:
        print(f"warning: skipped unusable checkpoint {'; '.join(skipped)}; resuming from "
              f"{checkpoint.name}", file=sys.stderr)
    run.truncate(trainer.round)
    return trainer


def round_tensors(trainer: Restorable, buffer: RolloutBuffer, keep: torch.Tensor, filter_scores: torch.Tensor | None
                  ) -> dict[str, torch.Tensor]:
    """What a round's buffer file holds: its records, the keep mask, the filter's scores, the recorded
    TracIn scores and the minibatch schedule."""
    tensors = buffer.tensors()
    tensors["keep"] = torch.as_tensor(keep, dtype=torch.bool)
    if filter_scores is not None:  # what the filter dropped by (its own chunk permutation and target)
        tensors["filter_scores"] = filter_scores.detach().double().reshape(-1)
    if trainer.tracin is not None:
        tensors["tracin"] = trainer.tracin.scores()
    if trainer.schedule:
        tensors["schedule_indices"] = torch.stack([s.indices for s in trainer.schedule])
        tensors["schedule_epochs"] = torch.tensor([s.epoch for s in trainer.schedule])
        tensors["schedule_lr"] = torch.tensor([s.lr for s in trainer.schedule], dtype=torch.float64)
    return tensors

def bytes_per_round(trainer: Restorable) -> dict[str, int]:
    """What a round writes, estimated: its checkpoint (float32 parameters, twice more for Adam's
    moments), its buffer (observations and ~12 per-record fields, the minibatch schedule), its frames."""
    cfg, n = trainer.config, trainer.config.rollout_size
    params = sum(p.numel() for p in trainer.policy.parameters())
    obs = int(np.prod(trainer.env.single_observation_space.shape or (1,)))
    return {"checkpoints": (4 * params * (2 if cfg.optimizer == "sgd" else 3) + 65536) * cfg.save_checkpoints,
            "buffers": n * (4 * obs + 12 * 8 + 8 * cfg.n_epochs) * cfg.save_buffers,
            "frames": 1024 * n * cfg.save_frames}  # compressed 96-px frames: 0.25-0.5 KB a record measured

def state_of(trainer: Restorable) -> dict[str, Any]:
    """Everything needed to continue training; loadable with ``torch.load(weights_only=True)``."""
    return {
        "format": CHECKPOINT_FORMAT,
        "env": trainer.config.env,
        "round": trainer.round,
        "env_steps": trainer.env_steps,
        "validation_env_steps": trainer.validation_env_steps,
        "train_seconds": trainer.train_seconds,
        "train_cpu_seconds": trainer.train_cpu_seconds,
        "policy": trainer.policy.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "generator": trainer.generator.get_state(),
        "filter": trainer.filter.state_dict(),
        "filter_class": filter_class(trainer.filter),
        **({"validation_generator": trainer.validation_stream.generator.get_state()} if trainer.validation_stream else {}),
        **({"past_policies": list(trainer.past_policies)} if trainer.past_policies else {}),
        **({"obs_statistics": {k: torch.as_tensor(trainer.obs_statistics[k]) for k in OBS_STATISTICS}}
           if trainer.obs_statistics is not None else {}),
    }

def filter_class(filter: Filter) -> str:
    """The filter's class, ``module.QualName``: a checkpoint records it, so that resuming a run
    trained with a custom filter object without it is refused (``restore.resume``). The package's
    own filters go by their public path, ``rlinfluence.filters.IIFFilter``, wherever they are defined."""
    module = type(filter).__module__
    return f"{'rlinfluence.filters' if module.startswith('rlinfluence.filters.') else module}.{type(filter).__qualname__}"

def restore_state(trainer: Restorable, state: dict[str, Any], source: str = "checkpoint") -> None:
    """Restore a ``state_dict``; ``UserError`` if it belongs to another env or network.

    The environments are reset (episodes cannot be restored) with a seed derived from
    (seed, round), so a resumed run is itself reproducible. A state with missing or malformed
    entries is a ``CheckpointError``, raised before anything is restored.
    """
    check_state(state, source)
    if state.get("env") != trainer.config.env:
        raise UserError(f"{source} is for env {state.get('env')!r}, not {trainer.config.env!r}")
    expected = {k: tuple(v.shape) for k, v in trainer.policy.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state["policy"].items()}
    if expected != found:
        diff = sorted(set(expected.items()) ^ set(found.items()))[0][0]
        raise UserError(f"{source} does not match the configured network (parameter {diff!r} differs)")
    try:
        trainer.policy.load_state_dict(state["policy"])
        trainer.optimizer.load_state_dict(state["optimizer"])
    except (ValueError, RuntimeError, KeyError) as exc:
        raise UserError(f"{source} does not match the configured optimizer: {exc}") from None
    trainer.generator.set_state(state["generator"])
    trainer.filter.load_state_dict(state.get("filter", {}))
    trainer.round = int(state["round"])
    trainer.env_steps = int(state["env_steps"])
    trainer.validation_env_steps = int(state.get("validation_env_steps", 0))
    if trainer.validation_stream is not None and "validation_generator" in state:
        trainer.validation_stream.generator.set_state(state["validation_generator"])
    trainer.train_seconds = float(state["train_seconds"])
    trainer.train_cpu_seconds = float(state.get("train_cpu_seconds", 0.0))
    trainer.past_policies.clear()
    trainer.past_policies.extend(state.get("past_policies", []))
    if trainer.obs_statistics is not None:  # the round's, for its evaluations and collections
        if "obs_statistics" not in state:
            raise CheckpointError(f"{source} holds no observation statistics, and the run normalises its observations")
        trainer.obs_statistics.update({k: state["obs_statistics"][k].double().numpy() for k in OBS_STATISTICS})
    trainer._reset_envs(derived_seed(trainer.config.seed, trainer.round, 0))
