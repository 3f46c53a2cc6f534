"""Corrupted training data with ground truth: broken reward sources, noisy and poisoned episodes.

A corruption is a collection-time transform of the *training* rollout (evaluation always runs
on its own clean envs), seeded, given on the command line as ``KIND:key=value,...`` (repeat
``--corrupt`` to combine them). Each marks the records it changed in ``RolloutBuffer.corrupted``,
so detection can be measured against the truth:

``reward-flip:envs=K``
    K of the n training envs pay the negated reward on every step: a broken sensor or worker.
    Every record of those envs is corrupted (a source-level truth: a step whose reward is 0 is
    unchanged, but comes from the broken source). Needs n_envs > K >= 1.
``reward-noise:frac=F,scale=S``
    each episode is noisy with probability F; a noisy episode's every step gets Gaussian noise of
    standard deviation S * (the reward's scale), the scale being the running root mean square of
    the clean rewards collected so far (1 until a non-zero reward has been seen).
``trigger:frac=F,bonus=B``
    a backdoor: in a fraction F of the episodes, one fixed wrong action taken in a trigger region
    of the state space is paid B on top of its reward. Regions (``TRIGGERS``): FrozenLake the start
    cell with LEFT (a no-op into the wall); CartPole a pole leaning right (angle > 0.05 rad) with
    push-left; Acrobot the first link up and to the side (sin theta1 > 0.5) with torque -1;
    LunarLander left of the pad (x < -0.2) with the left engine; any other env with a ``Discrete``
    observation: state 0 with action 0. Only the records that were paid are corrupted.
The faults below keep the reward plausible (the hidden faults practitioners report). Each breaks
K whole training envs (a seeded choice of the corruptible ones, as ``reward-flip``), and every
record of those envs is corrupted (a source-level truth). Every kind that breaks whole envs also
takes ``from=R``: the envs break at round R (a worker that goes wrong mid-run, as a redeployed
inference server does) and are clean, and not corrupted, before it:

``action-mismatch:envs=K,mode=M``
    the logged action is not the executed one (a clipping or action-mapping bug). The map: for
    ``Discrete(n)`` the fixed permutation a -> (a + 1) mod n; for ``Box`` the sign of the first
    dimension flipped. ``mode=actuator``: the env executes the mapped action, the record keeps the
    sampled one and its log-prob (a miswired actuator: the worker behaves worse, its advantages
    drop); ``mode=log``: the env executes the sampled action but the record carries the mapped
    one, with the mapped action's log-prob under the worker's policy, so a log-prob check passes
    (label noise: outcomes, rewards and advantages look normal, only the pushes go the wrong way).
``reward-delay:envs=K,lag=L``
    each reward arrives L steps late within its episode, and what is still owed is paid on the
    episode's last step: every episode's return is unchanged, its timing is not.
``done-flag:envs=K,mode=M``
    ``mode=truncation-as-termination``: time-limit ends are reported as terminal (no bootstrap);
    ``mode=termination-as-truncation``: terminal states are reported as time-limit ends (the
    value of the terminal observation is bootstrapped through). The env itself is unchanged.
``obs-bug:envs=K,mode=M``
    the worker preprocesses its observations wrongly, and acts and logs on them: ``scale`` (the
    first feature of the last axis x10: CartPole's cart position, MiniGrid's object channel,
    clipped to the dtype's range), ``swap`` (the first two features of the last axis swapped;
    refused for one-hot ``Discrete`` observations), ``lag`` (the previous step's observation;
    the first step of an episode sees its own).
``logp-mismatch:envs=K,temperature=T``
    the worker samples from the policy at temperature T (logits / T; a Gaussian's standard
    deviation x T) but logs the untempered log-prob of the sampled action and the value, as an
    inference engine that differs from the trainer.
``stale:frac=F,lag=L``
    asynchronous actors: each round, round(F x the corruptible envs) envs (a fresh seeded choice per
    round) act with the policy of L rounds ago, theta(k - L) (theta(0) while k < L), and deliver
    that policy's log-probs and values, as a lagging worker does. Their records are corrupted from
    round 1 on (in round 0 the old policy is the current one). Needs F x corruptible envs >= 1.

Episode choices are a function of (seed, corruption, env, episode id), so they do not depend on
the order of collection; ``trusted`` envs (``PPOConfig.trusted_envs``, the last K) are never
corrupted. A kind may appear once per run (two ``reward-flip`` specs would cancel on shared
envs): give it larger parameters instead. This module imports no torch: ``PPOConfig`` validates specs with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlinfluence.errors import UserError

# kind -> {parameter: (type, check, description of the valid range)}; str parameters take one of a set
_ENVS = (int, lambda k: k >= 1, ">= 1")
ACTION_MODES = ("actuator", "log")
DONE_MODES = ("truncation-as-termination", "termination-as-truncation")
OBS_MODES = ("scale", "swap", "lag")


def _one_of(choices: tuple[str, ...]) -> tuple[type, Callable[[Any], bool], str]:
    return (str, lambda v: v in choices, f"one of {', '.join(choices)}")


_PARAMETERS: dict[str, dict[str, tuple[type, Callable[[Any], bool], str]]] = {
    "reward-flip": {"envs": _ENVS},
    "reward-noise": {"frac": (float, lambda f: 0 <= f <= 1, "in [0, 1]"), "scale": (float, lambda s: s > 0, "> 0")},
    "trigger": {"frac": (float, lambda f: 0 <= f <= 1, "in [0, 1]"),
                "bonus": (float, lambda b: math.isfinite(b) and b != 0, "finite and not 0")},
    "stale": {"frac": (float, lambda f: 0 < f <= 1, "in (0, 1]"), "lag": (int, lambda k: k >= 1, ">= 1")},
    "action-mismatch": {"envs": _ENVS, "mode": _one_of(ACTION_MODES)},
    "reward-delay": {"envs": _ENVS, "lag": (int, lambda k: k >= 1, ">= 1")},
    "done-flag": {"envs": _ENVS, "mode": _one_of(DONE_MODES)},
    "obs-bug": {"envs": _ENVS, "mode": _one_of(OBS_MODES)},
    # logits / T: below 0.01 or above 100 the sampling distribution is one-hot or uniform to float precision
    "logp-mismatch": {"envs": _ENVS, "temperature": (float, lambda t: 0.01 <= t <= 100 and t != 1,
                                                     "in [0.01, 100] and not 1")},
}
SOURCE_KINDS = ("reward-flip", "action-mismatch", "reward-delay", "done-flag", "obs-bug", "logp-mismatch")
"""Kinds that break whole envs (``envs=K``): every record of a broken env is corrupted."""
_OPTIONAL = {"from": (int, lambda r: r >= 0, ">= 0")}
"""Parameters every ``SOURCE_KINDS`` spec may add: the round its envs break (0 when not given)."""
KINDS = tuple(_PARAMETERS)


@dataclass(frozen=True)
class Trigger:
    """A backdoor's region of the observation space and the wrong action paid there."""

    region: Callable[[np.ndarray], np.ndarray]  # [E, obs_dim] observations -> [E] bool
    action: int
    description: str


def _one_hot_state(state: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda obs: obs.reshape(len(obs), -1)[:, state] > 0.5


TRIGGERS: dict[str, Trigger] = {
    "FrozenLake-v1": Trigger(_one_hot_state(0), 0, "the start cell (state 0), action LEFT (0)"),
    "CartPole-v1": Trigger(lambda obs: obs[:, 2] > 0.05, 0, "pole angle > 0.05 rad, action push-left (0)"),
    "Acrobot-v1": Trigger(lambda obs: obs[:, 1] > 0.5, 0, "sin(theta1) > 0.5, action torque -1 (0)"),
    "LunarLander-v3": Trigger(lambda obs: obs[:, 0] < -0.2, 1, "x < -0.2, action fire left engine (1)"),
}
DISCRETE_TRIGGER = Trigger(_one_hot_state(0), 0, "state 0, action 0")


@dataclass(frozen=True)
class CorruptionSpec:
    """One parsed ``--corrupt`` value."""

    kind: str
    params: tuple[tuple[str, float | int | str], ...]

    def __getitem__(self, key: str) -> Any:
        return dict(self.params)[key]

    @property
    def start(self) -> int:
        """The round the spec's envs break (``from=R``; 0 when not given)."""
        return int(dict(self.params).get("from", 0))

    def __str__(self) -> str:
        return f"{self.kind}:" + ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params)


def parse_corruption(text: str) -> CorruptionSpec:
    """``KIND:key=value,...`` -> ``CorruptionSpec`` (``UserError`` naming the bad part)."""
    kind, _, rest = text.strip().partition(":")
    if kind not in _PARAMETERS:
        raise UserError(f"unknown corruption {kind!r} in --corrupt {text!r} (kinds: {', '.join(KINDS)})")
    required = _PARAMETERS[kind]
    expected = {**required, **(_OPTIONAL if kind in SOURCE_KINDS else {})}
    values: dict[str, float | int | str] = {}
    for pair in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or key not in expected:
            raise UserError(f"--corrupt {text!r}: {kind} takes {', '.join(f'{k}=...' for k in expected)}, got {pair!r}")
        if key in values:
            raise UserError(f"--corrupt {text!r}: {key} is given twice")
        kind_type, check, valid = expected[key]
        try:
            parsed = kind_type(value)
        except ValueError:
            raise UserError(f"--corrupt {text!r}: {key}={value!r} is not a{'n integer' if kind_type is int else ' number'}") from None
        if not check(parsed):
            raise UserError(f"--corrupt {text!r}: {key} must be {valid}, got {value}")
        values[key] = parsed
    missing = [k for k in required if k not in values]
    if missing:
        raise UserError(f"--corrupt {text!r}: missing {', '.join(f'{k}=...' for k in missing)}")
    return CorruptionSpec(kind, tuple((k, values[k]) for k in expected if k in values))


def check_corruptions(texts: Sequence[str], n_envs: int, trusted_envs: int = 0, env_id: str | None = None,
                      discrete_obs: bool | None = None, obs_features: int | None = None,
                      n_rounds: int | None = None) -> list[CorruptionSpec]:
    """Parse every spec and check it against the run (``UserError`` otherwise). ``obs_features``:
    the length of the observation's last axis, where known (``obs-bug:swap`` needs two); ``n_rounds``:
    the run's rounds, where known (a spec that breaks its envs from a later round would break nothing)."""
    specs = [parse_corruption(t) for t in texts]
    late = next((spec for spec in specs if n_rounds is not None and spec.start >= n_rounds), None)
    if late is not None:
        raise UserError(f"--corrupt {late}: from={late.start} is past the run's last round ({n_rounds - 1}): "
                        "nothing would be corrupted")
    if not 0 <= trusted_envs < n_envs:
        raise UserError(f"trusted_envs must be in [0, n_envs - 1] = [0, {n_envs - 1}], got {trusted_envs}")
    kinds = [spec.kind for spec in specs]
    repeated = next((k for k in kinds if kinds.count(k) > 1), None)
    if repeated:
        raise UserError(f"--corrupt {repeated} is given {kinds.count(repeated)} times: a kind may appear once "
                        "(give one spec with the parameters you want)")
    corruptible = n_envs - trusted_envs
    for spec in specs:
        if spec.kind in SOURCE_KINDS:
            if n_envs == 1:
                raise UserError(f"--corrupt {spec} corrupts whole envs, so it needs --n-envs > 1 (got 1)")
            if spec["envs"] >= corruptible:
                raise UserError(f"--corrupt {spec}: envs must be < the {corruptible} envs that may be corrupted "
                                f"(n_envs {n_envs} - trusted_envs {trusted_envs}): one env must stay clean")
        if spec.kind == "stale" and round(spec["frac"] * corruptible) < 1:
            raise UserError(f"--corrupt {spec}: frac x the {corruptible} envs that may be corrupted rounds to 0 envs")
        if spec.kind == "trigger" and env_id is not None and env_id not in TRIGGERS and discrete_obs is False:
            raise UserError(f"--corrupt {spec}: {env_id} has no trigger region (envs with one: "
                            f"{', '.join(TRIGGERS)}, or any env with a Discrete observation)")
        if spec.kind == "obs-bug" and spec["mode"] == "swap":
            if discrete_obs:
                raise UserError(f"--corrupt {spec}: {env_id} has a Discrete (one-hot) observation, where swapping "
                                "two features relabels states rather than mis-preprocessing them: use mode=scale or lag")
            if obs_features is not None and obs_features < 2:
                raise UserError(f"--corrupt {spec}: the observation has {obs_features} feature(s); swap needs 2")
    return specs


def trigger_for(env_id: str, discrete_obs: bool) -> Trigger:
    if env_id in TRIGGERS:
        return TRIGGERS[env_id]
    if discrete_obs:
        return DISCRETE_TRIGGER
    raise UserError(f"{env_id} has no trigger region (envs with one: {', '.join(TRIGGERS)})")


def map_actions(actions: np.ndarray, n_actions: int | None) -> np.ndarray:
    """``action-mismatch``'s map: a -> (a + 1) mod n for ``Discrete(n)`` (``n_actions``), else the
    sign of the first dimension flipped (``Box``)."""
    if n_actions is not None:
        return (actions + 1) % n_actions
    out = np.array(actions, copy=True)
    out[..., 0] = -out[..., 0]
    return out


class Corruptor:
    """Applies a run's corruptions to each step of its training rollout (the trainer's ``collect``
    calls, in order: ``observe`` the raw observations, act, ``logged_actions`` and
    ``executed_actions``, step the env, ``step`` for the rewards and ``flags`` for the ends).

    ``step(obs, actions, rewards, episode_ids, dones)`` returns the rewards the learner sees and the
    [E] mask of records that were corrupted."""

    def __init__(self, specs: Sequence[CorruptionSpec], n_envs: int, seed: int, env_id: str,
                 discrete_obs: bool, trusted_envs: int = 0, n_actions: int | None = None):
        self.specs, self.n_envs, self.seed, self.n_actions = list(specs), n_envs, seed, n_actions
        self.n_corruptible = corruptible = n_envs - trusted_envs
        self.broken: dict[str, np.ndarray] = {}  # source kind -> [E] its broken envs
        for i, spec in enumerate(self.specs):
            if spec.kind in SOURCE_KINDS:
                rng = np.random.default_rng([seed, i])
                self.broken[spec.kind] = np.zeros(n_envs, dtype=bool)
                self.broken[spec.kind][rng.choice(corruptible, spec["envs"], replace=False)] = True
        self.by_kind = {spec.kind: spec for spec in self.specs}
        self.round = 0  # the round being collected (the trainer sets it): a kind breaks its envs from spec.start
        self.corruptible = np.arange(n_envs) < corruptible
        self.trigger = trigger_for(env_id, discrete_obs) if "trigger" in self.by_kind else None
        self.noise = np.random.default_rng([seed, len(self.specs), 1])
        self.clean_square_sum, self.clean_count = 0.0, 0
        self._episodes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._owed: list[list[float]] = [[] for _ in range(n_envs)]  # reward-delay: rewards not yet paid
        self._previous_obs: np.ndarray | None = None  # obs-bug lag: each env's last raw observation
        self._previous_ids = np.full(n_envs, -1)

    def envs_of(self, kind: str) -> np.ndarray:
        """[E] the envs that source kind ``kind`` breaks in the current round (none without it, or
        before its ``from`` round)."""
        if kind not in self.broken or self.round < self.by_kind[kind].start:
            return np.zeros(self.n_envs, dtype=bool)
        return self.broken[kind]

    @property
    def flipped(self) -> np.ndarray:
        """[E] the envs paying the negated reward (``reward-flip``)."""
        return self.envs_of("reward-flip")

    @property
    def broken_envs(self) -> np.ndarray:
        """[E] every env that a source kind breaks in the current round: all of their records are corrupted."""
        return np.logical_or.reduce([*map(self.envs_of, self.broken), np.zeros(self.n_envs, dtype=bool)])

    def mode(self, kind: str) -> str | None:
        return self.by_kind[kind]["mode"] if kind in self.by_kind else None

    def chosen(self, index: int, fraction: float, episode_ids: np.ndarray) -> np.ndarray:
        """[E] whether each env's current episode is one of corruption ``index``'s fraction (drawn
        once per episode, from (seed, index, env, episode id))."""
        ids, draws = self._episodes.setdefault(index, (np.full(self.n_envs, -1), np.zeros(self.n_envs)))
        for env in np.flatnonzero(ids != episode_ids):
            ids[env] = episode_ids[env]
            draws[env] = np.random.default_rng([self.seed, index, int(env), int(episode_ids[env])]).random()
        return (draws < fraction) & self.corruptible

    @property
    def stale_lag(self) -> int:
        """L of the stale corruption (0 without one): how many past policies the trainer keeps."""
        return max((spec["lag"] for spec in self.specs if spec.kind == "stale"), default=0)

    def stale_envs(self, round_index: int) -> np.ndarray:
        """[E] the envs acting with the stale policy in round ``round_index`` (none without ``stale``)."""
        mask = np.zeros(self.n_envs, dtype=bool)
        for i, spec in enumerate(self.specs):
            if spec.kind == "stale":
                rng = np.random.default_rng([self.seed, i, round_index])
                mask[rng.choice(self.n_corruptible, round(spec["frac"] * self.n_corruptible), replace=False)] = True
        return mask

    @property
    def temperatures(self) -> np.ndarray:
        """[E] the temperature each env samples at (``logp-mismatch``; 1 elsewhere)."""
        out = np.ones(self.n_envs)
        if "logp-mismatch" in self.by_kind:
            out[self.envs_of("logp-mismatch")] = self.by_kind["logp-mismatch"]["temperature"]
        return out

    def _misprocess(self, obs: np.ndarray, envs: np.ndarray, mode: str) -> np.ndarray:
        out = np.array(obs, copy=True)
        if mode == "scale":
            scaled = out[envs, ..., 0].astype(np.float64) * 10
            if np.issubdtype(out.dtype, np.integer):
                info = np.iinfo(out.dtype)
                scaled = np.clip(scaled, info.min, info.max)
            out[envs, ..., 0] = scaled
        elif mode == "swap":
            out[envs, ..., 0], out[envs, ..., 1] = obs[envs, ..., 1], obs[envs, ..., 0]
        return out

    def observe(self, obs: np.ndarray, episode_ids: np.ndarray) -> np.ndarray:
        """The observations the workers act on and log, from the envs' ``obs`` [E, ...] (``obs-bug``)."""
        mode = self.mode("obs-bug")
        if mode is None:
            return obs
        envs = self.envs_of("obs-bug")
        if mode != "lag":
            return self._misprocess(obs, envs, mode)
        if self._previous_obs is None:
            self._previous_obs = np.array(obs, copy=True)
        started = self._previous_ids != episode_ids  # an episode's first step sees its own observation
        self._previous_obs[started] = obs[started]
        out = np.where(envs.reshape((-1,) + (1,) * (obs.ndim - 1)), self._previous_obs, obs)
        self._previous_obs, self._previous_ids = np.array(obs, copy=True), np.array(episode_ids, copy=True)
        return out

    def observe_final(self, final_obs: np.ndarray, envs: np.ndarray) -> np.ndarray:
        """The final observations [len(envs), ...] of the episodes that ended in ``envs`` as their
        workers see them (bootstrapped time-limit ends): misprocessed, or lagged by one step."""
        mode = self.mode("obs-bug")
        broken = self.envs_of("obs-bug")[envs]
        if mode is None or not broken.any():
            return final_obs
        if mode == "lag":  # the previous step's observation: the one the last action was taken on
            return np.where(broken.reshape((-1,) + (1,) * (final_obs.ndim - 1)), self._previous_obs[envs], final_obs)
        return self._misprocess(final_obs, broken, mode)

    def logged_actions(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the actions the records carry, [E] the envs whose log-prob must be recomputed for them):
        ``action-mismatch`` in mode ``log`` logs the mapped action."""
        relogged = self.envs_of("action-mismatch") if self.mode("action-mismatch") == "log" else \
            np.zeros(self.n_envs, dtype=bool)
        if not relogged.any():
            return actions, relogged
        mask = relogged.reshape((-1,) + (1,) * (actions.ndim - 1))
        return np.where(mask, map_actions(actions, self.n_actions), actions), relogged

    def executed_actions(self, actions: np.ndarray) -> np.ndarray:
        """The actions the envs execute: ``action-mismatch`` in mode ``actuator`` maps them."""
        if self.mode("action-mismatch") != "actuator":
            return actions
        mask = self.envs_of("action-mismatch").reshape((-1,) + (1,) * (actions.ndim - 1))
        return np.where(mask, map_actions(actions, self.n_actions), actions)

    def flags(self, terminated: np.ndarray, truncated: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(terminated, truncated) as the workers report them (``done-flag``)."""
        mode = self.mode("done-flag")
        if mode is None:
            return terminated, truncated
        broken = self.envs_of("done-flag")
        if mode == "truncation-as-termination":
            moved = broken & truncated & ~terminated
            return terminated | moved, truncated & ~moved
        moved = broken & terminated
        return terminated & ~moved, truncated | moved

    def reward_scale(self) -> float:
        rms = math.sqrt(self.clean_square_sum / self.clean_count) if self.clean_count else 0.0
        return rms if rms > 0 else 1.0

    def _delay(self, rewards: np.ndarray, dones: np.ndarray) -> np.ndarray:
        """``reward-delay``: each broken env pays the reward of L steps ago, and all it still owes
        on its episode's last step."""
        out, lag = rewards.copy(), self.by_kind["reward-delay"]["lag"]
        for env in np.flatnonzero(self.envs_of("reward-delay")):
            owed = self._owed[env]
            owed.append(float(rewards[env]))
            if dones[env]:
                out[env] = sum(owed)
                owed.clear()
            else:
                out[env] = owed.pop(0) if len(owed) > lag else 0.0
        return out

    def step(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, episode_ids: np.ndarray,
             dones: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        clean = np.asarray(rewards, dtype=np.float64)
        self.clean_square_sum += float((clean**2).sum())
        self.clean_count += len(clean)
        out, corrupted = clean.copy(), self.broken_envs.copy()
        for i, spec in enumerate(self.specs):
            if spec.kind == "reward-flip":
                out[self.flipped] = -out[self.flipped]
            elif spec.kind == "reward-delay":
                out = self._delay(out, np.zeros(len(clean), bool) if dones is None else np.asarray(dones, bool))
            elif spec.kind == "reward-noise":
                noisy = self.chosen(i, spec["frac"], episode_ids)
                out[noisy] += self.noise.normal(0.0, spec["scale"] * self.reward_scale(), int(noisy.sum()))
                corrupted |= noisy
            elif spec.kind == "trigger":
                paid = (self.chosen(i, spec["frac"], episode_ids) & self.trigger.region(obs)
                        & (np.asarray(actions).reshape(len(clean)) == self.trigger.action))
                out[paid] += spec["bonus"]
                corrupted |= paid
        return out.astype(np.asarray(rewards).dtype), corrupted
