"""The NumPy update engine (``update_engine="numpy"``): one step's gradient equals autograd's for
every loss option it covers, Adam's moments land in torch's layout (a torch step and a checkpoint
take them), the trainer with it stays close to the torch engine, target_kl still stops it, and
what it does not cover is refused with one line."""

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlinfluence.analysis.intervention import matches_checkpoint
from rlinfluence.checkpoint import load_round
from rlinfluence.errors import UserError
from rlinfluence.losses import ppo_loss
from rlinfluence.numpy_update import NumpyUpdate
from rlinfluence.policies import make_policy
from rlinfluence.ppo import PPO
from rlinfluence.reruns import Variant, batched_retrain

from .conftest import tiny_config

OBS = gym.spaces.Box(-1, 1, (6,), np.float32)
DISCRETE, BOX = gym.spaces.Discrete(4), gym.spaces.Box(-1, 1, (2,), np.float32)


def _policy(action_space, hidden=(16, 16)):
    torch.manual_seed(0)
    policy = make_policy(OBS, action_space, hidden)
    with torch.no_grad():  # away from the near-zero heads of the init, so every term has a gradient
        for p in policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return policy


def _minibatch(policy, action_space, b=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    obs = torch.rand(b, 6, generator=g) * 2 - 1
    actions = (torch.randint(0, 4, (b,), generator=g) if action_space is DISCRETE
               else torch.rand(b, 2, generator=g) * 2 - 1)
    with torch.no_grad():  # old log-probs and values off the current ones: ratios on both sides of the clip
        old_logp = policy.log_prob(obs, actions) + 0.3 * torch.randn(b, generator=g)
        old_values = policy.value(obs) + 0.3 * torch.randn(b, generator=g)
    return obs, actions, old_logp, torch.randn(b, generator=g), torch.randn(b, generator=g), old_values


CASES = [
    dict(action_space=DISCRETE),
    dict(action_space=BOX),
    dict(action_space=DISCRETE, ent_coef=0.05),
    dict(action_space=BOX, ent_coef=0.05),
    dict(action_space=DISCRETE, clip_range_vf=0.1),
    dict(action_space=DISCRETE, normalize_advantage=False),
    dict(action_space=DISCRETE, max_grad_norm=0.1),
    dict(action_space=BOX, max_grad_norm=0.1),
    dict(action_space=DISCRETE, hidden=()),
    dict(action_space=BOX, hidden=(8,)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_one_sgd_step_is_autograds(case, one_thread):
    case = dict(case)
    action_space, hidden = case.pop("action_space"), case.pop("hidden", (16, 16))
    max_grad_norm = case.pop("max_grad_norm", None)
    kwargs = dict(clip_range=0.2, clip_range_vf=None, vf_coef=0.5, ent_coef=0.0, normalize_advantage=True) | case
    reference = _policy(action_space, hidden)
    policy = copy.deepcopy(reference)
    batch = _minibatch(reference, action_space)
    out = ppo_loss(reference, *batch, **kwargs)
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm) if max_grad_norm else None
    if max_grad_norm:
        assert norm > max_grad_norm  # the clip binds
    engine = NumpyUpdate(policy, torch.optim.SGD(policy.parameters(), lr=1.0), max_grad_norm=max_grad_norm, **kwargs)
    engine.begin()
    terms = engine.forward(*(t.numpy() for t in batch))
    engine.step(1.0)
    engine.end()
    assert float(terms.per_record.mean()) == pytest.approx(out.loss.item(), rel=1e-5)
    assert float(terms.entropy.mean()) == pytest.approx(out.entropy, rel=1e-5)
    for (name, before), after in zip(reference.named_parameters(), policy.parameters(), strict=True):
        step = before.detach() - after.detach()  # lr 1: the step is the gradient
        assert before.grad is not None and before.grad.abs().max() > 0, name
        torch.testing.assert_close(step, before.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("action_space", [DISCRETE, BOX])
def test_adam_steps_match_torch_and_leave_torch_state(action_space, one_thread):
    kwargs = dict(clip_range=0.2, clip_range_vf=None, vf_coef=0.5, ent_coef=0.01, normalize_advantage=True)
    reference = _policy(action_space)
    policy = copy.deepcopy(reference)
    reference_opt = torch.optim.Adam(reference.parameters(), lr=1e-3, eps=1e-5)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3, eps=1e-5)
    engine = NumpyUpdate(policy, optimizer, max_grad_norm=None, **kwargs)
    for update in range(2):  # the second update reads back the state the first wrote
        engine.begin()
        for step in range(3):
            batch = _minibatch(reference, action_space, seed=10 * update + step)
            reference_opt.zero_grad()
            ppo_loss(reference, *batch, **kwargs).loss.backward()
            reference_opt.step()
            engine.forward(*(t.numpy() for t in batch))
            engine.step(optimizer.param_groups[0]["lr"])
        engine.end()
    for a, b in zip(reference.parameters(), policy.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        ours, theirs = optimizer.state[b], reference_opt.state[a]
        assert float(ours["step"]) == float(theirs["step"]) == 6
        torch.testing.assert_close(ours["exp_avg"], theirs["exp_avg"], rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(ours["exp_avg_sq"], theirs["exp_avg_sq"], rtol=1e-3, atol=1e-8)
    # torch's Adam steps on from that state, and it saves and loads without pickle
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert all(float(optimizer.state[p]["step"]) == 7 for p in policy.parameters())


def test_the_trainer_with_it_stays_close_to_torch(run_root, one_thread):
    """Round 0 collects the same records (the same theta(0)); after one update of 8 SGD steps the
    engines' parameters differ by float rounding only, and the second round trains on."""
    trainers = {engine: PPO(tiny_config(run_root=str(run_root / engine), update_engine=engine, learning_rate=3e-3),
                            run_dir=False) for engine in ("torch", "numpy")}
    stats = {engine: trainer.train_round() for engine, trainer in trainers.items()}
    assert stats["numpy"]["n_updates"] == stats["torch"]["n_updates"] == 8
    for name in ("policy_loss", "value_loss", "approx_kl", "entropy"):
        assert stats["numpy"][name] == pytest.approx(stats["torch"][name], rel=1e-4, abs=1e-7), name
    for a, b in zip(trainers["torch"].policy.parameters(), trainers["numpy"].policy.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert np.isfinite(trainers["numpy"].train_round()["value_loss"])


def test_target_kl_stops_it(run_root, one_thread):
    """The first step's kl is float rounding (~1e-10): it steps; one step of lr 0.5 puts the next
    minibatch's past 1.5 x 1e-6, which stops the update there, as the torch engine's."""
    trainer = PPO(tiny_config(run_root=str(run_root), update_engine="numpy", target_kl=1e-6, learning_rate=0.5),
                  run_dir=False)
    assert [trainer.train_round()["n_updates"] for _ in range(2)] == [1, 1]


def test_a_saved_round_of_it_rerun_is_its_checkpoint_and_not_batched(run_root, one_thread):
    """Re-runs of a NumPy-trained round take the run's own arithmetic, so the full re-run is
    theta(k+1) bit for bit (torch's batched kernels would not be); Adam's state resumes too."""
    cfg = tiny_config(run_root=str(run_root), total_timesteps=384, update_engine="numpy", optimizer="adam",
                      learning_rate=1e-3, save_buffers=True)
    trainer = PPO(cfg).learn()
    state = torch.load(trainer.run.path / "checkpoints" / "round_0002.pt", weights_only=True)
    assert state["optimizer"]["state"][0]["step"] == 16  # two rounds of 8 steps, in torch's layout
    saved = load_round(trainer.run.path, 1)
    saved.retrain()
    assert matches_checkpoint(saved.trainer, trainer.run.path, 2)
    serial = {n: p.detach().clone() for n, p in saved.trainer.policy.named_parameters()}
    reruns = batched_retrain(saved, [Variant()])  # one by one, in the run's own arithmetic
    for name, param in serial.items():
        assert torch.equal(reruns.params[0][name], param), name


def test_what_it_does_not_cover_is_refused():
    image = gym.spaces.Box(0, 255, (7, 7, 3), np.uint8)
    cnn = make_policy(image, DISCRETE)
    with pytest.raises(UserError, match="update_engine numpy covers MLP policies.*MiniGridCNN"):
        NumpyUpdate(cnn, torch.optim.SGD(cnn.parameters(), lr=0.1), clip_range=0.2, clip_range_vf=None,
                    vf_coef=0.5, ent_coef=0.0, normalize_advantage=True, max_grad_norm=None)
    mlp = make_policy(OBS, DISCRETE)
    with pytest.raises(UserError, match="momentum"):
        NumpyUpdate(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1, momentum=0.9), clip_range=0.2,
                    clip_range_vf=None, vf_coef=0.5, ent_coef=0.0, normalize_advantage=True, max_grad_norm=None)
    for option in ("tracin", "compile"):
        with pytest.raises(UserError, match=f"update_engine numpy and {option}"):
            tiny_config(update_engine="numpy", **{option: True}).validate()


def test_auto_takes_numpy_where_it_covers_the_run_torch_elsewhere_and_records_the_choice(tmp_path, capsys):
    """The default (``update_engine`` auto): NumPy for an MLP with SGD or Adam, torch for AdamW, tracin or
    a CNN; said once on stderr with progress, and the run's config.json holds the engine chosen."""
    import json

    trainer = PPO(tiny_config(run_root=str(tmp_path / "auto"), progress=True))
    assert trainer.config.update_engine == "numpy" and trainer._numpy_update is not None
    assert json.loads((trainer.run.path / "config.json").read_text())["update_engine"] == "numpy"
    said = [line for line in capsys.readouterr().err.splitlines() if "update_engine auto" in line]
    assert len(said) == 1 and "the numpy update" in said[0], said
    for settings, why in ((dict(optimizer="adamw"), "AdamW"), (dict(tracin=True, save_buffers=True), "tracin"),
                          (dict(env="MiniGrid-Empty-5x5-v0"), "MiniGridCNN")):
        trainer = PPO(tiny_config(progress=True, **settings), run_dir=False)
        assert trainer.config.update_engine == "torch", settings
        assert why in capsys.readouterr().err


def test_studies_another_trainers_runs_and_runs_from_before_the_choice_keep_the_torch_update():
    """A comparison pins torch (its published figures were trained with it) unless --set says otherwise;
    a run's config.json without the key was written by the torch update."""
    from rlinfluence.config import PPOConfig
    from rlinfluence.experiments.specs import CompareConfig, config_difference

    study = CompareConfig(env="CartPole-v1", methods=("ppo",))
    assert study.run_config("ppo", 1).update_engine == "torch"
    study = CompareConfig(env="CartPole-v1", methods=("ppo",), set=("update_engine=auto",))
    assert study.run_config("ppo", 1).update_engine == "auto"
    saved = PPOConfig().to_dict()
    del saved["update_engine"]
    assert PPOConfig.from_dict(saved).update_engine == "torch"
    # a study asking auto resumes its runs, which recorded the engine auto chose
    assert config_difference({**saved, "update_engine": "numpy"}, {**saved, "update_engine": "auto"}) == []
    assert config_difference({**saved, "update_engine": "numpy"}, {**saved, "update_engine": "torch"}) == ["update_engine"]
