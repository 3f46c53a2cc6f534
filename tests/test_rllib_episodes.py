"""RLlib's episodes as rlinfluence's records (``rlinfluence.integrations.rllib_episodes``), without
Ray: stand-in episodes with the reads of RLlib's ``SingleAgentEpisode``. The callback itself, on a
real RLlib PPO, is tests/test_rllib.py (skipped where ray[rllib] is not installed)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlinfluence.errors import UserError
from rlinfluence.integrations.rllib_episodes import (
    SOURCE_KEY,
    rllib_names,
    source_of,
    source_records,
    trajectories,
)
from rlinfluence.policies import make_policy


class Chunk:
    """An episode chunk as RLlib hands it to the Learner: len + 1 observations for len steps."""

    def __init__(self, n: int, start: float, source: tuple[int, int] | None, terminated=False, truncated=False):
        self.obs = start + np.arange(n + 1, dtype=np.float32)[:, None] * np.array([[0.01, -0.02, 0.03, 0.005]])
        self.actions = np.arange(n) % 2
        self.rewards = 1.0 + 0.1 * np.arange(n)
        self.logp = -0.5 - 0.01 * np.arange(n)
        self.is_terminated, self.is_truncated = terminated, truncated
        self.custom_data = {} if source is None else {SOURCE_KEY: source}

    def __len__(self) -> int:
        return len(self.actions)

    def get_observations(self, index=None):
        return self.obs if index is None else self.obs[index]

    def get_actions(self):
        return self.actions

    def get_rewards(self):
        return self.rewards

    def get_extra_model_outputs(self, key):
        assert key == "action_logp"
        return self.logp


def test_rllib_names_map_the_default_ppo_module_onto_actor_critic():
    rllib = [f"encoder.{part}_encoder.net.mlp.{i}.{kind}" for part in ("actor", "critic") for i in (0, 2)
             for kind in ("weight", "bias")] + [f"{head}.net.mlp.0.{kind}" for head in ("pi", "vf")
                                                for kind in ("weight", "bias")]
    ours = make_policy(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2), hidden_sizes=(256, 256))
    assert {rllib_names(name) for name in rllib} == {name for name, _ in ours.named_parameters()}
    assert rllib_names("pi.log_std_clip_param_const") is None


def test_sources_are_runner_by_sub_env():
    assert [source_of(w, e, 4) for w, e in ((1, 0), (1, 3), (2, 0), (2, 3))] == [0, 3, 4, 7]
    assert source_of(0, 2, 4) == 2  # the local runner, where there are no remote ones


def test_trajectories_keep_each_sources_chunks_in_order():
    a1 = Chunk(3, 0.0, (1, 0), terminated=True)
    b = Chunk(5, 1.0, (1, 1))
    a2 = Chunk(4, 2.0, (1, 0), truncated=True)
    a3 = Chunk(2, 3.0, (1, 0))
    runs = trajectories([a1, b, a2, a3], n_sources=2, envs_per_runner=2)
    assert [len(r) for r in runs] == [9, 5]
    np.testing.assert_array_equal(runs[0].obs, np.concatenate([a1.obs[:-1], a2.obs[:-1], a3.obs[:-1]]))
    np.testing.assert_array_equal(runs[0].terminated, [0, 0, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(runs[0].truncated, [0, 0, 0, 0, 0, 0, 1, 0, 0])
    assert [i for i, _ in runs[0].ends] == [2, 6, 8]
    np.testing.assert_array_equal(runs[0].ends[1][1], a2.obs[-1])
    with pytest.raises(UserError, match="source 1 sent no steps"):
        trajectories([a1], n_sources=2, envs_per_runner=2)
    with pytest.raises(UserError, match="no source tag"):
        trajectories([Chunk(2, 0.0, None)], n_sources=1, envs_per_runner=1)
    with pytest.raises(UserError, match="outside the 2 sources"):
        trajectories([Chunk(2, 0.0, (2, 0))], n_sources=2, envs_per_runner=2)


def test_source_records_are_gae_with_rllibs_bootstraps():
    """Against GAE written out term by term: A_t = sum_u (gamma lambda)^(u-t) delta_u up to the
    chunk's end, V(final observation) bootstrapped unless the episode terminated."""
    torch.manual_seed(0)
    policy = make_policy(gym.spaces.Box(-5, 5, (4,)), gym.spaces.Discrete(2), hidden_sizes=(8,))
    chunks = [Chunk(3, 0.0, (1, 0), terminated=True), Chunk(4, 2.0, (1, 0), truncated=True), Chunk(5, 3.0, (1, 0))]
    run = trajectories(chunks, 1, 1)[0]
    gamma, lam, kept = 0.9, 0.8, 10
    got = source_records(run, policy, gamma, lam, kept)

    def v(obs):
        with torch.no_grad():
            return float(policy.value(torch.as_tensor(np.asarray(obs)[None], dtype=torch.float32))[0])

    expected = []
    for chunk in chunks:
        n = len(chunk)
        values = [v(o) for o in chunk.obs]
        bootstrap = 0.0 if chunk.is_terminated else values[n]
        deltas = [chunk.rewards[t] + gamma * (values[t + 1] if t + 1 < n else bootstrap) - values[t] for t in range(n)]
        expected += [sum((gamma * lam) ** (u - t) * deltas[u] for u in range(t, n)) for t in range(n)]
    np.testing.assert_allclose(got["advantages"], expected[:kept], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["returns"] - got["values"], expected[:kept], rtol=1e-6, atol=1e-6)
    assert got["final_values"][6] == pytest.approx(v(chunks[1].obs[-1]), abs=1e-6)  # the truncated episode's
    assert got["final_values"][2] == 0.0 and np.count_nonzero(got["final_values"]) == 1
    assert got["last_value"] == pytest.approx(v(chunks[2].obs[3]), abs=1e-6)  # the record after the 10th
    assert source_records(run, policy, gamma, lam, len(run))["last_value"] == pytest.approx(v(chunks[2].obs[-1]),
                                                                                           abs=1e-6)
    assert got["obs"].shape == (kept, 4) and len(got["logp"]) == kept
