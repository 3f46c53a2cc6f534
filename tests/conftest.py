"""Shared fixtures: tiny configs that train in a second or two."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlinfluence.influence import state as influence_state
from rlinfluence.ppo import PPOConfig

# Debug mode for the whole suite: every scoring pass checks that it left the policy exactly as it
# found it (same Parameter objects, requires_grad, values, buffers, training flags; issue 13).
influence_state.CHECK_MODULE_STATE = True


class CountingChain(gym.Env):
    """Deterministic chain: obs = [t / 10], reward 1 every step, never terminates.

    Registered with a time limit, so every episode ends by truncation after ``max_episode_steps``.
    """

    observation_space = gym.spaces.Box(0.0, 10.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([self.t / 10], np.float32), 1.0, False, False, {}


gym.register("CountingChain-v0", entry_point=CountingChain, max_episode_steps=3)


def tiny_config(**overrides) -> PPOConfig:
    """CartPole, 128-step rounds, 2 rounds, 2 evaluation episodes, no progress bar."""
    base = dict(total_timesteps=256, n_steps=128, batch_size=32, n_epochs=2,
                eval_episodes=2, eval_envs=2, progress=False, tensorboard=False)
    return PPOConfig.for_env(overrides.pop("env", "CartPole-v1"), **{**base, **overrides})


@pytest.fixture
def run_root(tmp_path):
    return tmp_path / "runs"


@pytest.fixture
def one_thread():
    """Tiny tensors: threads only add synchronisation, which is ruinous on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = ["--total-timesteps", "256", "--n-steps", "128", "--batch-size", "32", "--n-epochs", "2",
        "--eval-episodes", "2", "--eval-envs", "2", "--no-progress", "--no-tensorboard"]
"""`rlinfluence train` flags of a 2-round CartPole run of 128-step rounds."""


def overriding(base: list[str], extra: list[str]) -> list[str]:
    """The flags ``base`` gives with those ``extra`` gives replaced, then ``extra`` (the command line
    refuses a flag given twice)."""
    given, out, i = {a for a in extra if a.startswith("--")}, [], 0
    while i < len(base):
        if base[i] in given:
            i += 2 if i + 1 < len(base) and not base[i + 1].startswith("--") else 1
            continue
        out.append(base[i])
        i += 1
    return out + extra


def only_run(root):
    (path,) = list(root.iterdir())
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 2-round CartPole run with saved buffers (copied before each use)."""
    from rlinfluence.cli import main

    root = tmp_path_factory.mktemp("trained")
    assert main(["train", *TINY, "--save-buffers", "--run-root", str(root)]) == 0
    return only_run(root)


@pytest.fixture
def run_copy(trained, tmp_path):
    import shutil

    path = tmp_path / "run"
    shutil.copytree(trained, path)
    return path


@pytest.fixture
def benchmark_script():
    """Loads ``benchmarks/<question>/<name>.py`` (or ``benchmarks/<name>.py``) as a module (the
    benchmarks are scripts, not a package), so that a test can call its functions."""

    def load(name: str):
        (path,) = [p for p in (Path(__file__).parents[1] / "benchmarks").rglob(f"{name}.py") if "studies" not in p.parts]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
