import numpy as np
import pytest
import torch

from rlinfluence.buffer import RolloutBuffer, compute_gae, discounted_returns
from rlinfluence.ppo import PPO

from .conftest import tiny_config

GAMMA, LAM = 0.9, 0.8


def _gae(rewards, dones, last_value, values=(0.5, 0.5, 0.5)):
    col = lambda x: np.array(x, dtype=np.float64)[:, None]  # noqa: E731
    return compute_gae(col(rewards), col(values), col(dones), np.array([last_value]), GAMMA, LAM)[:, 0]


def test_gae_terminal_episode_hand_computed():
    # t=2: delta = 1 - .5 = .5; t=1: delta = 1 + .9*.5 - .5 = .95, A = .95 + .72*.5
    np.testing.assert_allclose(_gae([1, 1, 1], [0, 0, 1], 10.0), [1.8932, 1.31, 0.5])


def test_gae_bootstraps_unfinished_tail_with_last_value():
    # t=2: delta = 1 + .9*10 - .5 = 9.5; A1 = .95 + .72*9.5; A0 = .95 + .72*A1
    np.testing.assert_allclose(_gae([1, 1, 1], [0, 0, 0], 10.0), [6.5588, 7.79, 9.5])


def test_gae_truncation_adds_discounted_final_value_to_reward():
    buf = RolloutBuffer.empty(0, 3, 1, (1,), torch.float32, (), torch.int64)
    buf.rewards[:] = 1.0
    buf.values[:] = 0.5
    buf.truncated[2] = True
    buf.final_values[2] = 2.0
    buf.last_values = torch.tensor([10.0])
    buf.compute_advantages(GAMMA, LAM)
    # r_2 becomes 1 + .9*2 = 2.8 -> delta_2 = 2.3; earlier steps as in the terminal case
    np.testing.assert_allclose(buf.advantages[:, 0].numpy(), [2.82632, 2.606, 2.3], rtol=1e-6)
    np.testing.assert_allclose(buf.returns.numpy(), (buf.advantages + buf.values).numpy())


def test_monte_carlo_returns_and_completeness():
    rewards = np.array([[1.0], [2.0], [3.0], [4.0]])
    dones = np.array([[0], [1], [0], [0]])
    g, complete = discounted_returns(rewards, dones, 0.5)
    np.testing.assert_allclose(g[:, 0], [2.0, 2.0, 5.0, 4.0])
    assert complete[:, 0].tolist() == [True, True, False, False]


def test_flat_order_is_env_major_with_stable_ids():
    buf = RolloutBuffer.empty(7, 3, 2, (1,), torch.float32, (), torch.int64)
    buf.rewards[:] = torch.arange(6, dtype=torch.float32).reshape(3, 2)  # value = 2*step + env
    ids = buf.record_ids()
    flat = buf.flat("rewards")
    assert ids.tolist() == [[7, 0, 0], [7, 0, 1], [7, 0, 2], [7, 1, 0], [7, 1, 1], [7, 1, 2]]
    assert flat.tolist() == [2.0 * s + e for _, e, s in ids.tolist()]


def test_trainer_bootstraps_time_limit_with_value_of_final_observation():
    trainer = PPO(tiny_config(env="CountingChain-v0", n_steps=8, batch_size=8), run_dir=False)
    buf = trainer.collect()
    steps = buf.truncated[:, 0].nonzero().squeeze(1).tolist()
    assert steps == [2, 5]  # episodes of 3 steps end by truncation, never by termination
    assert not buf.terminated.any()
    final_value = trainer.policy.value(torch.tensor([[0.3]])).item()  # obs after 3 steps
    assert buf.final_values[2, 0].item() == pytest.approx(final_value, rel=1e-6)
    assert buf.episode_ids[:, 0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    # the observation stored after a truncation is the reset observation of the next episode
    assert buf.obs[3, 0].item() == 0.0
