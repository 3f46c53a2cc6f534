"""The KL-adaptive learning rate (``adaptive_kl``, RSL-RL's adaptive schedule): the rule and its
bounds, the rate carried from round to round and through a resume, a re-run of an adaptive round
reproducing theta(k+1) bit for bit (batched re-runs fall back to it), and the bad settings."""

import csv

import pytest
import torch

from rlinfluence.analysis.intervention import matches_checkpoint
from rlinfluence.checkpoint import load_round
from rlinfluence.errors import UserError
from rlinfluence.ppo import PPO
from rlinfluence.reruns import Variant, batched_retrain
from rlinfluence.step_control import adapt_learning_rate

from .conftest import tiny_config


@pytest.mark.parametrize(("rate", "kl", "expected"), [
    (1.0, 0.05, 1.0 / 1.5),   # kl > 2 x 0.01: shorter
    (1.0, 0.001, 1.5),        # 0 < kl < 0.01 / 2: longer
    (1.0, 0.0, 1.0),          # kl exactly 0 (the round's first step): unchanged
    (1.0, 0.01, 1.0),         # within [target / 2, 2 target]: unchanged
    (0.011, 0.05, 0.01),      # floor: learning_rate / 100
    (9.0, 0.001, 10.0),       # ceiling: 10 x learning_rate
])
def test_the_adaptive_rule_and_its_bounds(rate, kl, expected):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=rate)
    adapt_learning_rate(optimizer, kl, adaptive_kl=0.01, learning_rate=1.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)


def _rates(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [float(row["learning_rate"]) for row in csv.DictReader(f)]


def test_the_rate_moves_with_the_kl_and_resumes_where_it_was(run_root):
    cfg = tiny_config(run_root=str(run_root), total_timesteps=384, adaptive_kl=0.001, learning_rate=3e-3,
                      record_minibatches=True)
    trainer = PPO(cfg)
    first = trainer.train_round()
    lrs = [step.lr for step in trainer.schedule]
    assert len(set(lrs)) > 1  # it moved within the round, step by step
    assert trainer.learning_rate == first["learning_rate"] == lrs[-1]
    trainer.learn()
    rates = _rates(trainer.run.path)
    assert len(rates) == 3 and len(set(rates)) > 1
    # the checkpoint carries the rate, and a resumed run starts from it (resuming resets the
    # episodes, so a resumed round is compared with another resume of it)
    state = torch.load(trainer.run.path / "checkpoints" / "round_0002.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["lr"] == rates[1]
    resumed_rates, policies = [], []
    for _ in range(2):
        (trainer.run.path / "checkpoints" / "round_0003.pt").unlink()
        resumed = PPO.resume(trainer.run.path)
        assert resumed.learning_rate == rates[1]
        resumed.learn()
        resumed_rates.append(_rates(trainer.run.path))
        policies.append(resumed.policy.state_dict())
    assert resumed_rates[0] == resumed_rates[1] and resumed_rates[0][:2] == pytest.approx(rates[:2], rel=1e-12)
    torch.testing.assert_close(policies[0], policies[1], rtol=0, atol=0)


def test_a_constant_rate_is_logged_as_configured():
    metrics = PPO(tiny_config(learning_rate=1e-3), run_dir=False).train_round()
    assert metrics["learning_rate"] == 1e-3


def test_a_rerun_of_an_adaptive_round_reproduces_it_and_is_not_batched(run_root):
    cfg = tiny_config(run_root=str(run_root), total_timesteps=384, adaptive_kl=0.001, learning_rate=3e-3,
                      save_buffers=True)
    trainer = PPO(cfg).learn()
    saved = load_round(trainer.run.path, 1)
    start_rate = saved.trainer.learning_rate
    stats = saved.retrain()
    assert matches_checkpoint(saved.trainer, trainer.run.path, 2)
    assert stats["learning_rate"] == _rates(trainer.run.path)[1]
    assert saved.trainer.learning_rate == start_rate  # a re-run does not move the trainer's rate on
    serial = {n: p.detach().clone() for n, p in saved.trainer.policy.named_parameters()}
    with pytest.warns(UserWarning, match="KL-adaptive rate cannot be batched"):
        reruns = batched_retrain(saved, [Variant()])
    for name, param in serial.items():
        assert torch.equal(reruns.params[0][name], param), name


@pytest.mark.parametrize(("overrides", "message"), [
    ({"adaptive_kl": 0.0}, "adaptive_kl must be > 0"),
    ({"adaptive_kl": 0.01, "step_control": "kl"}, "adaptive_kl and step_control 'kl' both set"),
])
def test_bad_adaptive_settings_are_one_clear_error(overrides, message):
    with pytest.raises(UserError, match=message):
        tiny_config(**overrides).validate()
