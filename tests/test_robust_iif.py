"""Issue 14 (part): step control by gradient length and the split-half signal gate."""

import copy

import numpy as np
import pytest
import torch

from rlinfluence.cli import main
from rlinfluence.filters import FilterContext, IIFFilter
from rlinfluence.losses import normalize_advantages
from rlinfluence.ppo import PPO

from .conftest import tiny_config


def _params(trainer):
    return [p.detach().clone() for p in trainer.policy.parameters()]


def test_step_control_norm_with_every_record_kept_is_the_plain_update():
    plain = PPO(tiny_config(), run_dir=False).learn()
    controlled = PPO(tiny_config(step_control="norm"), run_dir=False).learn()
    for a, b in zip(_params(plain), _params(controlled), strict=True):
        assert torch.equal(a, b)


def test_step_control_norm_gives_the_kept_records_the_full_buffers_gradient_length():
    trainer = PPO(tiny_config(), run_dir=False)
    buffer = trainer.collect()
    buffer.compute_advantages(0.99, 0.95)
    keep = buffer.flat("advantages") > buffer.flat("advantages").median()  # a very one-sided half
    scale = trainer.step_scale(buffer, keep)

    def grad(idx):  # brute force: the policy-loss gradient of one set, flattened
        obs, act, adv = (buffer.flat(k)[idx] for k in ("obs", "actions", "advantages"))
        trainer.policy.zero_grad()
        (-(normalize_advantages(adv) * trainer.policy.log_prob(obs, act)).mean()).backward()
        return torch.cat([p.grad.flatten() for p in trainer.policy.parameters() if p.grad is not None])

    full, kept = grad(torch.arange(len(buffer))), grad(keep.nonzero().squeeze(1))
    assert scale != pytest.approx(1.0, abs=0.05)
    assert float((scale * kept).norm()) == pytest.approx(float(full.norm()), rel=1e-5)
    assert trainer.step_scale(buffer, torch.ones(len(buffer), dtype=torch.bool)) == 1.0


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
        with pytest.raises(SystemExit) as exit_info:  # tyro rejects a value outside a Literal
            main(["train", "--env", "CartPole-v1", flag, value, "--run-root", str(tmp_path)])
        assert exit_info.value.code == 2 and value in capsys.readouterr().err
    assert main(["train", "--env", "CartPole-v1", "--gate-threshold", "2", "--run-root", str(tmp_path)]) == 2
    assert "gate_threshold must be in [-1, 1]" in capsys.readouterr().err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_gated_rounds_are_logged():
    trainer = PPO(tiny_config(filter="iif", gate="split-half", n_steps=256, batch_size=64), run_dir=False)
    metrics = trainer.train_round()
    assert metrics["gated"] in (0.0, 1.0) and "gate_reliability" in metrics and metrics["step_scale"] == 1.0
