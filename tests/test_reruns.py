"""Batched re-runs of a round's update equal serial re-runs (to float tolerance): keep masks, lr
scales and epoch counts; Adam and SGD; gradient-norm clipping on and off; an MLP (stacked), a
Gaussian policy with an entropy bonus and a CNN (vmapped); a
target_kl stop; and they leave the trainer at theta(k)."""

import numpy as np
import pytest
import torch

from rlinfluence.checkpoint import load_round
from rlinfluence.ppo import PPO, PPOConfig
from rlinfluence.reruns import Variant, batched_retrain


def _saved(tmp_path, round_index=1, **overrides):
    settings = {"env": "CartPole-v1", "n_envs": 4, "n_steps": 64, "batch_size": 64, "n_epochs": 3,
                "total_timesteps": 3 * 256, "eval_episodes": 0, "save_buffers": True, "seed": 5,
                "run_root": str(tmp_path), "progress": False, "tensorboard": False, **overrides}
    trainer = PPO(PPOConfig(**settings)).learn()
    return load_round(trainer.run.path, round_index)


def _variants(n):
    rng = np.random.default_rng(0)
    half = torch.from_numpy(rng.random(n) < 0.5)
    most = torch.from_numpy(rng.random(n) < 0.8)
    return [Variant(), Variant(keep=half), Variant(keep=most, lr_scale=0.5), Variant(n_epochs=1),
            Variant(keep=half, lr_scale=3.0, n_epochs=2)]


def _serial(saved, variants):
    out = []
    for v in variants:
        saved.retrain(v.keep, v.lr_scale, v.n_epochs)
        out.append({n: p.detach().clone() for n, p in saved.trainer.policy.named_parameters()})
    return out


@pytest.mark.parametrize("overrides", [
    {},
    {"optimizer": "sgd", "learning_rate": 0.05},
    {"max_grad_norm": None},
    {"env": "MiniGrid-Empty-5x5-v0", "n_steps": 32, "batch_size": 32},
    {"env": "Pendulum-v1", "ent_coef": 0.01, "learning_rate": 0.003},
], ids=["adam-clipped", "sgd", "adam-unclipped", "cnn", "gaussian-entropy"])
def test_batched_reruns_equal_serial_reruns(tmp_path, overrides):
    saved = _saved(tmp_path, **overrides)
    variants = _variants(len(saved.buffer))
    start = {n: p.detach().clone() for n, p in saved.trainer.policy.named_parameters()}
    batched = batched_retrain(saved, variants)
    for name, param in saved.trainer.policy.named_parameters():  # left at theta(k)
        assert torch.equal(param, start[name]), name
    serial = _serial(saved, variants)
    batch = saved.trainer.config.batch_size
    kept = [len(saved.buffer) if v.keep is None else int(v.keep.sum()) for v in variants]
    assert batched.n_updates == [(3 if v.n_epochs is None else v.n_epochs) * (n // batch)
                                 for v, n in zip(variants, kept, strict=True)]
    worst = 0.0
    for k, expected in enumerate(serial):
        for name, tensor in expected.items():
            moved = (tensor - start[name]).abs().max()
            error = (batched.params[k][name] - tensor).abs().max()
            worst = max(worst, float(error / moved))
            assert error <= 1e-4 * float(moved), (k, name, float(error), float(moved))
        assert not all(torch.equal(expected[n], start[n]) for n in start), k  # the variant moved
    print(f"largest error relative to the move: {worst:.2e}")


def test_a_variant_stops_where_target_kl_stops_its_serial_rerun(tmp_path):
    saved = _saved(tmp_path, target_kl=0.002, learning_rate=0.01)
    variants = [Variant(), Variant(lr_scale=0.05)]
    batched = batched_retrain(saved, variants)
    serial_steps = [saved.retrain(v.keep, v.lr_scale)["n_updates"] for v in variants]
    assert batched.n_updates == serial_steps and serial_steps[0] < serial_steps[1]
    serial = _serial(saved, variants)
    for k in range(2):
        for name, tensor in serial[k].items():
            assert torch.allclose(batched.params[k][name], tensor, atol=1e-5), (k, name)
