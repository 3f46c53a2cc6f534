"""Snapshot influence, targets and the ghost engine against per-record autograd; bad input;
no trace of scoring on the policy or on training (issue 3)."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import gymnasium as gym
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rlinfluence.buffer import MinibatchStep, RolloutBuffer
from rlinfluence.influence import (
    ActionTarget,
    Records,
    ReturnTarget,
    Target,
    ZeroTargetGradient,
    chunk_permutation,
    ghost,
    gradient_alignment,
    per_record_dots,
    plan_ghost,
    return_and_alignment_scores,
    score_buffer,
    snapshot_influence,
    top_records,
    tracin_influence,
)
from rlinfluence.influence.snapshot import _log_prob
from rlinfluence.losses import ppo_loss
from rlinfluence.policies import make_policy

N = 40  # records; chunks of 16 leave a partial last chunk
TOL = {torch.float64: 1e-9, torch.float32: 1e-4}


pytestmark = pytest.mark.usefixtures("one_thread")


# -- policies ------------------------------------------------------------------------------------
class LayerNormPolicy(nn.Module):
    """Categorical policy with a LayerNorm; no ``policy_parameters``; a value head log_prob never uses."""

    def __init__(self, obs_dim: int = 6, n_actions: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, 16), nn.LayerNorm(16), nn.Tanh())
        self.head = nn.Linear(16, n_actions)
        self.value_head = nn.Linear(16, 1)
        with torch.no_grad():  # non-trivial affine LayerNorm parameters
            self.body[1].weight.uniform_(0.5, 1.5)
            self.body[1].bias.uniform_(-0.5, 0.5)

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(obs))
        return torch.log_softmax(logits, -1).gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)


def to_float64(policy: nn.Module) -> nn.Module:
    """``policy.double()``; the library encoders cast observations with ``.float()``, so recast after them."""
    policy.double()
    if hasattr(policy, "encoder") and hasattr(policy.encoder, "convs"):
        policy.encoder.convs.register_forward_pre_hook(lambda module, args: (args[0].double(),))
    elif hasattr(policy, "encoder"):
        policy.encoder.register_forward_hook(lambda module, args, out: out.double())
    return policy


def make_case(kind: str, dtype: torch.dtype, n: int = N, seed: int = 0):
    """(policy, obs, actions, raw advantages) for one policy kind."""
    torch.manual_seed(seed)
    if kind == "mlp":
        policy = make_policy(gym.spaces.Box(-1, 1, (6,)), gym.spaces.Discrete(4), hidden_sizes=(16, 16))
        obs, actions = torch.randn(n, 6), torch.randint(0, 4, (n,))
    elif kind == "cnn":
        policy = make_policy(gym.spaces.Box(0, 255, (7, 7, 3), dtype="uint8"), gym.spaces.Discrete(7), hidden_sizes=(16,))
        obs, actions = torch.randint(0, 11, (n, 7, 7, 3), dtype=torch.uint8) * 20, torch.randint(0, 7, (n,))
    elif kind == "gaussian":
        policy = make_policy(gym.spaces.Box(-1, 1, (5,)), gym.spaces.Box(-1, 1, (2,)), hidden_sizes=(16, 16))
        with torch.no_grad():
            policy.log_std.copy_(torch.tensor([-0.3, 0.2]))
        obs, actions = torch.randn(n, 5), torch.randn(n, 2)
    elif kind == "layernorm":
        policy = LayerNormPolicy()
        obs, actions = torch.randn(n, 6), torch.randint(0, 3, (n,))
    else:
        raise AssertionError(kind)
    for name, module in policy.named_modules():  # larger action heads: non-degenerate gradients
        if name in ("action_head", "head"):
            nn.init.normal_(module.weight, std=0.5)
    advantages = torch.randn(n, dtype=torch.float64) * 2 + 0.3
    if dtype == torch.float64:
        policy = to_float64(policy)
        obs = obs if obs.dtype == torch.uint8 else obs.double()
        actions = actions.double() if actions.is_floating_point() else actions
    return policy, obs, actions, advantages.to(dtype)


def default_params(policy: nn.Module) -> list[nn.Parameter]:
    if hasattr(policy, "policy_parameters"):
        return list(policy.policy_parameters())
    return [p for name, p in policy.named_parameters() if not name.startswith("value_head")]


# -- references, written independently of the library ------------------------------------------
def normalized(adv: torch.Tensor, mode: str, chunk: int) -> torch.Tensor:
    def norm(a: torch.Tensor) -> torch.Tensor:
        return a if len(a) == 1 else (a - a.mean()) / (a.std() + 1e-8)

    if mode == "none":
        return adv
    if mode == "batch":
        return norm(adv)
    return torch.cat([norm(adv[i : i + chunk]) for i in range(0, len(adv), chunk)])


def gradient(value: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return sum((x * y).sum() for x, y in zip(a, b, strict=True))


def brute_force(policy, params, obs, actions, weights, target_grad, ent_coef: float = 0.0) -> torch.Tensor:
    """score_i = <grad(w_i log pi(a_i|s_i) + c H_i), grad f>, each record on its own."""
    scores = []
    for i in range(len(obs)):
        if ent_coef:
            logp, entropy, _ = policy.evaluate_actions(obs[i : i + 1], actions[i : i + 1])
            gain = weights[i] * logp.sum() + ent_coef * entropy.sum()
        else:
            gain = weights[i] * policy.log_prob(obs[i : i + 1], actions[i : i + 1]).sum()
        scores.append(dot(gradient(gain, params), target_grad))
    return torch.stack(scores)


def return_target_grad(policy, params, obs, actions, advantages) -> list[torch.Tensor]:
    return gradient((advantages * policy.log_prob(obs, actions)).mean(), params)


def assert_close(ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    scale = reference.abs().max()
    assert scale > 0
    error = float((ours.to(reference.dtype) - reference).abs().max() / scale)
    assert error < TOL[dtype], f"relative error {error:.2e}"


KINDS = ["mlp", "cnn", "gaussian", "layernorm"]
DTYPES = [torch.float64, torch.float32]


# -- brute force --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target_kind", ["return", "action", "validation"])
def test_snapshot_matches_per_record_autograd(kind, dtype, target_kind):
    policy, obs, actions, adv = make_case(kind, dtype)
    params = default_params(policy)
    if target_kind == "return":  # shared-forward path
        target, target_grad = ReturnTarget(), return_target_grad(policy, params, obs, actions, adv)
    elif target_kind == "action":  # mean over 3 pairs, generic path
        target = ActionTarget(obs[5:8], actions[5:8])
        target_grad = gradient(policy.log_prob(obs[5:8], actions[5:8]).mean(), params)
    else:  # explicit validation set
        _, v_obs, v_actions, v_adv = make_case(kind, dtype, n=12, seed=1)
        target = ReturnTarget(v_obs, v_actions, v_adv)
        target_grad = return_target_grad(policy, params, v_obs, v_actions, v_adv)
    ours = snapshot_influence(policy, obs, actions, adv, target=target, advantage_norm="chunk", chunk_size=16)
    assert ours.shape == (N,) and ours.dtype == dtype
    reference = brute_force(policy, params, obs, actions, normalized(adv, "chunk", 16), target_grad)
    assert_close(ours, reference, dtype)


@pytest.mark.parametrize(
    ("kind", "ghosted", "forward_mode"),
    [
        ("mlp", 6, ()),
        ("cnn", 10, ()),
        ("gaussian", 6, ("log_std",)),
        ("layernorm", 4, ("body.1.weight", "body.1.bias")),
    ],
)
def test_plan_ghosts_linear_and_conv_and_sends_the_rest_to_forward_mode(kind, ghosted, forward_mode):
    policy, obs, actions, adv = make_case(kind, torch.float64)
    params = default_params(policy)
    plan = plan_ghost(policy, params)
    assert len(plan.ghost_parameter_names) == ghosted
    assert plan.jvp_parameter_names == forward_mode
    target_grad = return_target_grad(policy, params, obs, actions, adv)
    per_record_dots(policy, plan, _log_prob, (obs, actions), target_grad)
    assert len(plan.ghost_parameter_names) == ghosted  # every ghosted parameter passed verification


@pytest.mark.parametrize("kind", ["mlp", "gaussian"])
def test_entropy_term(kind):
    policy, obs, actions, adv = make_case(kind, torch.float64)
    params = default_params(policy)
    ours = snapshot_influence(policy, obs, actions, adv, advantage_norm="batch", ent_coef=0.05)
    target_grad = return_target_grad(policy, params, obs, actions, adv)
    reference = brute_force(policy, params, obs, actions, normalized(adv, "batch", N), target_grad, ent_coef=0.05)
    assert_close(ours, reference, torch.float64)


@pytest.mark.parametrize("mode", ["chunk", "batch", "none"])
def test_advantage_norm_modes(mode):
    policy, obs, actions, adv = make_case("mlp", torch.float64)
    params = default_params(policy)
    ours = snapshot_influence(policy, obs, actions, adv, advantage_norm=mode, chunk_size=16)
    target_grad = return_target_grad(policy, params, obs, actions, adv)
    assert_close(ours, brute_force(policy, params, obs, actions, normalized(adv, mode, 16), target_grad), torch.float64)


def test_chunk_norm_with_one_chunk_is_batch_norm_and_modes_differ_only_by_weights():
    policy, obs, actions, adv = make_case("mlp", torch.float64)
    whole = snapshot_influence(policy, obs, actions, adv, advantage_norm="chunk", chunk_size=N)
    batch = snapshot_influence(policy, obs, actions, adv, advantage_norm="batch")
    none = snapshot_influence(policy, obs, actions, adv, advantage_norm="none")
    torch.testing.assert_close(whole, batch, rtol=0, atol=0)
    torch.testing.assert_close(batch / normalized(adv, "batch", N), none / adv, rtol=1e-10, atol=0)


def test_passes_and_accumulation_dtype_do_not_change_scores():
    policy, obs, actions, adv = make_case("layernorm", torch.float64)
    one_pass = snapshot_influence(policy, obs, actions, adv)
    chunked = snapshot_influence(policy, obs, actions, adv, records_per_pass=7)  # generic path, 6 passes
    torch.testing.assert_close(chunked, one_pass, rtol=1e-12, atol=1e-15)

    policy32, obs32, actions32, adv32 = make_case("mlp", torch.float32)
    policy64, obs64, actions64, adv64 = make_case("mlp", torch.float64)
    scores = snapshot_influence(policy32, obs32, actions32, adv32, accumulate_dtype=torch.float64)
    assert scores.dtype == torch.float64
    assert_close(scores, snapshot_influence(policy64, obs64, actions64, adv64), torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_one_pass_gives_each_return_score_and_the_alignment_as_its_own_call(kind):
    """return_and_alignment_scores: batch and chunk influence as snapshot_influence (bit for bit in the
    one-pass case), the alignment as gradient_alignment; forward-mode parameters (log_std, LayerNorm)
    included; past records_per_pass, the three calls themselves."""
    policy, obs, actions, adv = make_case(kind, torch.float64)
    calls = {"batch": snapshot_influence(policy, obs, actions, adv, advantage_norm="batch"),
             "chunk": snapshot_influence(policy, obs, actions, adv, advantage_norm="chunk", chunk_size=16),
             "alignment": gradient_alignment(policy, obs, actions, adv)}
    shared = return_and_alignment_scores(policy, obs, actions, adv, chunk_size=16)
    for name in ("batch", "chunk"):
        torch.testing.assert_close(shared[name], calls[name], rtol=0, atol=0)
    torch.testing.assert_close(shared["alignment"], calls["alignment"], rtol=1e-12, atol=1e-15)
    passes = return_and_alignment_scores(policy, obs, actions, adv, chunk_size=16, records_per_pass=7)
    for name, scores in calls.items():
        torch.testing.assert_close(passes[name], scores, rtol=1e-12, atol=1e-15)


def test_a_target_without_gradient_is_none_and_the_others_are_still_scored():
    """Equal advantages: the return target has a gradient, the alignment's (normalised to 0) none;
    all-zero advantages: neither has."""
    policy, obs, actions, _ = make_case("mlp", torch.float64)
    equal = return_and_alignment_scores(policy, obs, actions, torch.full((N,), 0.7, dtype=torch.float64))
    assert equal["alignment"] is None and equal["batch"] is not None and equal["chunk"] is not None
    with pytest.raises(ZeroTargetGradient):
        gradient_alignment(policy, obs, actions, torch.full((N,), 0.7, dtype=torch.float64))
    assert all(v is None for v in return_and_alignment_scores(policy, obs, actions, torch.zeros(N, dtype=torch.float64)).values())


def test_params_override_and_default_params_by_reachability():
    policy, obs, actions, adv = make_case("mlp", torch.float64)
    head = list(policy.action_head.parameters())
    ours = snapshot_influence(policy, obs, actions, adv, params=head)
    reference = brute_force(policy, head, obs, actions, normalized(adv, "chunk", 64), return_target_grad(policy, head, obs, actions, adv))
    assert_close(ours, reference, torch.float64)

    ln_policy, obs, actions, adv = make_case("layernorm", torch.float64)
    explicit = [p for name, p in ln_policy.named_parameters() if not name.startswith("value_head")]
    torch.testing.assert_close(
        snapshot_influence(ln_policy, obs, actions, adv),
        snapshot_influence(ln_policy, obs, actions, adv, params=explicit),
        rtol=0, atol=0,
    )


def test_action_target_hand_derived_linear_softmax():
    """pi(.|e_s) = softmax(W e_s). With W[:, 0] = (log 3, 0): pi(.|e_0) = (3/4, 1/4); W[:, 1] = 0.

    grad_W log pi(a|e_s) = (e_a - pi(.|e_s)) e_s^T, so for the target (e_0, a=0) and A_norm = A:
      record (e_0, 0, A=2): 2 * |(1/4, -1/4)|^2                      = 2 * 1/8  =  0.25
      record (e_0, 1, A=1): 1 * (-3/4, 3/4) . (1/4, -1/4)            = -3/8     = -0.375
      record (e_1, 0, A=5): states orthogonal                                   =  0
    """

    class LinearSoftmax(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2, bias=False)

        def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
            return torch.log_softmax(self.linear(obs), -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    policy = LinearSoftmax().double()
    with torch.no_grad():
        policy.linear.weight.copy_(torch.tensor([[math.log(3), 0.0], [0.0, 0.0]], dtype=torch.float64))
    e0, e1 = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)
    obs, actions = torch.stack([e0, e0, e1]), torch.tensor([0, 1, 0])
    adv = torch.tensor([2.0, 1.0, 5.0], dtype=torch.float64)
    scores = snapshot_influence(policy, obs, actions, adv, target=ActionTarget(e0, 0), advantage_norm="none")
    torch.testing.assert_close(scores, torch.tensor([0.25, -0.375, 0.0], dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_constant_target_is_rejected():
    class Constant(Target):
        def pieces(self, policy, records, records_per_pass):
            yield torch.tensor(1.0)

    policy, obs, actions, adv = make_case("mlp", torch.float64)
    with pytest.raises(ValueError, match="zero gradient"):
        snapshot_influence(policy, obs, actions, adv, target=Constant())
    with pytest.raises(ValueError, match="zero gradient"):  # f = 0 * log pi: shared-forward path
        snapshot_influence(policy, obs, actions, adv, target=ReturnTarget(obs, actions, torch.zeros_like(adv)))


def test_target_value_is_the_definition():
    policy, obs, actions, adv = make_case("gaussian", torch.float64)
    records = Records(obs, actions, adv)
    with torch.no_grad():
        logp = policy.log_prob(obs, actions)
    assert ReturnTarget().value(policy, records, records_per_pass=7) == pytest.approx(float((adv * logp).mean()), rel=1e-12)
    assert ActionTarget(obs[3], actions[3]).value(policy, records) == pytest.approx(float(logp[3]), rel=1e-12)


# -- structures the ghost path must not get wrong -------------------------------------------------
class TiedPolicy(nn.Module):
    """``out.weight`` is used by its Linear and again, transposed, outside it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.out = nn.Linear(8, 4)

    def log_prob(self, obs, actions):
        h = torch.tanh(self.embed(obs) + obs @ self.out.weight)
        return torch.log_softmax(self.out(h), -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


class TwiceCalledPolicy(nn.Module):
    """One Linear called twice per record, and a Linear over a middle (token) dimension."""

    def __init__(self):
        super().__init__()
        self.token = nn.Linear(2, 4)
        self.shared = nn.Linear(4, 4)

    def log_prob(self, obs, actions):
        h = torch.tanh(self.token(obs.view(len(obs), 2, 2))).sum(1)  # [N, 2 tokens, 2] -> [N, 4]
        logits = self.shared(torch.tanh(self.shared(h)))
        return torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


class InplacePolicy(nn.Module):
    """The first Linear's output is overwritten in place by ReLU(inplace=True)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 4))

    def log_prob(self, obs, actions):
        return torch.log_softmax(self.net(obs), -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


class TimeMajorPolicy(nn.Module):
    """A Linear sees [T=2, N, F]: its rows are time steps, not records."""

    def __init__(self):
        super().__init__()
        self.step = nn.Linear(2, 4)
        self.head = nn.Linear(4, 4)

    def log_prob(self, obs, actions):
        h = torch.tanh(self.step(obs.view(len(obs), 2, 2).transpose(0, 1))).sum(0)
        return torch.log_softmax(self.head(h), -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


class FunctionalPolicy(nn.Module):
    """An nn.Linear whose parameters are used through F.linear, never by calling the module."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.head = nn.Linear(8, 4)

    def log_prob(self, obs, actions):
        h = torch.tanh(F.linear(obs, self.fc.weight, self.fc.bias))
        return torch.log_softmax(self.head(h), -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


class ConvPolicy(nn.Module):
    """A strided, padded, dilated Conv2d (ghosted via unfold) and a grouped one (forward mode)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, kernel_size=3, stride=2, padding=1, dilation=1)
        self.dilated = nn.Conv2d(4, 4, kernel_size=2, dilation=2, bias=False)
        self.grouped = nn.Conv2d(4, 4, kernel_size=1, groups=2)
        self.head = nn.Linear(4, 4)

    def log_prob(self, obs, actions):
        x = torch.relu(self.conv(obs.view(len(obs), 2, 6, 6)))
        x = torch.relu(self.grouped(torch.tanh(self.dilated(x))))
        return torch.log_softmax(self.head(x.mean((2, 3))), -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize(
    ("policy_cls", "obs_dim", "forward_mode"),
    [
        (TiedPolicy, 4, ("out.weight",)),
        (TwiceCalledPolicy, 4, ()),
        (InplacePolicy, 4, ("net.0.weight", "net.0.bias")),
        (TimeMajorPolicy, 4, ("step.weight", "step.bias")),
        (FunctionalPolicy, 4, ("fc.weight", "fc.bias")),
        (ConvPolicy, 72, ("grouped.weight", "grouped.bias")),
    ],
)
def test_structures_the_ghost_path_cannot_take_go_to_forward_mode(policy_cls, obs_dim, forward_mode):
    torch.manual_seed(0)
    policy = policy_cls().double()
    obs, actions = torch.randn(N, obs_dim, dtype=torch.float64), torch.randint(0, 4, (N,))
    adv = torch.randn(N, dtype=torch.float64)
    params = list(policy.parameters())
    target_grad = return_target_grad(policy, params, obs, actions, adv)
    plan = plan_ghost(policy, params)
    dots = per_record_dots(policy, plan, _log_prob, (obs, actions), target_grad, records_per_pass=16)
    assert plan.jvp_parameter_names == forward_mode
    reference = brute_force(policy, params, obs, actions, torch.ones(N, dtype=torch.float64), target_grad)
    assert_close(dots, reference, torch.float64)
    ours = snapshot_influence(policy, obs, actions, adv, chunk_size=16)
    assert_close(ours, brute_force(policy, params, obs, actions, normalized(adv, "chunk", 16), target_grad), torch.float64)


def test_verification_runs_once_per_structure_and_again_when_the_structure_changes(monkeypatch):
    """The ghost-vs-autograd verdict is reused while the call signature is unchanged; an
    output-changing hook added to, or a parameter replaced in, the same policy object is verified
    afresh (and scores stay exact)."""
    verifications = []
    unverified = ghost._unverified
    monkeypatch.setattr(ghost, "_unverified", lambda *args: verifications.append(1) or unverified(*args))
    torch.manual_seed(0)
    policy = InplacePolicy().double()
    policy.net[1].inplace = False  # a clean MLP to start with
    obs, actions = torch.randn(N, 4, dtype=torch.float64), torch.randint(0, 4, (N,))
    adv = torch.randn(N, dtype=torch.float64)

    def check() -> None:
        params = list(policy.parameters())
        target_grad = return_target_grad(policy, params, obs, actions, adv)
        expected = brute_force(policy, params, obs, actions, normalized(adv, "chunk", 16), target_grad)
        assert_close(snapshot_influence(policy, obs, actions, adv, chunk_size=16), expected, torch.float64)

    check()
    check()
    assert len(verifications) == 1  # same structure: the verdict is reused
    handle = policy.net[0].register_forward_hook(lambda m, args, out: out * 2)  # a user hook changing the output
    check()
    assert len(verifications) == 2
    handle.remove()
    policy.net[2].weight = nn.Parameter(torch.randn(4, 8, dtype=torch.float64))
    check()
    assert len(verifications) == 3


# -- conveniences, package hygiene -----------------------------------------------------------------
def test_influence_package_never_imports_trainer_filters_or_cli():
    import rlinfluence.influence as package

    for path in Path(package.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not re.search(r"rlinfluence\.(ppo|filters|cli)\b|from \.\.(ppo|filters|cli)\b", text), path.name



def test_top_records():
    scores = torch.tensor([0.5, -2.0, 3.0, 0.0, -1.0, 3.0])
    top = top_records(scores, 2)
    assert top.proponents.tolist() == [2, 5] and top.proponent_scores.tolist() == [3.0, 3.0]
    assert top.opponents.tolist() == [1, 4] and top.opponent_scores.tolist() == [-2.0, -1.0]
    assert len(top_records(scores, 10).proponents) == 6


def test_score_buffer_scores_the_flat_fields():
    policy, _, _, _ = make_case("mlp", torch.float32)
    buf = RolloutBuffer.empty(3, 10, 2, (6,), torch.float32, (), torch.int64)
    torch.manual_seed(3)
    buf.obs.normal_()
    buf.actions.random_(0, 4)
    buf.rewards.normal_()
    buf.terminated[4, 1] = True
    with torch.no_grad():
        _, logp, values = policy.act(buf.obs.reshape(20, 6), torch.Generator().manual_seed(0))
    buf.logp, buf.values = logp.reshape(10, 2), values.reshape(10, 2)
    buf.last_values = torch.zeros(2)
    buf.compute_advantages(0.99, 0.95)
    flat = {k: buf.flat(k) for k in ("obs", "actions", "logp", "advantages", "returns", "values")}
    order = chunk_permutation(20, 0)  # "chunk" (the default) over chunks of a seeded permutation, as IIF
    permuted = snapshot_influence(policy, flat["obs"][order], flat["actions"][order], flat["advantages"][order],
                                  chunk_size=8)
    expected = torch.empty_like(permuted).index_copy_(0, order, permuted)
    torch.testing.assert_close(score_buffer(policy, buf, chunk_size=8), expected, rtol=0, atol=0)
    expected = snapshot_influence(policy, flat["obs"], flat["actions"], flat["advantages"], advantage_norm="batch")
    torch.testing.assert_close(score_buffer(policy, buf, advantage_norm="batch"), expected, rtol=0, atol=0)
    schedule = [MinibatchStep(0, torch.arange(0, 20, 2), 0.01), MinibatchStep(0, torch.arange(1, 20, 2), 0.01)]
    expected = tracin_influence(policy, flat["obs"], flat["actions"], flat["logp"], flat["advantages"], flat["returns"], flat["values"], schedule)
    torch.testing.assert_close(score_buffer(policy, buf, mode="full", schedule=schedule), expected, rtol=0, atol=0)


# -- bad input, hooks, training unaffected ------------------------------------------------------------
def setup(seed: int = 0):
    torch.manual_seed(seed)
    policy = make_policy(gym.spaces.Box(-1, 1, (6,)), gym.spaces.Discrete(4), hidden_sizes=(16, 16))
    obs, actions, adv = torch.randn(N, 6), torch.randint(0, 4, (N,)), torch.randn(N)
    return policy, obs, actions, adv


class NoLogProb(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 4)


class WrongShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 4)

    def log_prob(self, obs, actions):
        return self.linear(obs)[:, :1]  # [N, 1]


def _nan_at(i: int, value: float) -> torch.Tensor:
    adv = torch.randn(N)
    adv[i] = value
    return adv


SNAPSHOT_CASES = {
    "actions rows": (lambda p, o, a, v: snapshot_influence(p, o, a[:-1], v), "actions has 39 rows but obs has 40"),
    "advantages shape": (lambda p, o, a, v: snapshot_influence(p, o, a, v[:, None]), r"advantages must have shape \(40,\)"),
    "nan advantage": (lambda p, o, a, v: snapshot_influence(p, o, a, _nan_at(3, float("nan"))), r"advantages\[3\] = nan is not finite"),
    "inf advantage": (lambda p, o, a, v: snapshot_influence(p, o, a, _nan_at(7, float("inf"))), r"advantages\[7\] = inf is not finite"),
    "empty buffer": (lambda p, o, a, v: snapshot_influence(p, o[:0], a[:0], v[:0]), "empty buffer"),
    "no log_prob": (lambda p, o, a, v: snapshot_influence(NoLogProb(), o, a, v), "log_prob"),
    "log_prob shape": (lambda p, o, a, v: snapshot_influence(WrongShape(), o, a, v, target=ActionTarget(o[0], a[0])), r"returned \(40, 1\) for 40 records; expected shape \(40,\)"),
    "zero target": (lambda p, o, a, v: snapshot_influence(p, o, a, torch.zeros(N)), "zero gradient"),
    "advantage_norm": (lambda p, o, a, v: snapshot_influence(p, o, a, v, advantage_norm="episode"), "advantage_norm must be one of"),
    "chunk_size": (lambda p, o, a, v: snapshot_influence(p, o, a, v, chunk_size=0), "chunk_size must be a positive int"),
    "records_per_pass": (lambda p, o, a, v: snapshot_influence(p, o, a, v, records_per_pass=0), "records_per_pass"),
    "foreign param": (lambda p, o, a, v: snapshot_influence(p, o, a, v, params=[nn.Parameter(torch.zeros(3))]), "not a parameter of the policy"),
    "frozen param": (lambda p, o, a, v: snapshot_influence(p, o, a, v, params=[torch.zeros(3)]), "does not require grad"),
    "action target obs": (lambda p, o, a, v: snapshot_influence(p, o, a, v, target=ActionTarget(torch.zeros(5), 1)), "ActionTarget obs"),
    "action target count": (lambda p, o, a, v: snapshot_influence(p, o, a, v, target=ActionTarget(o[:3], a[:2])), "3 observations but 2 actions"),
    "return target partial": (lambda p, o, a, v: snapshot_influence(p, o, a, v, target=ReturnTarget(obs=o)), "needs all of"),
    "validation nan": (lambda p, o, a, v: snapshot_influence(p, o, a, v, target=ReturnTarget(o, a, _nan_at(0, float("nan")))), "not finite"),
    "entropy without evaluate_actions": (lambda p, o, a, v: snapshot_influence(WrongShape(), o, a, v, ent_coef=0.1), "evaluate_actions"),
}


@pytest.mark.parametrize("case", list(SNAPSHOT_CASES))
def test_snapshot_bad_input(case):
    call, message = SNAPSHOT_CASES[case]
    policy, obs, actions, adv = setup()
    with pytest.raises(ValueError, match=message) as err:
        call(policy, obs, actions, adv)
    assert "\n" not in str(err.value)


def _tracin(policy, obs, actions, adv, schedule, **overrides):
    fields = {"old_logp": torch.zeros(N), "returns": torch.zeros(N), "old_values": torch.zeros(N), **overrides}
    return tracin_influence(policy, obs, actions, fields["old_logp"], adv, fields["returns"], fields["old_values"], schedule)


TRACIN_CASES = {
    "empty schedule": (lambda p, o, a, v: _tracin(p, o, a, v, []), "schedule is empty"),
    "index out of range": (lambda p, o, a, v: _tracin(p, o, a, v, [MinibatchStep(0, torch.tensor([0, 40]), 0.1)]), r"schedule\[0\].indices contains 40"),
    "float indices": (lambda p, o, a, v: _tracin(p, o, a, v, [MinibatchStep(0, torch.tensor([0.0]), 0.1)]), "integer tensor"),
    "negative lr": (lambda p, o, a, v: _tracin(p, o, a, v, [MinibatchStep(0, torch.tensor([0]), 0.1), MinibatchStep(0, torch.tensor([1]), -1.0)]), r"schedule\[1\].lr = -1.0"),
    "nan returns": (lambda p, o, a, v: _tracin(p, o, a, v, [MinibatchStep(0, torch.tensor([0]), 0.1)], returns=_nan_at(2, float("nan"))), r"returns\[2\] = nan"),
    "old_logp shape": (lambda p, o, a, v: _tracin(p, o, a, v, [MinibatchStep(0, torch.tensor([0]), 0.1)], old_logp=torch.zeros(N - 1)), r"old_logp must have shape \(40,\)"),
    "no evaluate_actions": (lambda p, o, a, v: _tracin(WrongShape(), o, a, v, [MinibatchStep(0, torch.tensor([0]), 0.1)]), "evaluate_actions"),
}


@pytest.mark.parametrize("case", list(TRACIN_CASES))
def test_tracin_bad_input(case):
    call, message = TRACIN_CASES[case]
    policy, obs, actions, adv = setup()
    with pytest.raises(ValueError, match=message) as err:
        call(policy, obs, actions, adv)
    assert "\n" not in str(err.value)


def test_score_buffer_bad_input():
    policy, *_ = setup()
    buf = RolloutBuffer.empty(0, 8, 1, (6,), torch.float32, (), torch.int64)
    with pytest.raises(ValueError, match="no advantages"):
        score_buffer(policy, buf)
    buf.last_values = torch.zeros(1)
    buf.compute_advantages(0.99, 0.95)
    with pytest.raises(ValueError, match="mode must be one of"):
        score_buffer(policy, buf, mode="exact")
    with pytest.raises(ValueError, match="needs the round's schedule"):
        score_buffer(policy, buf, mode="full")


def _hook_counts(policy: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in policy.modules()]


def test_hooks_removed_and_grads_untouched_even_when_log_prob_raises():
    policy, obs, actions, adv = setup()
    before = _hook_counts(policy)
    snapshot_influence(policy, obs, actions, adv)
    assert _hook_counts(policy) == before
    assert all(p.grad is None for p in policy.parameters())

    class Failing(nn.Module):  # raises in the full-size pass, with the ghost hooks registered
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(6, 4)

        def log_prob(self, obs, actions):
            if len(obs) == N:
                raise RuntimeError("boom")
            return torch.log_softmax(self.net(obs), -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    failing = Failing()
    with pytest.raises(RuntimeError, match="boom"):
        snapshot_influence(failing, obs, actions, adv, target=ActionTarget(obs[0], actions[0]))
    assert _hook_counts(failing) == [0, 0]


def _train(attribute: bool) -> dict[str, torch.Tensor]:
    """Two rounds of PPO (Adam, global-RNG minibatches), scoring each round when ``attribute``."""
    torch.manual_seed(0)
    policy = make_policy(gym.spaces.Box(-1, 1, (6,)), gym.spaces.Box(-1, 1, (2,)), hidden_sizes=(16, 16))
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3, eps=1e-5)
    for _ in range(2):
        obs, actions, adv = torch.randn(N, 6), torch.randn(N, 2), torch.randn(N)
        with torch.no_grad():
            logp, _, values = policy.evaluate_actions(obs, actions)
        returns = adv + values
        start, start_optimizer = copy.deepcopy((policy, optimizer))
        if attribute:
            snapshot_influence(policy, obs, actions, adv, chunk_size=8)
        schedule = []
        for epoch in range(2):
            perm = torch.randperm(N)
            for b in range(0, N, 8):
                idx = perm[b : b + 8]
                loss = ppo_loss(policy, obs[idx], actions[idx], logp[idx], adv[idx], returns[idx], values[idx], clip_range=0.2).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.append(MinibatchStep(epoch, idx, 1e-3))
        if attribute:
            tracin_influence(start, obs, actions, logp, adv, returns, values, schedule, optimizer=start_optimizer)
    return {k: v.clone() for k, v in policy.state_dict().items()}


def test_training_with_attribution_is_bit_identical():
    plain, attributed = _train(attribute=False), _train(attribute=True)
    assert plain.keys() == attributed.keys()
    for name in plain:
        assert torch.equal(plain[name], attributed[name]), name
