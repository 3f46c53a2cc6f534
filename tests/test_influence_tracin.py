"""Full local TracIn: brute-force replay and the first-order identity (issue 3)."""

from __future__ import annotations

import copy

import gymnasium as gym
import pytest
import torch
from torch import nn

from rlinfluence.buffer import MinibatchStep
from rlinfluence.influence import ActionTarget, tracin_influence
from rlinfluence.losses import ppo_loss
from rlinfluence.policies import make_policy

N, BATCH = 24, 8


pytestmark = pytest.mark.usefixtures("one_thread")


def cast_encoder_output(policy: nn.Module) -> nn.Module:
    """``policy.double()``; the library encoders cast observations with ``.float()``, so recast after them."""
    policy.double()
    if hasattr(policy.encoder, "convs"):
        policy.encoder.convs.register_forward_pre_hook(lambda module, args: (args[0].double(),))
    else:
        policy.encoder.register_forward_hook(lambda module, args, out: out.double())
    return policy


def make_round(kind: str, n: int = N, seed: int = 0):
    """(policy at theta(k), buffer fields dict) in float64, with old log-probs/values from the policy."""
    torch.manual_seed(seed)
    if kind == "mlp":
        policy = make_policy(gym.spaces.Box(-1, 1, (6,)), gym.spaces.Discrete(4), hidden_sizes=(16, 16))
        obs, actions = torch.randn(n, 6), torch.randint(0, 4, (n,))
    elif kind == "cnn":
        policy = make_policy(gym.spaces.Box(0, 255, (7, 7, 3), dtype="uint8"), gym.spaces.Discrete(5), hidden_sizes=(16,))
        obs, actions = torch.randint(0, 11, (n, 7, 7, 3), dtype=torch.uint8) * 20, torch.randint(0, 5, (n,))
    elif kind == "layernorm":  # LayerNorm's parameters take the forward-mode path, the Linear ones ghost
        policy = make_policy(gym.spaces.Box(-1, 1, (6,)), gym.spaces.Discrete(4), hidden_sizes=(16, 16))
        policy.actor = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        nn.init.normal_(policy.actor[1].weight, 1.0, 0.3)
        nn.init.normal_(policy.actor[1].bias, 0.0, 0.3)
        obs, actions = torch.randn(n, 6), torch.randint(0, 4, (n,))
    elif kind == "hooked":  # a user hook rescales a layer's output: its ghost terms fail verification
        policy = make_policy(gym.spaces.Box(-1, 1, (6,)), gym.spaces.Discrete(4), hidden_sizes=(16, 16))
        policy.actor[0].register_forward_hook(lambda module, args, out: out * 1.5)
        obs, actions = torch.randn(n, 6), torch.randint(0, 4, (n,))
    else:
        policy = make_policy(gym.spaces.Box(-1, 1, (5,)), gym.spaces.Box(-1, 1, (2,)), hidden_sizes=(16, 16))
        obs, actions = torch.randn(n, 5), torch.randn(n, 2)
    nn.init.normal_(policy.action_head.weight, std=0.5)
    policy = cast_encoder_output(policy)
    obs = obs if obs.dtype == torch.uint8 else obs.double()
    actions = actions.double() if actions.is_floating_point() else actions
    with torch.no_grad():
        logp, _, values = policy.evaluate_actions(obs, actions)
    advantages = torch.randn(n, dtype=torch.float64) + 0.2
    data = {"obs": obs, "actions": actions, "old_logp": logp, "advantages": advantages,
            "returns": advantages + values + 0.1 * torch.randn(n, dtype=torch.float64), "old_values": values}
    return policy, data


def make_schedule(n: int, batch: int, epochs: int, lr: float, seed: int = 0) -> list[MinibatchStep]:
    generator = torch.Generator().manual_seed(seed)
    return [
        MinibatchStep(epoch, perm[start : start + batch], lr)
        for epoch in range(epochs)
        for perm in [torch.randperm(n, generator=generator)]
        for start in range(0, n - batch + 1, batch)
    ]


def minibatch(data: dict, idx: torch.Tensor, normalize: bool = True):
    adv = data["advantages"][idx]
    if normalize:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    return data["obs"][idx], data["actions"][idx], data["old_logp"][idx], adv, data["returns"][idx], data["old_values"][idx]


def return_target(policy: nn.Module, data: dict) -> torch.Tensor:
    return (data["advantages"] * policy.log_prob(data["obs"], data["actions"])).mean()


def train(policy: nn.Module, data: dict, schedule, optimizer: torch.optim.Optimizer, loss_kwargs: dict,
          max_grad_norm: float | None = None) -> None:
    """The trainer's update: the minibatch's mean PPO loss, optional clipping, optimiser step."""
    for step in schedule:
        loss = ppo_loss(policy, *minibatch(data, step.indices, normalize=False), normalize_advantage=True, **loss_kwargs).loss
        optimizer.zero_grad()
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = step.lr
        optimizer.step()


def brute_force_tracin(policy, data, schedule, optimizer, loss_kwargs, max_grad_norm=None) -> torch.Tensor:
    """I_i = sum_j lr_j c_j <grad f(theta_j), -grad ell_{j,i}(theta_j) / b>, each record on its own."""
    replica = copy.deepcopy(policy)
    params = list(replica.policy_parameters())
    opt = type(optimizer)(replica.parameters(), **optimizer.defaults)
    opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    influence = torch.zeros(len(data["advantages"]), dtype=torch.float64)
    for step in schedule:
        batch = minibatch(data, step.indices)
        target_grad = torch.autograd.grad(return_target(replica, data), params)
        opt.zero_grad()
        ppo_loss(replica, *batch, normalize_advantage=False, **loss_kwargs).loss.backward()
        clip = 1.0
        if max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(replica.parameters(), max_grad_norm))
            clip = min(1.0, max_grad_norm / (norm + 1e-6))
        for k, i in enumerate(step.indices.tolist()):
            record = tuple(x[k : k + 1] for x in batch)
            ell = ppo_loss(replica, *record, normalize_advantage=False, **loss_kwargs).loss
            grads = torch.autograd.grad(ell, params, allow_unused=True)
            term = sum((g * t).sum() for g, t in zip(grads, target_grad, strict=True) if g is not None)
            influence[i] += step.lr * clip / len(step.indices) * -term
        for group in opt.param_groups:
            group["lr"] = step.lr
        opt.step()
    return influence


@pytest.mark.parametrize(
    ("kind", "optimizer_name", "max_grad_norm", "loss_kwargs"),
    [
        ("mlp", "sgd", None, {"clip_range": 0.2}),
        ("cnn", "sgd", None, {"clip_range": 0.2, "vf_coef": 0.5}),
        ("gaussian", "adam", 0.5, {"clip_range": 0.1, "clip_range_vf": 0.2, "ent_coef": 0.01}),
        ("layernorm", "sgd", 0.5, {"clip_range": 0.2, "ent_coef": 0.01}),
        ("hooked", "sgd", None, {"clip_range": 0.2}),
    ],
)
def test_tracin_matches_brute_force_replay(kind, optimizer_name, max_grad_norm, loss_kwargs):
    policy, data = make_round(kind)
    schedule = make_schedule(N, BATCH, epochs=2, lr=0.05)
    if optimizer_name == "adam":  # moments from an earlier step, as the trainer carries them across rounds
        optimizer = torch.optim.Adam(policy.parameters(), lr=0.05, eps=1e-5)
        warm = copy.deepcopy(policy)
        warm_opt = torch.optim.Adam(warm.parameters(), lr=0.05, eps=1e-5)
        train(warm, data, schedule[:1], warm_opt, loss_kwargs)
        optimizer.load_state_dict(warm_opt.state_dict())
        given = optimizer
    else:
        optimizer, given = torch.optim.SGD(policy.parameters(), lr=0.05), None
    before = copy.deepcopy(policy.state_dict())
    state_before = copy.deepcopy(optimizer.state_dict())

    ours = tracin_influence(
        policy, data["obs"], data["actions"], data["old_logp"], data["advantages"], data["returns"],
        data["old_values"], schedule, optimizer=given, max_grad_norm=max_grad_norm, **loss_kwargs,
    )
    reference = brute_force_tracin(policy, data, schedule, optimizer, loss_kwargs, max_grad_norm)
    assert float((ours - reference).abs().max() / reference.abs().max()) < 1e-9
    for name, value in policy.state_dict().items():  # the policy and the optimiser are untouched
        assert torch.equal(value, before[name]), name
    assert str(optimizer.state_dict()) == str(state_before)


@pytest.mark.parametrize(("kind", "max_grad_norm"), [("mlp", None), ("cnn", None), ("gaussian", None), ("mlp", 0.05)])
def test_first_order_identity_with_plain_sgd(kind, max_grad_norm):
    """f(theta(k+1)) - f(theta(k)) ~= sum_i I_i at a small learning rate."""
    policy, data = make_round(kind, n=64)
    schedule = make_schedule(64, 16, epochs=2, lr=5e-4)
    loss_kwargs = {"clip_range": 0.2}
    scores = tracin_influence(
        policy, data["obs"], data["actions"], data["old_logp"], data["advantages"], data["returns"],
        data["old_values"], schedule, max_grad_norm=max_grad_norm, **loss_kwargs,
    )
    trained = copy.deepcopy(policy)
    train(trained, data, schedule, torch.optim.SGD(trained.parameters(), lr=5e-4), loss_kwargs, max_grad_norm)
    with torch.no_grad():
        change = float(return_target(trained, data) - return_target(policy, data))
    assert abs(change) > 1e-6
    assert abs(float(scores.sum()) - change) / abs(change) < 0.05


def test_tracin_with_action_target_and_records_outside_every_minibatch():
    policy, data = make_round("mlp")
    schedule = [MinibatchStep(0, torch.arange(0, 8), 0.01), MinibatchStep(0, torch.arange(4, 12), 0.01)]
    target = ActionTarget(data["obs"][20], data["actions"][20])
    scores = tracin_influence(
        policy, data["obs"], data["actions"], data["old_logp"], data["advantages"], data["returns"],
        data["old_values"], schedule, target=target,
    )
    assert torch.all(scores[12:] == 0) and torch.all(scores[:12] != 0)


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_the_trainer_records_the_replays_tracin_and_trains_unchanged(tmp_path, max_grad_norm):
    """PPOConfig.tracin: the scores recorded inside the update equal the replay of the saved round,
    and the run's parameters are those of the same run without recording, bit for bit."""
    from rlinfluence.analysis.validation import score_round
    from rlinfluence.checkpoint import load_round
    from rlinfluence.influence import ReturnTarget
    from rlinfluence.ppo import PPO, PPOConfig

    def run(tracin: bool) -> PPO:
        config = PPOConfig(env="CartPole-v1", n_envs=2, n_steps=64, batch_size=32, n_epochs=2, total_timesteps=256,
                           max_grad_norm=max_grad_norm, eval_episodes=0, tensorboard=False, progress=False,
                           save_buffers=True, tracin=tracin, run_root=str(tmp_path / str(tracin)),
                           update_engine="torch")  # auto would take numpy without tracin: another arithmetic
        return PPO(config).learn()

    recorded, plain = run(True), run(False)
    for name, value in plain.policy.state_dict().items():
        assert torch.equal(value, recorded.policy.state_dict()[name]), name
    for k in (0, 1):
        saved = load_round(recorded.run.path, k)
        assert saved.tracin is not None and saved.tracin.shape == (128,) and bool(saved.tracin.ne(0).all())
        replay = score_round(saved, ReturnTarget(), "full", 0)
        assert float((saved.tracin - replay).abs().max() / replay.abs().max()) < 1e-5
    # audit's tracin scorer reads the recorded scores, and replays a round trained without them
    from rlinfluence.analysis.harm import _tracin

    recorded_round, plain_round = load_round(recorded.run.path, 1), load_round(plain.run.path, 1)
    assert plain_round.tracin is None
    assert torch.equal(torch.from_numpy(_tracin(recorded_round)), -recorded_round.tracin.double())
    torch.testing.assert_close(torch.from_numpy(_tracin(plain_round)), -recorded_round.tracin.double(),
                               rtol=1e-5, atol=1e-5 * float(recorded_round.tracin.abs().max()))
    rows = recorded.run.rows
    assert all(row["tracin_seconds"] > 0 for row in rows)


def test_scoring_memory_grows_with_records_not_records_times_parameters():
    """100,000 records, a 256-256 policy (~68k attributed parameters): an [N, parameters] tensor
    would be ~27 GB. Snapshot scores and full TracIn (two steps, so the target spans every
    record) must allocate well under 0.4 GB beyond their inputs (peak resident set, own process)."""
    import subprocess
    import sys

    code = """
import resource, torch, gymnasium as gym
from rlinfluence.buffer import MinibatchStep
from rlinfluence.influence import snapshot_influence, tracin_influence
from rlinfluence.policies import make_policy
torch.set_num_threads(1)
policy = make_policy(gym.spaces.Box(-1, 1, (8,)), gym.spaces.Discrete(4), hidden_sizes=(256, 256))
n = 100_000
g = torch.Generator().manual_seed(0)
obs, actions, adv = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g), torch.randn(n, generator=g)
with torch.no_grad():
    logp, _, values = policy.evaluate_actions(obs, actions)
steps = [MinibatchStep(0, torch.arange(64), 1e-3), MinibatchStep(0, torch.arange(64, 128), 1e-3)]
snapshot_influence(policy, obs[:256], actions[:256], adv[:256], chunk_size=64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
snapshot_influence(policy, obs, actions, adv, chunk_size=64)
tracin_influence(policy, obs, actions, logp, adv, adv + values, values, steps)
params = sum(p.numel() for p in policy.policy_parameters())
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, params)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak_mb, params = (float(x) for x in out.stdout.split())
    assert params * 100_000 * 4 / 2**20 > 20_000  # the tensor that must never exist: > 20 GB
    assert peak_mb < 400, peak_mb


def test_a_step_without_target_gradient_adds_nothing_and_a_round_of_them_is_refused():
    """All advantages 0: grad f = 0 at every step. The recorder (as the trainer runs it) adds
    zeros and counts the steps; tracin_influence refuses the round as the snapshot scorer does."""
    from rlinfluence.influence import Records, TracInRecorder, ZeroTargetGradient

    policy, data = make_round("mlp")
    data["advantages"] = torch.zeros(N, dtype=torch.float64)
    schedule = make_schedule(N, BATCH, epochs=1, lr=0.05)
    recorder = TracInRecorder(policy, Records(data["obs"], data["actions"], data["advantages"]),
                              loss_kwargs={"clip_range": 0.2})
    for step in schedule:
        batch = minibatch(data, step.indices, normalize=False)
        policy.zero_grad()
        with recorder.capture(batch):
            ppo_loss(policy, *batch, normalize_advantage=False, clip_range=0.2).loss.backward()
        recorder.record(step.indices, step.lr)
    assert recorder.zero_target_steps == len(schedule) and torch.all(recorder.scores() == 0)
    with pytest.raises(ZeroTargetGradient):
        tracin_influence(policy, data["obs"], data["actions"], data["old_logp"], data["advantages"],
                         data["returns"], data["old_values"], schedule)


def test_tracin_in_training_needs_saved_buffers():
    from rlinfluence.errors import UserError
    from rlinfluence.ppo import PPOConfig

    with pytest.raises(UserError, match="--tracin needs --save-buffers"):
        PPOConfig(env="CartPole-v1", tracin=True).validate()
