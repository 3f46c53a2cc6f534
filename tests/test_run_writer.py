"""Any PPO loop's run written by ``RunWriter``: the CleanRL-style example (examples/cleanrl_ppo.py)
trains bit for bit as it does without the writer, each saved round is the policy that collected
it with the loop's records and advantages, every analysis command runs on the run, and what does not
map is refused with one UserError."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from rlinfluence import cli
from rlinfluence.checkpoint import load_round
from rlinfluence.errors import UserError
from rlinfluence.writer import RunWriter, cleanrl_names, process_state_kept
from tests.analysis_commands import EVERY_ANALYSIS

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cleanrl_ppo.py"
ROUNDS, N_ENVS, N_STEPS = 3, 3, 32


def example():
    spec = importlib.util.spec_from_file_location("cleanrl_ppo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cleanrl_ppo"] = module  # its dataclass resolves its annotations through it
    spec.loader.exec_module(module)
    return module


def example_args(module, run_dir) -> object:
    return module.Args(env_id="CartPole-v1", seed=3, total_timesteps=ROUNDS * N_ENVS * N_STEPS, num_envs=N_ENVS,
                       num_steps=N_STEPS, num_minibatches=2, update_epochs=2, run_dir=str(run_dir))


@pytest.fixture(scope="module")
def cleanrl_run(tmp_path_factory):
    module = example()
    path = tmp_path_factory.mktemp("cleanrl") / "run"
    torch.set_num_threads(1)
    agent = module.train(example_args(module, path))
    return path, agent, module


class NoWriter:
    """The example's writer replaced by one that does nothing: the loop as it is without rlinfluence."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_the_writer_adds_at_most_ten_lines_to_the_loop():
    lines = [line for line in EXAMPLE.read_text().splitlines() if line.rstrip().endswith("# rlinfluence")]
    assert 0 < len(lines) <= 10


def test_training_is_bit_for_bit_the_same_without_the_writer(cleanrl_run, monkeypatch, tmp_path):
    path, agent, module = cleanrl_run
    monkeypatch.setattr(module, "RunWriter", NoWriter)
    plain = module.train(example_args(module, tmp_path / "unused"))
    assert not (tmp_path / "unused").exists()
    for (name, a), (_, b) in zip(agent.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_each_saved_round_is_the_policy_that_collected_it_with_the_loops_records(cleanrl_run):
    path, agent, _ = cleanrl_run
    config = json.loads((path / "config.json").read_text())
    assert (config["env"], config["n_envs"], config["n_steps"], config["batch_size"]) == ("CartPole-v1", 3, 32, 48)
    assert config["learning_rate"] == pytest.approx(2.5e-4) and config["adam_eps"] == pytest.approx(1e-5)
    assert config["hidden_sizes"] == [64, 64] and config["total_timesteps"] == ROUNDS * N_ENVS * N_STEPS
    for k in range(ROUNDS):
        saved = load_round(path, k)
        buffer = saved.buffer
        logp = saved.trainer.policy.log_prob(buffer.flat("obs"), buffer.flat("actions"))
        assert torch.allclose(logp, buffer.flat("logp"), atol=1e-5) and saved.keep.all()
        assert buffer.obs.shape == (N_STEPS, N_ENVS, 4) and buffer.advantages.abs().sum() > 0
        ends = buffer.dones
        assert (buffer.episode_ids[1:] - buffer.episode_ids[:-1] == ends[:-1].long()).all()
    final = load_round(path, ROUNDS - 1).trainer  # theta(K) is the last checkpoint: the loop's final weights
    from rlinfluence.rundir import load_checkpoint

    state = load_checkpoint(path / "checkpoints" / f"round_{ROUNDS:04d}.pt")
    names, _ = cleanrl_names(agent)
    for name, parameter in agent.named_parameters():
        assert torch.equal(state["policy"][names[name]], parameter.detach().reshape(state["policy"][names[name]].shape))
    assert final.round == ROUNDS - 1


@pytest.mark.parametrize("command", EVERY_ANALYSIS)
def test_every_analysis_command_runs_on_the_loops_run(cleanrl_run, command, capsys):
    path, _, _ = cleanrl_run
    assert cli.main([c.format(run=path) for c in command]) == 0
    assert "error" not in capsys.readouterr().err


class ReluAgent(nn.Module):
    def __init__(self):
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.critic = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


class TanhAgent(nn.Module):
    def __init__(self, actor=(8,), critic=(8,)):
        super().__init__()

        def net(sizes, out):
            layers, width = [], 4
            for size in sizes:
                layers += [nn.Linear(width, size), nn.Tanh()]
                width = size
            return nn.Sequential(*layers, nn.Linear(width, out))

        self.actor, self.critic = net(actor, 2), net(critic, 1)


class MixedAgent(nn.Module):
    def __init__(self, actor_activation=nn.Sigmoid):
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 8), actor_activation(), nn.Linear(8, 2))
        self.critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize(("agent", "message"), [
    (MixedAgent(), "holds Sigmoid"),
    (MixedAgent(nn.ReLU), "the actor and the critic use relu and tanh"),
    (nn.Linear(4, 2), "no actor \\(or actor_mean\\) and critic"),
])
def test_a_policy_that_does_not_map_is_one_user_error_at_the_first_round(tmp_path, agent, message):
    writer = RunWriter(tmp_path / "run", "CartPole-v1", 2, 8, batch_size=8)
    with pytest.raises(UserError, match=message):
        writer.begin_round(agent, torch.optim.Adam(agent.parameters()))
    assert not (tmp_path / "run" / "config.json").exists()


def rollout(agent, n_steps=8, n_envs=2, wrong_logp=False):
    obs = torch.randn(n_steps, n_envs, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = agent.actor(obs)
        actions = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1).gather(-1, actions[..., None]).squeeze(-1)
        values = agent.critic(obs).squeeze(-1)
    return obs, actions, logp + (0.5 if wrong_logp else 0.0), values


def test_what_the_loop_gives_is_checked_with_one_clear_error(tmp_path):
    agent = TanhAgent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3)
    writer = RunWriter(tmp_path / "run", "CartPole-v1", 2, 8, batch_size=8)
    zeros = np.zeros(2, dtype=bool)
    writer.begin_round(agent, optimizer)
    obs, actions, logp, values = rollout(agent, wrong_logp=True)
    for t in range(8):
        writer.add_step(obs[t], actions[t], logp[t], values[t], np.ones(2), zeros, zeros)
    with pytest.raises(UserError, match="logged log-probs differ .* by up to 0.5"):
        writer.end_round(torch.zeros(8, 2), values, agent, optimizer)
    with pytest.raises(UserError, match="more than n_steps = 8"):
        writer.add_step(obs[0], actions[0], logp[0], values[0], np.ones(2), zeros, zeros)
    with pytest.raises(UserError, match="advantages of round 0 has shape \\(3,\\)"):
        writer.end_round(torch.zeros(3), values, agent, optimizer)
    with pytest.raises(UserError, match="unknown hyperparameter 'clip'"):
        RunWriter(tmp_path / "other", "CartPole-v1", 2, 8, clip=0.2)
    with pytest.raises(UserError, match="n_steps"):
        RunWriter(tmp_path / "other", "CartPole-v1", 2, 0)


def test_the_writer_leaves_the_process_generators_and_threads_as_it_found_them(tmp_path):
    agent = TanhAgent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3)
    torch.set_num_threads(2)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    writer = RunWriter(tmp_path / "run", "CartPole-v1", 2, 8, batch_size=8, eval_episodes=2)
    writer.begin_round(agent, optimizer)
    obs, actions, logp, values = rollout(agent)
    writer.add_rollout(obs, actions, logp, values, np.ones((8, 2)), np.zeros((8, 2), bool), np.zeros((8, 2), bool))
    writer.end_round(torch.randn(8, 2, generator=torch.Generator().manual_seed(0)), values, agent, optimizer)
    writer.close()
    assert torch.get_num_threads() == 2 and torch.equal(torch.rand(3), expected)
    torch.set_num_threads(1)
    with process_state_kept():
        torch.set_num_threads(3)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("agent", [TanhAgent(actor=(8,), critic=(16, 4)), ReluAgent()])
def test_an_actor_and_a_critic_of_different_sizes_or_relu_map(tmp_path, agent):
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3)
    writer = RunWriter(tmp_path / "run", "CartPole-v1", 2, 8, batch_size=8)
    writer.begin_round(agent, optimizer)
    obs, actions, logp, values = rollout(agent)
    writer.add_rollout(obs, actions, logp, values, np.ones((8, 2)), np.zeros((8, 2), bool), np.zeros((8, 2), bool))
    writer.end_round(torch.zeros(8, 2), values, agent, optimizer)  # the values check passes: the critic mapped
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    architecture = (config["hidden_sizes"], config["critic_hidden_sizes"], config["activation"])
    assert architecture == (([8], [16, 4], "tanh") if isinstance(agent, TanhAgent) else ([8], None, "relu"))
