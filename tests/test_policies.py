import gymnasium as gym
import numpy as np
import pytest
import torch

from rlinfluence.policies import NumpyActorCritic, make_policy, rollout_actor

BOX8 = gym.spaces.Box(-1, 1, (8,), np.float32)
IMAGE = gym.spaces.Box(0, 255, (7, 7, 3), np.uint8)


def test_categorical_head_matches_torch_distribution():
    torch.manual_seed(0)
    policy = make_policy(BOX8, gym.spaces.Discrete(4))
    obs, actions = torch.randn(16, 8), torch.randint(0, 4, (16,))
    logp, entropy, value = policy.evaluate_actions(obs, actions)
    dist = torch.distributions.Categorical(logits=policy.action_head(policy.actor(obs)))
    torch.testing.assert_close(logp, dist.log_prob(actions))
    torch.testing.assert_close(entropy, dist.entropy())
    torch.testing.assert_close(policy.log_prob(obs, actions), logp)
    assert value.shape == (16,)


def test_every_actions_log_prob_is_log_prob_of_that_action_bit_for_bit():
    """action_log_probs (the policy checks' one forward) column a == log_prob(obs, a), exactly; a Box
    policy has none."""
    torch.manual_seed(0)
    policy = make_policy(BOX8, gym.spaces.Discrete(4))
    obs = torch.randn(16, 8)
    every = policy.action_log_probs(obs)
    for a in range(4):
        assert torch.equal(every[:, a], policy.log_prob(obs, torch.full((16,), a)))
    with pytest.raises(ValueError, match="Discrete"):
        make_policy(BOX8, gym.spaces.Box(-1, 1, (3,), np.float32)).action_log_probs(obs)


def test_evaluate_every_action_is_evaluate_actions_and_action_log_probs_bit_for_bit():
    """evaluate_every_action (the policy checks' one pass): every action's log-prob as
    action_log_probs, the taken action's, the entropy and the value as evaluate_actions, exactly."""
    torch.manual_seed(0)
    policy = make_policy(BOX8, gym.spaces.Discrete(4))
    obs, actions = torch.randn(16, 8), torch.randint(0, 4, (16,))
    every, entropy, value = policy.evaluate_every_action(obs)
    logp, expected_entropy, expected_value = policy.evaluate_actions(obs, actions)
    assert torch.equal(every, policy.action_log_probs(obs))
    assert torch.equal(every.gather(-1, actions.unsqueeze(-1)).squeeze(-1), logp)
    assert torch.equal(entropy, expected_entropy) and torch.equal(value, expected_value)
    with pytest.raises(ValueError, match="Discrete"):
        make_policy(BOX8, gym.spaces.Box(-1, 1, (3,), np.float32)).evaluate_every_action(obs)


def test_gaussian_head_matches_torch_distribution_with_state_independent_log_std():
    torch.manual_seed(0)
    policy = make_policy(BOX8, gym.spaces.Box(-1, 1, (3,), np.float32))
    with torch.no_grad():
        policy.log_std.copy_(torch.tensor([-0.5, 0.0, 0.3]))
    obs, actions = torch.randn(16, 8), torch.randn(16, 3)
    logp, entropy, _ = policy.evaluate_actions(obs, actions)
    mean = policy.action_head(policy.actor(obs))
    dist = torch.distributions.Normal(mean, policy.log_std.exp())
    torch.testing.assert_close(logp, dist.log_prob(actions).sum(-1))
    torch.testing.assert_close(entropy, dist.entropy().sum(-1))


def test_policy_parameters_are_exactly_what_log_prob_depends_on():
    for space, obs_space in [(gym.spaces.Discrete(3), BOX8), (gym.spaces.Box(-1, 1, (2,)), BOX8),
                             (gym.spaces.Discrete(7), IMAGE)]:
        policy = make_policy(obs_space, space)
        obs = torch.as_tensor(np.stack([obs_space.sample() for _ in range(4)]))
        actions = torch.as_tensor(np.stack([space.sample() for _ in range(4)]))
        policy.zero_grad()
        policy.log_prob(obs, actions).sum().backward()
        reached = {id(p) for p in policy.parameters() if p.grad is not None}
        assert reached == {id(p) for p in policy.policy_parameters()}
        assert not any(p is q for p in policy.policy_parameters() for q in policy.value_head.parameters())


def test_cnn_is_chosen_for_images_and_shared_by_actor_and_critic():
    policy = make_policy(IMAGE, gym.spaces.Discrete(7))
    assert type(policy.encoder).__name__ == "MiniGridCNN"
    obs = torch.randint(0, 11, (5, 7, 7, 3), dtype=torch.uint8)
    policy.value(obs).sum().backward()
    assert policy.encoder.convs[0].weight.grad is not None  # the critic trains the shared encoder


def test_orthogonal_init_gains_follow_sb3():
    policy = make_policy(BOX8, gym.spaces.Discrete(4))
    w = policy.action_head.weight.detach()  # gain 0.01: rows orthonormal * 0.01
    torch.testing.assert_close(w @ w.T, 1e-4 * torch.eye(4), atol=1e-7, rtol=0)
    assert torch.all(policy.action_head.bias == 0)
    v = policy.value_head.weight.detach()
    assert v.norm().item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("action_space", [gym.spaces.Discrete(5), gym.spaces.Box(-1, 1, (3,), np.float32)])
def test_numpy_rollout_actor_equals_torch_forward(action_space):
    torch.manual_seed(1)
    policy = make_policy(BOX8, action_space)
    obs = torch.randn(64, 8)
    noise = policy.noise((64,), torch.Generator().manual_seed(0))
    actions, logp, value = policy.act_with_noise(obs, noise)
    fast = NumpyActorCritic.from_policy(policy)
    assert fast is not None
    f_actions, f_logp, f_value = fast.act_with_noise(obs.numpy(), noise.numpy())
    np.testing.assert_allclose(f_actions, actions.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(f_logp, logp.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f_value, value.numpy(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(policy.log_prob(obs, torch.as_tensor(f_actions)), logp, rtol=1e-5, atol=1e-5)


def test_cnn_policy_uses_the_torch_rollout_path():
    policy = make_policy(IMAGE, gym.spaces.Discrete(7))
    assert NumpyActorCritic.from_policy(policy) is None
    obs = np.random.default_rng(0).integers(0, 11, (4, 7, 7, 3)).astype(np.uint8)
    actions, logp, value = rollout_actor(policy)(obs, policy.noise((4,)).numpy())
    assert actions.shape == logp.shape == value.shape == (4,)


def test_inverse_cdf_sampling_follows_the_policy_distribution():
    torch.manual_seed(0)
    policy = make_policy(BOX8, gym.spaces.Discrete(4))
    with torch.no_grad():
        policy.action_head.weight.mul_(100)  # make the distribution far from uniform
    obs = torch.randn(1, 8).repeat(40_000, 1)
    actions, _, _ = policy.act(obs, torch.Generator().manual_seed(3))
    probs = torch.softmax(policy.action_head(policy.actor(obs[:1])), -1)[0].detach()
    freq = torch.bincount(actions, minlength=4) / len(actions)
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)
