"""Stable-Baselines3 integration (rlinfluence.integrations.sb3): scores, buffer, callback."""

from __future__ import annotations

import csv

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

pytest.importorskip("stable_baselines3")

from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.buffers import RolloutBuffer  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402
from stable_baselines3.common.envs import FakeImageEnv  # noqa: E402
from stable_baselines3.common.logger import configure  # noqa: E402
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv  # noqa: E402

from rlinfluence.filters import drop_lowest, iif_drop_count  # noqa: E402
from rlinfluence.influence import ActionTarget, snapshot_influence  # noqa: E402
from rlinfluence.integrations.sb3 import (  # noqa: E402
    FilteredRolloutBuffer,
    InfluenceFilterCallback,
    SB3PolicyAdapter,
    attribute,
)
from rlinfluence.integrations.sb3_audit import AUDIT_SCORERS, DEFAULT_AUDIT_SCORERS, AuditCallback  # noqa: E402
from rlinfluence.policies import ActorCritic  # noqa: E402

VALUE_ONLY = ("value_net.", "mlp_extractor.value_net.", "vf_features_extractor.")


class _Collected(Exception):
    pass


class _StopAtRolloutEnd(BaseCallback):
    """Stops learn() after the first rollout's GAE, before train(): the policy is still theta(k)."""

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        raise _Collected


def make_model(env, policy="MlpPolicy", n_envs=2, n_steps=32, batch_size=16, seed=0, **kwargs):
    vec = make_vec_env(env, n_envs=n_envs, seed=seed)
    return PPO(policy, vec, n_steps=n_steps, batch_size=batch_size, n_epochs=2, seed=seed,
               device="cpu", **kwargs)


def collect(model) -> RolloutBuffer:
    with pytest.raises(_Collected):
        model.learn(model.n_steps * model.n_envs, callback=_StopAtRolloutEnd())
    assert not model.rollout_buffer.generator_ready  # still [n_steps, n_envs, ...]
    return model.rollout_buffer


def env_major(array: np.ndarray) -> np.ndarray:
    """[n_steps, n_envs, ...] -> [n_envs * n_steps, ...], record env * n_steps + step."""
    return np.concatenate([array[:, e] for e in range(array.shape[1])])


def chunk_normalize(adv: torch.Tensor, order: np.ndarray, size: int) -> torch.Tensor:
    out = adv.clone()
    for start in range(0, len(order), size):
        rows = torch.as_tensor(order[start : start + size])
        a = adv[rows]
        out[rows] = (a - a.mean()) / (a.std() + 1e-8) if len(a) > 1 else a
    return out


def brute_force(model, buffer, order: np.ndarray, size: int) -> torch.Tensor:
    """score_i = A_norm_i <grad log pi(a_i|s_i), grad (1/N) sum_j A_j log pi(a_j|s_j)>, one
    autograd call per record, records read straight from SB3's [n_steps, n_envs] arrays."""
    policy = model.policy
    params = [p for name, p in policy.named_parameters() if not name.startswith(VALUE_ONLY)]
    discrete = model.action_space.__class__.__name__ == "Discrete"
    n_steps, n_envs = buffer.buffer_size, buffer.n_envs
    grads, advantages = [], []
    for e in range(n_envs):
        for t in range(n_steps):
            obs = torch.as_tensor(buffer.observations[t, e][None])
            action = torch.as_tensor(buffer.actions[t, e][None].astype(np.float32))  # as SB3's get()
            action = action.long().flatten() if discrete else action
            logp = policy.get_distribution(obs).log_prob(action).sum()
            grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(logp, params)]).double())
            advantages.append(float(buffer.advantages[t, e]))
    grads = torch.stack(grads)
    adv = torch.tensor(advantages, dtype=torch.float64)
    direction = (adv / len(adv)) @ grads
    return chunk_normalize(adv, order, size) * (grads @ direction)


def copy_into_actor_critic(policy, observation_space, action_space) -> ActorCritic:
    ours = ActorCritic(observation_space, action_space)
    names = {"mlp_extractor.policy_net.": "actor.", "mlp_extractor.value_net.": "critic.",
             "action_net.": "action_head.", "value_net.": "value_head.", "log_std": "log_std"}
    state = {}
    for name, value in policy.state_dict().items():
        prefix = next(p for p in names if name.startswith(p))
        state[names[prefix] + name[len(prefix):]] = value
    ours.load_state_dict(state)
    return ours


def assert_scores_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max()
    assert scale > 0
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4 * float(scale))


@pytest.mark.parametrize("env", ["CartPole-v1", "Pendulum-v1"])
def test_scores_match_core_and_brute_force(env):
    model = make_model(env, n_envs=2, n_steps=48)  # 96 records: 6 chunks of 16
    buffer = collect(model)
    n = 96
    order = np.random.default_rng(1).permutation(n)
    scores = attribute(model, buffer, "return", order=order)  # "auto" -> chunk of batch_size 16
    assert scores.shape == (n,)

    assert_scores_close(scores, brute_force(model, buffer, order, 16))

    # our core on our ActorCritic with the same weights, records in the same env-major order
    ours = copy_into_actor_critic(model.policy, model.observation_space, model.action_space)
    obs = torch.as_tensor(env_major(buffer.observations))
    actions = torch.as_tensor(env_major(buffer.actions))
    actions = actions.flatten().long() if env == "CartPole-v1" else actions
    adv = torch.as_tensor(env_major(buffer.advantages))
    idx = torch.as_tensor(order)
    shuffled = snapshot_influence(ours, obs[idx], actions[idx], adv[idx], advantage_norm="chunk", chunk_size=16)
    core = torch.empty_like(shuffled)
    core[idx] = shuffled
    assert_scores_close(scores, core)

    # an action target (one state and action of the buffer), raw advantages
    target = ActionTarget(obs[5], actions[5])
    ours_action = snapshot_influence(ours, obs, actions, adv, target=target, advantage_norm="none")
    assert_scores_close(attribute(model, buffer, target, advantage_norm="none"), ours_action)

    # "batch": one normalisation over the whole buffer, any order
    batch = attribute(model, buffer, advantage_norm="batch")
    assert_scores_close(batch, brute_force(model, buffer, np.arange(n), n))

    # after get() has flattened the buffer in place, the same scores come out
    next(buffer.get(16))
    assert buffer.generator_ready
    assert_scores_close(attribute(model, buffer, order=order), scores)


@pytest.mark.parametrize("share", [True, False])
def test_cnn_policy_scores_match_brute_force(share):
    model = PPO("CnnPolicy", make_vec_env(FakeImageEnv, n_envs=2, seed=0, env_kwargs=dict(
                    screen_height=36, screen_width=36, n_channels=1)),
                n_steps=16, batch_size=8, n_epochs=1, seed=0, device="cpu",
                policy_kwargs=dict(share_features_extractor=share, features_extractor_kwargs=dict(features_dim=32)))
    buffer = collect(model)
    order = np.random.default_rng(2).permutation(32)
    assert_scores_close(attribute(model, buffer, order=order), brute_force(model, buffer, order, 8))

    policy = model.policy
    attributed = {id(p) for p in SB3PolicyAdapter(policy).policy_parameters()}
    names = {name for name, p in policy.named_parameters() if id(p) in attributed}
    expected = {name for name, _ in policy.named_parameters() if not name.startswith(VALUE_ONLY)}
    assert names == expected
    assert any(name.startswith("features_extractor.cnn.") for name in names)  # the actor's CNN
    assert any(name.startswith("vf_features_extractor.") for name, _ in policy.named_parameters()) == (not share)


def _filled_buffers(n_envs=2, n_steps=20, seed=0):
    import gymnasium as gym

    obs_space = gym.spaces.Box(-1, 1, (3,), np.float32)
    act_space = gym.spaces.Discrete(4)
    rng = np.random.default_rng(seed)
    buffers = [cls(n_steps, obs_space, act_space, device="cpu", n_envs=n_envs)
               for cls in (RolloutBuffer, FilteredRolloutBuffer)]
    for _ in range(n_steps):
        row = (rng.normal(size=(n_envs, 3)).astype(np.float32), rng.integers(0, 4, (n_envs, 1)),
               rng.normal(size=n_envs), rng.random(n_envs) < 0.1,
               torch.as_tensor(rng.normal(size=n_envs), dtype=torch.float32),
               torch.as_tensor(rng.normal(size=n_envs), dtype=torch.float32))
        for buffer in buffers:
            buffer.add(*row)
    for buffer in buffers:
        buffer.compute_returns_and_advantage(torch.zeros(n_envs), np.zeros(n_envs, bool))
    return buffers


@pytest.mark.parametrize("batch_size", [8, 12, None])  # 40 records: 12 leaves a partial minibatch
@pytest.mark.parametrize("mask", ["none", "all"])
def test_get_keeping_everything_is_sb3_get(batch_size, mask):
    plain, filtered = _filled_buffers()
    if mask == "all":
        filtered.set_keep_mask(np.ones(40, bool))
    draws = []
    for buffer in (plain, filtered):
        np.random.seed(123)
        draws.append([list(buffer.get(batch_size)) for _ in range(2)] + [np.random.random()])
    for epoch_a, epoch_b in zip(draws[0][:2], draws[1][:2], strict=True):
        assert len(epoch_a) == len(epoch_b)
        for a, b in zip(epoch_a, epoch_b, strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)
    assert draws[0][2] == draws[1][2]  # same NumPy random state afterwards
    sizes = [len(ix) for ix in filtered.minibatch_indices[0]]
    assert sizes == [len(s.advantages) for s in draws[1][0]]


def test_get_filtered_draws_full_minibatches_of_kept_records():
    _, buffer = _filled_buffers()
    keep = np.random.default_rng(5).random(40) < 0.7
    buffer.set_keep_mask(keep)
    kept = set(np.flatnonzero(keep).tolist())
    flat_obs = env_major(buffer.observations.copy())
    np.random.seed(0)
    epochs = [list(buffer.get(8)) for _ in range(3)]
    assert len(buffer.minibatch_indices) == 3
    for samples, indices in zip(epochs, buffer.minibatch_indices, strict=True):
        assert len(samples) == len(kept) // 8
        assert all(len(ix) == 8 for ix in indices)
        drawn = np.concatenate(indices).tolist()
        assert len(set(drawn)) == len(drawn) and set(drawn) <= kept
        for sample, ix in zip(samples, indices, strict=True):
            assert torch.equal(sample.observations, torch.as_tensor(flat_obs[ix]))
    firsts = [np.concatenate(ix) for ix in buffer.minibatch_indices]
    assert not np.array_equal(firsts[0], firsts[1])  # a fresh permutation every epoch
    buffer.reset()
    assert buffer.keep is None and buffer.minibatch_indices == []
    with pytest.raises(ValueError, match="keeps no record"):
        buffer.set_keep_mask(np.zeros(40, bool))


@pytest.mark.parametrize("env", ["CartPole-v1", "Pendulum-v1"])
def test_keep_everything_reproduces_plain_ppo_bit_for_bit(env):
    def train(callback):
        model = PPO("MlpPolicy", env, n_steps=64, batch_size=16, n_epochs=2, seed=3, device="cpu",
                    rollout_buffer_class=FilteredRolloutBuffer if callback else None)
        model.learn(128, callback=callback)  # 2 rounds
        return model

    plain = train(None)
    callback = InfluenceFilterCallback(drop_pct=0)  # scores every round, keeps everything
    filtered = train(callback)
    assert len(callback.history) == 2 and callback.history[-1]["kept_fraction"] == 1.0
    assert callback.history[-1]["n_negative"] > 0  # it did score
    plain_state, filtered_state = plain.policy.state_dict(), filtered.policy.state_dict()
    assert plain_state.keys() == filtered_state.keys()
    for name in plain_state:
        assert torch.equal(plain_state[name], filtered_state[name]), name
    # the default chunk order was the first epoch's minibatches of the (unfiltered) update
    first_epoch = np.concatenate(filtered.rollout_buffer.minibatch_indices[0])
    assert np.array_equal(callback.order, first_epoch)


def test_iif_drops_expected_count_and_logs(tmp_path):
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, n_epochs=2, seed=3,
                device="cpu", rollout_buffer_class=FilteredRolloutBuffer)
    model.set_logger(configure(str(tmp_path), ["csv"]))
    callback = InfluenceFilterCallback(drop_pct=50.0)  # neg-bottom
    model.learn(128, callback=callback)

    scores = callback.scores
    n_drop = iif_drop_count(scores, 50.0, "neg-bottom")
    assert n_drop == int((scores < 0).sum()) // 2 > 0
    assert torch.equal(callback.keep, drop_lowest(scores, n_drop))
    assert callback.history[-1]["n_dropped"] == n_drop
    assert callback.history[-1]["kept_fraction"] == (64 - n_drop) / 64
    assert (scores[~callback.keep].max() <= scores[callback.keep].min()) and (scores[~callback.keep] < 0).all()

    kept = set(np.flatnonzero(callback.keep.numpy()).tolist())
    epochs = model.rollout_buffer.minibatch_indices
    assert len(epochs) == 2
    for indices in epochs:
        assert len(indices) == len(kept) // 16 and all(len(ix) == 16 for ix in indices)
        assert set(np.concatenate(indices).tolist()) <= kept

    with open(tmp_path / "progress.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for key in ("influence/kept_fraction", "influence/n_negative", "influence/seconds"):
        assert all(row[key] != "" for row in rows), key
    assert float(rows[-1]["influence/kept_fraction"]) == pytest.approx((64 - n_drop) / 64)

    plain = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, n_epochs=2, seed=3, device="cpu")
    plain.learn(128)
    assert not torch.equal(plain.policy.action_net.weight, model.policy.action_net.weight)


def test_callback_needs_the_filtered_buffer():
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=32, batch_size=16, seed=0, device="cpu")
    with pytest.raises(TypeError, match="FilteredRolloutBuffer"):
        model.learn(32, callback=InfluenceFilterCallback())
    with pytest.raises(ValueError, match="drop_pct"):
        InfluenceFilterCallback(drop_pct=150)


# -- every supported space; aliased BatchNorm; degenerate rollouts (issue 13) ------------------------
class SpaceEnv(gym.Env):
    """Random observations of ``obs_space``, any ``act_space``; reward ``reward`` (None: a random
    one from the env's generator); 8-step episodes."""

    def __init__(self, obs_space, act_space, reward=None):
        self.observation_space, self.action_space, self.reward = obs_space, act_space, reward

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(1 << 30)))
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        reward = float(self.np_random.normal()) if self.reward is None else self.reward
        return self.observation_space.sample(), reward, False, self.t >= 8, {}


BOX = gym.spaces.Box(-1, 1, (3,), np.float32)
SPACES = {  # (observation space, action space); image observations: test_cnn_policy_scores_match_brute_force
    "action Discrete": (BOX, gym.spaces.Discrete(3)),
    "action Box": (BOX, gym.spaces.Box(-1, 1, (2,), np.float32)),
    "action MultiDiscrete": (BOX, gym.spaces.MultiDiscrete([3, 2])),
    "action MultiBinary": (BOX, gym.spaces.MultiBinary(3)),
    "obs Discrete": (gym.spaces.Discrete(5), gym.spaces.Discrete(3)),
    "obs MultiDiscrete": (gym.spaces.MultiDiscrete([3, 4]), gym.spaces.Discrete(3)),
    "obs MultiBinary": (gym.spaces.MultiBinary(4), gym.spaces.Discrete(3)),
}


@pytest.mark.parametrize("space", list(SPACES))
def test_every_supported_space_matches_brute_force(space):
    obs_space, act_space = SPACES[space]
    model = make_model(lambda: SpaceEnv(obs_space, act_space), n_envs=2, n_steps=16, batch_size=8)
    buffer = collect(model)
    order = np.random.default_rng(3).permutation(32)
    assert_scores_close(attribute(model, buffer, order=order), brute_force(model, buffer, order, 8))


def test_dict_observations_are_rejected_with_a_clear_error():
    space = gym.spaces.Dict({"a": BOX})
    model = PPO("MultiInputPolicy", make_vec_env(lambda: SpaceEnv(space, gym.spaces.Discrete(2)), n_envs=1),
                n_steps=8, batch_size=8, device="cpu")
    with pytest.raises(ValueError, match="Dict observation spaces are not supported"):
        SB3PolicyAdapter(model.policy)


class BatchNormExtractor(BaseFeaturesExtractor):
    """Linear -> BatchNorm1d -> ReLU; shared by actor and critic (SB3 registers it as
    ``features_extractor`` and ``pi_features_extractor``)."""

    def __init__(self, observation_space, features_dim=16):
        super().__init__(observation_space, features_dim)
        self.net = nn.Sequential(nn.Linear(observation_space.shape[0], features_dim), nn.BatchNorm1d(features_dim), nn.ReLU())

    def forward(self, observations):
        return self.net(observations)


def test_batchnorm_features_extractor_at_drop_0_is_plain_sb3_bit_for_bit():
    def train(callback):
        model = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, n_epochs=2, seed=3, device="cpu",
                    policy_kwargs=dict(features_extractor_class=BatchNormExtractor),
                    rollout_buffer_class=FilteredRolloutBuffer if callback else None)
        model.learn(128, callback=callback)  # 2 rounds
        return model

    plain = train(None)
    callback = InfluenceFilterCallback(drop_pct=0)
    filtered = train(callback)
    policy = filtered.policy
    assert policy.pi_features_extractor is policy.features_extractor
    assert callback.history[-1]["n_negative"] > 0  # it did score (the BatchNorm took forward mode)
    plain_state, filtered_state = plain.policy.state_dict(), policy.state_dict()
    assert plain_state.keys() == filtered_state.keys()
    for name in plain_state:  # weights and BatchNorm running statistics
        assert torch.equal(plain_state[name], filtered_state[name]), name
    bn = policy.features_extractor.net[1]
    optimised = {id(p) for group in policy.optimizer.param_groups for p in group["params"]}
    for p in (bn.weight, bn.bias):
        assert isinstance(p, nn.Parameter) and p.requires_grad and id(p) in optimised


def test_a_rollout_with_every_advantage_zero_is_kept_and_logged(tmp_path):
    def train(callback):
        model = make_model(lambda: SpaceEnv(BOX, gym.spaces.Discrete(2), reward=0.0), n_envs=1, n_steps=32,
                           batch_size=16, rollout_buffer_class=FilteredRolloutBuffer if callback else None)
        with torch.no_grad():  # V = 0 and r = 0: every advantage is exactly 0
            model.policy.value_net.weight.zero_()
            model.policy.value_net.bias.zero_()
        model.set_logger(configure(str(tmp_path / str(callback is None)), ["csv"]))
        model.learn(64, callback=callback)  # 2 rounds
        return model

    callback = InfluenceFilterCallback(drop_pct=50)
    with pytest.warns(RuntimeWarning, match=r"rollout 0 kept every record \(influence/skipped = 1\).*zero gradient"):
        filtered = train(callback)
    assert [h["skipped"] for h in callback.history] == [1.0, 1.0]
    assert all(h["kept_fraction"] == 1.0 for h in callback.history) and callback.keep.all()
    with open(tmp_path / "False" / "progress.csv") as f:
        assert [float(row["influence/skipped"]) for row in csv.DictReader(f)] == [1.0, 1.0]
    plain = train(None)
    for name, value in plain.policy.state_dict().items():  # trained through, exactly as plain SB3
        assert torch.equal(value, filtered.policy.state_dict()[name]), name


@pytest.mark.parametrize("space", [gym.spaces.MultiDiscrete([3, 2]), gym.spaces.MultiBinary(3)])
def test_iif_on_joint_action_spaces_warns_once(space):
    model = make_model(lambda: SpaceEnv(BOX, space), n_envs=1, n_steps=16, batch_size=8,
                       rollout_buffer_class=FilteredRolloutBuffer)
    callback = InfluenceFilterCallback(drop_pct=12.5)
    with pytest.warns(UserWarning, match=f"{type(space).__name__} action space") as record:
        model.learn(16, callback=callback)
        model.learn(16, callback=callback, reset_num_timesteps=False)
    assert sum("joint action" in str(w.message) for w in record) == 1


def _audited_cartpole(path, flipped_env=None, seed=3, rollouts=6):
    """SB3 PPO on 4 CartPole envs (env ``flipped_env`` paying the negated reward), audited."""
    def make(i):
        env = gym.make("CartPole-v1")
        return gym.wrappers.TransformReward(env, lambda r: -r) if i == flipped_env else env

    vec = DummyVecEnv([lambda i=i: make(i) for i in range(4)])
    vec.seed(seed)
    model = PPO("MlpPolicy", vec, n_steps=64, batch_size=64, n_epochs=2, seed=seed, device="cpu")
    callback = AuditCallback(path, scorers=AUDIT_SCORERS, corrupted_envs=() if flipped_env is None else (flipped_env,))
    model.learn(rollouts * 256, callback=callback)
    return model, callback


def test_audit_of_an_sb3_run_flags_the_flipped_env_and_no_env_of_clean_runs(tmp_path, capsys):
    from rlinfluence import cli

    _, callback = _audited_cartpole(tmp_path / "flip", flipped_env=1)
    tables = sorted((tmp_path / "flip" / "audit" / "scores").glob("round_*.parquet"))
    assert len(tables) == callback.rounds == 6
    first = pd.read_parquet(tables[0])
    assert list(first.columns[:6]) == ["round", "source", "episode", "step", "trusted", "corrupted"]
    assert (first["source"].to_numpy() == np.repeat(np.arange(4), 64)).all() and first["corrupted"].sum() == 64
    assert (np.diff(first["episode"].to_numpy().reshape(4, 64), axis=1) >= 0).all()  # episodes counted per env
    assert cli.main(["audit", str(tmp_path / "flip"), "--scorer", "negative-advantage", "--by", "episode"]) == 0
    out = capsys.readouterr().out
    sources = pd.read_csv(tmp_path / "flip" / "audit" / "sources_negative-advantage.csv")
    assert sources["flagged"].tolist() == [False, True, False, False], out
    assert (tmp_path / "flip" / "audit" / "detection.csv").is_file() and "the 10 most harmful episodes" in out
    # the verdict tests the written gradient columns (influence, dtv) only where asked
    for extra, tested in (([], False), (["--gradient-families"], True)):
        assert cli.main(["audit", str(tmp_path / "flip"), *extra]) == 0
        columns = set(pd.read_csv(tmp_path / "flip" / "audit" / "sources.csv").columns)
        assert {"p_influence", "p_dtv"} <= columns if tested else not {"p_influence", "p_dtv"} & columns
        assert "p_reward-extremes" in columns
    assert cli.main(["report", str(tmp_path / "flip")]) == 0  # no run of our trainer: a report of its audit
    assert "Audit" in (tmp_path / "flip" / "report.html").read_text()
    for seed in (4, 5):
        _audited_cartpole(tmp_path / f"clean{seed}", seed=seed)
        for scorer in ("influence", "negative-advantage"):
            assert cli.main(["audit", str(tmp_path / f"clean{seed}"), "--scorer", scorer]) == 0
            assert not pd.read_csv(tmp_path / f"clean{seed}" / "audit" / f"sources_{scorer}.csv")["flagged"].any()


def test_the_audit_callback_leaves_sb3_training_unchanged(tmp_path):
    plain = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, n_epochs=2, seed=3, device="cpu").learn(128)
    audited = PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=16, n_epochs=2, seed=3, device="cpu")
    audited.learn(128, callback=AuditCallback(tmp_path))
    for name, value in plain.policy.state_dict().items():
        assert torch.equal(value, audited.policy.state_dict()[name]), name
    written = pd.read_parquet(next((tmp_path / "audit" / "scores").glob("round_*.parquet")))
    assert set(DEFAULT_AUDIT_SCORERS) <= set(written.columns) and not {"influence", "dtv"} & set(written.columns)
    with pytest.raises(ValueError, match="unknown scorer 'tracin'"):
        AuditCallback(tmp_path, scorers=("tracin",))


def test_attribute_refuses_a_buffer_the_policy_no_longer_collects():
    """After learn() the policy has been updated on model.rollout_buffer: scoring it there would be
    attribution at theta(k+1). One clear error; check_policy=False scores anyway."""
    model = make_model("CartPole-v1", n_envs=2, n_steps=48)
    model.learn(96)
    with pytest.raises(ValueError, match="not the one that collected this rollout buffer"):
        attribute(model)
    assert attribute(model, check_policy=False).shape == (96,)


def test_the_audit_callback_refuses_a_fractional_env_and_a_folder_another_training_wrote(tmp_path):
    """corrupted_envs=[1.7] is not env 1; a second training into a folder that holds the first's
    rounds would make the audit mix the two: both are one clear error."""
    from rlinfluence.integrations.sb3_audit import AuditCallback

    with pytest.raises(ValueError, match="corrupted_envs holds 1.7"):
        AuditCallback(tmp_path, corrupted_envs=[1.7])
    first = make_model("CartPole-v1", n_envs=2, n_steps=48)
    callback = AuditCallback(tmp_path)
    first.learn(96, callback=callback)
    first.learn(96, callback=callback, reset_num_timesteps=False)  # the same training, continued
    assert len(list((tmp_path / "audit" / "scores").glob("round_*.parquet"))) == 2  # one rollout each
    second = make_model("CartPole-v1", n_envs=2, n_steps=48)
    with pytest.raises(ValueError, match="from another training"):
        second.learn(96, callback=AuditCallback(tmp_path))


@pytest.mark.parametrize(("space", "scored"), [(gym.spaces.Discrete(3), True), (gym.spaces.Box(-1, 1, (2,), np.float32), True),
                                               (gym.spaces.MultiDiscrete([3, 2]), False), (gym.spaces.MultiBinary(3), False)])
def test_action_calibration_is_scored_only_where_its_law_is_known(space, scored):
    """An SB3 policy's logged actions are calibrated for Discrete and Box (uniform U, mean near 1/2);
    a joint action has no law implemented and scores NaN (the calibration test then has nothing to
    flag, instead of flagging every env)."""
    from rlinfluence.consistency import action_count, policy_checks
    from rlinfluence.integrations.sb3 import as_rollout_buffer

    model = make_model(lambda: SpaceEnv(BOX, space), n_envs=2, n_steps=64, batch_size=8)
    collect(model)
    ours = as_rollout_buffer(model, model.rollout_buffer, 0, np.zeros(2, dtype=np.int64))
    adapter = SB3PolicyAdapter(model.policy)
    u = policy_checks(adapter, ours, action_count(adapter))["action-calibration"]
    if scored:
        assert np.isfinite(u).all() and abs(u.mean()) < 0.1
    else:
        assert np.isnan(u).all()


def test_the_adapters_every_action_log_prob_is_sb3s_log_prob_of_that_action():
    """SB3PolicyAdapter.action_log_probs (the policy checks' one forward) column a == log_prob(obs, a),
    exactly; the policy checks give what one forward per action gave."""
    from rlinfluence.consistency import action_count, policy_checks
    from rlinfluence.integrations.sb3 import as_rollout_buffer

    model = make_model("CartPole-v1", n_envs=2, n_steps=64, batch_size=8)
    collect(model)
    adapter = SB3PolicyAdapter(model.policy)
    obs = torch.as_tensor(model.rollout_buffer.observations.reshape(-1, 4))
    every = adapter.action_log_probs(obs)
    for a in range(2):
        assert torch.equal(every[:, a], adapter.log_prob(obs, torch.full((len(obs),), a)))

    class OnlyEvaluateActions(torch.nn.Module):  # the one-forward-per-action path
        def evaluate_actions(self, obs, actions):
            return adapter.evaluate_actions(obs, actions)

    ours = as_rollout_buffer(model, model.rollout_buffer, 0, np.zeros(2, dtype=np.int64))
    with torch.no_grad():
        one, per_action = policy_checks(adapter, ours, 2), policy_checks(OnlyEvaluateActions(), ours, action_count(adapter))
    for name in one:
        np.testing.assert_array_equal(one[name], per_action[name])
