"""PPO with an attribution-ready rollout buffer (Stable-Baselines3 semantics, CleanRL layout).

One round k:

    1. collect     n_steps * n_envs records with pi_theta(k); episodes continue across rounds
    2. advantages  GAE(gamma, lambda), bootstrapping time-limit truncations with V(final obs)
    3. filter      keep = filter(buffer)          (standard PPO keeps every record); a filter
                   that scores against a validation set (``uses_validation``) gets, with
                   ``validation_steps > 0``, a separate rollout of pi_theta(k) on its own envs
    4. optimise    n_epochs x floor(|kept| / batch_size) minibatch steps on kept records,
                   a fresh permutation each epoch, the remainder dropped (docs/method.md, section 5.2)
    5. evaluate    the stochastic policy on separate envs (not counted in train_seconds, nor in
                   train_cpu_seconds, the process CPU time of steps 1-4: robust to other load)

``PPOConfig`` (``rlinfluence.config``) holds every hyperparameter and is also the CLI of
``rlinfluence train``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import random
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from rlinfluence import restore
from rlinfluence.buffer import MinibatchStep, RolloutBuffer
from rlinfluence.config import FIELD_TYPES, ROBUST_IIF, PPOConfig, coerce  # noqa: F401  (importable from here)
from rlinfluence.corruptions import Corruptor, check_corruptions
from rlinfluence.device import resolve_device
from rlinfluence.envs import EnvStream, base_observation_space, check_finite, make_env, make_vec_env
from rlinfluence.errors import UserError
from rlinfluence.evaluation import Evaluator
from rlinfluence.filters import Filter, FilterContext, make_filter
from rlinfluence.frames import FrameRecorder, save_frames
from rlinfluence.influence import Records, TracInRecorder
from rlinfluence.influence.tracin import clip_coefficient
from rlinfluence.losses import (
    MINIBATCH_FIELDS,
    PPOTerms,
    normalize_advantages,
    policy_terms,
    update_diagnostics,
)
from rlinfluence.numpy_update import NumpyUpdate, resolve_update_engine
from rlinfluence.policies import ActorCritic, make_policy, rollout_actor, tempered
from rlinfluence.progress import progress_bar
from rlinfluence.rundir import RunDirectory
from rlinfluence.seeding import derived_seed
from rlinfluence.step_control import adapt_learning_rate, lookahead
from rlinfluence.step_control import step_scale as round_step_scale

RoundCallback = Callable[["PPO", dict[str, Any]], "bool | None"]


class PPO:
    """The PPO trainer. ``PPO(config).learn()`` trains and writes the run directory.

    ``filter`` decides each round which records the update uses (default: all). Set
    ``run_dir=False`` to train without writing anything (library use, tests).
    """

    def __init__(
        self,
        config: PPOConfig,
        filter: Filter | None = None,
        run_dir: str | Path | RunDirectory | None | Literal[False] = None, stand_in: gym.vector.VectorEnv | None = None,
    ):
        config.validate(check_env=stand_in is None)
        if filter is None:
            config.check_filter_options()
        self.config = config
        self.filter = filter if filter is not None else make_filter(
            config.filter, drop_pct=config.drop_pct, seed=derived_seed(config.seed, 0, 2),
            drop_mode=config.drop_mode, advantage_norm=config.advantage_norm,
            random_match=config.random_match, heuristic=config.heuristic,
            gate=config.gate, gate_threshold=config.gate_threshold, precondition=config.precondition,
            quarantine=(config.quarantine_window,
                        config.quarantine_alpha / (config.rounds if config.quarantine_guarantee == "run" else 1),
                        config.quarantine_attribution, config.trusted_envs),
        )

        # Seeding: once, everything, before anything random is built (CleanRL).
        random.seed(config.seed)
        np.random.seed(config.seed)
        torch.manual_seed(config.seed)
        torch.set_num_threads(config.torch_threads)
        self.generator = torch.Generator().manual_seed(config.seed)

        render_mode = "rgb_array" if config.save_frames else None
        asynchronous = config.vec_env == "async"
        self.obs_statistics = None if config.obs_norm_clip is None else {"clip": config.obs_norm_clip, "mean": 0.0, "var": 1.0, "epsilon": 0.0}  # restore sets a round's
        self.stream = EnvStream(stand_in or make_vec_env(config.env, config.n_envs, render_mode, asynchronous, self.obs_statistics), self.generator)  # stand_in: checkpoint.load_round's, for a run whose envs cannot be re-created
        self.last_frames: FrameRecorder | None = None  # the last collection's frames (save_frames)
        self.env.action_space.seed(config.seed)
        discrete_obs = stand_in is None and isinstance(base_observation_space(config.env), gym.spaces.Discrete)
        action_space = self.env.single_action_space
        self.corruptor = Corruptor(check_corruptions(config.corrupt, config.n_envs, config.trusted_envs, config.env,
                                                     discrete_obs, self.env.single_observation_space.shape[-1]),
                                   config.n_envs, derived_seed(config.seed, 0, 5), config.env, discrete_obs,
                                   config.trusted_envs,
                                   int(action_space.n) if isinstance(action_space, gym.spaces.Discrete) else None,
                                   ) if config.corrupt else None
        # the policies theta(k - L) .. theta(k) that a stale corruption's lagging actors use
        lag = self.corruptor.stale_lag if self.corruptor is not None else 0
        self.past_policies: collections.deque[dict[str, torch.Tensor]] = collections.deque(maxlen=lag + 1)
        # the validation rollout has its own envs and noise, so the training stream stays the same
        self.validation_stream = (
            EnvStream(make_vec_env(config.env, config.n_envs, asynchronous=asynchronous, obs_statistics=self.obs_statistics),
                      torch.Generator().manual_seed(derived_seed(config.seed, 0, 3)))
            if config.validation_steps and getattr(self.filter, "uses_validation", False) else None
        )
        self.device = resolve_device(config.device)
        self.policy: ActorCritic = make_policy(
            self.env.single_observation_space, self.env.single_action_space,
            config.hidden_sizes, config.encoder, config.critic_hidden_sizes, config.activation, config.features_dim, config.observation_parts,
        ).to(self.device)  # initialised on the CPU (the same weights on every device), then moved
        # --compile: the minibatch loss of the trainer's own policy, compiled on its first step
        self._policy_terms = torch.compile(policy_terms, dynamic=False) if config.compile else policy_terms
        if config.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(self.policy.parameters(), lr=config.learning_rate)
        elif config.optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=config.learning_rate, eps=config.adam_eps,
                                               weight_decay=config.weight_decay)
        else:
            self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=config.learning_rate, eps=config.adam_eps)
        if config.update_engine == "auto":  # the fastest update that covers the run, said once
            self.config = config = resolve_update_engine(config, self.policy, self.optimizer)
        self._numpy_update = NumpyUpdate(
            self.policy, self.optimizer, clip_range=config.clip_range, clip_range_vf=config.clip_range_vf,
            vf_coef=config.vf_coef, ent_coef=config.ent_coef, normalize_advantage=config.normalize_advantage,
            max_grad_norm=config.max_grad_norm,
        ) if config.update_engine == "numpy" else None

        self.round = 0  # completed rounds
        self.rounds_planned = math.ceil(config.total_timesteps / config.rollout_size)  # learn() may say otherwise
        self.env_steps = 0
        self.validation_env_steps = 0
        self.train_seconds = 0.0
        self.train_cpu_seconds = 0.0
        self.schedule: list[MinibatchStep] = []  # last round's optimiser steps (record_minibatches)
        self.tracin: TracInRecorder | None = None  # last round's full TracIn (PPOConfig.tracin)
        self.last_buffer: RolloutBuffer | None = None
        self._reset_envs(config.seed)
        self._evaluator: Evaluator | None = None
        self.run: RunDirectory | None = None
        if run_dir is not False:
            self.run = (
                run_dir if isinstance(run_dir, RunDirectory)
                else RunDirectory.create(config.run_root, config.env, config.method_label, config.seed, config.tensorboard)
                if run_dir is None else RunDirectory.at(run_dir, config.tensorboard)
            )
            self.run.write_config(config.to_dict(), spaces=(self.env.single_observation_space, self.env.single_action_space))
            if config.wandb:
                self.run.log_to_wandb(config.wandb_project, config.to_dict())

    @property
    def env(self) -> gym.vector.VectorEnv:
        """The training envs."""
        return self.stream.env

    # -- the loop -----------------------------------------------------------------------
    def learn(self, total_timesteps: int | None = None, callback: RoundCallback | None = None) -> PPO:
        """Train until ``total_timesteps`` env steps (default: the config's) have been collected.

        ``callback(trainer, metrics)`` runs after every round; returning False stops training.
        """
        cfg = self.config
        if cfg.obs_norm_clip is not None:
            raise UserError("obs_norm_clip is for runs another trainer wrote (SB3's VecNormalize): this trainer keeps no running statistics")
        if cfg.rollout_size % cfg.batch_size and self.round == 0:  # the remainder is a new random draw each epoch
            warnings.warn(f"batch_size {cfg.batch_size} does not divide a round's {cfg.rollout_size} records: each epoch's last {cfg.rollout_size % cfg.batch_size} sit it out", stacklevel=2)
        n_rounds = self.rounds_planned = math.ceil((total_timesteps or cfg.total_timesteps) / cfg.rollout_size)
        if self.run is not None:
            self.run.check_room(n_rounds - self.round, restore.bytes_per_round(self))
        if self.run is not None and cfg.save_checkpoints and self.round == 0:
            self.run.save_checkpoint(0, self.state_dict())  # theta(0): attribution of round 0 needs it
        try:
            with progress_bar(cfg.progress, cfg.env, n_rounds, self.round) as advance:
                while self.round < n_rounds:
                    metrics = self.train_round()
                    evaluation = (f"eval_return {metrics['eval_return_mean']:.4g} ({metrics['eval_seconds']:.1f} s)"
                                  if math.isfinite(metrics["eval_return_mean"]) else "not evaluated")
                    advance(f"round {metrics['round']} | env_steps {metrics['env_steps']} | train "
                            f"{metrics['collect_seconds'] + metrics['filter_seconds'] + metrics['update_seconds']:.1f} s"
                            f" | {evaluation} | kept_fraction "
                            f"{metrics['kept_fraction']:.3f}")
                    if callback is not None and callback(self, metrics) is False:
                        break
        finally:
            if self.run is not None:
                self.run.close()
        return self

    def train_round(self) -> dict[str, Any]:
        """One round: collect -> advantages -> filter -> update -> evaluate -> log."""
        cfg = self.config
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.last_frames = None
        buffer = self.collect()
        buffer.compute_advantages(cfg.gamma, cfg.gae_lambda)
        validation = None
        if self.validation_stream is not None:
            validation = self.collect(self.validation_stream, cfg.validation_steps)
            validation.compute_advantages(cfg.gamma, cfg.gae_lambda)
        t1 = time.perf_counter()
        trusted = (buffer.record_ids()[:, 1] >= cfg.n_envs - cfg.trusted_envs
                   if cfg.scoring_target == "trusted" else None)
        context = FilterContext(self.policy, self.round, cfg.batch_size, cfg.gamma, validation=validation, trusted=trusted,
                                optimizer=self.optimizer, ent_coef=cfg.ent_coef, lookahead=lambda train, held_out: lookahead(self, buffer, train, held_out))
        keep = self.filter(buffer, context)
        step_scale = round_step_scale(self, buffer, keep) if cfg.step_control != "none" else 1.0
        t2 = time.perf_counter()
        update_stats = self.update(buffer, keep, context.sample_weights, lr_scale=step_scale)
        if cfg.adaptive_kl is not None:  # training moves the rate on; a re-run of the update does not
            for group in self.optimizer.param_groups:
                group["lr"] = update_stats["learning_rate"]
        self._check_weights(buffer.round)
        t3 = time.perf_counter()
        # rendering --save-frames is not training: out of both clocks
        frames_seconds, frames_cpu = (self.last_frames.seconds, self.last_frames.cpu_seconds) \
            if self.last_frames is not None else (0.0, 0.0)
        self.train_seconds += t3 - t0 - frames_seconds
        self.train_cpu_seconds += time.process_time() - cpu0 - frames_cpu

        evaluated = (self.round + 1) % cfg.eval_every == 0 or self.round + 1 >= self.rounds_planned
        eval_returns = self.evaluate() if evaluated else np.zeros(0)
        t4 = time.perf_counter()
        self.round += 1
        metrics = {
            "round": self.round - 1,
            "env_steps": self.env_steps,
            "validation_env_steps": self.validation_env_steps,
            "train_seconds": self.train_seconds,
            "train_cpu_seconds": self.train_cpu_seconds,
            "collect_seconds": t1 - t0 - frames_seconds,
            "frames_seconds": frames_seconds,
            "filter_seconds": t2 - t1,
            "update_seconds": t3 - t2,
            "eval_seconds": t4 - t3,
            "steps_per_second": len(buffer) / (t3 - t0 - frames_seconds),
            "eval_return_mean": float(eval_returns.mean()) if eval_returns.size else float("nan"),
            "eval_return_std": float(eval_returns.std()) if eval_returns.size else float("nan"),
            "train_return_mean": float(np.mean(self.stream.finished_returns)) if self.stream.finished_returns else float("nan"),
            "train_episodes": len(self.stream.finished_returns),
            **update_stats,
            "step_scale": step_scale,
            **context.stats,
        }
        if self.run is not None:
            self.run.log_round(metrics, filter_stats=context.stats.keys(), scores=context.scores)
            if cfg.save_buffers:
                self.run.save_buffer(buffer.round, restore.round_tensors(self, buffer, keep, context.scores))
            if cfg.save_frames:
                save_frames(self.run.path, buffer.round, self.last_frames.flat())
            if cfg.save_checkpoints:
                self.run.save_checkpoint(self.round, self.state_dict())
        self.last_buffer = buffer
        return metrics

    # -- 1. collect ---------------------------------------------------------------------
    def _reset_envs(self, seed: int) -> None:
        self.stream.reset(seed)
        if self.validation_stream is not None:
            self.validation_stream.reset(derived_seed(seed, 0, 4))

    @torch.no_grad()
    def collect(self, stream: EnvStream | None = None, n_steps: int | None = None) -> RolloutBuffer:
        """Roll out pi_theta(k) for ``n_steps`` (default: the config's) in every env of
        ``stream`` (default: the training envs); returns the records as a buffer of this round."""
        cfg = self.config
        stream = stream or self.stream
        n_steps = n_steps or cfg.n_steps
        space = stream.env.single_action_space
        continuous = self.policy.continuous
        buf = RolloutBuffer.empty(
            self.round, n_steps, cfg.n_envs, stream.obs.shape[1:], torch.from_numpy(stream.obs).dtype,
            tuple(space.shape) if continuous else (), torch.float32 if continuous else torch.int64,
        )
        # numpy views of the buffer: per-step writes into numpy are far cheaper than into torch
        b_obs, b_act, b_logp, b_val, b_rew, b_term, b_trunc, b_ep, b_corrupted = (
            getattr(buf, name).numpy() for name in
            ("obs", "actions", "logp", "values", "rewards", "terminated", "truncated", "episode_ids", "corrupted")
        )
        corruptor = self.corruptor if stream is self.stream else None
        if corruptor is not None:
            corruptor.round = self.round  # a fault given from=R breaks its envs from round R
        stale = corruptor.stale_envs(self.round) if corruptor is not None else np.zeros(cfg.n_envs, dtype=bool)
        stale_act = None
        if stale.any():  # lagging actors: theta(k - L) acts and reports its log-probs and values
            self.past_policies.append(copy.deepcopy(self.policy.state_dict()))
            old = copy.deepcopy(self.policy)
            old.load_state_dict(self.past_policies[0])
            stale_act = rollout_actor(old)
            stale_records = stale if self.round > 0 else np.zeros_like(stale)
        act = rollout_actor(self.policy)
        hot = corruptor.temperatures != 1 if corruptor is not None else np.zeros(cfg.n_envs, dtype=bool)
        # logp-mismatch: those workers sample at another temperature and log the trainer's log-probs
        hot_act = rollout_actor(tempered(self.policy, float(corruptor.temperatures[hot][0]))) if hot.any() else None
        noise = self.policy.noise((n_steps, cfg.n_envs), stream.generator).numpy()
        stream.finished_returns = []
        obs = stream.obs
        frames = FrameRecorder(n_steps, cfg.n_envs) if cfg.save_frames and stream is self.stream else None
        for t in range(n_steps):
            if frames is not None:
                frames.capture(t, stream.env)  # the frame of obs, before the step
            # the observations the workers act on and log (an obs-bug corruption misprocesses them)
            seen = corruptor.observe(obs, stream.episode_ids) if corruptor is not None else obs
            actions, logp, values = act(seen, noise[t])
            if hot_act is not None:
                hot_actions = hot_act(seen, noise[t])[0]
                actions = np.where(hot.reshape((-1,) + (1,) * (actions.ndim - 1)), hot_actions, actions)
                logp = self._log_probs(seen, actions, hot, logp)
            if stale_act is not None:
                old_actions, old_logp, old_values = stale_act(seen, noise[t])
                env_mask = stale.reshape((-1,) + (1,) * (actions.ndim - 1))
                actions = np.where(env_mask, old_actions, actions)
                logp, values = np.where(stale, old_logp, logp), np.where(stale, old_values, values)
            logged, executed = actions, actions
            if corruptor is not None:  # action-mismatch: logged and executed actions part
                logged, relogged = corruptor.logged_actions(actions)
                logp = self._log_probs(seen, logged, relogged, logp)
                executed = corruptor.executed_actions(actions)
            env_actions = np.clip(executed, space.low, space.high) if continuous else executed
            next_obs, rewards, terminated, truncated, infos = stream.env.step(env_actions)
            b_obs[t] = seen
            b_act[t] = logged  # the sampled action, not the clipped one (SB3)
            b_logp[t] = logp
            b_val[t] = values
            reported_terminated, reported_truncated = terminated, truncated
            if corruptor is not None:  # the learner sees the corrupted reward; the env's own is tracked
                b_rew[t], b_corrupted[t] = corruptor.step(obs, actions, rewards, stream.episode_ids,
                                                          terminated | truncated)
                reported_terminated, reported_truncated = corruptor.flags(terminated, truncated)
                if stale_act is not None:
                    b_corrupted[t] |= stale_records
            else:
                b_rew[t] = rewards
            b_term[t] = reported_terminated
            # a time-limit end is bootstrapped with V(final obs); a true termination is not
            time_limit = reported_truncated & ~reported_terminated
            b_trunc[t] = time_limit
            b_ep[t] = stream.episode_ids
            if time_limit.any():
                idx = np.flatnonzero(time_limit)
                final_obs = np.stack([infos["final_obs"][i] for i in idx])
                if corruptor is not None:
                    final_obs = corruptor.observe_final(final_obs, idx)
                buf.final_values[t, torch.as_tensor(idx)] = self._values(final_obs)
            stream.track(rewards, terminated | truncated)
            obs = next_obs
        stream.obs = obs
        if frames is not None:
            self.last_frames = frames
        check_finite(b_rew, "reward", self.round)
        check_finite(b_obs, "observation", self.round)
        last_seen = corruptor.observe_final(obs, np.arange(cfg.n_envs)) if corruptor is not None else obs
        buf.last_values = self._values(last_seen)
        if stream is self.stream:
            self.env_steps += len(buf)
        else:
            self.validation_env_steps += len(buf)
        return buf

    def _values(self, obs: np.ndarray) -> torch.Tensor:
        """V(s) of a batch of observations, on the CPU (the buffer's device)."""
        return self.policy.value(torch.as_tensor(obs, device=self.device)).cpu()

    def _log_probs(self, obs: np.ndarray, actions: np.ndarray, envs: np.ndarray, logp: np.ndarray) -> np.ndarray:
        """``logp`` with the rows of ``envs`` replaced by log pi_theta(k)(actions | obs)."""
        if not envs.any():
            return logp
        out = np.array(logp, copy=True)
        out[envs] = self.policy.log_prob(torch.as_tensor(obs[envs], device=self.device),
                                         torch.as_tensor(actions[envs], device=self.device)).cpu().numpy()
        return out

    # -- 4. optimise --------------------------------------------------------------------
    def update(
        self, buffer: RolloutBuffer, keep: torch.Tensor, sample_weights: torch.Tensor | None = None,
        lr_scale: float = 1.0, n_epochs: int | None = None,
    ) -> dict[str, float]:
        """PPO epochs (``n_epochs``, default the configured ones) on the kept records: full
        minibatches of a fresh permutation per epoch, at ``lr_scale`` times the configured
        learning rate.

        With ``sample_weights`` each epoch instead draws |kept| records with replacement,
        with probability proportional to their weights (prioritised minibatches).
        """
        rate = self.learning_rate
        for group in self.optimizer.param_groups:
            group["lr"] = rate * lr_scale
        try:
            stats = self._update(buffer, keep, sample_weights, self.config.n_epochs if n_epochs is None else n_epochs)
            stats["learning_rate"] = self.optimizer.param_groups[0]["lr"] / lr_scale  # where adaptive_kl left it
            return stats
        finally:
            for group in self.optimizer.param_groups:
                group["lr"] = rate

    @property
    def learning_rate(self) -> float:
        """The rate the next update starts from: ``learning_rate``, or with ``adaptive_kl`` where the
        last round's update left it (the optimiser's state carries it, so checkpoints do too)."""
        if self.config.adaptive_kl is None:
            return self.config.learning_rate
        return self.optimizer.param_groups[0]["lr"]

    def _update(self, buffer: RolloutBuffer, keep: torch.Tensor, sample_weights: torch.Tensor | None,
                n_epochs: int) -> dict[str, float]:
        cfg = self.config
        keep = torch.as_tensor(keep, dtype=torch.bool)
        if keep.shape != (len(buffer),):
            raise ValueError(f"filter returned a keep mask of shape {tuple(keep.shape)}, expected ({len(buffer)},)")
        kept = keep.nonzero().squeeze(1)
        if len(kept) < cfg.batch_size:
            raise UserError(
                f"round {buffer.round}: filter kept {len(kept)} records, fewer than one minibatch "
                f"(batch_size {cfg.batch_size})"
            )
        if not torch.isfinite(buffer.advantages).all():
            raise UserError(f"round {buffer.round}: non-finite advantages (check the env's rewards)")
        tensors = self._update_tensors(buffer)
        returns, old_values = tensors["returns"], tensors["values"]
        n_minibatches = len(kept) // cfg.batch_size
        self.schedule = []
        self.tracin = self._tracin_recorder(tensors) if cfg.tracin else None
        steps: list[PPOTerms] = []  # each step's terms, detached: the diagnostics are read once, after the round
        fast = self._numpy_update
        if fast is not None:
            fast.begin()
        try:
            for epoch in range(n_epochs):
                if sample_weights is None:
                    perm = kept[torch.randperm(len(kept), generator=self.generator)]
                else:
                    draw = torch.multinomial(sample_weights[kept], len(kept), replacement=True,
                                             generator=self.generator)
                    perm = kept[draw]
                at = perm.to(self.device)
                shuffled = [tensors[k][at] for k in MINIBATCH_FIELDS]  # one gather per epoch; minibatches are slices
                if fast is not None:
                    shuffled = [f.numpy() for f in shuffled]
                for m in range(n_minibatches):
                    rows = slice(m * cfg.batch_size, (m + 1) * cfg.batch_size)
                    idx = perm[rows]
                    fields = [f[rows] for f in shuffled]
                    out = (self._numpy_minibatch_step(fast, fields, buffer.round, epoch) if fast is not None else
                           self._minibatch_step(self.policy, self.optimizer, fields, idx, buffer.round, epoch,
                                                self.tracin))
                    if out is None:
                        break
                    if cfg.record_minibatches or cfg.save_buffers:
                        self.schedule.append(MinibatchStep(epoch, idx, self.optimizer.param_groups[0]["lr"]))
                    steps.append(out)
                else:
                    continue
                break  # target_kl stopped the update
        finally:
            if fast is not None:
                fast.end()
        n_updates = len(steps)
        stats = update_diagnostics(steps, cfg.clip_range)
        with torch.no_grad():
            var_returns = returns.var()
            stats["explained_variance"] = float(1 - (returns - old_values).var() / var_returns) if var_returns > 0 else float("nan")
        stats["kept_fraction"] = len(kept) / len(buffer)
        stats["n_updates"] = n_updates
        if self.tracin is not None:
            stats["tracin_seconds"] = self.tracin.seconds
        return stats

    def _tracin_recorder(self, tensors: dict[str, torch.Tensor]) -> TracInRecorder:
        """Full local TracIn of this round's records (return target, raw advantages), recorded
        from the update's own steps (``PPOConfig.tracin``)."""
        cfg = self.config
        return TracInRecorder(self.policy, Records(tensors["obs"], tensors["actions"], tensors["advantages"]),
                              loss_kwargs={"clip_range": cfg.clip_range, "clip_range_vf": cfg.clip_range_vf,
                                           "vf_coef": cfg.vf_coef, "ent_coef": cfg.ent_coef})

    def _update_tensors(self, buffer: RolloutBuffer) -> dict[str, torch.Tensor]:
        """The update's records, flat, on the policy's device (the buffer stays on the CPU)."""
        return {name: buffer.flat(name).to(self.device) for name in MINIBATCH_FIELDS}

    def _minibatch_step(self, policy: ActorCritic, optimizer: torch.optim.Optimizer, fields: list[torch.Tensor],
                        idx: torch.Tensor, round_index: int, epoch: int, tracin: TracInRecorder | None = None
                        ) -> PPOTerms | None:
        """One optimiser step of the PPO loss on one minibatch, ``fields`` its records' tensors in
        ``MINIBATCH_FIELDS`` order and ``idx`` their record indices; returns the step's terms
        (detached), or None (no step taken) when target_kl stops the round. ``tracin`` records the
        step's terms."""
        cfg = self.config
        if tracin is not None and cfg.normalize_advantage:
            # the recorder's per-record terms need the advantages as the loss uses them (same op, same values)
            fields = [*fields[:3], normalize_advantages(fields[3]), *fields[4:]]
        obs, actions, *rest = fields
        with tracin.capture(fields) if tracin is not None else contextlib.nullcontext():
            terms_of = self._policy_terms if policy is self.policy else policy_terms  # a probe's copy: eager
            terms = terms_of(policy, obs, actions, *rest, clip_range=cfg.clip_range, clip_range_vf=cfg.clip_range_vf,
                             vf_coef=cfg.vf_coef, ent_coef=cfg.ent_coef,
                             normalize_advantage=cfg.normalize_advantage and tracin is None)
            loss = terms.per_record.mean()
            if not self._take_step(terms, loss.item(), optimizer, round_index, epoch):
                return None
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        if cfg.max_grad_norm is not None:
            norm = nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        if tracin is not None:  # the step's size eta_j c_j, c_j the clipping factor
            clip = clip_coefficient(norm, cfg.max_grad_norm) if cfg.max_grad_norm is not None else 1.0
            tracin.record(idx, optimizer.param_groups[0]["lr"] * clip)
        optimizer.step()
        return PPOTerms(*(t.detach() for t in (terms.per_record, terms.pg, terms.vf, terms.entropy, terms.ratio,
                                              terms.log_ratio)))

    def _numpy_minibatch_step(self, fast: NumpyUpdate, fields: list[np.ndarray], round_index: int, epoch: int
                              ) -> PPOTerms | None:
        """``_minibatch_step`` of the trainer's own policy by the NumPy engine (``update_engine numpy``)."""
        terms = fast.forward(*fields)
        if not self._take_step(terms, float(terms.per_record.mean()), self.optimizer, round_index, epoch):
            return None
        fast.step(self.optimizer.param_groups[0]["lr"])
        return terms

    def _take_step(self, terms: PPOTerms, loss: float, optimizer: torch.optim.Optimizer, round_index: int,
                   epoch: int) -> bool:
        """Whether to step on a minibatch of loss ``loss``: False when target_kl stops the update;
        a non-finite loss is a ``UserError``; adaptive_kl sets the optimiser's rate first."""
        cfg = self.config
        if not math.isfinite(loss):
            raise UserError(
                f"round {round_index}: non-finite loss {loss} at epoch {epoch} (policy_loss "
                f"{terms.pg.mean().item()}, value_loss {terms.vf.mean().item()}); stopped before the "
                f"round's checkpoint (check the env's reward scale)"
            )
        if cfg.target_kl is not None and terms.approx_kl().item() > 1.5 * cfg.target_kl:
            return False
        if cfg.adaptive_kl is not None:
            adapt_learning_rate(optimizer, terms.approx_kl().item(), cfg.adaptive_kl, cfg.learning_rate)
        return True

    def _check_weights(self, round_index: int) -> None:
        """``UserError`` if the update left a non-finite parameter (before any checkpoint of it)."""
        for name, param in self.policy.named_parameters():
            if not torch.isfinite(param).all():
                bad = param[~torch.isfinite(param)][0]
                raise UserError(f"round {round_index}: parameter {name!r} became {float(bad)} in the "
                                f"update; stopped before the round's checkpoint (lower learning_rate?)")

    # -- 5. evaluate --------------------------------------------------------------------
    def evaluate(self, n_episodes: int | None = None) -> np.ndarray:
        """Returns of the stochastic policy; the sampling generator depends only on (seed, round)."""
        n_episodes = self.config.eval_episodes if n_episodes is None else n_episodes
        if n_episodes == 0:
            return np.zeros(0)
        if self._evaluator is None:
            self._evaluator = Evaluator(lambda: make_env(self.config.env, obs_statistics=self.obs_statistics),
                                        self.config.eval_envs, self.config.eval_seed)
        generator = torch.Generator().manual_seed(derived_seed(self.config.seed, self.round, 1))
        return self._evaluator.evaluate(self.policy, n_episodes, generator)

    # -- state (rlinfluence.restore) ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue training; loadable with ``torch.load(weights_only=True)``."""
        return restore.state_of(self)

    def load_state_dict(self, state: dict[str, Any], source: str = "checkpoint") -> None:
        """Restore a ``state_dict`` (``restore.restore_state``); ``UserError`` if it belongs to another
        env or network, ``CheckpointError`` for missing or malformed entries, before anything is restored."""
        restore.restore_state(self, state, source)

    def save(self, path: str | Path) -> None:
        """Save config + state to one file (``PPO.load`` reads it back)."""
        torch.save({**self.state_dict(), "config": self.config.to_dict()}, path)

    @classmethod
    def load(cls, path: str | Path, filter: Filter | None = None, **config_overrides: Any) -> PPO:
        """A trainer restored from ``PPO.save``, writing no run directory (``restore.load``)."""
        return restore.load(cls, path, filter, **config_overrides)

    @classmethod
    def resume(cls, run_dir: str | Path, filter: Filter | None = None) -> PPO:
        """Continue a run from its newest loadable checkpoint (``restore.resume``)."""
        return restore.resume(cls, run_dir, filter)

