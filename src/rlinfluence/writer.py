"""Any PPO loop's run as an rlinfluence run directory: a few calls in the loop, and every analysis
(``attribute``, ``diagnose``, ``timeline``, ``validate``, ``intervene``, ``explain``, ``audit``,
``report``) reads the run.

    writer = RunWriter("runs/my_ppo", env="CartPole-v1", n_envs=4, n_steps=128, seed=1,
                       batch_size=128, n_epochs=4, clip_range=0.2, ent_coef=0.01)
    for iteration in range(iterations):
        writer.begin_round(agent, optimizer)                        # theta(k), before collecting
        for step in range(n_steps):
            ...                                                     # act, env.step
            writer.add_step(obs, action, logprob, value, reward, terminations, truncations)
        ...                                                         # GAE
        ...                                                         # the PPO update
        writer.end_round(advantages, returns, agent, optimizer)     # theta(k+1), after the update
    writer.close()

What it writes, as ``rlinfluence train --save-buffers`` does: ``config.json`` (a ``PPOConfig``
with the hyperparameters given, the learning rate and Adam's eps read from the optimiser, the
hidden sizes and activation from the policy), ``checkpoints/round_K.pt`` (theta(k) and the optimiser's state, in
rlinfluence's ``ActorCritic`` names), ``buffers/round_K.safetensors`` (round k's records with the
advantages the update used) and ``metrics.csv`` (one row per round: the loop's own scalars, and
rlinfluence's evaluation of theta(k+1) with ``eval_episodes``).

**The policy.** Analyses score records with rlinfluence's ``ActorCritic`` (MLPs with tanh or ReLU,
an actor and a critic, a linear action head and value head, a state-independent
``log_std`` for Box actions), so the caller's module is mapped onto it, parameter by parameter:

- an ``ActorCritic``: as it is;
- CleanRL's layout: ``actor`` (or ``actor_mean``) and ``critic``, each an ``nn.Sequential`` of
  ``Linear`` layers with ``Tanh`` (or ``ReLU``) between them, and for Box actions ``actor_logstd``;
- anything else through ``names``: a function from the caller's parameter name to rlinfluence's
  (``actor.0.weight``, ..., ``action_head.weight``, ``value_head.bias``, ``log_std``; None for a
  parameter the policy does not use).

A mapping is checked on every round: the logged log-probs and values of a sample of the round's
records must equal rlinfluence's policy's at theta(k) (``LOGP_TOLERANCE``), or the round is refused
with one ``UserError`` naming the largest gap. What does not map (another activation, a shared trunk, a CNN)
is refused at the first ``begin_round`` with one ``UserError``.

**What re-runs mean.** ``validate``, ``intervene`` and ``explain`` redo round k's update with
rlinfluence's PPO (its minibatches, its loss with the hyperparameters given) from theta(k) and the
optimiser's state: a plain re-run lands near the loop's theta(k+1), on it only where the loop's
update is rlinfluence's (the gap is measured in ``docs/trainers.md``). Scores at theta(k)
(``attribute``, ``diagnose``, ``timeline``, ``audit``) need no re-run and are exact.

**The caller's training is unchanged**: the writer reads tensors and writes files; it draws no
random number from the process's generators and leaves the torch thread count as it found it
(its own trainer and evaluation run inside ``process_state_kept``).
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.config import PPOConfig
from rlinfluence.envs import UnavailableEnv
from rlinfluence.errors import UserError
from rlinfluence.rundir import RunDirectory

WRITTEN_BY = "rlinfluence.RunWriter"
"""``written_by`` of the run's identity: analyses read the run, ``train --resume`` refuses it."""
LOGP_TOLERANCE = 1e-4
"""The largest gap allowed between a logged log-prob (or value) and rlinfluence's policy's, per record."""
CHECKED_RECORDS = 256
"""Records per round whose log-probs and values are checked against the mapped policy."""
OPTIMIZERS = {torch.optim.Adam: "adam", torch.optim.AdamW: "adamw", torch.optim.SGD: "sgd"}
"""The optimisers a run's re-runs can take, by class (``PPOConfig.optimizer``)."""
FIELDS = ("obs", "actions", "logp", "values", "rewards", "terminated", "truncated", "final_values")


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Run the body and restore the process's global generators (``random``, NumPy, torch) and the
    torch thread count as they were: rlinfluence's trainer seeds and sets them for itself."""
    state = random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        torch.set_num_threads(state[3])


def _linears(module: nn.Module, where: str) -> tuple[list[nn.Linear], str | None]:
    """(the ``Linear`` layers, the activation between them: ``ACTIVATIONS``' name, None for one
    layer) of a CleanRL-style ``nn.Sequential``: Linear, act, ..., Linear with one activation."""
    from rlinfluence.policies import ACTIVATIONS

    by_type = {kind: name for name, kind in ACTIVATIONS.items()}
    if not isinstance(module, nn.Sequential):
        raise UserError(f"RunWriter: {where} is a {type(module).__name__}, not an nn.Sequential of Linear layers with "
                        "tanh or ReLU between them; pass names= to map the policy's parameters")
    layers = list(module)
    for layer in layers:
        if not isinstance(layer, nn.Linear) and type(layer) not in by_type:
            raise UserError(f"RunWriter: {where} holds {type(layer).__name__}; rlinfluence's policy is Linear layers "
                            "with tanh or ReLU between them (pass names= for a module that computes the same)")
    linears = [layer for layer in layers if isinstance(layer, nn.Linear)]
    activations = {by_type[type(layer)] for layer in layers if not isinstance(layer, nn.Linear)}
    if not linears or not isinstance(layers[-1], nn.Linear) or len(layers) != 2 * len(linears) - 1 \
            or any(isinstance(layer, nn.Linear) for layer in layers[1::2]) or len(activations) > 1:
        raise UserError(f"RunWriter: {where} is not Linear, act, ..., Linear (one activation, tanh or ReLU, after "
                        "every hidden layer, none after the last)")
    return linears, next(iter(activations), None)


def cleanrl_names(policy: nn.Module) -> tuple[dict[str, str], dict[str, Any]]:
    """(the caller's parameter name -> rlinfluence's ``ActorCritic`` name, the architecture's
    ``PPOConfig`` fields: ``hidden_sizes``, ``critic_hidden_sizes``, ``activation``) of a
    CleanRL-style agent: ``actor`` or ``actor_mean``, ``critic``, optional ``actor_logstd``."""
    actor_name = "actor_mean" if hasattr(policy, "actor_mean") else "actor"
    if not hasattr(policy, actor_name) or not hasattr(policy, "critic"):
        raise UserError(f"RunWriter: the policy ({type(policy).__name__}) is not rlinfluence's ActorCritic and has no "
                        "actor (or actor_mean) and critic to map; pass names= to map its parameters")
    names: dict[str, str] = {}
    sizes, activations = {}, set()
    for prefix, ours, head in ((actor_name, "actor", "action_head"), ("critic", "critic", "value_head")):
        linears, activation = _linears(getattr(policy, prefix), prefix)
        activations |= {activation} - {None}
        sizes[ours] = tuple(layer.out_features for layer in linears[:-1])
        for i, layer in enumerate(linears):
            target = head if i == len(linears) - 1 else f"{ours}.{2 * i}"
            index = list(getattr(policy, prefix)).index(layer)
            names[f"{prefix}.{index}.weight"] = f"{target}.weight"
            names[f"{prefix}.{index}.bias"] = f"{target}.bias"
    if len(activations) > 1:
        raise UserError(f"RunWriter: the actor and the critic use {' and '.join(sorted(activations))}; rlinfluence's "
                        "policy has one activation for both")
    for logstd in ("actor_logstd", "log_std"):
        if hasattr(policy, logstd):
            names[logstd] = "log_std"
    return names, {"hidden_sizes": sizes["actor"],
                   "critic_hidden_sizes": None if sizes["critic"] == sizes["actor"] else sizes["critic"],
                   "activation": next(iter(activations), "tanh")}


class RunWriter:
    """Writes a PPO loop's run at ``path`` (module docstring).

    ``env``: the gymnasium id the loop trains on (evaluations and re-runs make it); ``n_envs`` x
    ``n_steps``: one round's records; ``hyperparameters``: ``PPOConfig`` fields the loop's update
    uses (``batch_size``, ``n_epochs``, ``gamma``, ``gae_lambda``, ``clip_range``, ``ent_coef``,
    ``vf_coef``, ``max_grad_norm``, ``normalize_advantage``, ``clip_range_vf``, ``target_kl``, ...);
    ``names``: the caller's parameter name -> rlinfluence's, for a policy that is neither an
    ``ActorCritic`` nor CleanRL's layout; ``eval_episodes``: rlinfluence's evaluation of each
    theta(k+1) (``eval_return_mean`` in metrics.csv; 0 = none)."""

    def __init__(self, path: str | Path, env: str, n_envs: int, n_steps: int, seed: int = 0,
                 names: Callable[[str], str | None] | dict[str, str] | None = None, eval_episodes: int = 0,
                 written_by: str = WRITTEN_BY, check_env: bool = True, **hyperparameters: Any):
        self.path = Path(path)
        if (self.path / "config.json").exists():
            raise UserError(f"{str(self.path)!r} already holds a run: the analyses would mix the two trainings; give "
                            "this one its own path")
        unknown = sorted(set(hyperparameters) - set(PPOConfig.__dataclass_fields__))
        if unknown:
            raise UserError(f"RunWriter: unknown hyperparameter {unknown[0]!r} (PPOConfig's fields are accepted)")
        self._given = {"env": env, "n_envs": n_envs, "n_steps": n_steps, "seed": seed, "eval_episodes": eval_episodes,
                       **hyperparameters}
        PPOConfig(**self._given).validate(check_env)  # a bad value is refused here, before the loop trains
        self._spaces: tuple[Any, Any] | None = None
        self._names, self.written_by = names, written_by
        self.trainer = None
        self.run: RunDirectory | None = None
        self.round = 0
        self._steps: list[dict[str, torch.Tensor]] = []
        self._episodes = torch.zeros(n_envs, dtype=torch.int64)
        self._lr_warned = False
        self._begun = False
        # False where the loop's logged values are by design not its critic's (the caller then checks
        # the critic's mapping another way); the log-probs are checked either way
        self.check_values = True

    @classmethod
    def from_config(cls, path: str | Path, config: PPOConfig, names: Callable[[str], str | None] | None = None,
                    written_by: str = WRITTEN_BY, spaces: tuple[Any, Any] | None = None) -> RunWriter:
        """A writer for a loop whose ``PPOConfig`` is known whole (``RunDirectoryCallback``); with
        ``spaces`` (observation, action), for an env that cannot be built here: the policy is built on
        them (``envs.UnavailableEnv``)."""
        fields = {k: v for k, v in config.to_dict().items() if k in PPOConfig.__dataclass_fields__}
        env, n_envs, n_steps, seed = (fields.pop(k) for k in ("env", "n_envs", "n_steps", "seed"))
        writer = cls(path, env, n_envs, n_steps, seed, names=names, written_by=written_by, check_env=spaces is None,
                     **fields)
        writer._spaces = spaces
        return writer

    # -- the policy -------------------------------------------------------------------
    def _mapping(self, policy: nn.Module) -> tuple[dict[str, str], dict[str, Any]]:
        from rlinfluence.policies import ActorCritic

        if isinstance(policy, ActorCritic):
            return {n: n for n, _ in policy.named_parameters()}, {}
        if self._names is None:
            return cleanrl_names(policy)
        lookup = self._names.get if isinstance(self._names, dict) else self._names
        return {n: lookup(n) for n, _ in policy.named_parameters() if lookup(n) is not None}, {}

    def _start(self, policy: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The first round: the config (rate and eps from the optimiser, sizes from the policy), the
        trainer the analyses' policy lives in, the run directory."""
        from rlinfluence.ppo import PPO

        names, architecture = self._mapping(policy)
        group, kind = optimizer.param_groups[0], OPTIMIZERS.get(type(optimizer))
        if kind is None or group.get("amsgrad") or group.get("maximize") or len(optimizer.param_groups) > 1 or (
                kind != "adamw" and group.get("weight_decay")) or (kind == "sgd" and group.get("momentum")):
            raise UserError(f"RunWriter: optimiser {type(optimizer).__name__} (weight decay {group.get('weight_decay', 0)}, "
                            "one parameter group); rlinfluence's re-runs take Adam, AdamW or plain SGD")
        fields = {**self._given, "learning_rate": float(group["lr"]), "optimizer": kind,
                  "save_buffers": True, "progress": False, "tensorboard": False}
        if kind != "sgd":
            fields["adam_eps"] = float(group["eps"])
        if kind == "adamw":
            fields["weight_decay"] = float(group["weight_decay"])
        fields.update(architecture)
        if fields.get("update_engine", "auto") == "auto":  # re-runs of another loop's update: the engine its gap was measured with
            fields["update_engine"] = "torch"
        fields.setdefault("total_timesteps", fields["n_envs"] * fields["n_steps"])
        self.config = PPOConfig(**fields)
        self.config.validate(check_env=self._spaces is None)
        stand_in = None if self._spaces is None else UnavailableEnv(self.config.n_envs, *self._spaces, "no env recorded")
        with process_state_kept():
            self.trainer = PPO(self.config, run_dir=False, stand_in=stand_in)
        ours = dict(self.trainer.policy.named_parameters())
        theirs = dict(policy.named_parameters())
        unmapped = sorted(set(ours) - set(names.values()))
        bad = [(n, o) for n, o in names.items() if o not in ours or theirs[n].numel() != ours[o].numel()]
        if unmapped or bad:
            what = f"rlinfluence's {unmapped[0]!r} has no counterpart" if unmapped else \
                f"{bad[0][0]!r} does not map onto rlinfluence's {bad[0][1]!r}"
            raise UserError(f"RunWriter: the policy does not map onto rlinfluence's ActorCritic ({what}; its "
                            f"parameters: {sorted(ours)})")
        self._map = [(theirs[n], ours[o]) for n, o in names.items()]
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in theirs.items() if n in names and id(p) not in in_optimizer]
        if missing:
            raise UserError(f"RunWriter: the optimiser does not hold the policy's parameter {missing[0]!r}")
        self.run = RunDirectory.at(self.path, tensorboard=False)
        self.run.write_config(self.config.to_dict(), written_by=self.written_by,
                              spaces=(self.trainer.env.single_observation_space, self.trainer.env.single_action_space))

    def _sync(self, optimizer: torch.optim.Optimizer, obs_statistics: dict[str, Any] | None = None) -> None:
        """rlinfluence's policy, optimiser and observation statistics set to the caller's as they are
        now (shapes as ours: CleanRL's ``actor_logstd`` is [1, d] where ``log_std`` is [d])."""
        trainer = self.trainer
        if (obs_statistics is None) != (trainer.obs_statistics is None):
            raise UserError(f"RunWriter: obs_statistics {'given' if obs_statistics is not None else 'missing'}, "
                            f"obs_norm_clip is {self.config.obs_norm_clip}: give both or neither")
        if obs_statistics is not None:
            trainer.obs_statistics.update({k: np.asarray(obs_statistics[k], dtype=np.float64)
                                           for k in ("mean", "var", "epsilon")})
        our_index = {id(p): i for i, p in enumerate(trainer.policy.parameters())}
        state: dict[int, dict[str, Any]] = {}
        with torch.no_grad():
            for theirs, ours in self._map:
                ours.copy_(theirs.detach().cpu().reshape(ours.shape))
                moments = optimizer.state.get(theirs)
                if moments:
                    state[our_index[id(ours)]] = {k: v.detach().cpu().clone().reshape(ours.shape)
                                                  if torch.is_tensor(v) and v.numel() == ours.numel()
                                                  else (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                                                  for k, v in moments.items()}
        group = {**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"},
                 "params": list(range(len(our_index)))}
        trainer.optimizer.load_state_dict({"state": state, "param_groups": [group]})
        lr = float(group["lr"])
        if lr != self.config.learning_rate and not self._lr_warned:
            self._lr_warned = True
            warnings.warn(f"RunWriter: the learning rate is {lr:g} at round {self.round}, not {self.config.learning_rate:g} "
                          "(a schedule?): re-runs of an update use the configured constant rate", stacklevel=3)
        trainer.round = self.round

    # -- the loop's calls -------------------------------------------------------------
    def begin_round(self, policy: nn.Module, optimizer: torch.optim.Optimizer,
                    obs_statistics: dict[str, Any] | None = None) -> None:
        """Round k starts: ``policy`` and ``optimizer`` as they are before collecting (theta(k));
        ``obs_statistics``: with ``obs_norm_clip``, the running statistics that normalise the
        observations now (``mean``, ``var``, ``epsilon``: ``envs.NormalizedObservation``)."""
        if self._begun:
            raise UserError(f"RunWriter: begin_round called twice without end_round (round {self.round})")
        if self.trainer is None:
            self._start(policy, optimizer)
        self._sync(optimizer, obs_statistics)
        if not self.run.checkpoint_path(self.round).exists():
            self.run.save_checkpoint(self.round, self.trainer.state_dict())
        self._steps, self._begun = [], True

    def add_step(self, obs: Any, actions: Any, logp: Any, values: Any, rewards: Any, terminated: Any,
                 truncated: Any, final_values: Any = None) -> None:
        """One step of every env: the observations acted on, the actions, their log-probs and values
        at theta(k), and what ``env.step`` returned (rewards, terminated, truncated; ``final_values``:
        V(final observation) where an episode was cut by a time limit and the loop bootstraps it)."""
        if not self._begun:
            raise UserError("RunWriter: add_step before begin_round")
        if len(self._steps) >= self.config.n_steps:
            raise UserError(f"RunWriter: more than n_steps = {self.config.n_steps} steps in round {self.round}")
        values_given = (obs, actions, logp, values, rewards, terminated, truncated,
                        np.zeros(self.config.n_envs) if final_values is None else final_values)
        self._steps.append({name: _tensor(value) for name, value in zip(FIELDS, values_given, strict=True)})

    def add_rollout(self, obs: Any, actions: Any, logp: Any, values: Any, rewards: Any, terminated: Any,
                    truncated: Any, final_values: Any = None) -> None:
        """A whole round's steps at once, each ``[n_steps, n_envs, ...]`` (as ``add_step``)."""
        arrays = [obs, actions, logp, values, rewards, terminated, truncated, final_values]
        for t in range(len(_tensor(obs))):
            self.add_step(*(None if a is None else a[t] for a in arrays))

    def end_round(self, advantages: Any, returns: Any, policy: nn.Module, optimizer: torch.optim.Optimizer,
                  metrics: dict[str, float] | None = None, last_values: Any = None,
                  obs_statistics: dict[str, Any] | None = None, keep: Any = None) -> None:
        """Round k ends: the advantages and returns the update used (``[n_steps, n_envs]``), the
        policy and optimiser after the update (theta(k+1)), the loop's own scalars for metrics.csv,
        V(s_T) of the observations after the last step (``last_values``, [n_envs]; the audit's
        one-step checks read it), the observation statistics now (as ``begin_round``), and the
        records the update used (``keep``, [N] bool in ``RolloutBuffer.flat`` order; default: all)."""
        buffer = self.records(advantages, returns, last_values)
        tensors = buffer.tensors()
        tensors["keep"] = torch.ones(len(buffer), dtype=torch.bool) if keep is None else _tensor(keep).bool().reshape(-1)
        if len(tensors["keep"]) != len(buffer):
            raise UserError(f"RunWriter: keep holds {len(tensors['keep'])} values for round {self.round}'s "
                            f"{len(buffer)} records")
        self.run.save_buffer(self.round, tensors)
        self._begun = False
        self.round += 1
        self._sync(optimizer, obs_statistics)  # theta(k+1)
        self.run.save_checkpoint(self.round, self.trainer.state_dict())
        row: dict[str, Any] = {"round": self.round - 1, "env_steps": self.round * self.config.rollout_size,
                               "kept_fraction": 1.0}
        for key, value in (metrics or {}).items():
            if not isinstance(value, int | float | np.number) and not (torch.is_tensor(value) and value.numel() == 1):
                raise UserError(f"RunWriter: metrics[{key!r}] is {type(value).__name__}; give numbers")
            row[key] = float(value)
        with process_state_kept():  # NaN without evaluation episodes: the column is the run's evaluation either way
            evaluated = self.trainer.evaluate()
        row["eval_return_mean"] = float(evaluated.mean()) if evaluated.size else math.nan
        row["eval_return_std"] = float(evaluated.std()) if evaluated.size else math.nan
        self.run.log_round(row)
        if "total_timesteps" not in self._given:  # the run so far: analyses read the rounds the files hold
            self.config = PPOConfig(**{**self.config.to_dict(), "total_timesteps": self.round * self.config.rollout_size})
            self.run.write_config(self.config.to_dict(), written_by=self.written_by)

    def close(self) -> None:
        """Close the run's files (the last checkpoint was written by the last ``end_round``)."""
        if self.run is not None:
            self.run.close()

    # -- records ----------------------------------------------------------------------
    def records(self, advantages: Any, returns: Any, last_values: Any = None) -> RolloutBuffer:
        """Round k's records as ``end_round`` writes them, checked against the policy at theta(k):
        for a filter that decides which records the loop's update keeps before it runs."""
        if not self._begun:
            raise UserError("RunWriter: the round's records before begin_round")
        buffer = self._buffer(advantages, returns, last_values)
        self._check(buffer)
        return buffer

    def _buffer(self, advantages: Any, returns: Any, last_values: Any) -> RolloutBuffer:
        cfg, n = self.config, len(self._steps)
        if n != cfg.n_steps:
            raise UserError(f"RunWriter: round {self.round} has {n} steps, n_steps is {cfg.n_steps}")
        field = {name: torch.stack([step[name] for step in self._steps]) for name in FIELDS}
        te = (cfg.n_steps, cfg.n_envs)
        obs_shape = tuple(self.trainer.env.single_observation_space.shape)
        discrete = self.trainer.policy.continuous is False
        expected = {"obs": te + obs_shape, "actions": te if discrete else te + (self.trainer.policy.log_std.numel(),)}
        per_record = {"advantages": _tensor(advantages), "returns": _tensor(returns)}
        for name, value in list(field.items()) + list(per_record.items()):
            shape = expected.get(name, te)
            if tuple(value.shape) != shape and not (value.numel() == math.prod(shape) and name != "obs"):
                raise UserError(f"RunWriter: {name} of round {self.round} has shape {tuple(value.shape)}, expected "
                                f"{shape} (n_steps x n_envs{' x ...' if name in expected else ''})")
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise UserError(f"RunWriter: {name} of round {self.round} holds a non-finite value")
        ends = field["terminated"].reshape(te).bool() | field["truncated"].reshape(te).bool()
        before = torch.cat([torch.zeros(1, cfg.n_envs, dtype=torch.int64), torch.cumsum(ends.long(), 0)[:-1]])
        episode_ids = self._episodes[None] + before
        self._episodes = episode_ids[-1] + ends[-1].long()
        obs = field["obs"].to(torch.uint8 if self.trainer.env.single_observation_space.dtype == np.uint8 else torch.float32)
        last = torch.zeros(cfg.n_envs) if last_values is None else _tensor(last_values).float().reshape(cfg.n_envs)
        buffer = RolloutBuffer(
            round=self.round, obs=obs, actions=(field["actions"].reshape(te).long() if discrete else
                                                field["actions"].reshape(expected["actions"]).float()),
            rewards=field["rewards"].reshape(te).float(), terminated=field["terminated"].reshape(te).bool(),
            truncated=field["truncated"].reshape(te).bool() & ~field["terminated"].reshape(te).bool(),
            logp=field["logp"].reshape(te).float(), values=field["values"].reshape(te).float(),
            final_values=field["final_values"].reshape(te).float(), episode_ids=episode_ids,
            corrupted=torch.zeros(te, dtype=torch.bool), last_values=last)
        buffer.advantages = per_record["advantages"].reshape(te).float()
        buffer.returns = per_record["returns"].reshape(te).float()
        return buffer

    def _check(self, buffer: RolloutBuffer) -> None:
        """The logged log-probs and values of a sample of records against the mapped policy at theta(k)."""
        n = len(buffer)
        rows = torch.linspace(0, n - 1, min(n, CHECKED_RECORDS)).long()
        obs, actions = buffer.flat("obs")[rows], buffer.flat("actions")[rows]
        with torch.no_grad():
            logp = self.trainer.policy.log_prob(obs, actions)
            values = self.trainer.policy.value(obs)
        checks = [("log-probs", logp, buffer.flat("logp")[rows])]
        if self.check_values:
            checks.append(("values", values, buffer.flat("values")[rows]))
        for what, ours, logged in checks:
            gap = float((ours - logged).abs().max())
            scale = max(1.0, float(logged.abs().max()))
            if not gap <= LOGP_TOLERANCE * scale:
                raise UserError(f"RunWriter: round {self.round}'s logged {what} differ from rlinfluence's policy at "
                                f"theta({self.round}) by up to {gap:.3g}: the policy's parameters do not map as "
                                f"assumed, or the {what} were not computed by the policy given to begin_round")


def _tensor(value: Any) -> torch.Tensor:
    """A CPU tensor of ``value`` (a tensor, a NumPy array, a number or a list), detached."""
    if torch.is_tensor(value):
        return value.detach().cpu()
    return torch.as_tensor(np.asarray(value))


__all__ = ["RunWriter", "cleanrl_names", "process_state_kept"]
