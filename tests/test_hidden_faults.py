"""Faults that hide from the reward: each kind changes exactly its envs and leaves rewards (or
returns) as stated; the consistency checks equal a brute-force recomputation; the exact permutation
test equals enumeration; maxT's adjusted p-values hold their level and do not pay for correlated
families; the verdict's outlier test is calibrated and unmasks two broken sources; the verdict flags a broken CartPole worker and nothing on a clean run;
quarantine drops exactly the flagged sources; bad specs are one error line."""

import itertools

import gymnasium as gym
import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats as scipy_stats
from sklearn.linear_model import Ridge
from sklearn.preprocessing import StandardScaler

from rlinfluence import cli, corruptions
from rlinfluence.analysis.audit import audit_run
from rlinfluence.checkpoint import load_round
from rlinfluence.consistency import (
    _features,
    _folds,
    consistency_scores,
    model_checks,
    policy_checks,
)
from rlinfluence.ppo import PPO, PPOConfig
from rlinfluence.readings import FAULT_CLASSES, KIND_CLASS, reading
from rlinfluence.sources import (
    VERDICT_VERSION,
    calibration_test,
    episode_floor,
    maxt_test,
    normal_scores,
    outlier_test,
    source_test,
    verdict,
)


def _round(corrupt=(), env="CartPole-v1", seed=3):
    """Round 0 of a 4-env run: the policy and the action noise do not depend on the corruption."""
    config = PPOConfig(env=env, n_envs=4, n_steps=64, batch_size=64, total_timesteps=256, eval_episodes=0,
                       corrupt=tuple(corrupt), seed=seed, progress=False)
    trainer = PPO(config, run_dir=False)
    return trainer, trainer.collect()


def _broken(trainer):
    bad = trainer.corruptor.broken_envs
    assert bad.sum() == 1
    return bad


def _same_outside(clean, faulty, bad, names=("obs", "actions", "logp", "values", "rewards", "terminated", "truncated")):
    for name in names:
        assert torch.equal(getattr(clean, name)[:, ~bad], getattr(faulty, name)[:, ~bad]), name
    assert faulty.corrupted[:, bad].all() and not faulty.corrupted[:, ~bad].any()


def test_action_mismatch_actuator_executes_the_mapped_action_and_logs_the_sampled_one():
    _, clean = _round()
    trainer, faulty = _round(["action-mismatch:envs=1,mode=actuator"])
    bad = _broken(trainer)
    _same_outside(clean, faulty, bad)
    # the first step is taken from the same state with the same noise: same logged action, but the
    # env executed the other one, so the next observation differs; CartPole pays 1 whatever happens
    assert torch.equal(clean.actions[0, bad], faulty.actions[0, bad])
    assert not torch.equal(clean.obs[1, bad], faulty.obs[1, bad])
    assert (faulty.rewards == 1).all()


def test_action_mismatch_log_executes_the_sampled_action_and_logs_the_mapped_one_with_its_log_prob():
    _, clean = _round()
    trainer, faulty = _round(["action-mismatch:envs=1,mode=log"])
    bad = _broken(trainer)
    _same_outside(clean, faulty, bad)
    assert torch.equal(clean.obs[:, bad], faulty.obs[:, bad]) and torch.equal(clean.rewards, faulty.rewards)
    assert torch.equal(faulty.actions[:, bad], (clean.actions[:, bad] + 1) % 2)
    expected = trainer.policy.log_prob(faulty.obs[:, bad].reshape(64, -1), faulty.actions[:, bad].reshape(64))
    assert torch.allclose(faulty.logp[:, bad].reshape(64), expected, atol=1e-6)


def test_reward_delay_keeps_every_episodes_return_and_moves_its_rewards_later():
    _, clean = _round()
    trainer, faulty = _round(["reward-delay:envs=1,lag=3"])
    bad = _broken(trainer)
    _same_outside(clean, faulty, bad, names=("obs", "actions", "logp", "values", "terminated", "truncated"))
    env = int(np.flatnonzero(bad)[0])
    episodes, rewards, clean_rewards = faulty.episode_ids[:, env], faulty.rewards[:, env], clean.rewards[:, env]
    dones = faulty.dones[:, env]
    for episode in episodes.unique():
        steps = episodes == episode
        if dones[steps].any():  # a complete episode: the same return
            assert float(rewards[steps].sum()) == pytest.approx(float(clean_rewards[steps].sum()))
        first = int(steps.nonzero()[0])
        if first == 0 or episodes[first - 1] != episode:  # its first three rewards are owed
            assert (rewards[first:first + 3][~dones[first:first + 3]] == 0).all()
    assert not torch.equal(rewards, clean_rewards)


@pytest.mark.parametrize("mode", ["truncation-as-termination", "termination-as-truncation"])
def test_done_flags_move_ends_between_terminated_and_truncated_and_nothing_else(mode):
    env_id = "CartPole-v1" if mode == "termination-as-truncation" else "FrozenLake-v1"
    _, clean = _round(env=env_id)
    trainer, faulty = _round([f"done-flag:envs=1,mode={mode}"], env=env_id)
    bad = _broken(trainer)
    _same_outside(clean, faulty, bad, names=("obs", "actions", "logp", "values", "rewards"))
    assert torch.equal(clean.dones, faulty.dones)
    moved_from, moved_to = ("truncated", "terminated") if mode == "truncation-as-termination" else \
        ("terminated", "truncated")
    assert not getattr(faulty, moved_from)[:, bad].any()
    assert torch.equal(getattr(faulty, moved_to)[:, bad], clean.dones[:, bad])


def test_the_truncations_check_is_each_ends_type_and_sets_apart_a_worker_that_bootstraps_its_falls():
    """CartPole's early episodes all end by a fall: the share of ends reported as truncations is 1 for
    the termination-as-truncation worker and 0 for the others; records that end nothing are NaN."""
    trainer, faulty = _round(["done-flag:envs=1,mode=termination-as-truncation"])
    scores = consistency_scores(trainer.policy, faulty, 2)["truncations"].reshape(faulty.n_envs, -1)
    ends = faulty.dones.T.numpy().astype(bool)
    assert np.isnan(scores[~ends]).all() and ends.any(axis=1).all()
    bad = int(np.flatnonzero(trainer.corruptor.broken_envs)[0])
    shares = np.array([np.nanmean(row) for row in scores])
    assert shares[bad] == 1.0 and (np.delete(shares, bad) == 0.0).all()


def test_obs_bug_scale_swap_and_lag_change_the_logged_observations_as_stated():
    _, clean = _round()
    for mode in ("scale", "swap"):
        trainer, faulty = _round([f"obs-bug:envs=1,mode={mode}"])
        bad = _broken(trainer)
        _same_outside(clean, faulty, bad)
        env = int(np.flatnonzero(bad)[0])
        first = faulty.obs[0, env]  # the first observation is the same state, misprocessed
        if mode == "scale":
            assert torch.allclose(first[0], 10 * clean.obs[0, env, 0]) and torch.equal(first[1:], clean.obs[0, env, 1:])
        else:
            assert torch.equal(first[:2], clean.obs[0, env, [1, 0]]) and torch.equal(first[2:], clean.obs[0, env, 2:])
    trainer, faulty = _round(["obs-bug:envs=1,mode=lag"])
    bad = _broken(trainer)
    _same_outside(clean, faulty, bad)
    env = int(np.flatnonzero(bad)[0])
    # the worker acts on the previous observation: the env moves on; each logged observation is the
    # one the env gave a step earlier (its own at an episode's first step)
    assert torch.equal(faulty.obs[0, env], faulty.obs[1, env]) or faulty.dones[0, env]
    episodes = faulty.episode_ids[:, env]
    for t in range(2, 64):
        if episodes[t] == episodes[t - 1] == episodes[t - 2]:
            assert not torch.equal(faulty.obs[t, env], faulty.obs[t - 1, env])


def test_logp_mismatch_samples_hotter_and_logs_the_trainers_log_prob():
    _, clean = _round()
    trainer, faulty = _round(["logp-mismatch:envs=1,temperature=50"])
    bad = _broken(trainer)
    _same_outside(clean, faulty, bad)
    env = int(np.flatnonzero(bad)[0])
    expected = trainer.policy.log_prob(faulty.obs[:, env], faulty.actions[:, env])
    assert torch.allclose(faulty.logp[:, env], expected, atol=1e-6) and (faulty.rewards == 1).all()


def test_the_policy_and_observation_checks_equal_a_brute_force_recomputation():
    trainer, buffer = _round(["obs-bug:envs=1,mode=scale"])
    buffer.compute_advantages(0.99, 0.95)
    scores = consistency_scores(trainer.policy, buffer, 2)
    obs, actions = buffer.flat("obs"), buffer.flat("actions")
    for i in range(0, len(buffer), 37):
        with torch.no_grad():
            logits = trainer.policy.action_head(trainer.policy.actor(obs[i:i + 1]))[0]
            logp = torch.log_softmax(logits, -1)
            entropy = -(logp.exp() * logp).sum()
        gap = abs(float(buffer.flat("logp")[i]) - float(logp[actions[i]]))
        assert scores["logp-gap"][i] == pytest.approx(gap if gap > 1e-3 else 0.0, abs=1e-6)
        assert scores["action-surprise"][i] == pytest.approx(float(-logp[actions[i]] - entropy), abs=1e-5)
    x = obs.double().numpy()
    centre = np.median(x, axis=0)
    scale = 1.4826 * np.median(np.abs(x - centre), axis=0)
    assert scores["obs-shift"] == pytest.approx(np.log1p(((x - centre) / scale) ** 2).mean(axis=1))


def _confident_round(corrupt=(), env="CartPole-v1", sharpen=300.0, n_steps=512):
    """Round 0 with the policy's action head scaled up: a policy that prefers some actions strongly,
    where sampling hotter than logged changes which actions are taken."""
    config = PPOConfig(env=env, n_envs=4, n_steps=n_steps, batch_size=64, total_timesteps=4 * n_steps,
                       eval_episodes=0, corrupt=tuple(corrupt), seed=3, progress=False)
    trainer = PPO(config, run_dir=False)
    with torch.no_grad():
        trainer.policy.action_head.weight.mul_(sharpen)
    return trainer, trainer.collect()


def test_action_calibration_is_the_randomised_pit_of_the_logged_action():
    """U - 1/2 with U in [P(a' ranks before a), P(a' ranks before a) + pi(a|s)], the actions ranked by
    probability, most likely first: brute force from the logits."""
    trainer, buffer = _confident_round(sharpen=30.0)
    pit = policy_checks(trainer.policy, buffer, 2)["action-calibration"] + 0.5
    obs, actions = buffer.flat("obs"), buffer.flat("actions")
    with torch.no_grad():
        probs = torch.softmax(trainer.policy.action_head(trainer.policy.actor(obs)).double(), -1).numpy()
    for i in range(0, len(buffer), 29):
        a = int(actions[i])
        before = sum(probs[i, b] for b in range(2) if probs[i, b] > probs[i, a] or (probs[i, b] == probs[i, a] and b < a))
        assert before - 1e-9 <= pit[i] <= before + probs[i, a] + 1e-9


@pytest.mark.parametrize("env", ["CartPole-v1", "Pendulum-v1"])
def test_action_calibration_is_uniform_for_a_worker_that_samples_what_it_logs(env):
    """The null the calibration test assumes, on a confident policy (Discrete) and a Gaussian one:
    U uniform on (0, 1) over 2048 records, and every env's z = sum (U - 1/2) / sqrt(n / 12) modest."""
    trainer, buffer = _confident_round(env=env)
    u = policy_checks(trainer.policy, buffer, 2 if env == "CartPole-v1" else None)["action-calibration"]
    assert scipy_stats.kstest(u + 0.5, "uniform").pvalue > 1e-3
    per_env = u.reshape(buffer.n_envs, -1)
    p = calibration_test(per_env.sum(axis=1), np.full(buffer.n_envs, per_env.shape[1]), 1 / 12)
    assert p.min() > 1e-3


def test_the_calibration_test_flags_a_worker_that_samples_hotter_than_it_logs():
    """logp-mismatch at temperature 3 on a confident policy: the log-prob check passes (the logged
    log-prob is the policy's), the calibration test flags the worker alone."""
    trainer, buffer = _confident_round(["logp-mismatch:envs=1,temperature=3"], n_steps=2048)
    scores = policy_checks(trainer.policy, buffer, 2)
    assert (scores["logp-gap"] == 0).all()
    per_env = scores["action-calibration"].reshape(buffer.n_envs, -1)
    p = calibration_test(per_env.sum(axis=1), np.full(buffer.n_envs, per_env.shape[1]), 1 / 12)
    bad = int(np.flatnonzero(trainer.corruptor.broken_envs)[0])
    assert p[bad] < 1e-6 and np.delete(p, bad).min() > 1e-3


def test_the_calibration_test_runs_at_its_share_of_alpha():
    """With calibration p-values for a family, its adjusted p = min(p_maxT / 0.9, Holm(p_cal) / 0.1)
    and every other family's is p_maxT / 0.9; z = sum / sqrt(n variance), two-sided."""
    assert calibration_test(np.array([3.0, -3.0, 0.0]), np.array([12, 12, 0]), 1 / 12) == pytest.approx(
        [2 * scipy_stats.norm.sf(3.0), 2 * scipy_stats.norm.sf(3.0), 1.0])
    h = np.random.default_rng(2).normal(size=(5, 7))
    cal = np.array([0.5, 0.5, 1e-5, 0.5, 0.5, 0.5, 0.5])
    out = verdict({"dynamics": h, "action-calibration": h[:, ::-1]}, range(7), calibrated={"action-calibration": cal})
    _, _, adjusted = maxt_test({"dynamics": h, "action-calibration": h[:, ::-1]})
    assert out["flagged"].tolist() == [s == 2 for s in range(7)] and out.loc[0, "test"] == "exact+calibration"
    assert out.loc[2, "p_adjusted_min"] == pytest.approx(min(7 * 1e-5 / 0.1, adjusted[2].min() / 0.9))
    assert out.loc[2, "signature"] == "action-calibration"


def test_the_folds_split_the_episodes_in_halves_when_the_ids_advance_with_the_sources():
    """Every worker's first episode running the whole round (ids 0..E-1, as in Acrobot's early
    rounds, where every episode hits the time limit at once): half of the episodes in each fold,
    each episode whole in one, so the model checks score the round instead of leaving it NaN."""
    _, buffer = _round()
    buffer.episode_ids = torch.arange(buffer.n_envs).repeat(buffer.n_steps, 1)  # one episode per env
    fold = _folds(buffer)
    source = buffer.record_ids()[:, 1].numpy()
    per_episode = [set(fold[source == e].tolist()) for e in range(buffer.n_envs)]
    assert all(len(f) == 1 for f in per_episode) and sum(f == {0} for f in per_episode) == buffer.n_envs // 2
    buffer.compute_advantages(0.99, 0.95)
    assert not np.isnan(model_checks(buffer, 2)["dynamics"]).all()


@pytest.mark.parametrize("targets", [None, 3])
def test_the_ridge_from_each_actions_moments_is_the_direct_ridge(targets):
    """_moment_ridge_weights (phi's ridge without phi, for image observations) gives the direct
    fit's weights and predictions: constant observation features, an action never taken, integer
    and large-mean features, one target or several."""
    from rlinfluence.consistency import _moment_ridge_weights, _Phi, _ridge_weights, _Split

    rng = np.random.default_rng(0 if targets is None else 1)
    for trial in range(12):
        n, d, n_actions = int(rng.integers(30, 300)), int(rng.integers(2, 10)), int(rng.integers(2, 6))
        obs = rng.integers(0, 4, size=(n, d)).astype(float) * (0.37 if trial % 2 else 1.0)
        obs[:, 0] = 2.0
        obs[:, 1] += 10.0
        actions = rng.integers(0, n_actions - (trial % 3 == 0), n).astype(float)
        y = rng.normal(size=n if targets is None else (n, targets))
        train = rng.random(n) < 0.6
        split = _Split(_Phi(obs, actions, n_actions), train, ~train)
        w, intercept = _ridge_weights(split.x_train, y[train])
        w_moments, intercept_moments = _moment_ridge_weights(obs, actions, n_actions, split, y)
        np.testing.assert_allclose(w_moments, w, rtol=1e-8, atol=1e-10 * np.abs(w).max())
        np.testing.assert_allclose(split.x_test @ w_moments + intercept_moments, split.x_test @ w + intercept,
                                   rtol=1e-9, atol=1e-10)


def test_a_wide_phis_fold_moments_are_phis_own_to_the_bit():
    """_Phi.column_moments on [o, e_a, o (x) e_a] wider than MOMENT_RIDGE_FEATURES, block by block
    without phi, equals the mean and standard deviation of phi's rows bit for bit (negative
    observations, an action never taken), and builds no phi."""
    from rlinfluence.consistency import MOMENT_RIDGE_FEATURES, _Phi

    rng = np.random.default_rng(3)
    n, d, n_actions = 500, 60, 6
    obs = rng.normal(size=(n, d)) * rng.integers(0, 3, size=(n, d))
    actions = rng.integers(0, n_actions - 1, n).astype(float)
    phi = _Phi(obs, actions, n_actions)
    assert phi.width == d * (1 + n_actions) + n_actions > MOMENT_RIDGE_FEATURES and phi.blockwise
    rows = rng.random(n) < 0.5
    mean, std = phi.column_moments(rows)
    assert "matrix" not in phi.__dict__
    full = _features(obs, actions, n_actions)[rows]
    assert np.array_equal(mean, full.mean(axis=0)) and np.array_equal(std, full.std(axis=0))


def test_the_dynamics_check_is_cross_fitted_on_the_other_folds_episodes():
    _, buffer = _round()
    buffer.compute_advantages(0.99, 0.95)
    checks = model_checks(buffer, 2)
    dynamics = checks["dynamics"]
    obs = buffer.flat("obs").double().numpy()
    step, done = buffer.record_ids()[:, 2].numpy(), buffer.flatten(buffer.dones).numpy()
    rows = (step < buffer.n_steps - 1) & ~done
    delta = np.roll(obs, -1, axis=0) - obs
    y = (delta - delta[rows].mean(axis=0)) / delta[rows].std(axis=0)
    phi, fold = _features(obs, buffer.flat("actions").double().numpy(), 2), _folds(buffer)
    train, test = rows & (fold == 1), rows & (fold == 0)
    scaler = StandardScaler().fit(phi[train])
    model = Ridge(alpha=1.0).fit(scaler.transform(phi[train]), y[train])
    fitted = model.predict(scaler.transform(phi[test]))
    assert dynamics[test] == pytest.approx(((fitted - y[test]) ** 2).mean(axis=1))
    assert np.isnan(dynamics[~rows]).all()
    # action-fit: the error with the logged action minus its mean over both actions, same model
    alternatives = [((model.predict(scaler.transform(_features(obs, np.full(len(obs), a), 2)[test])) - y[test]) ** 2)
                    .mean(axis=1) for a in (0.0, 1.0)]
    assert checks["action-fit"][test] == pytest.approx(dynamics[test] - np.mean(alternatives, axis=0))
    # lag-fit: that mean minus the error with the previous record's action, where the episode had one
    actions = buffer.flat("actions").double().numpy()
    episode = buffer.flat("episode_ids").numpy()
    previous = (step > 0) & (episode == np.roll(episode, 1))
    with_previous = model.predict(scaler.transform(_features(obs, np.roll(actions, 1), 2)[test]))
    expected = np.mean(alternatives, axis=0) - ((with_previous - y[test]) ** 2).mean(axis=1)
    assert checks["lag-fit"][test & previous] == pytest.approx(expected[previous[test]])
    assert np.isnan(checks["lag-fit"][~previous]).all()


def test_lag_fit_sets_apart_a_worker_whose_observations_run_a_step_behind():
    """obs-bug lag: the previous record's action explains the logged transitions, so the worker's
    lag-fit stands far above the others'; a miswired actuator's does not."""
    for mode, far in (("obs-bug:envs=1,mode=lag", True), ("action-mismatch:envs=1,mode=actuator", False)):
        trainer, buffer = _round([mode], seed=4)
        lag = model_checks(buffer, 2)["lag-fit"].reshape(buffer.n_envs, -1)
        means = np.array([np.nanmean(row) for row in lag])
        bad = int(np.flatnonzero(trainer.corruptor.broken_envs)[0])
        others = np.delete(means, bad)
        assert ((means[bad] - others.mean()) / others.std(ddof=1) > 5) == far, (mode, means)


@pytest.mark.parametrize("two_sided", [False, True])
def test_the_exact_permutation_test_equals_enumerating_every_labelling(two_sided):
    h = np.random.default_rng(2).normal(size=(4, 3)) + np.array([0.0, 1.0, -1.0])
    statistic, p = source_test(h, two_sided=two_sided)
    centred = h - h.mean(axis=1, keepdims=True)
    null = np.array([np.mean([centred[k, i] for k, i in enumerate(labels)])
                     for labels in itertools.product(range(3), repeat=4)])
    for t, p_s in zip(statistic, p, strict=True):
        expected = (np.abs(null) >= abs(t) - 1e-12).mean() if two_sided else (null >= t - 1e-12).mean()
        assert p_s == pytest.approx(expected)


def test_the_outlier_test_is_the_t_statistic_of_a_source_against_the_others():
    h = np.random.default_rng(3).normal(size=(5, 6))
    t, p = outlier_test(h)
    means = h.mean(axis=0)
    others = np.delete(means, 2)
    expected = (means[2] - others.mean()) / (others.std(ddof=1) * np.sqrt(1 + 1 / 5))
    assert t[2] == pytest.approx(expected) and p[2] == pytest.approx(scipy_stats.t.sf(expected, 4))
    _, p_two = outlier_test(h, two_sided=True)
    assert p_two[2] == pytest.approx(2 * scipy_stats.t.sf(abs(expected), 4))
    # reference means that are all equal are no yardstick
    flat = np.zeros((3, 5))
    flat[:, 0] = 1.0
    assert outlier_test(flat)[1][0] == 1.0


@pytest.mark.parametrize("skewed", [False, True])
def test_the_outlier_test_holds_its_level_when_sources_are_alike(skewed):
    """7 exchangeable sources whose records are correlated within a source and heavy-tailed: after
    normal scores, P(p < 0.05) and P(p < 0.01) stay at or below their level, and the test is not
    idle (4000 simulated audits)."""
    rng = np.random.default_rng(4)
    p_values = []
    for _ in range(4000):
        rounds, sources = np.repeat(np.arange(3), 7 * 40), np.tile(np.repeat(np.arange(7), 40), 3)
        shared = rng.normal(size=(3, 7))[rounds, sources]  # an episode's common part, per round and source
        noise = rng.lognormal(size=len(rounds)) if skewed else rng.normal(size=len(rounds))
        z = normal_scores(rounds, shared + noise)
        h = pd.DataFrame({"r": rounds, "s": sources, "z": z}).groupby(["r", "s"])["z"].mean().unstack().to_numpy()
        p_values.append(outlier_test(h)[1][0])
    p_values = np.array(p_values)
    assert 0.025 < (p_values < 0.05).mean() < 0.062 and (p_values < 0.01).mean() < 0.016


def test_the_episode_floor_is_the_standard_error_from_the_other_sources_episodes():
    """floor_s = sqrt(var of the other sources' episode means x mean_j 1/n_j); it replaces a
    between-source spread that is smaller (sources whose means happen to agree)."""
    rng = np.random.default_rng(1)
    sources = np.repeat(np.arange(5), 40)
    episodes = np.tile(np.repeat(np.arange(4), 10), 5)
    z = rng.normal(size=len(sources)) + np.repeat(rng.normal(size=20), 10)  # episodes differ
    floor = episode_floor(sources, episodes, z, range(5))
    means = pd.DataFrame({"s": sources, "e": episodes, "z": z}).groupby(["s", "e"])["z"].mean()
    others = means[means.index.get_level_values("s") != 3]
    assert floor[3] == pytest.approx(np.sqrt(others.var(ddof=1) / 4))
    h = np.array([[0.0, 0.0, 0.0, 0.0, 1.0]])  # four sources that agree exactly, one above them
    assert outlier_test(h)[1][4] == 1.0  # no spread, no yardstick
    t, p = outlier_test(h, floor=floor)
    assert t[4] == pytest.approx(1.0 / (floor[4] * np.sqrt(1 + 1 / 4))) and p[4] < 1.0


def test_normal_scores_rank_within_rounds_so_one_extreme_record_counts_as_the_largest():
    rounds = np.array([0, 0, 0, 1, 1, 1, 1])
    values = np.array([1.0, np.inf, -3.0, 5.0, np.nan, 5.0, 7.0])
    z = normal_scores(rounds, values)
    assert z[:3] == pytest.approx(scipy_stats.norm.ppf([1.5 / 3, 2.5 / 3, 0.5 / 3]))
    assert np.isnan(z[4]) and z[3] == z[5] == pytest.approx(scipy_stats.norm.ppf(1 / 3))


def test_maxt_equals_enumerating_every_labelling_of_the_rounds():
    """3 sources x 3 rounds, a one-sided and a two-sided family: every marginal p and the largest
    hypothesis's adjusted p equal their shares over all 6^3 within-round labellings (Monte Carlo
    error aside), and every adjusted p lies at or above its marginal p."""
    rng = np.random.default_rng(6)
    means = {"a": rng.normal(size=(3, 3)) + np.array([0.0, 1.0, -0.5]), "b": rng.normal(size=(3, 3))}
    observed, p, adjusted = maxt_test(means, two_sided=("b",), permutations=40_000)
    centred = means["a"] - means["a"].mean(axis=1, keepdims=True)
    assert observed[:, 0] == pytest.approx(centred.sum(axis=0) / np.sqrt((centred ** 2).mean(axis=1).sum()))
    assert p[:, 0] == pytest.approx(source_test(means["a"])[1], abs=0.01)
    assert p[:, 1] == pytest.approx(source_test(means["b"], two_sided=True)[1], abs=0.01)
    labellings = list(itertools.product(itertools.permutations(range(3)), repeat=3))
    largest = []
    for labels in labellings:
        permuted = {f: np.stack([h[k, list(labels[k])] for k in range(3)]) for f, h in means.items()}
        largest.append(maxt_test(permuted, two_sided=("b",), permutations=1)[0].max())
    top = observed.max()
    assert adjusted.min() == pytest.approx(np.mean(np.array(largest) >= top - 1e-9), abs=0.01)
    assert (adjusted >= p - 1e-12).all()


def test_maxt_drawn_in_blocks_equals_one_draw(monkeypatch):
    """The null is drawn in blocks to bound memory for many sources: the same p-values as one draw."""
    import rlinfluence.sources as sources_module

    rng = np.random.default_rng(0)
    means = {f: rng.normal(size=(5, 9)) + (f == "b") * np.eye(9)[2] for f in "abcd"}
    whole = maxt_test(means, {"b"}, 3000)
    monkeypatch.setattr(sources_module, "MAXT_BLOCK", 9 * 4 * 7)  # blocks of 7 draws
    for one, blocked in zip(whole, maxt_test(means, {"b"}, 3000), strict=True):
        np.testing.assert_array_equal(one, blocked)


def test_maxt_stopped_where_it_can_no_longer_flag_flags_what_the_whole_test_flags():
    """With stop_above, maxT either runs every draw (the whole test's p-values, to the bit) or stops
    early, and then no p_adjusted of the whole test is at or below stop_above: the same flags; on
    sources that do not differ it stops, on one far out it does not."""
    rng = np.random.default_rng(3)
    stopped = 0
    for trial in range(40):
        shift = (trial % 3) * 1.5  # none, a modest and a large departure of source 2 in family b
        means = {f: rng.normal(size=(6, 8)) + (f == "b") * shift * np.eye(8)[2] for f in "abc"}
        whole = maxt_test(means, {"c"}, 2000)
        early = maxt_test(means, {"c"}, 2000, stop_above=0.01)
        if (early[2] == 1).all() and not (whole[2] == 1).all():
            stopped += 1
            assert (whole[2] > 0.01).all(), trial
        else:
            for one, other in zip(whole, early, strict=True):
                np.testing.assert_array_equal(one, other)
        if shift == 3.0:
            assert early[2][2, 1] <= 0.01, trial
    assert stopped >= 15  # of the 27 without a large departure


def test_the_verdicts_flags_alone_are_the_whole_verdicts_flags():
    """verdict_p_values(flags_at=alpha), as the quarantine filter calls it (the outlier and calibration
    tests first, maxT stopped once it can flag no other source), flags exactly the sources the whole
    computation flags: sources far out in one family, in several, under the calibration test only,
    none."""
    from rlinfluence.sources import verdict_p_values

    rng = np.random.default_rng(4)
    families = ["a", "b", "c"]
    for trial in range(30):
        shift = np.zeros(8)
        shift[rng.choice(8, size=int(rng.integers(0, 3)), replace=False)] = rng.choice([0.0, 1.0, 3.0, 6.0])
        means = {f: rng.normal(size=(6, 8)) + (f != "c") * shift for f in families}
        outlier_means = {f: rng.normal(size=(6, 8)) + (f == "a") * shift for f in families}
        floors = {f: np.full(8, 0.1) for f in families}
        calibrated = {"c": np.where(rng.random(8) < 0.1, 1e-6, rng.random(8))}
        whole = verdict_p_values(means, {"c"}, outlier_means, floors, 2000, calibrated)[1]
        flags = verdict_p_values(means, {"c"}, outlier_means, floors, 2000, calibrated, flags_at=0.01)[1]
        np.testing.assert_array_equal((flags < 0.01).any(axis=1), (whole < 0.01).any(axis=1), err_msg=str(trial))


def test_maxt_does_not_pay_for_families_that_move_together():
    """The same family tested ten times over: Holm would multiply its p-values by 10, maxT's
    adjusted p-values are those of testing it once."""
    h = np.random.default_rng(7).normal(size=(5, 7))
    h[:, 2] += 1.5
    once = maxt_test({"a": h})[2]
    ten = maxt_test({f"copy{i}": h for i in range(10)})[2]
    assert ten[:, 0] == pytest.approx(once[:, 0]) and (ten == ten[:, :1]).all()


def test_maxt_holds_its_family_wise_level_when_sources_are_alike():
    """7 exchangeable sources, 6 families correlated with each other and across the records of a
    source and round: P(some adjusted p < alpha) stays within 3 standard errors of alpha or below
    (2000 simulated audits), and the test is not idle."""
    rng = np.random.default_rng(8)
    smallest = []
    for _ in range(2000):
        shared = rng.normal(size=(4, 7, 1))
        means = {f"f{j}": (shared + 0.7 * rng.standard_t(3, size=(4, 7, 1)))[..., 0] + rng.normal(size=(4, 7))
                 for j in range(6)}
        smallest.append(maxt_test(means, two_sided=("f0",), permutations=200)[2].min())
    smallest = np.array(smallest)
    for alpha in (0.1, 0.05):
        assert (smallest < alpha).mean() < alpha + 3 * np.sqrt(alpha * (1 - alpha) / len(smallest))
    assert (smallest < 0.2).mean() > 0.12


def test_the_verdict_weighs_the_exact_test_and_the_outlier_test():
    """p = min(p_exact / 0.8, p_outlier / 0.2): a source far above the others in two rounds is
    flagged by the outlier test (the exact test cannot go below about 7^-1); without the outlier
    means (too few episodes) it is not."""
    h = np.random.default_rng(5).normal(scale=0.05, size=(2, 7))
    h[:, 3] += 3.0
    both = verdict({"dynamics": h}, range(7), outlier_means={"dynamics": h})
    _, exact, exact_adjusted = maxt_test({"dynamics": h})
    assert both.loc[3, "p_dynamics"] == pytest.approx(min(exact[3, 0] / 0.8, outlier_test(h)[1][3] / 0.2))
    assert both["flagged"].tolist() == [s == 3 for s in range(7)] and both.loc[0, "test"] == "exact+outlier"
    alone = verdict({"dynamics": h}, range(7))
    assert not alone["flagged"].any() and alone.loc[3, "p_dynamics"] == pytest.approx(exact[3, 0])
    assert alone.loc[3, "p_adjusted_min"] == pytest.approx(exact_adjusted[3, 0]) and exact_adjusted[3, 0] > 0.1


def test_an_audit_that_could_not_flag_anything_says_so():
    """A source above the others in every round: by the exact test alone, 7 sources are flagged
    from round 4 at alpha 0.01 (smallest adjusted p about 7^-3), not at round 3 (7^-2); the note
    says so at 3, and says nothing where a flag was reachable."""
    from rlinfluence.analysis.audit import unreachable_note
    from rlinfluence.sources import rounds_needed

    assert rounds_needed(7, 0.01) == 4 and rounds_needed(7, 0.01, share=0.8) == 4 and rounds_needed(4, 0.01) == 5
    h = np.random.default_rng(0).normal(size=(4, 7))
    h[:, 5] += 10.0
    assert verdict({"dynamics": h}, range(7))["flagged"].tolist() == [s == 5 for s in range(7)]
    sources = verdict({"dynamics": h[:3], "obs-shift": h[:3]}, range(7))
    assert not sources["flagged"].any() and sources["p_adjusted_min"].min() > 0.01
    assert "needs 4 rounds (this audit has 3)" in unreachable_note(sources, 0.01)
    assert unreachable_note(verdict({"dynamics": h[:3]}, range(7), outlier_means={"dynamics": h[:3]}), 0.01) == ""


def test_a_signature_names_a_class_only_where_the_evidence_separates_it():
    # one class explains every flagging family: named
    assert reading(["logp-gap"])[0] == "stale-policy"
    assert reading(["dtv", "dynamics", "action-surprise"], {"action-fit": 0.01})[0] == "action"  # logged, not executed
    assert reading(["action-calibration", "action-fit"])[0] == "action"
    assert reading(["truncations"], directions={"truncations": 0.4})[0] == "done-flags"  # more time-limit ends
    assert reading(["reward-recheck"])[0] == "reward"
    # another action explains the transitions and the previous one does not: an action, or observations
    # that do not follow the state (rounded ones move action-fit too: version 3 names neither)
    assert reading(["dynamics", "action-fit"], {"lag-fit": 0.3})[::2] == ("undetermined", "observation;action")
    # transitions off and no action explains them: not an action, but observation or env undetermined
    fault, text, candidates = reading(["obs-shift", "dynamics"], {"action-fit": 0.4, "lag-fit": 0.6})
    assert (fault, candidates) == ("undetermined", "observation;environment")
    assert "do not follow from its logged (state, action)" in text and "tells:" in text
    # a lag: an observation lag and an actuator lag fit the same evidence
    fault, text, candidates = reading(["dynamics", "action-fit", "lag-fit"])
    assert (fault, candidates) == ("undetermined", "observation;action") and "actuator lag" in text
    assert reading(["dynamics", "action-fit"], {"lag-fit": 0.001})[2] == "observation;action"
    # unlikely actions alone: a sampler or logged actions that were not executed
    assert reading(["action-surprise"])[2] == "stale-policy;action;sampling"
    assert reading(["action-calibration"], {"logp-gap": 0.9})[0] == "undetermined"
    # fewer time-limit ends, a reward model, a termination model: a worker that behaves otherwise fits too
    assert reading(["truncations"], directions={"truncations": -0.3})[0] == "undetermined"
    assert reading(["reward-model", "reward-extremes"])[2] == "observation;action;environment;reward"
    assert "done-flags" in reading(["termination", "td-error"])[2].split(";")
    # never a class whose family is not in the signature or its support
    for signature in (["obs-shift"], ["reward-extremes"], ["termination"], ["dynamics"]):
        fault, _, candidates = reading(signature)
        assert fault == "undetermined" and len(candidates.split(";")) >= 2
    # families that no one class explains: the most specific ones' classes, undetermined
    fault, _, candidates = reading(["logp-gap", "dynamics"])
    assert (fault, candidates) == ("undetermined", "stale-policy")
    # a rule that would leave nothing: undetermined with what was left before it
    assert reading(["dynamics", "action-surprise"], {"action-fit": 0.5})[::2] == ("undetermined", "action")
    # gradient families only: no consistency check flags it, so any class fits (version 2 claimed
    # self-consistent data, "unexplained", where a scaled reward or a flaky actuator was the cause)
    fault, text, candidates = reading(["influence", "dtv"])
    assert fault == "undetermined" and {"reward", "action", "sampling"} <= set(candidates.split(";"))
    assert "unexplained" not in candidates and "reward" in text
    assert reading([]) == ("", "", "")
    assert set(KIND_CLASS.values()) <= set(FAULT_CLASSES)


def test_the_verdict_records_its_version_and_reads_the_side_of_a_two_sided_family():
    h = np.zeros((6, 7))
    h[:, 2] = 0.9  # one source ends its episodes by the time limit far more often than the others
    h += np.random.default_rng(1).normal(scale=0.01, size=h.shape)
    sources = verdict({"truncations": h}, range(7), two_sided=["truncations"])
    row = sources.set_index("source").loc[2]
    assert row["flagged"] and row["fault_class"] == "done-flags" and row["candidates"] == "done-flags"
    assert (sources["verdict_version"] == VERDICT_VERSION).all()
    h[:, 2] = -0.9  # far less often: a worker that fails sooner fits as well
    assert verdict({"truncations": h}, range(7), two_sided=["truncations"]).loc[2, "fault_class"] == "undetermined"


def _trained(tmp_path, corrupt, seed, filter="none", rounds=7):
    config = PPOConfig(env="CartPole-v1", n_envs=8, n_steps=64, batch_size=64, total_timesteps=rounds * 512, seed=seed,
                       eval_episodes=0, corrupt=tuple(corrupt), save_buffers=True, tracin=True, filter=filter,
                       run_root=str(tmp_path), method=f"s{seed}{filter}{len(corrupt)}", progress=False,
                       tensorboard=False)
    return PPO(config).learn()


def test_the_verdict_flags_an_action_mismatch_worker_and_nothing_on_a_clean_run(tmp_path):
    broken = _trained(tmp_path, ["action-mismatch:envs=1,mode=log"], 1)
    bad = int(np.flatnonzero(broken.corruptor.broken_envs)[0])
    sources, _, _ = audit_run(broken.run.path)
    assert sources["flagged"].tolist() == [s == bad for s in range(8)]
    row = sources.set_index("source").loc[bad]
    assert set(row["signature"].split(";")) & {"dynamics", "action-fit", "action-surprise"}
    assert row["fault_class"] == "action" or "action" in row["candidates"].split(";")
    clean = _trained(tmp_path, [], 2)
    sources, _, _ = audit_run(clean.run.path)
    assert not sources["flagged"].any()


def test_quarantine_drops_exactly_the_flagged_sources_and_nothing_on_a_clean_run(tmp_path):
    faulty = _trained(tmp_path, ["action-mismatch:envs=1,mode=log"], 1, filter="quarantine")
    bad = int(np.flatnonzero(faulty.corruptor.broken_envs)[0])
    rows = pd.read_csv(faulty.run.path / "metrics.csv", dtype={"quarantined_sources": str}, keep_default_na=False)
    quarantined_rounds = 0
    for row in rows.itertuples():
        sources = [int(s) for s in str(row.quarantined_sources).split()] if row.quarantined else []
        saved = load_round(faulty.run.path, int(row.round))
        keep = saved.keep.numpy()
        env = saved.buffer.record_ids()[:, 1].numpy()
        assert (keep == ~np.isin(env, sources)).all()
        quarantined_rounds += bad in sources
        assert set(sources) <= {bad}
    assert quarantined_rounds >= 1
    clean = _trained(tmp_path, [], 4, filter="quarantine")
    rows = pd.read_csv(clean.run.path / "metrics.csv")
    assert (rows["quarantined"] == 0).all() and (rows["kept_fraction"] == 1).all()


@pytest.mark.parametrize(("spec", "message"), [
    ("action-mismatch:envs=1,mode=sideways", "mode must be one of actuator, log"),
    ("obs-bug:envs=1,mode=swap", "has a Discrete (one-hot) observation"),
    ("done-flag:envs=4,mode=truncation-as-termination", "envs must be < the 4 envs"),
    ("reward-delay:envs=1,lag=0", "lag must be >= 1"),
    ("logp-mismatch:envs=1,temperature=1", "temperature must be in [0.01, 100] and not 1"),
    ("logp-mismatch:envs=1,temperature=1e-300", "temperature must be in [0.01, 100] and not 1"),
    ("obs-bug:envs=1,mode=scale,mode=lag", "mode is given twice"),
    ("trigger:frac=0.5,bonus=0", "bonus must be finite and not 0"),
])
def test_a_bad_fault_spec_is_one_error_line_and_writes_nothing(tmp_path, capsys, spec, message):
    args = ["train", "--env", "FrozenLake-v1", "--n-envs", "4", "--run-root", str(tmp_path / "runs"), "--corrupt", spec]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_kind_given_twice_is_refused(tmp_path, capsys):
    args = ["train", "--env", "FrozenLake-v1", "--n-envs", "4", "--run-root", str(tmp_path / "runs"),
            "--corrupt", "reward-flip:envs=1", "reward-flip:envs=2"]
    assert cli.main(args) == 2
    assert "reward-flip is given 2 times" in capsys.readouterr().err


def test_the_sb3_quarantine_callback_drops_exactly_the_flagged_env_and_nothing_on_clean_envs(monkeypatch):
    gym = pytest.importorskip("gymnasium")
    sb3 = pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.vec_env import DummyVecEnv

    from rlinfluence.integrations.sb3 import FilteredRolloutBuffer
    from rlinfluence.integrations.sb3_audit import QuarantineCallback

    class Scaled(gym.ObservationWrapper):  # an observation bug in one worker: the cart position x10
        def observation(self, observation):
            return observation * np.array([10, 1, 1, 1], dtype=np.float32)

    masks = []
    original = FilteredRolloutBuffer.set_keep_mask

    def record(buffer, keep):
        masks.append(np.asarray(keep).copy())
        original(buffer, keep)

    monkeypatch.setattr(FilteredRolloutBuffer, "set_keep_mask", record)

    def make(i, broken):
        return lambda: Scaled(gym.make("CartPole-v1")) if i == broken else gym.make("CartPole-v1")

    env_of = np.repeat(np.arange(8), 64)  # SB3's flat order is env-major
    for broken in (2, None):
        masks.clear()
        model = sb3.PPO("MlpPolicy", DummyVecEnv([make(i, broken) for i in range(8)]), n_steps=64, batch_size=64,
                        n_epochs=2, seed=0, rollout_buffer_class=FilteredRolloutBuffer)
        callback = QuarantineCallback(window=6)
        model.learn(8 * 512, callback=callback)
        for quarantined, keep in zip(callback.history, masks, strict=True):
            assert (keep == ~np.isin(env_of, quarantined)).all()
        if broken is None:
            assert not any(callback.history)
        else:
            assert any(callback.history) and all(set(q) <= {broken} for q in callback.history)
    # 2 untrusted envs: refused when training starts, not by the test in its fifth round
    model = sb3.PPO("MlpPolicy", DummyVecEnv([make(i, None) for i in range(3)]), n_steps=64, batch_size=64,
                    rollout_buffer_class=FilteredRolloutBuffer)
    with pytest.raises(ValueError, match="at least 3 untrusted envs, got 3 - 1"):
        model.learn(192, callback=QuarantineCallback(trusted_envs=1))


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.assign(my_score=t["my_score"].where(t["source"] != "bob", np.nan)), "not finite numbers"),
    (lambda t: t.assign(my_score=t["my_score"].where(t.index != 3, np.inf)), "(first: inf)"),
    (lambda t: pd.concat([t, t.iloc[:1]]), "times or more: each record once"),
    (lambda t: t.assign(source=t["source"].where(t.index != 0, None)), "row(s) without a source id"),
    (lambda t: t.assign(round=0), "round 0 is held by both"),
    (lambda t: t, "hold only gradient families (influence): test them with --gradient-families"),
])
def test_a_written_harm_table_the_test_would_misread_is_one_error_line(tmp_path, capsys, change, message):
    """A NaN source, a single inf, a duplicated row, a missing source id or two files of one round
    would each change the flags silently: refused, naming the file."""
    scores = tmp_path / "run" / "audit" / "scores"
    scores.mkdir(parents=True)
    workers = np.repeat(["ann", "bob", "cyd"], 4)
    for k in range(2):
        table = pd.DataFrame({"round": k, "source": workers, "episode": 0, "step": np.tile(np.arange(4), 3),
                              "trusted": False, "my_score": np.arange(12.0)})
        if "gradient" in message:  # a writer's table of a gradient family alone: version 4 tests it where asked
            table = table.rename(columns={"my_score": "influence"})
        (change(table) if k == 1 else table).to_parquet(scores / f"round_{k:06d}.parquet")
    assert cli.main(["audit", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_quarantine_run_resumes_with_its_window(tmp_path):
    """The filter's window (its records and the episodes' start rounds) is saved with each checkpoint
    (loaded with weights_only) and restored on resume."""
    from rlinfluence import checkpoint

    cut = _trained(tmp_path, ["obs-bug:envs=1,mode=scale"], 5, filter="quarantine", rounds=4)
    resumed = checkpoint.resume(cut.run.path)
    before, after = cut.filter, resumed.filter
    assert before.first_seen and after.first_seen == before.first_seen
    assert sorted(after.records) == sorted(before.records) == [0, 1, 2, 3]
    for k, record in before.records.items():
        for name, tensor in record.items():
            assert torch.equal(after.records[k][name].nan_to_num(7.0), tensor.nan_to_num(7.0)), (k, name)
    resumed.learn(total_timesteps=6 * 512)
    assert sorted(resumed.filter.records) == [0, 1, 2, 3, 4, 5]


def test_the_quarantine_windows_sums_give_the_verdict_of_its_records(tmp_path, monkeypatch):
    """The filter sums each round's units once and adds the window's sums up: the tests' inputs are
    those the verdict computes from the window's records themselves (group means per start round
    and per collected round, episode floors, calibration sums), to float rounding."""
    from rlinfluence.consistency import CALIBRATED, TWO_SIDED
    from rlinfluence.filters import quarantine
    from rlinfluence.sources import (
        calibration_p_values,
        episode_floor,
        group_means,
        verdict_p_values,
    )

    calls = []
    monkeypatch.setattr(quarantine, "verdict_p_values", lambda **tests: calls.append(tests) or verdict_p_values(**tests))
    trainer = _trained(tmp_path, ["reward-flip:envs=1"], 3, filter="quarantine", rounds=9)
    window = trainer.filter
    means, outlier_means, floors, calibrated = (calls[-1][k] for k in ("means", "outlier_means", "floors", "calibrated"))
    records = [window.records[k] for k in sorted(window.records)]
    assert len(records) == window.window and outlier_means is not None
    starts, sources, episodes, z = (torch.cat([r[name] for r in records]).numpy() for name in ("start", "source", "episode", "units"))
    collected = np.concatenate([np.full(len(r["source"]), k) for k, r in enumerate(records)])
    in_window = starts >= min(window.records)
    expected = {"means": group_means(starts[in_window], sources[in_window], z[in_window], range(8))[1],
                "outlier_means": group_means(collected, sources, z, range(8))[1],
                "floors": episode_floor(sources, episodes, z, range(8))}
    for name, got in (("means", means), ("outlier_means", outlier_means), ("floors", floors)):
        np.testing.assert_allclose(np.stack([got[f] for f in window.families]), expected[name], rtol=1e-12, atol=1e-14,
                                   err_msg=name)
    for family, p in calibrated.items():
        j = window.families.index(family)
        np.testing.assert_allclose(p, calibration_p_values(sources, z[:, j], range(8), CALIBRATED[family]), rtol=1e-12)
    from_records = verdict_p_values(dict(zip(window.families, expected["means"], strict=True)), TWO_SIDED,
                                    dict(zip(window.families, expected["outlier_means"], strict=True)),
                                    dict(zip(window.families, expected["floors"], strict=True)), window.permutations, calibrated)
    np.testing.assert_allclose(verdict_p_values(**{**calls[-1], "flags_at": None})[1], from_records[1], rtol=1e-9)


def test_the_learning_benchmark_counts_what_a_filter_drops_and_the_rounds_corrupted_share(benchmark_script):
    """benchmarks/faults/hidden_faults.py's Recording: per round, the records dropped and the corrupted
    ones among them (selectivity), and the round's records and corrupted records (the base rate a
    fault of a fraction of the episodes has, which its spec does not state)."""
    from types import SimpleNamespace

    hidden_faults = benchmark_script("hidden_faults")
    corrupted = torch.tensor([True, True, False, False, False, True, False, False])
    buffer = SimpleNamespace(flat=lambda name: {"corrupted": corrupted}[name])
    keep = torch.tensor([False, True, False, True, True, True, True, True])

    def drop_two(_buffer, _context):
        return keep

    drop_two.name = "drop-two"
    recording = hidden_faults.Recording(drop_two)
    assert torch.equal(recording(buffer, None), keep)
    assert (recording.dropped, recording.dropped_corrupted) == ([2], [1])
    assert (recording.records, recording.corrupted) == ([8], [3])


class _Recorder(gym.Wrapper):
    """The actions the env really executes, across episodes."""

    def __init__(self, env):
        super().__init__(env)
        self.executed = []

    def step(self, action):
        self.executed.append(int(action))
        return self.env.step(action)


def _executed(wrapped: gym.Wrapper, action: int, steps: int = 400) -> np.ndarray:
    """The actions a ``_Recorder`` inside ``wrapped`` saw executed over ``steps`` steps that all give ``action``."""
    wrapped.reset(seed=0)
    for _ in range(steps):
        _, _, terminated, truncated, _ = wrapped.step(action)
        if terminated or truncated:
            wrapped.reset()
    return np.array(wrapped.env.executed)


def test_the_held_out_faults_do_what_their_protocol_says(benchmark_script):
    """benchmarks/faults/held_out_faults.py: each wrapper changes what its kind says and nothing else."""
    held_out = benchmark_script("held_out_faults")

    lagged = held_out.ActuatorLag(_Recorder(gym.make("CartPole-v1")))
    lagged.reset(seed=0)
    for action in (1, 0, 0, 1):
        lagged.step(action)
    assert lagged.env.executed == [1, 1, 0, 0]  # the first step its own, then the previous one
    executed = _executed(held_out.RandomActuator(_Recorder(gym.make("CartPole-v1")), p=0.25, seed=3), action=1)
    assert 0.08 < (executed == 0).mean() < 0.18  # a quarter drawn at random, half of those the other action
    rounded = held_out.ObservationRounding(gym.make("CartPole-v1"), 1)
    obs, _ = rounded.reset(seed=0)
    assert obs.dtype == np.float32 and np.allclose(obs, np.round(obs, 1))
    scaled = held_out.RewardScale(gym.make("CartPole-v1"), 3.0)
    scaled.reset(seed=0)
    assert scaled.step(0)[1] == 3.0
    short = held_out.KINDS["short-time-limit"][1](gym.make("CountingChain-v0", max_episode_steps=40), 0)
    short.reset(seed=0)
    steps, truncated = 0, False
    while not truncated:  # the chain never terminates: only a time limit ends it
        obs, _, terminated, truncated, _ = short.step(0)
        assert not terminated
        steps += 1
    assert steps == 40 // 4
    assert held_out.KINDS.keys().isdisjoint(corruptions.KINDS)  # never a --corrupt kind
    assert not held_out.applies("obs-rounding", "FrozenLake-v1") and held_out.applies("obs-rounding", "CartPole-v1")
    assert {held_out.broken_env(seed, 7) for seed in held_out.FAULT_SEEDS} <= set(range(7))


def test_the_third_held_out_set_does_what_its_protocol_says(benchmark_script):
    """held_out_faults.KINDS_4: dropped commands execute action 0 about a quarter of the time, an offset
    moves every observation by the same amount, dropped rewards are 0 about a tenth of the time, and a
    teleport returns a fresh start's observation without ending the episode."""
    held_out = benchmark_script("held_out_faults")

    executed = _executed(held_out.DroppedCommands(_Recorder(gym.make("CartPole-v1")), p=0.25, seed=3), action=1)
    assert 0.18 < (executed == 0).mean() < 0.32
    plain, offset = gym.make("CartPole-v1"), held_out.KINDS_4["obs-offset"][1](gym.make("CartPole-v1"), 5)
    shift = offset.reset(seed=0)[0] - plain.reset(seed=0)[0]
    assert np.allclose(offset.step(1)[0] - plain.step(1)[0], shift, atol=1e-6) and (np.abs(shift) > 0).all()
    assert np.allclose(shift, 0.1 * held_out.observation_spread("CartPole-v1", 5), atol=1e-6)
    lossy = held_out.RewardDropout(gym.make("CartPole-v1"), p=0.1, seed=3)
    lossy.reset(seed=0)
    rewards = []
    for _ in range(1000):
        _, reward, terminated, truncated, _ = lossy.step(int(len(rewards) % 2))
        rewards.append(reward)
        if terminated or truncated:
            lossy.reset()
    assert 0.06 < np.mean(np.array(rewards) == 0) < 0.14 and set(rewards) == {0.0, 1.0}
    jumpy = held_out.Teleport(gym.make("CountingChain-v0", max_episode_steps=400), p=0.5, seed=3)
    obs, _ = jumpy.reset(seed=0)
    jumps = 0
    for _ in range(40):  # the chain counts up by 0.1 a step: a teleport sends it back to its start, 0
        nxt, _, terminated, truncated, _ = jumpy.step(0)
        assert not (terminated or truncated)
        teleported = not np.allclose(nxt, obs + 0.1)
        assert not teleported or nxt[0] == 0.0
        jumps += teleported
        obs = nxt
    assert 10 < jumps < 30
    assert held_out.KINDS_4.keys().isdisjoint(corruptions.KINDS)  # never a --corrupt kind
    assert held_out.KINDS_4.keys().isdisjoint(held_out.KINDS | held_out.KINDS_3)  # nor an earlier held-out kind
    assert not set(held_out.SEEDS_4) & (set(held_out.SEEDS) | set(held_out.SEEDS_3))
    assert not held_out.applies("obs-offset", "FrozenLake-v1") and held_out.applies("teleport", "FrozenLake-v1")


def test_the_benchmark_counts_readings_apart_and_never_mixes_verdict_versions(benchmark_script, tmp_path):
    hidden_faults = benchmark_script("hidden_faults")
    outcome = hidden_faults.reading_outcome
    assert outcome("action", "action", "action") == "right"
    assert outcome("undetermined", "observation;action", "action") == "undetermined"
    assert outcome("undetermined", "observation;environment", "action") == "wrong"
    assert outcome("observation", "observation", "action") == "wrong"
    assert hidden_faults.truth_class("held-out:short-time-limit") == "done-flags"
    assert hidden_faults.truth_class("obs-bug:envs=1,mode=lag") == "observation"
    looks = [hidden_faults.sequential_alpha(0.01, k) for k in range(1, 10_001)]
    assert sum(looks) <= 0.01 and looks[0] == 0.005
    rows = pd.DataFrame({"env": "CartPole-v1", "fault": ["clean", "clean"], "seed": [1, 2], "rounds": 20,
                         "verdict_version": [1, 2], "verdict_round": np.nan, "false_flags": ""})
    rows.to_csv(tmp_path / "runs.csv", index=False)
    from types import SimpleNamespace

    with pytest.raises(SystemExit, match="verdict versions \\[1, 2\\]"):
        hidden_faults.summary(SimpleNamespace(out=str(tmp_path), runs="", data="", name="x"))


def test_the_held_out_answer_is_written_from_its_rows_and_an_edited_figure_fails_the_check(benchmark_script, tmp_path,
                                                                                            monkeypatch):
    publish = benchmark_script("publish_results")
    hidden_faults = benchmark_script("hidden_faults")
    data = tmp_path / "docs" / "data"
    data.mkdir(parents=True)
    rows = []
    for seed in range(201, 211):
        for kind, truth in (("random-actuator", "action"), ("reward-scale", "reward")):
            flagged = seed % 3 != 0
            rows.append({"env": "CartPole-v1", "fault": f"held-out:{kind}", "seed": seed, "rounds": 8, "start": 0,
                         "verdict_version": 2, "verdict_round": 3.0 if flagged else np.nan,
                         "seq_verdict_round": 6.0 if flagged else np.nan, "reading": truth if flagged else "",
                         "candidates": truth if flagged else "", "reading_outcome": "right" if flagged else "",
                         "seq_reading_outcome": "right" if flagged else "",
                         "false_flags": "", "seq_false_flags": "", "round_dynamics": np.nan})
        rows.append({"env": "CartPole-v1", "fault": "clean", "seed": seed, "rounds": 20, "start": 0, "verdict_version": 2,
                     "verdict_round": np.nan, "seq_verdict_round": np.nan, "reading": "", "candidates": "",
                     "reading_outcome": "", "seq_reading_outcome": "", "false_flags": "4:3 " if seed == 201 else "",
                     "seq_false_flags": "",
                     "round_dynamics": np.nan})
    pd.DataFrame(rows).to_csv(data / "hidden_faults_held_out_runs.csv", index=False)
    for page in publish.HELD_OUT_PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("intro\n<!-- table:held-out-answer -->\n<!-- /table:held-out-answer -->\n")
    monkeypatch.setattr(publish, "ROOT", tmp_path)
    monkeypatch.setattr(publish, "DATA", data)
    assert publish.held_out(check=False)  # written the first time
    page = tmp_path / "docs/results/hidden-faults.md"
    answer = page.read_text()
    assert "CartPole 12/20 runs" in answer and "1 of 10 have a false flag" in answer
    assert "12 right, 0 undetermined (the truth among the candidates), 0 wrong" in answer
    assert "all/faults/flagged_within_5: 12/20" in (data / "hidden_faults_held_out_summary.txt").read_text()
    assert publish.held_out(check=True) == []  # and then in step with its rows
    page.write_text(answer.replace("12 right", "13 right"))
    summary = data / "hidden_faults_held_out_summary.txt"
    summary.write_text(summary.read_text().replace("12/20", "13/20"))
    assert publish.held_out(check=True) == ["docs/data/hidden_faults_held_out_summary.txt",
                                            "docs/results/hidden-faults.md (held-out-answer)"]
    assert hidden_faults.prepared(pd.read_csv(data / "hidden_faults_held_out_runs.csv")).equals(
        hidden_faults.prepared(hidden_faults.prepared(pd.read_csv(data / "hidden_faults_held_out_runs.csv"))))


def test_a_false_flag_is_recorded_with_the_families_that_raised_it(benchmark_script):
    hidden_faults = benchmark_script("hidden_faults")
    verdict = pd.DataFrame({"source": [0, 3, 5], "flagged": [True, True, False],
                            "signature": ["truncations", "dynamics;action-fit", ""],
                            "fault_class": ["done-flags", "action", ""], "candidates": ["done-flags", "action", ""]})
    row = {"false_flags": "", "false_signatures": "", "verdict_round": np.nan}
    found = hidden_faults._note(row, "", verdict, 4, {3}, "action")
    assert list(found["source"]) == [3] and row["verdict_round"] == 5 and row["reading_outcome"] == "right"
    assert row["false_flags"] == "5:0 " and row["false_signatures"] == "5:0:truncations "


def test_a_family_whose_values_set_too_few_sources_apart_gets_no_outlier_test():
    """One source's episode reached a time limit, the others' none (a rare 0/1 family): the others'
    spread is zero and the outlier test's t unbounded; version 3 leaves that family to the exact test."""
    from rlinfluence.sources import OUTLIER_MIN_SPREAD, spread_enough

    rare = np.zeros((3, 8))
    rare[1, 4], rare[2, 2] = 1.0, 0.15  # two sources apart from the rest: the spread is one small value's
    assert not spread_enough(rare)
    flagged = verdict({"truncations": rare}, range(8), outlier_means={"truncations": rare})
    assert not flagged["flagged"].any()
    from rlinfluence import sources

    with pytest.MonkeyPatch.context() as patch:  # with the outlier test, that one event is a flag (version 2)
        patch.setattr(sources, "spread_enough", lambda means: True)
        assert verdict({"truncations": rare}, range(8), outlier_means={"truncations": rare})["flagged"].tolist()[4]
    spread = np.random.default_rng(0).normal(size=(3, 8))
    assert spread_enough(spread) and OUTLIER_MIN_SPREAD == 3


def test_the_per_run_levels_sum_to_alpha_and_a_bad_guarantee_is_one_user_error():
    from rlinfluence.errors import UserError
    from rlinfluence.sources import audit_level

    levels = [audit_level(0.01, r, "run") for r in range(1, 100_001)]
    assert sum(levels) < 0.01 and sum(levels) == pytest.approx(0.01, rel=1e-4)  # every audit of a run: alpha
    assert audit_level(0.01, 4, "audit") == 0.01 and audit_level(0.01, 4, "run") == pytest.approx(0.0005)
    with pytest.raises(UserError, match="guarantee must be one of audit, run, got 'always'"):
        audit_level(0.01, 4, "always")


def test_quarantine_with_the_per_run_guarantee_tests_each_round_at_alpha_over_the_planned_rounds():
    from rlinfluence.ppo import PPO, PPOConfig

    config = PPOConfig(env="CartPole-v1", n_envs=4, n_steps=32, batch_size=32, total_timesteps=10 * 128,
                       filter="quarantine", quarantine_guarantee="run", run_root="", progress=False, tensorboard=False)
    quarantine = PPO(config, run_dir=False).filter
    assert quarantine.alpha == pytest.approx(0.001) and quarantine.permutations == 2500  # resolves 0.001 / 0.8
    per_round = PPO(PPOConfig(**{**config.to_dict(), "quarantine_guarantee": "round"}), run_dir=False).filter
    assert per_round.alpha == 0.01 and per_round.permutations == per_round.PERMUTATIONS


@pytest.mark.parametrize(("shape", "constant"), [((300, 12), 0), ((40, 90), 0), ((40, 90), 60), ((300, 12), 5)])
def test_the_model_checks_ridge_is_sklearns_ridge_in_closed_form(shape, constant):
    """consistency._ridge (closed form, primal or dual; constant columns left out of the products,
    which can turn the dual into the primal) predicts what sklearn's Ridge(alpha=1) does, also on
    records where a column constant in the fit varies."""
    from sklearn.linear_model import Ridge

    from rlinfluence.consistency import _ridge

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=shape), rng.normal(size=(shape[0], 3))
    x[:, :constant] = rng.normal(size=constant)  # a column constant over the records fitted
    z = rng.normal(size=(25, shape[1]))
    assert np.allclose(_ridge(x, y)(z), Ridge(alpha=1.0).fit(x, y).predict(z), rtol=1e-9, atol=1e-10)
    assert np.allclose(_ridge(x, y[:, 0])(z), Ridge(alpha=1.0).fit(x, y[:, 0]).predict(z), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("separation", [0.5, 6.0])  # overlapping classes, and nearly separable ones (step halving)
def test_the_termination_models_newton_fit_is_sklearns_logistic_regression_at_its_optimum(separation):
    """consistency._logistic_newton minimises LogisticRegression(C=1)'s objective (intercept unpenalised):
    its probabilities are sklearn's run to a tight tolerance; sklearn's default stop (tol 1e-4) is
    further from that optimum."""
    from sklearn.linear_model import LogisticRegression

    from rlinfluence.consistency import _logistic_newton

    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 6))
    y = (x[:, 0] * separation + rng.normal(size=400) > 2.0).astype(float)  # the rarer class about 1 in 5
    tight = LogisticRegression(C=1.0, tol=1e-12, max_iter=100_000).fit(x, y)
    w, b = _logistic_newton(x, y)
    z = rng.normal(size=(50, 6))
    newton = 1 / (1 + np.exp(-(z @ w + b)))
    assert np.abs(newton - tight.predict_proba(z)[:, 1]).max() < 1e-6
    assert np.allclose(w, tight.coef_[0], atol=1e-5) and b == pytest.approx(tight.intercept_[0], abs=1e-5)


def test_quarantine_with_attribution_tests_influence_and_dtv_as_their_own_calls_score_them():
    """QuarantineFilter(attribution=True) adds the influence (batch advantages) and dtv families, from
    one gradient pass: each is minus its own call's scores."""
    import torch

    from rlinfluence.filters import FilterContext, QuarantineFilter
    from rlinfluence.influence import gradient_alignment, snapshot_influence
    from rlinfluence.ppo import PPO, PPOConfig

    config = PPOConfig(env="CartPole-v1", n_envs=4, n_steps=32, batch_size=32, total_timesteps=128, eval_episodes=0,
                       progress=False, tensorboard=False)
    trainer = PPO(config, run_dir=False)
    buffer = trainer.collect()
    buffer.compute_advantages(0.99, 0.95)
    quarantine = QuarantineFilter(attribution=True)
    scores = quarantine._scores(buffer, FilterContext(trainer.policy, 0, 32))
    records = [buffer.flat(k) for k in ("obs", "actions", "advantages")]
    expected = {"influence": -snapshot_influence(trainer.policy, *records, advantage_norm="batch"),
                "dtv": -gradient_alignment(trainer.policy, *records)}
    for family, values in expected.items():
        column = scores[:, quarantine.families.index(family)]
        assert torch.allclose(torch.from_numpy(column), values.double(), rtol=1e-6, atol=1e-9)
    assert quarantine(buffer, FilterContext(trainer.policy, 0, 32)).all()  # one round: nothing flagged


def test_the_termination_model_falls_back_to_lbfgs_where_newtons_hessian_fails(monkeypatch):
    """A Hessian that is not numerically positive definite (Newton's solve raises) gives sklearn's fit,
    not an error."""
    from scipy import linalg
    from sklearn.linear_model import LogisticRegression

    from rlinfluence import consistency

    def singular(x, y):
        raise linalg.LinAlgError("not positive definite")

    monkeypatch.setattr(consistency, "_logistic_newton", singular)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(200, 3)), (rng.random(200) < 0.3).astype(float)
    z = rng.normal(size=(20, 3))
    expected = LogisticRegression(C=1.0, max_iter=500).fit(x, y).predict_proba(z)[:, 1]
    assert np.array_equal(consistency._logistic(x, y)(z), expected)
    monkeypatch.undo()  # Newton's own solve: a LAPACK Cholesky that fails raises LinAlgError
    monkeypatch.setattr(consistency.lapack, "dposv", lambda a, b: (a, b, 2))
    with pytest.raises(linalg.LinAlgError, match="positive definite"):
        consistency._logistic_newton(x, y)
    assert np.array_equal(consistency._logistic(x, y)(z), expected)
