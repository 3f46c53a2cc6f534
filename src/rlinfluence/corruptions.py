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
``stale:frac=F,lag=L``
    asynchronous actors: each round, round(F x the corruptible envs) envs (a fresh seeded choice per
    round) act with the policy of L rounds ago, theta(k - L) (theta(0) while k < L), and deliver
    that policy's log-probs and values, as a lagging worker does. Their records are corrupted from
    round 1 on (in round 0 the old policy is the current one). Needs F x corruptible envs >= 1.

Episode choices are a function of (seed, corruption, env, episode id), so they do not depend on
the order of collection; ``trusted`` envs (``PPOConfig.trusted_envs``, the last K) are never
corrupted. This module imports no torch: ``PPOConfig`` validates specs with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlinfluence.errors import UserError

# kind -> {parameter: (type, check, description of the valid range)}
_PARAMETERS: dict[str, dict[str, tuple[type, Callable[[Any], bool], str]]] = {
    "reward-flip": {"envs": (int, lambda k: k >= 1, ">= 1")},
    "reward-noise": {"frac": (float, lambda f: 0 <= f <= 1, "in [0, 1]"), "scale": (float, lambda s: s > 0, "> 0")},
    "trigger": {"frac": (float, lambda f: 0 <= f <= 1, "in [0, 1]"),
                "bonus": (float, math.isfinite, "finite")},
    "stale": {"frac": (float, lambda f: 0 < f <= 1, "in (0, 1]"), "lag": (int, lambda k: k >= 1, ">= 1")},
}
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
    params: tuple[tuple[str, float | int], ...]

    def __getitem__(self, key: str) -> Any:
        return dict(self.params)[key]

    def __str__(self) -> str:
        return f"{self.kind}:" + ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params)


def parse_corruption(text: str) -> CorruptionSpec:
    """``KIND:key=value,...`` -> ``CorruptionSpec`` (``UserError`` naming the bad part)."""
    kind, _, rest = text.strip().partition(":")
    if kind not in _PARAMETERS:
        raise UserError(f"unknown corruption {kind!r} in --corrupt {text!r} (kinds: {', '.join(KINDS)})")
    expected = _PARAMETERS[kind]
    values: dict[str, float | int] = {}
    for pair in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or key not in expected:
            raise UserError(f"--corrupt {text!r}: {kind} takes {', '.join(f'{k}=...' for k in expected)}, got {pair!r}")
        kind_type, check, valid = expected[key]
        try:
            parsed = kind_type(value)
        except ValueError:
            raise UserError(f"--corrupt {text!r}: {key}={value!r} is not a{'n integer' if kind_type is int else ' number'}") from None
        if not check(parsed):
            raise UserError(f"--corrupt {text!r}: {key} must be {valid}, got {value}")
        values[key] = parsed
    missing = [k for k in expected if k not in values]
    if missing:
        raise UserError(f"--corrupt {text!r}: missing {', '.join(f'{k}=...' for k in missing)}")
    return CorruptionSpec(kind, tuple((k, values[k]) for k in expected))


def check_corruptions(texts: Sequence[str], n_envs: int, trusted_envs: int = 0, env_id: str | None = None,
                      discrete_obs: bool | None = None) -> list[CorruptionSpec]:
    """Parse every spec and check it against the run (``UserError`` otherwise)."""
    specs = [parse_corruption(t) for t in texts]
    if not 0 <= trusted_envs < n_envs:
        raise UserError(f"trusted_envs must be in [0, n_envs - 1] = [0, {n_envs - 1}], got {trusted_envs}")
    corruptible = n_envs - trusted_envs
    for spec in specs:
        if spec.kind == "reward-flip":
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
    return specs


def trigger_for(env_id: str, discrete_obs: bool) -> Trigger:
    if env_id in TRIGGERS:
        return TRIGGERS[env_id]
    if discrete_obs:
        return DISCRETE_TRIGGER
    raise UserError(f"{env_id} has no trigger region (envs with one: {', '.join(TRIGGERS)})")


class Corruptor:
    """Applies a run's corruptions to each step of its training rollout.

    ``step(obs, actions, rewards, episode_ids)`` returns the rewards the learner sees and the
    [E] mask of records that were corrupted."""

    def __init__(self, specs: Sequence[CorruptionSpec], n_envs: int, seed: int, env_id: str,
                 discrete_obs: bool, trusted_envs: int = 0):
        self.specs, self.n_envs, self.seed = list(specs), n_envs, seed
        self.n_corruptible = corruptible = n_envs - trusted_envs
        self.flipped = np.zeros(n_envs, dtype=bool)
        for i, spec in enumerate(self.specs):
            if spec.kind == "reward-flip":
                rng = np.random.default_rng([seed, i])
                self.flipped[rng.choice(corruptible, spec["envs"], replace=False)] = True
        self.corruptible = np.arange(n_envs) < corruptible
        self.trigger = trigger_for(env_id, discrete_obs) if any(s.kind == "trigger" for s in self.specs) else None
        self.noise = np.random.default_rng([seed, len(self.specs), 1])
        self.clean_square_sum, self.clean_count = 0.0, 0
        self._episodes: dict[int, tuple[np.ndarray, np.ndarray]] = {}

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

    def reward_scale(self) -> float:
        rms = math.sqrt(self.clean_square_sum / self.clean_count) if self.clean_count else 0.0
        return rms if rms > 0 else 1.0

    def step(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, episode_ids: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
        clean = np.asarray(rewards, dtype=np.float64)
        self.clean_square_sum += float((clean**2).sum())
        self.clean_count += len(clean)
        out, corrupted = clean.copy(), np.zeros(len(clean), dtype=bool)
        for i, spec in enumerate(self.specs):
            if spec.kind == "reward-flip":
                out[self.flipped] = -out[self.flipped]
                corrupted |= self.flipped
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
