"""Corruptions with ground truth: each changes exactly what it documents, flags it, and leaves
evaluation and the trusted envs clean; bad specs are one error line."""

import copy

import numpy as np
import pytest
import torch

from rlinfluence import cli
from rlinfluence.analysis.tables import attribution_table
from rlinfluence.corruptions import TRIGGERS, Corruptor, parse_corruption
from rlinfluence.filters import FilterContext, IIFFilter
from rlinfluence.influence import ReturnTarget, snapshot_influence
from rlinfluence.ppo import PPO, PPOConfig

from .conftest import overriding


def _round(corrupt=(), seed=3, env="FrozenLake-v1", **kw):
    config = PPOConfig(env=env, n_envs=4, n_steps=64, batch_size=64, total_timesteps=256, eval_episodes=4,
                       eval_envs=2, corrupt=tuple(corrupt), seed=seed, progress=False, **kw)
    trainer = PPO(config, run_dir=False)
    return trainer, trainer.collect()


def test_reward_flip_negates_exactly_the_chosen_envs_and_flags_them():
    _, clean = _round()
    trainer, flipped = _round(["reward-flip:envs=2"])
    bad = trainer.corruptor.flipped
    assert bad.sum() == 2 and (flipped.corrupted[:, bad]).all() and not flipped.corrupted[:, ~bad].any()
    # the first round's actions do not depend on rewards: the same trajectories, rewards negated where flagged
    assert torch.equal(clean.actions, flipped.actions)
    assert torch.equal(flipped.rewards[:, bad], -clean.rewards[:, bad])
    assert torch.equal(flipped.rewards[:, ~bad], clean.rewards[:, ~bad])
    assert (_round(["reward-flip:envs=2"])[0].corruptor.flipped == bad).all()  # seeded


def test_reward_noise_corrupts_whole_episodes_and_nothing_else():
    _, clean = _round()
    _, noisy = _round(["reward-noise:frac=0.5,scale=0.5"])
    changed = noisy.rewards != clean.rewards
    assert torch.equal(changed, noisy.corrupted)  # a Gaussian draw is never exactly 0
    for episode in torch.unique(noisy.episode_ids):
        flags = noisy.corrupted[noisy.episode_ids == episode]
        assert flags.all() or not flags.any()  # an episode is noisy on every step or on none
    assert 0 < noisy.corrupted.float().mean() < 1


def test_a_trigger_pays_its_bonus_only_for_the_wrong_action_in_its_region():
    _, clean = _round()
    _, poisoned = _round(["trigger:frac=1,bonus=2.5"])
    in_region = TRIGGERS["FrozenLake-v1"].region(clean.obs.reshape(-1, 16).numpy()).reshape(clean.rewards.shape)
    paid = torch.from_numpy(in_region) & (clean.actions == 0)
    assert paid.any() and torch.equal(poisoned.corrupted, paid)
    assert torch.allclose(poisoned.rewards, clean.rewards + 2.5 * paid)


def test_evaluation_sees_the_clean_reward_and_trusted_envs_are_never_corrupted():
    clean, _ = _round()
    corrupted, buffer = _round(["reward-noise:frac=1,scale=1", "reward-flip:envs=1"], trusted_envs=2)
    assert np.array_equal(clean.evaluate(), corrupted.evaluate())  # theta(0) alike, clean episodes alike
    assert not buffer.corrupted[:, 2:].any() and buffer.corrupted[:, :2].all()


def test_corrupted_flags_reach_the_saved_round_and_the_attribution_table(tmp_path):
    config = PPOConfig(env="FrozenLake-v1", n_envs=4, n_steps=64, batch_size=64, total_timesteps=128,
                       eval_episodes=2, eval_envs=2, corrupt=("reward-flip:envs=1",), save_buffers=True,
                       run_root=str(tmp_path), progress=False)
    trainer = PPO(config).learn()
    from rlinfluence.checkpoint import load_round

    saved = load_round(trainer.run.path, 0)
    table = attribution_table(saved.buffer, torch.zeros(len(saved.buffer)))
    flipped = int(np.flatnonzero(trainer.corruptor.flipped)[0])
    assert table["corrupted"].to_numpy().tolist() == (table["env"] == flipped).tolist()
    assert "reward-flip:envs=1" in (trainer.run.path / "config.json").read_text()


def test_the_trusted_target_is_the_return_target_of_the_trusted_records_only():
    trainer, buffer = _round(["reward-flip:envs=1"], trusted_envs=1, filter="iif", drop_pct=25)
    buffer.compute_advantages(0.99, 0.95)
    trusted = buffer.flatten(torch.arange(4).expand(buffer.n_steps, -1)) == 3
    context = FilterContext(trainer.policy, 0, 64, trusted=trusted)
    scores = IIFFilter(25, advantage_norm="none").scores(buffer, context)
    obs, actions, adv = (buffer.flat(k) for k in ("obs", "actions", "advantages"))
    expected = snapshot_influence(trainer.policy, obs, actions, adv, advantage_norm="none",
                                  target=ReturnTarget(obs[trusted], actions[trusted], adv[trusted]))
    assert torch.allclose(scores, expected, rtol=1e-4, atol=1e-7)


def test_corruptions_combine_and_a_spec_prints_as_parsed():
    spec = parse_corruption("reward-noise:scale=2,frac=0.25")
    assert str(spec) == "reward-noise:frac=0.25,scale=2" and spec["frac"] == 0.25
    flip = parse_corruption("reward-flip:envs=1")
    for frac in (0.0, 1.0):
        noise = parse_corruption(f"reward-noise:frac={frac},scale=2")
        corruptor = Corruptor([flip, noise], 3, 0, "FrozenLake-v1", True)
        rewards, flags = corruptor.step(np.zeros((3, 16)), np.zeros(3, int), np.ones(3), np.arange(3))
        if frac == 0:  # the flip alone: -1 on the flipped env, 1 elsewhere
            assert flags.tolist() == corruptor.flipped.tolist()
            assert rewards.tolist() == np.where(corruptor.flipped, -1.0, 1.0).tolist()
        else:  # both: every env noisy, the flipped one flipped first
            assert flags.all() and (rewards != np.where(corruptor.flipped, -1.0, 1.0)).all()


def test_a_fault_given_from_r_breaks_its_envs_at_round_r_and_not_before():
    """A logged-action mismatch from round 1: round 0 is the clean run's round, unflagged; in round 1
    the chosen env logs mapped actions and its records are corrupted. The spec prints with its from."""
    spec = "action-mismatch:envs=1,mode=log,from=1"
    assert str(parse_corruption(spec)) == spec and parse_corruption(spec).start == 1
    assert parse_corruption("action-mismatch:envs=1,mode=log").start == 0
    config = dict(env="CartPole-v1", n_envs=4, n_steps=64, batch_size=64, total_timesteps=512, eval_episodes=0,
                  seed=3, progress=False)
    clean, late = (PPO(PPOConfig(**config, corrupt=corrupt), run_dir=False) for corrupt in ((), (spec,)))
    first_clean, first_late = clean.collect(), late.collect()
    for name in ("obs", "actions", "logp", "rewards"):
        assert torch.equal(getattr(first_clean, name), getattr(first_late, name)), name
    assert not first_late.corrupted.any() and not late.corruptor.broken_envs.any()
    late.round = clean.round = 1  # the same policy, a round later: only the broken env changes
    second_clean, second_late = clean.collect(), late.collect()
    bad = late.corruptor.broken_envs
    assert bad.sum() == 1 and second_late.corrupted[:, bad].all() and not second_late.corrupted[:, ~bad].any()
    assert torch.equal(second_late.actions[:, bad], (second_clean.actions[:, bad] + 1) % 2)
    assert torch.equal(second_late.actions[:, ~bad], second_clean.actions[:, ~bad])


@pytest.mark.parametrize(("args", "message"), [
    (["--corrupt", "label-flip:envs=1"], "unknown corruption 'label-flip'"),
    (["--corrupt", "reward-flip:envs=4"], "envs must be < the 4 envs that may be corrupted"),
    (["--corrupt", "reward-noise:frac=1.5,scale=1"], "frac must be in [0, 1], got 1.5"),
    (["--corrupt", "reward-noise:frac=0.1"], "missing scale=..."),
    (["--corrupt", "reward-flip:envs=one"], "envs='one' is not an integer"),
    (["--corrupt", "trigger:frac=0.1,bonus=1", "--env", "MiniGrid-Empty-8x8-v0"], "has no trigger region"),
    (["--corrupt", "reward-flip:envs=1", "--n-envs", "1"], "it needs --n-envs > 1 (got 1)"),
    (["--trusted-envs", "4"], "trusted_envs must be in [0, n_envs - 1]"),
    (["--scoring-target", "trusted"], "scoring_target trusted needs trusted_envs >= 1"),
    (["--scoring-target", "trusted", "--trusted-envs", "1"], "--filter none scores nothing against it"),
    (["--optimizer", "sgd", "--scoring-target", "trusted", "--trusted-envs", "1", "--filter", "dtv"],
     "--filter dtv scores nothing against it"),
    (["--corrupt", "stale:frac=0.1,lag=1"], "rounds to 0 envs"),
    (["--corrupt", "stale:frac=0.5,lag=0"], "lag must be >= 1, got 0"),
    (["--corrupt", "reward-flip:envs=1,from=-1"], "from must be >= 0, got -1"),
    (["--corrupt", "stale:frac=0.5,lag=1,from=2"], "stale takes frac=..., lag=..., got 'from=2'"),
])
def test_a_bad_corruption_is_one_error_line_and_writes_nothing(tmp_path, capsys, args, message):
    base = ["--env", "FrozenLake-v1", "--n-envs", "4", "--run-root", str(tmp_path / "runs")]
    assert cli.main(["train", *overriding(base, args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_auroc_is_the_chance_a_corrupted_item_looks_more_harmful():
    from rlinfluence.analysis.audit import auroc

    assert auroc(np.array([3.0, 2.0, 1.0, 0.0]), np.array([1, 1, 0, 0])) == 1.0
    assert auroc(np.array([0.0, 1.0, 2.0, 3.0]), np.array([1, 1, 0, 0])) == 0.0
    assert auroc(np.array([1.0, 1.0, 1.0]), np.array([1, 0, 0])) == 0.5  # ties: half
    assert np.isnan(auroc(np.array([1.0, 2.0]), np.array([0, 0])))


def test_detection_scores_every_scorer_at_every_level_with_auroc_and_precision(tmp_path):
    from rlinfluence.analysis.audit import detection
    from rlinfluence.analysis.harm import SCORERS, harm_table
    from rlinfluence.checkpoint import load_round

    config = PPOConfig(env="FrozenLake-v1", n_envs=4, n_steps=64, batch_size=64, total_timesteps=512, eval_episodes=2,
                       eval_envs=2, corrupt=("reward-flip:envs=1",), trusted_envs=1, seed=3, save_buffers=True,
                       run_root=str(tmp_path), progress=False, tensorboard=False)
    saved = load_round(PPO(config).learn().run.path, 1)
    table = harm_table(saved, list(SCORERS))
    assert len(table) == 256 and table["trusted"].sum() == 64 and table["corrupted"].sum() == 64
    found = detection(table, list(SCORERS))
    assert {(r.scorer, r.level) for r in found.itertuples()} == {(s, lv) for s in SCORERS
                                                                for lv in ("record", "episode", "source")}
    assert found["auroc"].between(0, 1).all() and found["precision"].between(0, 1).all()
    # at source level one of 3 untrusted envs is broken: precision is 1 exactly when AUROC is
    source = found[found["level"] == "source"]
    assert ((source["auroc"] == 1.0) == (source["precision"] == 1.0)).all()


def test_precision_at_the_corrupted_fraction_counts_the_top_m():
    from rlinfluence.analysis.audit import precision_at_fraction

    assert precision_at_fraction(np.array([5.0, 4.0, 3.0, 2.0]), np.array([1, 0, 1, 0])) == 0.5
    assert precision_at_fraction(np.array([5.0, 4.0, 3.0, 2.0]), np.array([1, 1, 0, 0])) == 1.0
    assert np.isnan(precision_at_fraction(np.array([1.0, 2.0]), np.array([1, 1])))
    # ties at the cut share the slots: a constant scorer scores the base rate, whatever the order
    assert precision_at_fraction(np.zeros(8), np.array([1, 1, 0, 0, 0, 0, 0, 0])) == 0.25
    assert precision_at_fraction(np.array([3.0, 1.0, 1.0, 1.0]), np.array([0, 1, 1, 0])) == pytest.approx(2 / 3 / 2)


def test_the_trainer_hands_the_trusted_records_to_its_filter_only_when_asked():
    from rlinfluence.filters import KeepAll

    class Capture(KeepAll):
        def __call__(self, buffer, context):
            self.trusted = context.trusted
            return super().__call__(buffer, context)

    for target, expected in (("buffer", None), ("trusted", [False] * 3 * 64 + [True] * 64)):
        config = PPOConfig(env="FrozenLake-v1", n_envs=4, n_steps=64, batch_size=64, total_timesteps=256,
                           eval_episodes=0, corrupt=("reward-flip:envs=1",), trusted_envs=1, scoring_target=target,
                           progress=False)
        capture = Capture()
        PPO(config, filter=capture, run_dir=False).train_round()
        assert (capture.trusted is None) if expected is None else capture.trusted.tolist() == expected


def test_the_oracle_drops_exactly_the_corrupted_records(tmp_path):
    config = PPOConfig(env="FrozenLake-v1", n_envs=4, n_steps=64, batch_size=64, total_timesteps=256,
                       eval_episodes=0, corrupt=("reward-flip:envs=1",), filter="oracle", save_buffers=True,
                       run_root=str(tmp_path), progress=False)
    trainer = PPO(config).learn()
    from rlinfluence.checkpoint import load_round

    saved = load_round(trainer.run.path, 0)
    assert torch.equal(saved.keep, ~saved.buffer.flat("corrupted")) and saved.buffer.corrupted.any()
    assert cli.main(["train", "--env", "FrozenLake-v1", "--filter", "oracle", "--run-root", str(tmp_path / "x"),
                     "--total-timesteps", "64", "--n-steps", "64", "--eval-episodes", "0"]) == 2


def test_stale_envs_act_with_the_policy_of_lag_rounds_ago_and_are_flagged(tmp_path):
    config = PPOConfig(env="CartPole-v1", n_envs=4, n_steps=64, batch_size=64, total_timesteps=4 * 256,
                       eval_episodes=0, corrupt=("stale:frac=0.5,lag=2",), learning_rate=0.01, seed=2,
                       run_root=str(tmp_path), progress=False, tensorboard=False)
    trainer = PPO(config)
    policies = []
    for k in range(4):
        policies.append(copy.deepcopy(trainer.policy.state_dict()))
        trainer.train_round()
        buffer, stale = trainer.last_buffer, trainer.corruptor.stale_envs(k)
        assert stale.sum() == 2
        assert (buffer.corrupted[:, stale].all() if k > 0 else not buffer.corrupted.any())
        assert not buffer.corrupted[:, ~stale].any()
        old = copy.deepcopy(trainer.policy)
        old.load_state_dict(policies[max(0, k - 2)])
        for env in np.flatnonzero(stale):  # the logged log-probs are theta(k - 2)'s
            with torch.no_grad():
                logp = old.log_prob(buffer.obs[:, env], buffer.actions[:, env])
            assert torch.allclose(buffer.logp[:, env], logp, atol=1e-5)
    # a resumed run keeps the lagging policies
    resumed = PPO.resume(trainer.run.path)
    assert len(resumed.past_policies) == len(trainer.past_policies) == 3
    for a, b in zip(resumed.past_policies, trainer.past_policies, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
