"""RLlib's PPO (the current API stack: EnvRunners, RLModule, Learner) as an rlinfluence run: one
round per training iteration, each env runner's sub-envs as the sources, and quarantine of the
sources the audit's test flags, before the Learner's update.

    from ray.rllib.algorithms.ppo import PPOConfig
    from rlinfluence.integrations.rllib import run_callback

    config = (PPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=2, num_envs_per_env_runner=4)
              .training(train_batch_size_per_learner=2048)
              .callbacks(run_callback("runs/rllib_cartpole", quarantine=True)))
    algo = config.build_algo()
    for _ in range(20):
        algo.train()

**What is recorded.** On each env runner, ``on_episode_created`` tags every episode with its
source, ``(runner, sub-env)``: source ``(runner - 1) x sub-envs + sub-env`` of the run (runner 0,
the local one, where there are no remote runners). The episodes reach the Learner with the tag;
there a connector piece, first in the Learner's pipeline (before PPO's own pieces), takes round k:
each source's steps in order, the log-probs the runner logged, and the critic's values at theta(k)
(computed here: RLlib's episodes carry none), GAE with RLlib's gamma and lambda, and writes them
with ``rlinfluence.writer.RunWriter``; theta(k) and the optimiser's state come from the Learner, before
its update, and theta(k+1) after it (``on_train_result``).

**Rounds are rectangles.** RLlib's sub-envs step unevenly (a reset takes a vector step without a
transition), so source s has n_s >= ``records_per_source`` steps in an iteration; the round keeps
each source's first ``records_per_source`` (default 7/8 of the iteration's share per source) and
the update uses all of them: scores of the kept records are exact, and re-runs (``validate``,
``intervene``, ``explain``) redo the update on the kept records with rlinfluence's PPO (RLlib's
KL penalty, value-loss clip and batch-wide advantage normalisation are not rlinfluence's: a
re-run lands far from RLlib's theta(k+1), docs/rllib.md measures how far).

**Quarantine** (``quarantine=True``): the connector piece runs ``rlinfluence.filters.
QuarantineFilter`` (the audit's test on the consistency checks and the reward, value and
advantage statistics, over the last ``window`` rounds) on the round's records and removes every
episode of a flagged source from the episodes the Learner trains on, this iteration; the round's
``keep`` mask says which records the update used. With nothing flagged the Learner receives the
episodes as they came: training is unchanged (tested bit for bit).

**What crosses the network** on a cluster: the source tag, two small integers per episode, rides
with the episodes RLlib already sends to the Learner; the recording and the quarantine run where
the Learner runs, on data it already has. The run directory is written there, so the Learner must
be local (``num_learners=0``, RLlib's default on one machine) or the directory a shared path (not
supported yet: refused with one error).

Needs ``ray[rllib]`` (``pip install "rlinfluence[rllib]"``); the policy must be RLlib's default
PPO module with separate actor and critic MLPs (``vf_share_layers=False``, tanh or ReLU, no head
layers) on a discrete action space, which maps onto rlinfluence's ``ActorCritic``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from rlinfluence.errors import UserError
from rlinfluence.filters.base import FilterContext
from rlinfluence.filters.quarantine import QuarantineFilter
from rlinfluence.integrations.rllib_episodes import (
    SOURCE_KEY,
    rllib_names,
    source_of,
    source_records,
    trajectories,
)
from rlinfluence.sources import MIN_SOURCES
from rlinfluence.writer import RunWriter

try:
    from ray.rllib.callbacks.callbacks import RLlibCallback
    from ray.rllib.connectors.connector_v2 import ConnectorV2
    from ray.rllib.core import DEFAULT_MODULE_ID
except ImportError as exc:  # pragma: no cover - the extra is optional
    raise ImportError('rlinfluence.integrations.rllib needs RLlib: pip install "rlinfluence[rllib]"') from exc

__all__ = ["RunCallback", "run_callback"]

KEPT_SHARE = 7 / 8
"""The share of an iteration's steps per source a round keeps by default (module docstring)."""
WRITTEN_BY = "rlinfluence.integrations.rllib"


class _EpisodeTap(ConnectorV2):
    """The Learner connector piece, first in its pipeline: hands the iteration's episodes to the
    run's callback, which records round k and returns the episodes the Learner may train on; the
    pipeline's episode list is changed in place (RLlib's later pieces and its step count read it)."""

    def __init__(self, callback: RunCallback, **kwargs: Any):
        super().__init__(**kwargs)
        self.callback = callback

    def __call__(self, *, rl_module: Any, batch: dict, episodes: list, explore: bool | None = None,
                 shared_data: dict | None = None, metrics: Any = None, **kwargs: Any) -> Any:
        episodes[:] = self.callback.take(episodes)
        return batch


class RunCallback(RLlibCallback):
    """Writes RLlib's PPO run at ``settings["path"]`` and quarantines flagged sources (module
    docstring). RLlib builds its callbacks without arguments: ``run_callback(path, ...)`` makes the
    class with its settings."""

    settings: dict[str, Any] = {}

    # -- on each env runner ----------------------------------------------------------
    def on_episode_created(self, *, episode: Any, env_runner: Any = None, env_index: int = 0, **kwargs: Any) -> None:
        episode.custom_data[SOURCE_KEY] = (int(getattr(env_runner, "worker_index", 0)), int(env_index))

    # -- on the driver, where the Learner is ----------------------------------------
    def on_algorithm_init(self, *, algorithm: Any, **kwargs: Any) -> None:
        config = algorithm.config
        learner = getattr(algorithm.learner_group, "_learner", None)
        if learner is None or config.num_learners:
            raise UserError(f"rlinfluence's RLlib run needs the Learner in this process (num_learners=0), got "
                            f"num_learners={config.num_learners}")
        if config.is_multi_agent:
            raise UserError("rlinfluence's RLlib run records single-agent PPO; this config is multi-agent")
        if not isinstance(config.env, str):
            raise UserError(f"rlinfluence's RLlib run needs a gymnasium id as the env (analyses make it), got {config.env!r}")
        self.module = learner.module[DEFAULT_MODULE_ID]
        if not isinstance(self.module.action_space, gym.spaces.Discrete):  # before anything is written
            raise UserError(f"rlinfluence maps RLlib's PPO module on discrete actions only (its head for "
                            f"{self.module.action_space} is not a state-independent log-std)")
        self.optimizer = learner.get_optimizer(DEFAULT_MODULE_ID)
        model = {"fcnet_hiddens": [256, 256], "fcnet_activation": "tanh", "vf_share_layers": False,
                 "head_fcnet_hiddens": [], **(config.model_config or {})}
        if model["vf_share_layers"] or model["head_fcnet_hiddens"] or model["fcnet_activation"] not in ("tanh", "relu"):
            raise UserError(f"rlinfluence maps RLlib's PPO module with separate actor and critic MLPs, tanh or relu, "
                            f"no head layers; got vf_share_layers={model['vf_share_layers']}, fcnet_activation="
                            f"{model['fcnet_activation']!r}, head_fcnet_hiddens={model['head_fcnet_hiddens']}")
        self.envs_per_runner = config.num_envs_per_env_runner
        self.n_sources = max(config.num_env_runners, 1) * self.envs_per_runner
        share = config.train_batch_size_per_learner / self.n_sources
        per_source = int(self.settings.get("records_per_source") or math.floor(KEPT_SHARE * share))
        if not 1 <= per_source <= share:
            raise UserError(f"records_per_source={per_source}: each of the {self.n_sources} sources has about "
                            f"{share:g} steps an iteration")
        self.gamma, self.gae_lambda = float(config.gamma), float(config.lambda_)
        self.writer = RunWriter(
            self.settings["path"], config.env, self.n_sources, per_source, seed=int(config.seed or 0),
            names=rllib_names, eval_episodes=int(self.settings.get("eval_episodes", 0)), written_by=WRITTEN_BY,
            batch_size=int(config.minibatch_size), n_epochs=int(config.num_epochs), gamma=self.gamma,
            gae_lambda=self.gae_lambda, clip_range=float(config.clip_param), ent_coef=_number(config.entropy_coeff),
            vf_coef=float(config.vf_loss_coeff), max_grad_norm=None if config.grad_clip is None else float(config.grad_clip),
            hidden_sizes=tuple(model["fcnet_hiddens"]), activation=model["fcnet_activation"])
        self.filter = None
        if self.settings.get("quarantine"):
            if self.n_sources < MIN_SOURCES:
                raise UserError(f"quarantine compares each source with 2 or more others: it needs at least {MIN_SOURCES} "
                                f"sub-envs in all, got {self.n_sources}")
            self.filter = QuarantineFilter(int(self.settings.get("window", 6)), float(self.settings.get("alpha", 0.01)))
        self.quarantined: list[list[int]] = []
        self.pending: dict[str, Any] | None = None
        self.writer.begin_round(self.module, self.optimizer)
        learner._learner_connector.prepend(_EpisodeTap(self))

    def take(self, episodes: list) -> list:
        """Round k from the iteration's episodes (the Learner's weights are still theta(k)): record
        it, and return the episodes the update may use (all but the quarantined sources')."""
        writer, policy, n = self.writer, self.writer.trainer.policy, self.writer.config.n_steps
        runs = trajectories(episodes, self.n_sources, self.envs_per_runner)
        short = [s for s, run in enumerate(runs) if len(run) < n]
        if short:
            raise UserError(f"source {short[0]} has {len(runs[short[0]])} steps in round {writer.round}, fewer than "
                            f"records_per_source={n}: give run_callback a smaller records_per_source")
        columns = [source_records(run, policy, self.gamma, self.gae_lambda, n) for run in runs]

        def stack(key: str) -> np.ndarray:
            return np.stack([column[key] for column in columns], axis=1)

        writer.add_rollout(stack("obs"), stack("actions"), stack("logp"), stack("values"), stack("rewards"),
                           stack("terminated"), stack("truncated"), stack("final_values"))
        self.pending = {"advantages": stack("advantages"), "returns": stack("returns"),
                        "last_values": np.array([column["last_value"] for column in columns])}
        dropped: list[int] = []
        if self.filter is not None:
            buffer = writer.records(self.pending["advantages"], self.pending["returns"], self.pending["last_values"])
            context = FilterContext(policy, writer.round, writer.config.batch_size, self.gamma)
            with torch.no_grad():
                self.pending["keep"] = self.filter(buffer, context)
            dropped = [int(s) for s in str(context.stats.get("quarantined_sources", "")).split()]
        self.quarantined.append(dropped)
        if not dropped:
            return episodes
        return [e for e in episodes if source_of(*e.custom_data[SOURCE_KEY], self.envs_per_runner) not in dropped]

    def on_train_result(self, *, algorithm: Any, result: dict, **kwargs: Any) -> None:
        if self.pending is None:
            return
        runners = result.get("env_runners", {})
        metrics = {k: runners[k] for k in ("episode_return_mean", "episode_len_mean")
                   if isinstance(runners.get(k), int | float) and math.isfinite(runners[k])}
        metrics["quarantined"] = float(len(self.quarantined[-1]))
        self.writer.end_round(self.pending["advantages"], self.pending["returns"], self.module, self.optimizer,
                              metrics=metrics, last_values=self.pending["last_values"], keep=self.pending.get("keep"))
        self.pending = None
        self.writer.begin_round(self.module, self.optimizer)  # theta(k+1): the weights the next iteration samples with

    def on_algorithm_end(self, **kwargs: Any) -> None:  # pragma: no cover - RLlib calls it on stop() where it has it
        self.writer.close()


def _number(value: Any) -> float:
    """A coefficient RLlib may give as a schedule ([[timestep, value], ...]): its first value."""
    return float(value[0][1]) if isinstance(value, list | tuple) else float(value)


def run_callback(path: str | Path, quarantine: bool = False, records_per_source: int | None = None,
                 window: int = 6, alpha: float = 0.01, eval_episodes: int = 0) -> type[RunCallback]:
    """The ``RunCallback`` class for ``AlgorithmConfig.callbacks``: writes the run at ``path``
    (a new folder); with ``quarantine``, drops the episodes of the sources ``QuarantineFilter(window,
    alpha)`` flags before each update; ``records_per_source``: each round's steps per source
    (default: 7/8 of an iteration's share); ``eval_episodes``: rlinfluence's evaluation of each
    theta(k+1), in metrics.csv."""
    if (Path(path) / "config.json").exists():
        raise UserError(f"{str(path)!r} already holds a run: give this one its own path")
    if window < 1 or not 0 < alpha < 1 or (records_per_source is not None and records_per_source < 1):
        raise UserError(f"window must be >= 1, alpha in (0, 1), records_per_source >= 1; got {window}, {alpha}, "
                        f"{records_per_source}")
    settings = {"path": str(path), "quarantine": quarantine, "records_per_source": records_per_source,
                "window": window, "alpha": alpha, "eval_episodes": eval_episodes}
    return type("RunCallback", (RunCallback,), {"settings": settings, "__module__": __name__})
