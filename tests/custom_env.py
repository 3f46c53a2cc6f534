"""An env gymnasium cannot make by id (not registered): the tests train and analyse runs of it
through its entry point ``tests.custom_env:make_env``."""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class LineWalk(gym.Env):
    """Walk along a line from 0 towards +1 (action 1: a step right, 0: left), a small noise on every
    step; reward 1 on reaching +1 (terminated), -0.01 a step otherwise."""

    def __init__(self):
        self.observation_space = gym.spaces.Box(-2.0, 2.0, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x = float(self.np_random.uniform(-0.5, 0.5))
        return self._obs(), {}

    def _obs(self):
        return np.array([self.x, 1.0 - self.x], dtype=np.float32)

    def step(self, action):
        self.x = float(np.clip(self.x + (0.1 if action == 1 else -0.1) + self.np_random.normal(0, 0.02), -2, 2))
        reached = self.x >= 1.0
        return self._obs(), 1.0 if reached else -0.01, reached, False, {}


def make_env() -> gym.Env:
    return gym.wrappers.TimeLimit(LineWalk(), max_episode_steps=40)


class DictLineWalk(gym.ObservationWrapper):
    """LineWalk observed as a Dict (SB3's MultiInputPolicy): the position, which side of 0 it
    is on (Discrete), and whether it is past each quarter mark (MultiBinary)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.observation_space = gym.spaces.Dict({"position": env.observation_space, "side": gym.spaces.Discrete(2),
                                                  "marks": gym.spaces.MultiBinary(2)})

    def observation(self, observation):
        x = float(observation[0])
        return {"position": observation, "side": int(x > 0), "marks": np.array([x > 0.25, x > 0.75], dtype=np.int8)}


def make_dict_env() -> gym.Env:
    return DictLineWalk(make_env())


class ImageLineWalk(gym.ObservationWrapper):
    """LineWalk seen as a 36 x 36 grey image (height x width x 1, uint8; SB3's CnnPolicy takes it):
    a bright column where the walker is."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.observation_space = gym.spaces.Box(0, 255, (36, 36, 1), np.uint8)

    def observation(self, observation):
        image = np.zeros((36, 36, 1), dtype=np.uint8)
        image[:, int(np.clip((observation[0] + 2.0) / 4.0 * 35, 0, 35))] = 255
        return image


def make_image_env() -> gym.Env:
    return ImageLineWalk(make_env())


class ImageDictLineWalk(gym.ObservationWrapper):
    """LineWalk observed as a Dict of its image (ImageLineWalk's) and the side of 0 it is on: SB3's
    MultiInputPolicy takes the image through a NatureCNN and the rest flat."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.image = ImageLineWalk(env)
        self.observation_space = gym.spaces.Dict({"image": self.image.observation_space, "side": gym.spaces.Discrete(2)})

    def observation(self, observation):
        return {"image": self.image.observation(observation), "side": int(observation[0] > 0)}


def make_image_dict_env() -> gym.Env:
    return ImageDictLineWalk(make_env())
