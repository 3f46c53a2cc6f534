"""Scoring never changes the model it scores (issue 13): aliased submodules with BatchNorm and
LayerNorm, tied weights, an embedding shared by input and output. After every scorer the policy
holds the same Parameter objects (same requires_grad, values, buffers, training flags) and they
still train; scores equal per-record autograd in eval mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlinfluence.influence import (
    ActionTarget,
    ReturnTarget,
    per_record_dots,
    plan_ghost,
    snapshot_influence,
    state,
    unchanged,
)
from rlinfluence.influence.snapshot import _log_prob

N = 24

pytestmark = pytest.mark.usefixtures("one_thread")


def categorical(logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)


class AliasedNorms(nn.Module):
    """A features extractor registered under two names (as SB3's ``features_extractor`` /
    ``pi_features_extractor``) holding a BatchNorm and a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.LayerNorm(8), nn.Tanh())
        self.pi_features = self.features
        self.head = nn.Linear(8, 3)

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return categorical(self.head(self.pi_features(obs)), actions)


class TiedLinear(nn.Module):
    """Two Linear layers sharing one weight."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.b.weight = self.a.weight

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return categorical(self.head(torch.tanh(self.b(torch.tanh(self.a(obs))))), actions)


class SharedEmbedding(nn.Module):
    """Token in, token out: the output layer's weight is the input embedding."""

    def __init__(self, vocab: int = 6, dim: int = 5):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embedding.weight

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return categorical(self.out(torch.tanh(self.mix(self.embedding(obs)))), actions)


def make(kind: str):
    torch.manual_seed(0)
    policy = {"aliased": AliasedNorms, "tied": TiedLinear, "embedding": SharedEmbedding}[kind]().double()
    obs = torch.randint(0, 6, (N,)) if kind == "embedding" else torch.randn(N, 5, dtype=torch.float64)
    if kind == "aliased":
        with torch.no_grad():  # non-trivial running statistics and affine parameters
            for _ in range(3):
                policy.features(torch.randn(32, 5, dtype=torch.float64) * 2 + 1)
            for m in (policy.features[1], policy.features[2]):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    policy.train()  # as a trainer leaves it: scoring must switch to eval and back
    return policy, obs, torch.randint(0, 3, (N,)), torch.randn(N, dtype=torch.float64)


def snapshot_of(policy: nn.Module) -> dict:
    return {
        "params": [(name, p) for name, p in policy.named_parameters(remove_duplicate=False)],
        "values": {name: p.detach().clone() for name, p in policy.named_parameters(remove_duplicate=False)},
        "buffers": {name: (b, b.clone()) for name, b in policy.named_buffers(remove_duplicate=False)},
        "training": [m.training for m in policy.modules()],
    }


def assert_untouched(policy: nn.Module, before: dict) -> None:
    after = list(policy.named_parameters(remove_duplicate=False))
    assert [name for name, _ in after] == [name for name, _ in before["params"]]
    for (name, p), (_, q) in zip(after, before["params"], strict=True):
        assert p is q and isinstance(p, nn.Parameter) and p.requires_grad, name
        assert torch.equal(p, before["values"][name]), name
    for name, b in policy.named_buffers(remove_duplicate=False):
        obj, value = before["buffers"][name]
        assert b is obj and torch.equal(b, value), name
    assert [m.training for m in policy.modules()] == before["training"]


def brute_force(policy: nn.Module, obs, actions, adv, target_obs=None, target_actions=None) -> torch.Tensor:
    """score_i = A_i <grad log pi(a_i|s_i), grad f> in eval mode, one autograd call per record;
    f = (1/n) sum_j A_j log pi(a_j|s_j), or the mean log-prob of the target pairs."""
    params = list(policy.parameters())
    policy.eval()

    def grad(o, a, w):
        return torch.cat([g.flatten() for g in torch.autograd.grad((w * policy.log_prob(o, a)).sum(), params)])

    grads = torch.stack([grad(obs[i : i + 1], actions[i : i + 1], 1.0) for i in range(N)])
    direction = (adv / N) @ grads if target_obs is None else grad(target_obs, target_actions, 1.0 / len(target_obs))
    policy.train()
    return adv * (grads @ direction)


KINDS = ["aliased", "tied", "embedding"]
JVP_NAMES = {"aliased": ("features.1.weight", "features.1.bias", "features.2.weight", "features.2.bias"),
             "tied": (), "embedding": ("embedding.weight",)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["shared pass", "per pass", "action target"])
def test_scoring_leaves_the_policy_as_it_found_it(kind, path):
    policy, obs, actions, adv = make(kind)
    before = snapshot_of(policy)
    kwargs = dict(advantage_norm="none")
    expected_args = ()
    if path == "per pass":
        kwargs["records_per_pass"] = 10  # grad f first, then per_record_dots over 3 passes
    elif path == "action target":
        kwargs["target"] = ActionTarget(obs[:3], actions[:3])
        expected_args = (obs[:3], actions[:3])
    scores = snapshot_influence(policy, obs, actions, adv, **kwargs)
    assert_untouched(policy, before)
    torch.testing.assert_close(scores, brute_force(policy, obs, actions, adv, *expected_args), rtol=1e-9, atol=1e-12)

    # the engine itself: norms take forward mode; the output weight tied to the embedding fails
    # ghost verification and is demoted to it; two Linear layers sharing a weight stay ghosted
    # (both layers' calls add up into the one parameter); the policy is still untouched after
    params = list(policy.parameters())
    plan = plan_ghost(policy, params)
    per_record_dots(policy, plan, _log_prob, (obs, actions), [torch.randn_like(p) for p in params])
    assert plan.jvp_parameter_names == JVP_NAMES[kind]
    assert_untouched(policy, before)

    # every parameter still trains: the optimiser's step moves all of them (norms included)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    optimizer.zero_grad()
    (-(adv * policy.log_prob(obs, actions)).sum()).backward()
    optimizer.step()
    for name, p in policy.named_parameters():
        assert p.grad is not None and not torch.equal(p, before["values"][name]), name


def test_batchnorm_running_statistics_untouched_in_training_mode():
    policy, obs, actions, adv = make("aliased")
    bn = policy.features[1]
    stats = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    snapshot_influence(policy, obs, actions, adv, target=ReturnTarget(), advantage_norm="batch")
    assert bn.training
    assert torch.equal(bn.running_mean, stats[0]) and torch.equal(bn.running_var, stats[1])
    assert int(bn.num_batches_tracked) == stats[2]


def test_the_debug_check_is_on_and_catches_a_change():
    assert state.CHECK_MODULE_STATE  # tests/conftest.py turns it on for the whole suite
    policy, obs, actions, adv = make("aliased")
    policy.register_buffer("calls", torch.zeros(()))

    def counting(p: nn.Module, o: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        p.calls += 1  # an in-place change of a buffer: a side effect of scoring
        return _log_prob(p, o, a)

    params = list(policy.head.parameters())  # ghost path only
    with pytest.raises(RuntimeError, match="scoring changed the policy"):
        per_record_dots(policy, plan_ghost(policy, params), counting, (obs, actions), [torch.ones_like(p) for p in params])
    with pytest.raises(RuntimeError, match="scoring changed the policy"), unchanged(policy):
        policy.features[1].weight.requires_grad_(False)
