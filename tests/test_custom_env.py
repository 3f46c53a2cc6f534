"""An env gymnasium cannot make by id, given by its entry point (``package.module:function``):
trained natively, by Stable-Baselines3 and by a CleanRL-style loop, and every analysis run on each run, which re-creates the
env from the entry point; what cannot be imported is one clear error."""

from __future__ import annotations

import dataclasses

import gymnasium as gym
import pytest
import torch

from rlinfluence import cli
from rlinfluence.envs import make_env
from rlinfluence.errors import UserError
from rlinfluence.ppo import PPO, PPOConfig
from tests.analysis_commands import EVERY_ANALYSIS

ENTRY = "tests.custom_env:make_env"


@pytest.fixture(scope="module")
def native_run(tmp_path_factory):
    config = PPOConfig(env=ENTRY, n_envs=3, n_steps=32, batch_size=32, n_epochs=2, total_timesteps=3 * 96, seed=2,
                       eval_episodes=2, save_buffers=True, run_root=str(tmp_path_factory.mktemp("native")),
                       progress=False, tensorboard=False)
    return PPO(config).learn().run.path


@pytest.fixture(scope="module")
def sb3_run(tmp_path_factory):
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import PPO as SB3PPO
    from stable_baselines3.common.vec_env import DummyVecEnv

    from rlinfluence.integrations.sb3_rundir import RunDirectoryCallback
    from tests.custom_env import make_env as factory

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("sb3") / "run"
    model = SB3PPO("MlpPolicy", DummyVecEnv([factory] * 3), n_steps=32, batch_size=32, n_epochs=2, seed=2,
                   device="cpu")
    model.learn(3 * 96, callback=RunDirectoryCallback(path, eval_episodes=2, env=ENTRY))
    return path


@pytest.fixture(scope="module")
def cleanrl_run(tmp_path_factory):
    """The CleanRL-style example's loop on the custom env: its make_env builds the env as the user's
    own loop would, and the writer is given the entry point the analyses re-create it from."""
    from tests.custom_env import make_env as factory
    from tests.test_run_writer import example, example_args

    module = example()
    module.make_env = lambda env_id: (lambda: gym.wrappers.RecordEpisodeStatistics(factory()))
    path = tmp_path_factory.mktemp("cleanrl") / "run"
    torch.set_num_threads(1)
    module.train(dataclasses.replace(example_args(module, path), env_id=ENTRY))
    return path


@pytest.mark.parametrize("command", EVERY_ANALYSIS)
@pytest.mark.parametrize("trainer", ["native_run", "sb3_run", "cleanrl_run"])
def test_every_analysis_runs_on_a_custom_env_run(trainer, command, request, capsys):
    path = request.getfixturevalue(trainer)
    assert cli.main([c.format(run=path) for c in command]) == 0
    assert "error" not in capsys.readouterr().err


def test_an_entry_point_builds_the_env_and_a_bad_one_is_one_user_error():
    env = make_env(ENTRY)
    assert env.observation_space.shape == (2,) and env.action_space.n == 2
    with pytest.raises(UserError, match="cannot import 'tests.no_such_module'"):
        make_env("tests.no_such_module:make_env")
    with pytest.raises(UserError, match="has no function 'missing'"):
        make_env("tests.custom_env:missing")
    with pytest.raises(UserError, match="does not take render_mode"):
        make_env(ENTRY, render_mode="rgb_array")


def test_the_sb3_callback_warns_on_an_env_without_an_id_and_refuses_an_entry_point_that_builds_another(tmp_path):
    pytest.importorskip("stable_baselines3")
    from stable_baselines3 import PPO as SB3PPO
    from stable_baselines3.common.vec_env import DummyVecEnv

    from rlinfluence.integrations.sb3_rundir import RunDirectoryCallback
    from tests.custom_env import make_env as factory

    model = SB3PPO("MlpPolicy", DummyVecEnv([factory] * 2), n_steps=32, batch_size=32, device="cpu")
    with pytest.warns(UserWarning, match="no gymnasium id.*env='package.module:function'"):
        model.learn(64, callback=RunDirectoryCallback(tmp_path / "a"))
    with pytest.raises(UserError, match="builds observation space .* the model's is"):
        model.learn(64, callback=RunDirectoryCallback(tmp_path / "b", env="CartPole-v1"))


def test_a_run_whose_env_cannot_be_re_created_is_still_read_by_what_needs_no_env(tmp_path, monkeypatch, capsys):
    """The env's module is gone (another machine, a renamed package): attribute, diagnose, timeline and
    audit read the saved rounds with the spaces the run recorded; explain, which evaluates policies,
    is one error naming the module."""
    import sys

    (tmp_path / "vanishing_env.py").write_text("from tests.custom_env import make_env  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = PPOConfig(env="vanishing_env:make_env", n_envs=3, n_steps=32, batch_size=32, n_epochs=2,
                       total_timesteps=3 * 96, seed=2, eval_episodes=2, save_buffers=True,
                       run_root=str(tmp_path / "runs"), progress=False, tensorboard=False)
    path = PPO(config).learn().run.path
    (tmp_path / "vanishing_env.py").unlink()
    monkeypatch.delitem(sys.modules, "vanishing_env")
    for command in EVERY_ANALYSIS:
        if command[0] in ("attribute", "diagnose", "timeline", "audit"):
            assert cli.main([c.format(run=path) for c in command]) == 0, command
    capsys.readouterr()
    assert cli.main(["explain", str(path), "--round", "1", "--episodes", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot import 'vanishing_env'" in err[0], err


def test_a_run_records_its_envs_package_and_a_reader_with_another_version_is_warned(tmp_path, capsys):
    """An env from an installed package: the run records the package and its version (run.json); read
    where another version is installed, a command says so in one warning line."""
    import json

    pytest.importorskip("stable_baselines3")
    config = PPOConfig(env="stable_baselines3.common.envs:IdentityEnvBox", n_envs=2, n_steps=16, batch_size=16,
                       n_epochs=1, total_timesteps=32, eval_episodes=0, save_buffers=True, run_root=str(tmp_path),
                       progress=False, tensorboard=False)
    path = PPO(config).learn().run.path
    identity = json.loads((path / "run.json").read_text())
    assert identity["env_package"]["name"] == "stable_baselines3"
    identity["env_package"]["version"] = "0.0.1"
    (path / "run.json").write_text(json.dumps(identity))
    assert cli.main(["attribute", str(path), "--round", "0"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "comes from" in line]
    assert len(err) == 1 and "stable_baselines3 0.0.1; here it is 2." in err[0], err


def test_a_dict_observation_env_trains_natively_on_its_flattened_vector(tmp_path):
    """make_env flattens a Dict (Box, Discrete, MultiBinary) as SB3's extractor does: gymnasium's flatten,
    one-hot per discrete part, in the space's key order."""
    config = PPOConfig(env="tests.custom_env:make_dict_env", n_envs=2, n_steps=16, batch_size=16, n_epochs=1,
                       total_timesteps=32, eval_episodes=2, save_buffers=True, run_root=str(tmp_path),
                       progress=False, tensorboard=False)
    trainer = PPO(config).learn()
    assert trainer.env.single_observation_space.shape == (6,)
    assert cli.main(["attribute", str(trainer.run.path), "--round", "0"]) == 0
