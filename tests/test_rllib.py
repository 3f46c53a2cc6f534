"""RLlib's PPO written as a run and quarantined (``rlinfluence.integrations.rllib``), on a local Ray
cluster: 2 env runners x 2 sub-envs, CartPole. Needs ray[rllib] (``pip install -e ".[rllib]"``);
skipped without it (CI installs the package without RLlib, whose gymnasium pin is not the
project's). What needs no Ray is tests/test_rllib_episodes.py."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

pytest.importorskip("ray.rllib", reason="RLlib not installed (pip install -e '.[rllib]')")

import ray  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402

from rlinfluence import cli  # noqa: E402
from rlinfluence.checkpoint import load_round  # noqa: E402
from rlinfluence.errors import UserError  # noqa: E402
from rlinfluence.integrations.rllib import run_callback  # noqa: E402
from rlinfluence.rundir import RunDirectory  # noqa: E402
from tests.analysis_commands import EVERY_ANALYSIS  # noqa: E402

ITERATIONS, BATCH = 3, 512
BROKEN_RUNNER, BROKEN_SUB_ENV = 2, 1


@pytest.fixture(scope="module", autouse=True)
def local_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def config(callbacks=None) -> PPOConfig:
    built = (PPOConfig().environment("CartPole-v1")
             .env_runners(num_env_runners=2, num_envs_per_env_runner=2)
             .training(train_batch_size_per_learner=BATCH, minibatch_size=128, num_epochs=2)
             .debugging(seed=5))
    return built if callbacks is None else built.callbacks(callbacks)


def train(config: PPOConfig, iterations: int = ITERATIONS) -> dict[str, torch.Tensor]:
    algorithm = config.build_algo()
    try:
        for _ in range(iterations):
            algorithm.train()
        return {k: v.clone() for k, v in algorithm.learner_group._learner.module["default_policy"].state_dict().items()}
    finally:
        algorithm.stop()


def broken(callback: type) -> type:
    """``callback`` with sub-env ``BROKEN_SUB_ENV`` of runner ``BROKEN_RUNNER`` executing every action
    twice (a frame skip of 2 on one worker), set up where the runner builds its envs."""

    class FrameSkip(gym.Wrapper):
        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                return obs, reward, terminated, truncated, info
            obs, second, terminated, truncated, info = self.env.step(action)
            return obs, reward + second, terminated, truncated, info

    class Broken(callback):
        def on_environment_created(self, *, env_runner, env, **kwargs):
            if env_runner.worker_index == BROKEN_RUNNER:
                env.envs[BROKEN_SUB_ENV] = FrameSkip(env.envs[BROKEN_SUB_ENV])

    return Broken


@pytest.fixture(scope="module")
def rllib_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("rllib") / "run"
    weights = train(config(run_callback(path)))
    return path, weights


def test_training_is_bit_for_bit_the_same_with_the_callback(rllib_run, tmp_path):
    _, recorded = rllib_run
    plain = train(config())
    quarantine = train(config(run_callback(tmp_path / "quarantine", quarantine=True)))  # nothing flagged on a clean run
    assert all(torch.equal(plain[k], recorded[k]) and torch.equal(plain[k], quarantine[k]) for k in plain)
    kept = [load_round(tmp_path / "quarantine", k).buffer for k in range(ITERATIONS)]
    assert all(RunDirectory.at(tmp_path / "quarantine").load_buffer(k)["keep"].all() for k in range(ITERATIONS))
    assert all(len(b) == 4 * (7 * BATCH // 32) for b in kept)


def test_each_round_is_the_learners_weights_and_the_runners_records(rllib_run):
    """theta(k+1) of the run is the Learner's after iteration k; the records' log-probs are the ones
    the runners logged (``RunWriter`` checks them against the mapped policy at theta(k))."""
    path, weights = rllib_run
    state = torch.load(path / "checkpoints" / f"round_{ITERATIONS:04d}.pt", weights_only=True)["policy"]
    assert torch.equal(state["actor.2.weight"], weights["encoder.actor_encoder.net.mlp.2.weight"])
    assert torch.equal(state["value_head.bias"], weights["vf.net.mlp.0.bias"])
    saved = load_round(path, 1)
    buffer = saved.buffer
    assert buffer.obs.shape == (7 * BATCH // 32, 4, 4) and saved.trainer.config.n_envs == 4
    with torch.no_grad():
        logp = saved.trainer.policy.log_prob(buffer.flat("obs"), buffer.flat("actions"))
    assert float((logp - buffer.flat("logp")).abs().max()) < 1e-4


@pytest.mark.parametrize("command", EVERY_ANALYSIS)
def test_every_analysis_command_runs_on_an_rllib_run(rllib_run, command, capsys):
    path, _ = rllib_run
    assert cli.main([c.format(run=path) for c in command]) == 0
    assert "error" not in capsys.readouterr().err


def test_quarantine_drops_the_broken_sub_envs_episodes_before_the_update(tmp_path):
    path = tmp_path / "broken"
    train(config(broken(run_callback(path, quarantine=True, alpha=0.05))).training(train_batch_size_per_learner=1024),
          iterations=5)
    source = (BROKEN_RUNNER - 1) * 2 + BROKEN_SUB_ENV
    run = RunDirectory.at(path)
    keeps = [run.load_buffer(k)["keep"].reshape(4, -1) for k in range(5)]  # flat order is env-major
    dropped = [sorted(np.flatnonzero(~keep.all(1).numpy()).tolist()) for keep in keeps]
    assert any(d == [source] for d in dropped), dropped  # the broken sub-env, and only it, dropped in some round
    assert all(d in ([], [source]) for d in dropped), dropped


def test_a_config_it_cannot_map_is_one_user_error(tmp_path):
    shared = config(run_callback(tmp_path / "shared")).rl_module(model_config={"vf_share_layers": True})
    with pytest.raises(UserError, match="separate actor and critic"):
        shared.build_algo()
