"""The held-out faults: kinds of broken worker that no rule of the verdict was built or tuned on.

They are not ``--corrupt`` kinds and never will be (``rlinfluence.corruptions`` must not learn them):
each is a gymnasium wrapper that ``hidden_faults.py detect --held-out`` puts around one training env
of a run, chosen by the seed, so that the trainer, the run directory and the audit know nothing of
it. The protocol that uses them (fixed before any of them was measured) is the first section of
docs/results/hidden-faults.md; its constants are here so that the benchmark cannot drift from it.

    random-actuator    with probability 0.25 per step the env executes a uniformly drawn action
                       instead of the sampled one, which the record keeps (a flaky actuator)
    actuator-lag       the env executes the previous step's sampled action (an episode's first
                       step executes its own): a one-step actuator delay
    obs-rounding       the worker's observations are rounded to one decimal (a lossy serialisation),
                       and it acts and logs on them; one-hot observations are unchanged (FrozenLake:
                       does not apply)
    reward-scale       its rewards are multiplied by 3 (another reward normalisation)
    short-time-limit   its episodes are cut by a time limit of a quarter of the env's own, reported
                       as truncations (a worker configured with another max_episode_steps)

The second held-out set (``KINDS_3``, seeds 231-260), written before verdict version 3 was measured and
unseen by every rule of versions 1-3 (the protocol: docs/results/hidden-faults.md):

    sticky-actuator    with probability 0.25 per step the env repeats the action it executed at the
                       step before instead of the sampled one (Atari's sticky actions, on one worker)
    obs-noise          Gaussian noise of standard deviation 0.05 x (the env's observation scale, its
                       per-dimension spread over 1000 random steps) added to every observation the
                       worker acts and logs on (a noisy sensor); FrozenLake: does not apply
    reward-offset      0.1 added to every reward (a bonus another version of the env pays)
    single-start       every episode of the worker starts from the same state (its env reset with one
                       seed, a worker whose seeding is broken); FrozenLake, whose episodes all start
                       in one state: does not apply
    frame-skip         every logged step executes the action twice, rewards summed (a worker configured
                       with another frame skip)

The third held-out set (``KINDS_4``, seeds 261-290), written before verdict version 4 was measured and
unseen by every rule of versions 1-4:

    dropped-commands   with probability 0.25 per step the env executes its first action (index 0, its
                       default) instead of the sampled one (commands lost on the way to the actuator)
    obs-offset         0.1 x the env's observation scale (as obs-noise's) added to every observation
                       the worker acts and logs on (a miscalibrated sensor); FrozenLake: does not apply
    reward-dropout     with probability 0.1 per step the reward is lost and logged as 0 (a dropped message)
    teleport           with probability 0.02 per step the env restarts without ending the episode: the
                       step returns a fresh start's observation with the step's reward (a worker whose
                       env resets itself silently)
"""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import numpy as np

SEEDS = range(201, 231)
"""Fresh seeds: no committed benchmark, study or test used seeds 201-230 before the protocol."""
FAULT_SEEDS = range(201, 211)
"""The faulty runs: 10 seeds per env and kind; the clean runs use all of ``SEEDS``."""
ENVS = ("CartPole-v1", "LunarLander-v3", "FrozenLake-v1")
"""The envs of the targets; Acrobot-v1 is measured with the same seeds and kinds and reported apart."""
ROUNDS = 8
CLEAN_ROUNDS = 20
"""Clean runs are audited after each of 20 rounds: a run's false flag at any of them counts."""
RANDOM_ACTUATOR_P = 0.25
ROUNDING_DECIMALS = 1
REWARD_FACTOR = 3.0
TIME_LIMIT_SHARE = 4


class RandomActuator(gym.ActionWrapper):
    """With probability ``p`` a step executes a uniformly drawn action (seeded) instead of the given one."""

    def __init__(self, env: gym.Env, p: float, seed: int):
        super().__init__(env)
        self.p, self.rng = p, np.random.default_rng(seed)

    def action(self, action):
        if self.rng.random() >= self.p:
            return action
        space = self.env.action_space
        if isinstance(space, gym.spaces.Discrete):
            return np.int64(space.start + self.rng.integers(space.n))
        return self.rng.uniform(space.low, space.high).astype(space.dtype)


class ActuatorLag(gym.Wrapper):
    """Each step executes the action given at the step before (an episode's first step, its own)."""

    def reset(self, **kwargs):
        self.previous = None
        return self.env.reset(**kwargs)

    def step(self, action):
        executed = action if self.previous is None else self.previous
        self.previous = action
        return self.env.step(executed)


class ObservationRounding(gym.ObservationWrapper):
    """Observations rounded to ``decimals`` decimals, in their own dtype."""

    def __init__(self, env: gym.Env, decimals: int):
        super().__init__(env)
        self.decimals = decimals

    def observation(self, observation):
        return np.round(observation, self.decimals).astype(observation.dtype)


class RewardScale(gym.RewardWrapper):
    def __init__(self, env: gym.Env, factor: float):
        super().__init__(env)
        self.factor = factor

    def reward(self, reward):
        return self.factor * reward


def _short_time_limit(env: gym.Env, seed: int) -> gym.Env:
    return gym.wrappers.TimeLimit(env, max_episode_steps=max(1, env.spec.max_episode_steps // TIME_LIMIT_SHARE))


KINDS: dict[str, tuple[str, Callable[[gym.Env, int], gym.Env]]] = {
    "random-actuator": ("action", lambda env, seed: RandomActuator(env, RANDOM_ACTUATOR_P, seed)),
    "actuator-lag": ("action", lambda env, seed: ActuatorLag(env)),
    "obs-rounding": ("observation", lambda env, seed: ObservationRounding(env, ROUNDING_DECIMALS)),
    "reward-scale": ("reward", lambda env, seed: RewardScale(env, REWARD_FACTOR)),
    "short-time-limit": ("done-flags", _short_time_limit),
}
"""kind -> (the fault class a right reading names, the wrapper of the broken env given (env, seed))."""


class StickyActuator(gym.Wrapper):
    """With probability ``p`` a step executes the action executed at the step before (seeded)."""

    def __init__(self, env: gym.Env, p: float, seed: int):
        super().__init__(env)
        self.p, self.rng = p, np.random.default_rng(seed)

    def reset(self, **kwargs):
        self.previous = None
        return self.env.reset(**kwargs)

    def step(self, action):
        if self.previous is not None and self.rng.random() < self.p:
            action = self.previous
        self.previous = action
        return self.env.step(action)


def observation_spread(env_id: str, seed: int) -> np.ndarray:
    """The env's per-dimension spread of observations (at least 1e-6), over ``SCALE_STEPS`` random steps
    of a copy of the env seeded by ``seed``."""
    probe = gym.make(env_id)
    probe.action_space.seed(seed)
    seen, (obs, _) = [], probe.reset(seed=seed)
    for _ in range(SCALE_STEPS):
        seen.append(obs)
        obs, _, terminated, truncated, _ = probe.step(probe.action_space.sample())
        if terminated or truncated:
            obs, _ = probe.reset()
    probe.close()
    return np.maximum(np.std(np.asarray(seen, dtype=np.float64), axis=0), 1e-6)


class ObservationNoise(gym.ObservationWrapper):
    """Observations plus Gaussian noise of ``scale`` x the env's per-dimension spread (``observation_spread``)."""

    def __init__(self, env: gym.Env, scale: float, seed: int):
        super().__init__(env)
        self.sd = scale * observation_spread(env.spec.id, seed)
        self.rng = np.random.default_rng([seed, 3])

    def observation(self, observation):
        return (observation + self.rng.normal(0.0, self.sd)).astype(observation.dtype)


class RewardOffset(gym.RewardWrapper):
    def __init__(self, env: gym.Env, offset: float):
        super().__init__(env)
        self.offset = offset

    def reward(self, reward):
        return reward + self.offset


class SingleStart(gym.Wrapper):
    """Every episode reset with the same seed: one start state."""

    def __init__(self, env: gym.Env, seed: int):
        super().__init__(env)
        self.start_seed = seed

    def reset(self, **kwargs):
        kwargs["seed"] = self.start_seed
        return self.env.reset(**kwargs)


class FrameSkip(gym.Wrapper):
    """Each step executes the action ``skip`` times (fewer where the episode ends), rewards summed."""

    def __init__(self, env: gym.Env, skip: int):
        super().__init__(env)
        self.skip = skip

    def step(self, action):
        total = 0.0
        for _ in range(self.skip):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += reward
            if terminated or truncated:
                break
        return obs, total, terminated, truncated, info


SEEDS_3 = range(231, 261)
"""Fresh seeds of the second held-out set: no committed benchmark, study or test used 231-260 before it."""
FAULT_SEEDS_3 = range(231, 241)
STICKY_P = 0.25
NOISE_SCALE = 0.05
SCALE_STEPS = 1000
REWARD_OFFSET = 0.1
FRAME_SKIP = 2

KINDS_3: dict[str, tuple[str, Callable[[gym.Env, int], gym.Env]]] = {
    "sticky-actuator": ("action", lambda env, seed: StickyActuator(env, STICKY_P, seed)),
    "obs-noise": ("observation", lambda env, seed: ObservationNoise(env, NOISE_SCALE, seed)),
    "reward-offset": ("reward", lambda env, seed: RewardOffset(env, REWARD_OFFSET)),
    "single-start": ("environment", lambda env, seed: SingleStart(env, seed)),
    "frame-skip": ("environment", lambda env, seed: FrameSkip(env, FRAME_SKIP)),
}
"""The second held-out set (module docstring): kind -> (the class a right reading names, the wrapper)."""


class DroppedCommands(gym.ActionWrapper):
    """With probability ``p`` a step executes the action space's first action instead of the given one (seeded)."""

    def __init__(self, env: gym.Env, p: float, seed: int):
        super().__init__(env)
        self.p, self.rng = p, np.random.default_rng([seed, 5])

    def action(self, action):
        return np.int64(self.env.action_space.start) if self.rng.random() < self.p else action


class ObservationOffset(gym.ObservationWrapper):
    """Observations plus ``scale`` x the env's per-dimension spread (``observation_spread``), every step."""

    def __init__(self, env: gym.Env, scale: float, seed: int):
        super().__init__(env)
        self.offset = scale * observation_spread(env.spec.id, seed)

    def observation(self, observation):
        return (observation + self.offset).astype(observation.dtype)


class RewardDropout(gym.RewardWrapper):
    """With probability ``p`` a step's reward is logged as 0 (seeded)."""

    def __init__(self, env: gym.Env, p: float, seed: int):
        super().__init__(env)
        self.p, self.rng = p, np.random.default_rng([seed, 7])

    def reward(self, reward):
        return 0.0 if self.rng.random() < self.p else reward


class Teleport(gym.Wrapper):
    """With probability ``p`` a step that does not end its episode returns a fresh start's observation
    (the env reset, the step's reward kept, no episode end) instead of the stepped one (seeded)."""

    def __init__(self, env: gym.Env, p: float, seed: int):
        super().__init__(env)
        self.p, self.rng = p, np.random.default_rng([seed, 11])

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if not (terminated or truncated) and self.rng.random() < self.p:
            obs, _ = self.env.reset(seed=int(self.rng.integers(2**31)))
        return obs, reward, terminated, truncated, info


SEEDS_4 = range(261, 291)
"""Fresh seeds of the third held-out set: no committed benchmark, study or test used 261-290 before it."""
FAULT_SEEDS_4 = range(261, 271)
DROP_P = 0.25
OFFSET_SCALE = 0.1
REWARD_DROP_P = 0.1
TELEPORT_P = 0.02

KINDS_4: dict[str, tuple[str, Callable[[gym.Env, int], gym.Env]]] = {
    "dropped-commands": ("action", lambda env, seed: DroppedCommands(env, DROP_P, seed)),
    "obs-offset": ("observation", lambda env, seed: ObservationOffset(env, OFFSET_SCALE, seed)),
    "reward-dropout": ("reward", lambda env, seed: RewardDropout(env, REWARD_DROP_P, seed)),
    "teleport": ("environment", lambda env, seed: Teleport(env, TELEPORT_P, seed)),
}
"""The third held-out set (module docstring): kind -> (the class a right reading names, the wrapper)."""
PROTOCOLS = {2: (KINDS, SEEDS, FAULT_SEEDS), 3: (KINDS_3, SEEDS_3, FAULT_SEEDS_3), 4: (KINDS_4, SEEDS_4, FAULT_SEEDS_4)}
"""The verdict version each held-out protocol measures -> (its kinds, its seeds, its faulty runs' seeds)."""
ALL_KINDS = KINDS | KINDS_3 | KINDS_4


def applies(kind: str, env_id: str) -> bool:
    """Whether the kind changes the data on ``env_id`` (rounding or noise on one-hot observations, one
    start state where every episode starts in one: not applied)."""
    return not (kind in ("obs-rounding", "obs-noise", "obs-offset", "single-start") and env_id.startswith("FrozenLake"))


def broken_env(seed: int, corruptible: int) -> int:
    """The env a held-out fault breaks: a seeded choice among the first ``corruptible`` (untrusted) envs."""
    return int(np.random.default_rng([seed, 71]).integers(corruptible))


def break_env(vec_env, kind: str, index: int, seed: int) -> None:
    """Wrap sub-env ``index`` of a gymnasium ``SyncVectorEnv`` or SB3 ``DummyVecEnv`` (both keep
    them in ``envs``) with the held-out ``kind``, before the first reset."""
    vec_env.envs[index] = ALL_KINDS[kind][1](vec_env.envs[index], seed)
