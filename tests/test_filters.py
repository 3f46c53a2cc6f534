import pytest
import torch

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.errors import UserError
from rlinfluence.filters import (
    AdvantageFilter,
    FilterContext,
    IIFFilter,
    InfluenceScorer,
    RandomFilter,
    RewardExtremesFilter,
    TDErrorFilter,
    drop_lowest,
    iif_drop_count,
    make_filter,
)
from rlinfluence.ppo import PPO

from .conftest import tiny_config


def _buffer(n=8, rewards=None):
    buf = RolloutBuffer.empty(0, n, 1, (1,), torch.float32, (), torch.int64)
    if rewards is not None:
        buf.rewards[:, 0] = torch.as_tensor(rewards, dtype=torch.float32)
    buf.last_values = torch.zeros(1)
    buf.compute_advantages(0.99, 0.95)
    return buf


def _iif_with_scores(scores, **kwargs):
    """An IIF filter whose influence scores are the given hand-made ones."""
    f = IIFFilter(**kwargs)
    f.scores = lambda buffer, context: torch.as_tensor(scores, dtype=torch.float32)
    return f


def _ctx(batch_size=1):
    return FilterContext(policy=None, round=0, batch_size=batch_size)


SCORES = [0.5, -3.0, -1.0, 2.0, -2.0, -0.5, 1.0, -4.0]  # 5 negatives


@pytest.mark.parametrize(
    "mode, pct, dropped",
    [
        ("neg-bottom", 50, {7, 1}),  # floor(0.5 * 5) = 2 lowest: -4, -3
        ("neg-bottom", 100, {7, 1, 4, 2, 5}),  # every negative, never a positive
        ("neg-bottom", 10, set()),  # floor(0.1 * 5) = 0
        ("bottom", 25, {7, 1}),  # floor(0.25 * 8) = 2 lowest of all
        ("neg", 12.5, {7, 1, 4, 2, 5}),
    ],
)
def test_iif_masks_on_hand_made_scores(mode, pct, dropped):
    keep = _iif_with_scores(SCORES, drop_pct=pct, drop_mode=mode)(_buffer(), _ctx())
    assert set(torch.nonzero(~keep).squeeze(1).tolist()) == dropped


def test_all_negative_scores_with_p_100_drops_everything_but_keeps_one_minibatch():
    scores = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0]
    assert iif_drop_count(torch.tensor(scores), 100, "neg-bottom") == 8
    ctx = _ctx(batch_size=3)
    keep = _iif_with_scores(scores, drop_pct=100)(_buffer(), ctx)
    assert keep.tolist() == [True, True, True, False, False, False, False, False]  # the 3 best
    assert ctx.stats["minibatch_guard"] == 1.0


def test_ties_at_the_threshold_are_broken_by_index():
    keep = drop_lowest(torch.tensor([-1.0, -2.0, -2.0, -2.0, 3.0]), 2)
    assert keep.tolist() == [True, False, False, True, True]


def test_bad_drop_pct_and_mode():
    for p in (0, -5, 100.5):
        with pytest.raises(UserError, match=f"drop_pct must be in \\(0, 100\\], got {p}"):
            IIFFilter(drop_pct=p)
    with pytest.raises(UserError, match="unknown drop_mode 'top'"):
        IIFFilter(drop_pct=50, drop_mode="top")
    with pytest.raises(UserError, match="unknown filter 'magic'"):
        make_filter("magic")


def test_random_filter_drops_exactly_iifs_count_with_its_own_seed():
    buf, counts = _buffer(), []
    for seed in (0, 0, 1):
        f = RandomFilter(drop_pct=50, seed=seed)
        f.scores = lambda buffer, context: torch.tensor(SCORES)
        counts.append(f(buf, _ctx()))
    assert int((~counts[0]).sum()) == 2
    assert torch.equal(counts[0], counts[1])
    pct = RandomFilter(drop_pct=25, match="pct")(buf, _ctx())
    assert int((~pct).sum()) == 2


def test_reward_extremes_drops_both_tails():
    buf = _buffer(rewards=[0, 5, -5, 1, 2, 3, -1, 4])
    keep = RewardExtremesFilter(drop_pct=25)(buf, _ctx())  # 12.5% = 1 record each side
    assert set(torch.nonzero(~keep).squeeze(1).tolist()) == {1, 2}


def test_td_error_sets_rank_based_sampling_weights():
    buf = _buffer(rewards=[0, 0, 3, 0, -1, 0, 0, 0])
    ctx = _ctx()
    keep = TDErrorFilter(alpha=1.0)(buf, ctx)
    assert keep.all()
    w = ctx.sample_weights
    assert w.sum().item() == pytest.approx(1.0) and w.argmax().item() == 2  # largest |delta|


def test_advantage_heuristics_drop_only_sign_mismatched_records():
    # a deterministic 2-state chain: state A (obs 0) -> action 1 gives reward 1 and ends,
    # action 0 gives 0 and ends. Estimated advantages are set by hand with wrong signs.
    buf = RolloutBuffer.empty(0, 6, 1, (1,), torch.float32, (), torch.int64)
    buf.actions[:, 0] = torch.tensor([1, 0, 1, 0, 1, 0])
    buf.rewards[:, 0] = torch.tensor([1.0, 0, 1, 0, 1, 0])
    buf.terminated[:] = True
    buf.last_values = torch.zeros(1)
    buf.advantages = torch.tensor([[-0.5], [0.2], [0.5], [-0.2], [0.1], [0.4]])
    a_bar = buf.monte_carlo_advantages(0.99)
    torch.testing.assert_close(a_bar, torch.tensor([0.5, -0.5, 0.5, -0.5, 0.5, -0.5], dtype=torch.float64))
    keep = AdvantageFilter(drop_pct=50, heuristic="H1")(buf, _ctx())
    # mismatched: 0 (|diff| 1.0), 1 (0.7), 5 (0.9); floor(0.5 * 3) = 1 -> drop record 0
    assert torch.nonzero(~keep).squeeze(1).tolist() == [0]
    keep = AdvantageFilter(drop_pct=100, heuristic="H2")(buf, _ctx())
    assert set(torch.nonzero(~keep).squeeze(1).tolist()) == {0, 1, 5}


def test_iif_in_the_trainer_drops_the_expected_count_and_logs():
    trainer = PPO(tiny_config(filter="iif", drop_pct=50, n_steps=256, total_timesteps=256), run_dir=False)
    metrics = trainer.train_round()
    n_neg = int(metrics["n_negative"])
    expected_kept = 256 - n_neg // 2
    assert metrics["kept_fraction"] == pytest.approx(expected_kept / 256)
    assert metrics["n_updates"] == trainer.config.n_epochs * (expected_kept // 32)
    for key in ("score_mean", "score_std", "scoring_seconds", "minibatch_guard"):
        assert key in metrics


def test_filtered_runs_are_reproducible_and_resumable(tmp_path):
    cfg = tiny_config(filter="random", drop_pct=50, run_root=str(tmp_path), total_timesteps=384)
    a = PPO(cfg, run_dir=tmp_path / "a").learn()
    b = PPO(cfg, run_dir=tmp_path / "b").learn()
    torch.testing.assert_close(a.policy.state_dict(), b.policy.state_dict())
    assert (tmp_path / "a").name and a.filter.state_dict()["generator"].equal(b.filter.state_dict()["generator"])


class Spy:
    """Wraps a filter and keeps the contexts it was called with."""

    def __init__(self, inner):
        self.inner, self.contexts, self.name = inner, [], inner.name
        self.uses_validation = getattr(inner, "uses_validation", False)

    def __call__(self, buffer, context):
        self.contexts.append(context)
        return self.inner(buffer, context)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


def test_iif_with_a_validation_rollout_scores_against_it_and_leaves_the_training_stream_alone():
    base = dict(filter="iif", drop_pct=50, n_steps=128, n_envs=2, total_timesteps=512)
    spy = Spy(make_filter("iif", drop_pct=50))
    trainer = PPO(tiny_config(**base, validation_steps=64), filter=spy, run_dir=False)
    plain = PPO(tiny_config(**base), run_dir=False)
    for round_index in range(2):
        metrics = trainer.train_round()
        plain.train_round()
        validation = spy.contexts[-1].validation
        assert validation is not None and len(validation) == 64 * 2 and validation.round == round_index
        assert metrics["validation_env_steps"] == 128 * (round_index + 1) and metrics["env_steps"] == 256 * (round_index + 1)
    # round 0 trains on the same records as without validation (own envs, own noise) ...
    first = tiny_config(**base, validation_steps=64)
    a, b = PPO(first, run_dir=False), PPO(tiny_config(**base), run_dir=False)
    buf_a, buf_b = a.collect(), b.collect()
    assert torch.equal(buf_a.obs, buf_b.obs) and torch.equal(buf_a.actions, buf_b.actions)
    for buf in (buf_a, buf_b):
        buf.compute_advantages(0.99, 0.95)
    # ... and the scores are taken against the validation set: another target, other scores
    a_scores = a.filter.scores(buf_a, FilterContext(a.policy, 0, 32, validation=_validation(a)))
    b_scores = b.filter.scores(buf_b, FilterContext(b.policy, 0, 32))
    assert not torch.allclose(a_scores, b_scores)


def _validation(trainer):
    buf = trainer.collect(trainer.validation_stream, trainer.config.validation_steps)
    buf.compute_advantages(trainer.config.gamma, trainer.config.gae_lambda)
    return buf


def test_validation_rollout_is_only_collected_for_scoring_filters_and_resumes(tmp_path):
    assert PPO(tiny_config(validation_steps=32), run_dir=False).validation_stream is None  # standard PPO
    assert PPO(tiny_config(filter="random", validation_steps=32), run_dir=False).validation_stream is not None
    with pytest.raises(UserError, match="validation_steps must be >= 0, got -1"):
        tiny_config(filter="iif", validation_steps=-1).validate()
    cfg = tiny_config(filter="iif", validation_steps=32, total_timesteps=384)
    PPO(cfg, run_dir=tmp_path / "run").learn()
    policies = []
    for _ in range(2):  # resuming from round 2 is reproducible (envs are reset, as for every resume)
        (tmp_path / "run" / "checkpoints" / "round_0003.pt").unlink()
        resumed = PPO.resume(tmp_path / "run")
        assert resumed.validation_env_steps == 2 * 32
        saved = torch.load(tmp_path / "run" / "checkpoints" / "round_0002.pt", weights_only=True)
        assert torch.equal(resumed.validation_stream.generator.get_state(), saved["validation_generator"])
        policies.append(resumed.learn().policy.state_dict())
    torch.testing.assert_close(*policies)


# -- a round with no attribution signal (issue 13) -------------------------------------------------
def test_iif_keeps_every_record_when_every_advantage_is_zero():
    import gymnasium as gym

    from rlinfluence.influence import ZeroTargetGradient, snapshot_influence
    from rlinfluence.policies import make_policy

    torch.manual_seed(0)
    policy = make_policy(gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2), hidden_sizes=(8,))
    buffer = _buffer(16)  # zero rewards and values: every advantage is exactly 0
    assert not buffer.flat("advantages").any()
    for f in (IIFFilter(drop_pct=100, drop_mode="bottom"), RandomFilter(drop_pct=50)):
        context = FilterContext(policy=policy, round=3, batch_size=4)
        with pytest.warns(RuntimeWarning, match=r"round 3: \w+ kept every record \(skipped=1\).*zero gradient"):
            keep = f(buffer, context)
        assert keep.all() and context.stats["skipped"] == 1.0 and context.stats["minibatch_guard"] == 0.0
    # the scorer alone (the audit's influence family) says the same, not an AttributeError
    context = FilterContext(policy=policy, round=3, batch_size=4)
    with pytest.warns(RuntimeWarning, match=r"round 3: influence kept every record \(skipped=1\)"):
        assert InfluenceScorer(advantage_norm="batch").scores(buffer, context) is None
    scored = FilterContext(policy=policy, round=0, batch_size=4)
    IIFFilter(drop_pct=50)(_buffer(16, rewards=torch.arange(16.0)), scored)
    assert scored.stats["skipped"] == 0.0
    # the direct library call still raises, a UserError saying what to do
    with pytest.raises(ZeroTargetGradient, match="keep every record") as err:
        snapshot_influence(policy, buffer.flat("obs"), buffer.flat("actions"), buffer.flat("advantages"))
    assert isinstance(err.value, UserError) and "\n" not in str(err.value)


def test_rlhf_iif_keeps_every_sequence_when_the_target_has_no_signal(tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from rlinfluence.rlhf import RLHFTrainer

    from .test_rlhf import PROMPTS
    from .test_rlhf import tiny_config as rlhf_config

    config = rlhf_config(tmp_path, algo="grpo", group_size=2, filter="iif", drop_mode="neg", mini_batch_size=2)
    trainer = RLHFTrainer(config, reward_fn=lambda texts: torch.zeros(len(texts)), train_prompts=PROMPTS,
                          val_prompts=PROMPTS[:3], test_prompts=PROMPTS[3:], run_dir=False)
    seen = {}
    update = trainer.update

    def spy(rollout, keep):
        seen["keep"] = keep.clone()
        return update(rollout, keep)

    trainer.update = spy
    with pytest.warns(RuntimeWarning, match=r"IIF kept every sequence \(skipped=1\).*zero gradient"):
        metrics = trainer.train_round()
    assert metrics["skipped"] == 1.0 and seen["keep"].all()


def test_iif_scores_include_the_trainers_entropy_bonus():
    """With ent_coef != 0 the training loss has an entropy term, so the filter's scores are the
    snapshot scores with that term (and differ from the ent_coef = 0 scores); the trainer passes it."""
    from rlinfluence.influence import ReturnTarget, snapshot_influence

    trainer = PPO(tiny_config(filter="iif", drop_pct=50, ent_coef=0.5, n_steps=64, n_envs=2), run_dir=False)
    buffer = trainer.collect()
    buffer.compute_advantages(0.99, 0.95)
    context = FilterContext(trainer.policy, 0, 32, ent_coef=0.5)
    scorer = IIFFilter(drop_pct=50, advantage_norm="batch")
    flat = [buffer.flat(k) for k in ("obs", "actions", "advantages")]
    expected = snapshot_influence(trainer.policy, *flat, target=ReturnTarget(), advantage_norm="batch", ent_coef=0.5)
    torch.testing.assert_close(scorer.scores(buffer, context), expected)
    assert not torch.allclose(scorer.scores(buffer, FilterContext(trainer.policy, 0, 32)), expected)

    spy = Spy(make_filter("iif", drop_pct=50))
    PPO(tiny_config(filter="iif", drop_pct=50, ent_coef=0.5, n_steps=64, n_envs=2), filter=spy, run_dir=False).train_round()
    assert spy.contexts[-1].ent_coef == 0.5
