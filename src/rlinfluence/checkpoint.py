"""Checkpoints and saved rounds of PPO runs: load, resume, and a saved round k at theta(k).

- ``load(path)``: a trainer restored from ``PPO.save`` (config + state in one file);
- ``resume(run_dir)``: a run continued from its newest loadable checkpoint;
- ``load_round(run_dir, k)`` -> ``SavedRound``: the trainer restored to theta(k) with round k's
  saved buffer and minibatch schedule (what attribution and every analysis reads).

Every file is read with ``torch.load(weights_only=True)`` (``rlinfluence.rundir.load_checkpoint``):
no pickle of arbitrary objects. The trainer's own state is ``PPO.state_dict`` /
``PPO.load_state_dict``; this module builds on ``rlinfluence.ppo`` (never the other way round).
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch

from rlinfluence.buffer import MinibatchStep, RolloutBuffer
from rlinfluence.config import PPOConfig
from rlinfluence.errors import UserError
from rlinfluence.ppo import PPO
from rlinfluence.rundir import RunDirectory

load = PPO.load
"""A trainer restored from ``PPO.save`` (``rlinfluence.restore.load``)."""
resume = PPO.resume
"""A run continued from its newest loadable checkpoint (``rlinfluence.restore.resume``)."""


@dataclass
class SavedRound:
    """A saved round k of a run: the trainer at theta(k) and the round's records."""

    trainer: PPO
    buffer: RolloutBuffer
    keep: torch.Tensor
    schedule: list[MinibatchStep]
    start: dict[str, Any]
    """the trainer's state at theta(k) (policy, optimiser, generator), for ``retrain``"""
    tracin: torch.Tensor | None = None
    """full local TracIn of the records as recorded in training (``PPOConfig.tracin``), or None"""
    filter_scores: torch.Tensor | None = None
    """the per-record scores (flat order) the run's filter computed in training and dropped by, or
    None: a re-scoring draws another chunk permutation (IIF's comes from the filter's generator), so
    only these say exactly why a record was dropped"""

    def retrain(self, keep: torch.Tensor | None = None, lr_scale: float = 1.0, n_epochs: int | None = None
                ) -> dict[str, float]:
        """Redo round k's update from theta(k) on the records ``keep`` (default: all) with the
        learning rate scaled by ``lr_scale`` for ``n_epochs`` epochs (default: the configured
        ones); the trainer is left at the retrained theta.

        The trainer is first restored to theta(k) with its optimiser state and minibatch
        generator, and the generator is advanced past the round's collection draw, as in
        training: so a standard run's round retrained on every record at scale 1 reproduces
        its own theta(k+1) exactly. Returns the update's statistics (approx_kl, ...).
        """
        trainer, cfg = self.trainer, self.trainer.config
        trainer.load_state_dict(copy.deepcopy(self.start))
        trainer.policy.noise((cfg.n_steps, cfg.n_envs), trainer.generator)
        if keep is None:
            keep = torch.ones(len(self.buffer), dtype=torch.bool)
        return trainer.update(self.buffer, keep, lr_scale=lr_scale, n_epochs=n_epochs)


def load_round(run_dir: str | Path, round_index: int) -> SavedRound:
    """Round ``round_index`` of a run trained with ``save_buffers``: the trainer restored to
    theta(k) (policy and optimiser state before the round's update) and the saved buffer."""
    if isinstance(round_index, bool) or not isinstance(round_index, numbers.Integral) or round_index < 0:
        raise UserError(f"round_index must be an int >= 0 (a saved round), got {round_index!r}")
    round_index = int(round_index)
    run = RunDirectory.open_existing(run_dir, tensorboard=False)
    # retraining a saved round (validate, intervention) does not record TracIn again; the analyses
    # read a run on the CPU, wherever it trained
    config = dataclasses.replace(PPOConfig.from_dict(run.read_config()), progress=False, tracin=False, device="cpu")
    tensors = run.load_buffer(round_index)
    checkpoint = run.checkpoint_path(round_index)
    if not checkpoint.is_file():
        raise UserError(f"no checkpoint for theta({round_index}) ({str(checkpoint)!r})")
    trainer = reading_trainer(run, config)
    _check_buffer_fits(tensors, trainer, run.buffer_path(round_index))
    state = run.read_checkpoint(checkpoint)
    trainer.load_state_dict(state, source=repr(str(checkpoint)))
    if state["round"] != round_index:
        raise UserError(f"checkpoint {str(checkpoint)!r} holds theta({state['round']}), not theta({round_index}) "
                        "(a file of another round?)")
    schedule = []
    if "schedule_indices" in tensors:
        schedule = [MinibatchStep(int(e), idx, float(lr)) for e, idx, lr in zip(
            tensors["schedule_epochs"], tensors["schedule_indices"], tensors["schedule_lr"], strict=True)]
    return SavedRound(trainer, RolloutBuffer.from_tensors(tensors), tensors["keep"], schedule, state,
                      tensors.get("tracin"), tensors.get("filter_scores"))


def reading_trainer(run: RunDirectory, config: PPOConfig) -> PPO:
    """The trainer a saved round is read into; where the run's env cannot be re-created (an entry
    point that is not importable here) and the run recorded its spaces, one whose envs stand in
    (``envs.UnavailableEnv``): what reads saved rounds only runs, what acts in the env says why not."""
    from rlinfluence.envs import UnavailableEnv, check_env_package, make_env

    try:
        trainer = PPO(config, run_dir=False)
        check_env_package((run.identity or {}).get("env_package"), config.env)
        return trainer
    except UserError as exc:
        spaces = run.read_spaces()
        try:
            make_env(config.env).close()
        except UserError as env_error:
            if spaces is None:
                raise
            return PPO(config, run_dir=False, stand_in=UnavailableEnv(config.n_envs, *spaces, str(env_error)))
        raise exc from None


def _check_buffer_fits(tensors: dict[str, torch.Tensor], trainer: PPO, path: Path) -> None:
    """``UserError`` if a saved buffer does not fit this run: its shape (n_steps x n_envs of the
    config, which an edit of config.json would change), its minibatch size and its observations
    and actions (the run's env) must all agree."""
    cfg = trainer.config
    ids = tensors["record_ids"]  # its round index is checked when the file is read (RunDirectory.load_buffer)
    n_envs, n_steps = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
    if (n_steps, n_envs) != (cfg.n_steps, cfg.n_envs):
        raise UserError(f"buffer {str(path)!r} has {n_steps} steps x {n_envs} envs, but the run's config.json says "
                        f"n_steps={cfg.n_steps}, n_envs={cfg.n_envs} (was config.json edited?)")
    if "schedule_indices" in tensors and len(tensors["schedule_indices"]) and \
            tensors["schedule_indices"].shape[-1] != cfg.batch_size:
        raise UserError(f"buffer {str(path)!r} was trained in minibatches of {tensors['schedule_indices'].shape[-1]}, "
                        f"but the run's config.json says batch_size={cfg.batch_size} (was config.json edited?)")
    _check_values(tensors, trainer, path)
    space, continuous = trainer.env.single_observation_space, trainer.policy.continuous
    action_shape = tuple(trainer.env.single_action_space.shape) if continuous else ()
    for name, expected in (("obs", tuple(space.shape)), ("actions", action_shape)):
        found = tuple(tensors[name].shape[1:])
        if found != expected:
            raise UserError(f"buffer {str(path)!r} does not fit env {trainer.config.env}: {name} of "
                            f"shape {found} per record, expected {expected} (a buffer of another run?)")


def _check_values(tensors: dict[str, torch.Tensor], trainer: PPO, path: Path) -> None:
    """``UserError`` naming the record if a saved value cannot be what the run recorded: a value that
    is not finite, an action outside the env's action space, or an advantage beyond what the round's
    rewards and values allow. GAE sums (gamma lambda)^l delta_(t+l), and every |delta| <= r + (1 + gamma) v
    (r, v the largest |reward| and |value| of the round), so |A| <= (r + (1 + gamma) v) / (1 - gamma lambda)."""
    for name in ("obs", "actions", "rewards", "logp", "values", "final_values", "last_values", "advantages"):
        values = tensors[name]
        if values.is_floating_point() and not torch.isfinite(values).all():
            _refuse_record(path, name, values, ~torch.isfinite(values), "not finite")
    actions, space = tensors["actions"], trainer.env.single_action_space
    if isinstance(space, gym.spaces.Discrete):
        outside = (actions != actions.round()) | (actions < space.start) | (actions >= space.start + space.n)
        if outside.any():
            _refuse_record(path, "actions", actions, outside, f"outside the action space {space}")
    elif isinstance(space, gym.spaces.MultiDiscrete):
        outside = (actions < 0) | (actions >= torch.as_tensor(space.nvec).reshape(1, -1))
        if outside.any():
            _refuse_record(path, "actions", actions, outside, f"outside the action space {space}")
    cfg = trainer.config
    largest = max(float(tensors[k].abs().max()) for k in ("values", "final_values", "last_values"))
    bound = (float(tensors["rewards"].abs().max()) + (1 + cfg.gamma) * largest) / max(1 - cfg.gamma * cfg.gae_lambda, 1e-12)
    beyond = tensors["advantages"].abs() > bound * 1.001 + 1e-6
    if beyond.any():
        _refuse_record(path, "advantages", tensors["advantages"], beyond,
                       f"beyond what the round's rewards and values allow (|A| <= {bound:.4g})")


def _refuse_record(path: Path, name: str, values: torch.Tensor, bad: torch.Tensor, why: str) -> None:
    flat = bad.reshape(len(bad), -1).any(dim=1)
    i = int(flat.nonzero()[0])
    shown = values[i].tolist()
    raise UserError(f"buffer {str(path)!r}: {name} of record {i} is {shown} ({why}; "
                    f"{int(flat.sum())} of {len(flat)} records): not what the run recorded")
