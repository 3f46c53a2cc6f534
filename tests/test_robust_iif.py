"""Issue 14: step control (norm, kl), the split-half signal gate, drop_pct auto, Adam-faithful
scores and the iif-robust recommendation."""

import copy
import math

import numpy as np
import pytest
import torch

from rlinfluence.cli import main
from rlinfluence.filters import AUTO_DROP_GRID, FilterContext, IIFFilter
from rlinfluence.influence import (
    Records,
    ReturnTarget,
    adam_inverse_preconditioner,
    snapshot_influence,
)
from rlinfluence.losses import normalize_advantages
from rlinfluence.ppo import PPO, ROBUST_IIF, PPOConfig
from rlinfluence.step_control import lookahead, probe, step_scale

from .conftest import tiny_config


def _params(trainer):
    return [p.detach().clone() for p in trainer.policy.parameters()]


@pytest.mark.parametrize("step_control", ["norm", "kl"])
def test_step_control_with_every_record_kept_is_the_plain_update(step_control):
    plain = PPO(tiny_config(), run_dir=False).learn()
    controlled = PPO(tiny_config(step_control=step_control), run_dir=False).learn()
    for a, b in zip(_params(plain), _params(controlled), strict=True):
        assert torch.equal(a, b)


def _round_buffer(trainer):
    buffer = trainer.collect()
    buffer.compute_advantages(0.99, 0.95)
    return buffer


def test_step_control_norm_gives_the_kept_records_the_full_buffers_gradient_length():
    trainer = PPO(tiny_config(step_control="norm"), run_dir=False)
    buffer = _round_buffer(trainer)
    keep = buffer.flat("advantages") > buffer.flat("advantages").median()  # a very one-sided half
    scale = step_scale(trainer, buffer, keep)

    def grad(idx):  # brute force: the policy-loss gradient of one set, flattened
        obs, act, adv = (buffer.flat(k)[idx] for k in ("obs", "actions", "advantages"))
        trainer.policy.zero_grad()
        (-(normalize_advantages(adv) * trainer.policy.log_prob(obs, act)).mean()).backward()
        return torch.cat([p.grad.flatten() for p in trainer.policy.parameters() if p.grad is not None])

    full, kept = grad(torch.arange(len(buffer))), grad(keep.nonzero().squeeze(1))
    assert scale != pytest.approx(1.0, abs=0.05)
    assert float((scale * kept).norm()) == pytest.approx(float(full.norm()), rel=1e-5)
    assert step_scale(trainer, buffer, torch.ones(len(buffer), dtype=torch.bool)) == 1.0


def test_the_gate_closes_on_noise_advantages_and_opens_on_a_planted_signal():
    # FrozenLake: one-hot states, so gradients of different (state, action) pairs are nearly
    # orthogonal and noise halves agree only by chance
    trainer = PPO(tiny_config(env="FrozenLake-v1", n_steps=1024, batch_size=64), run_dir=False)
    noise = trainer.collect()
    noise.compute_advantages(0.99, 0.95)
    signal = copy.deepcopy(noise)
    rng = np.random.default_rng(0)
    shape = noise.advantages.shape
    noise.advantages = torch.as_tensor(rng.normal(size=shape), dtype=torch.float32)
    # planted: action 2 (right) is good everywhere (+1), the others bad (-1), plus a little noise
    good = (signal.actions == 2).numpy()
    signal.advantages = torch.as_tensor(np.where(good, 1.0, -1.0) + 0.1 * rng.normal(size=shape), dtype=torch.float32)
    gate = IIFFilter(50.0, gate="split-half", gate_threshold=0.3, seed=1)
    for buffer, expect_gated in ((noise, 1.0), (signal, 0.0)):
        context = FilterContext(trainer.policy, 0, 64)
        keep = gate(buffer, context)
        assert context.stats["gated"] == expect_gated, context.stats
        if expect_gated:
            assert bool(keep.all()) and "n_negative" not in context.stats  # not even scored
    context = FilterContext(trainer.policy, 0, 64)
    IIFFilter(50.0, seed=1)(noise, context)
    assert "gated" not in context.stats  # the default filter is the paper's, unchanged


def test_an_unknown_gate_or_step_control_is_refused_before_anything_is_written(tmp_path, capsys):
    for flag, value in (("--gate", "halves"), ("--step-control", "kl2")):
        # tyro rejects a value outside a Literal: one error line, exit 2
        assert main(["train", "--env", "CartPole-v1", flag, value, "--run-root", str(tmp_path)]) == 2
        assert value in capsys.readouterr().err
    assert main(["train", "--env", "CartPole-v1", "--gate-threshold", "2", "--run-root", str(tmp_path)]) == 2
    assert "gate_threshold must be in [-1, 1]" in capsys.readouterr().err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_gated_rounds_are_logged():
    trainer = PPO(tiny_config(filter="iif", gate="split-half", n_steps=256, batch_size=64), run_dir=False)
    metrics = trainer.train_round()
    assert metrics["gated"] in (0.0, 1.0) and "gate_reliability" in metrics and metrics["step_scale"] == 1.0


def test_step_control_kl_brings_the_kept_records_probe_kl_to_the_full_buffers():
    trainer = PPO(tiny_config(step_control="kl", n_steps=512, optimizer="sgd", learning_rate=0.02), run_dir=False)
    buffer = _round_buffer(trainer)
    keep = buffer.flat("advantages") > buffer.flat("advantages").quantile(0.3)
    before = (_params(trainer), trainer.generator.get_state(), copy.deepcopy(trainer.optimizer.state_dict()))
    everything = torch.arange(len(buffer))
    kl_all = probe(trainer, buffer, everything, everything)[0]
    kl_kept = probe(trainer, buffer, keep.nonzero().squeeze(1), everything)[0]
    scale = step_scale(trainer, buffer, keep)
    assert kl_all > 0 and abs(math.log(kl_kept / kl_all)) > 0.1  # dropping records changes the KL
    kl_scaled = probe(trainer, buffer, keep.nonzero().squeeze(1), everything, scale)[0]
    assert kl_scaled == pytest.approx(kl_all, rel=0.1)
    # probing trains copies: the trainer's parameters, optimiser and generator are untouched
    assert all(torch.equal(a, b) for a, b in zip(before[0], _params(trainer), strict=True))
    assert torch.equal(before[1], trainer.generator.get_state())
    assert str(before[2]) == str(trainer.optimizer.state_dict())


def test_step_control_kl_logs_its_scale_on_filtered_rounds():
    metrics = PPO(tiny_config(filter="iif", step_control="kl"), run_dir=False).train_round()
    assert metrics["kept_fraction"] < 1 and 0.1 <= metrics["step_scale"] <= 10 and metrics["step_scale"] != 1


# -- drop_pct auto ------------------------------------------------------------------------------
def _auto_context(trainer, lookahead):
    return FilterContext(trainer.policy, 0, trainer.config.batch_size, lookahead=lookahead)


def test_drop_pct_auto_chooses_the_p_whose_lookahead_gains_most():
    trainer = PPO(tiny_config(n_steps=512), run_dir=False)
    buffer = _round_buffer(trainer)
    state = IIFFilter(50.0, seed=3).state_dict()

    def seeded(drop_pct):
        iif = IIFFilter(drop_pct, seed=3)
        iif.load_state_dict(copy.deepcopy(state))
        return iif

    sizes = []  # how many of half A's records each p keeps, read off a replay with the same seed
    seeded("auto")(buffer, _auto_context(trainer, lambda train, held_out: sizes.append(len(train)) or 0.0))
    assert len(sizes) == len(AUTO_DROP_GRID) and len(set(sizes)) == len(sizes)
    best = sizes[AUTO_DROP_GRID.index(25.0)]
    context = _auto_context(trainer, lambda train, held_out: -abs(len(train) - best))  # peaks at p = 25
    keep = seeded("auto")(buffer, context)
    assert context.stats["drop_pct"] == 25.0 and context.stats["auto_gain_over_p0"] > 0
    assert torch.equal(keep, seeded(25.0)(buffer, _auto_context(trainer, None)))  # IIF at p = 25


def test_drop_pct_auto_is_seeded_and_resumes_from_the_filters_state():
    trainer = PPO(tiny_config(n_steps=512), run_dir=False)
    buffer = _round_buffer(trainer)

    def gain(train, held_out):
        return lookahead(trainer, buffer, train, held_out)

    first = IIFFilter("auto", seed=5)
    first.choose_drop_pct(buffer, _auto_context(trainer, gain))  # advance its random state
    saved = copy.deepcopy(first.state_dict())
    chosen = first.choose_drop_pct(buffer, _auto_context(trainer, gain))
    resumed = IIFFilter("auto", seed=123)
    resumed.load_state_dict(saved)
    assert resumed.choose_drop_pct(buffer, _auto_context(trainer, gain)) == chosen
    assert chosen in AUTO_DROP_GRID


def test_drop_pct_auto_trains_and_logs_the_chosen_p():
    config = tiny_config(filter="iif", drop_pct="auto")
    a, b = (PPO(config, run_dir=False) for _ in range(2))
    for _ in range(2):
        ma, mb = a.train_round(), b.train_round()
        assert ma["drop_pct"] in AUTO_DROP_GRID and ma["drop_pct"] == mb["drop_pct"]
    assert all(torch.equal(x, y) for x, y in zip(_params(a), _params(b), strict=True))


@pytest.mark.parametrize("flags, message", [
    (["--filter", "none", "--drop-pct", "auto"], "drop_pct auto chooses p each round for --filter iif only"),
    (["--filter", "random", "--drop-pct", "auto"], "drop_pct auto chooses p each round for --filter iif only"),
    (["--filter", "iif", "--drop-pct", "auto", "--drop-mode", "neg"], "drop_mode neg drops every negative"),
    (["--filter", "iif", "--precondition", "adam", "--optimizer", "sgd"], "precondition adam"),
    (["--filter", "iif-robust", "--drop-pct", "25"], "--filter iif-robust sets --drop-pct itself"),
])
def test_bad_robust_options_are_one_error_line(flags, message, tmp_path, capsys):
    assert main(["train", "--env", "CartPole-v1", "--run-root", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


# -- Adam-faithful scores -----------------------------------------------------------------------
def _adam_trainer():
    trainer = PPO(tiny_config(optimizer="adam", learning_rate=3e-3, n_steps=256), run_dir=False)
    trainer.train_round()  # Adam's moments now hold a round of steps
    buffer = _round_buffer(trainer)
    trainer.policy.double()  # float64: the first-order check below is not lost in rounding
    for state in trainer.optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = state[key].double()
    return trainer, buffer.flat("obs").double(), buffer.flat("actions"), buffer.flat("advantages").double()


def test_adam_preconditioned_scores_predict_a_frozen_moment_adam_step():
    """For theta' = theta - lr P^-1 grad L_mb (the step Adam takes with its moments frozen, L_mb
    the minibatch's summed loss), f(theta') - f(theta) = lr * sum_{i in mb} score_i to first order."""
    trainer, obs, actions, advantages = _adam_trainer()
    policy, inverse = trainer.policy, adam_inverse_preconditioner(trainer.optimizer)
    assert inverse and all(torch.all(v > 0) for v in inverse.values())
    scores = snapshot_influence(policy, obs, actions, advantages, advantage_norm="none",
                                inverse_preconditioner=inverse)
    mb = torch.arange(64)

    def f():
        with torch.no_grad():
            return float((advantages * policy.log_prob(obs, actions)).mean())

    # f is the return target the scores are taken on: its weights are A_j / n
    assert torch.allclose(ReturnTarget().weighted_pairs(Records(obs, actions, advantages))[2], advantages / len(obs))
    lr = 1e-10  # small: P^-1 reaches 1 / eps = 1e5 where v is tiny, and the step with it
    f0 = f()
    loss = -(advantages[mb] * policy.log_prob(obs[mb], actions[mb])).sum()
    params = list(policy.policy_parameters())
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p -= lr * inverse[p] * g
    assert f() - f0 == pytest.approx(lr * float(scores[mb].sum()), rel=0.05)


def test_an_identity_preconditioner_gives_the_plain_scores():
    trainer, obs, actions, advantages = _adam_trainer()
    identity = {p: torch.ones_like(p) for p in trainer.policy.parameters()}
    plain = snapshot_influence(trainer.policy, obs, actions, advantages)
    assert torch.allclose(snapshot_influence(trainer.policy, obs, actions, advantages,
                                             inverse_preconditioner=identity), plain, rtol=1e-9, atol=1e-12)
    adam = snapshot_influence(trainer.policy, obs, actions, advantages,
                              inverse_preconditioner=adam_inverse_preconditioner(trainer.optimizer))
    assert not torch.allclose(adam, plain)


def test_precondition_adam_trains_with_the_trainers_adam():
    metrics = PPO(tiny_config(filter="iif", optimizer="adam", precondition="adam"), run_dir=False).learn()
    assert metrics.round == 2


# -- iif-robust ---------------------------------------------------------------------------------
def test_iif_robust_is_iif_with_the_recommended_options_written_out():
    config = PPOConfig.for_env("CartPole-v1", filter="iif-robust")
    assert config.filter == "iif" and config.method_label == "iif-robust"
    assert all(getattr(config, key) == value for key, value in ROBUST_IIF.items())
    assert PPOConfig.from_dict(config.to_dict()) == config  # config.json says what ran


def test_iif_robust_runs_on_a_preset_whose_p_differs_from_its_own():
    from rlinfluence.experiments import CompareConfig, plan_comparison
    from rlinfluence.ppo import PPOConfig

    config = PPOConfig.for_env("MiniGrid-Empty-8x8-v0", filter="iif-robust")  # the preset's p is 12.5
    assert (config.filter, config.drop_pct, config.method) == ("iif", "auto", "iif-robust")
    plan_comparison(CompareConfig(env="MiniGrid-Empty-8x8-v0", methods=("ppo", "iif-robust")))
