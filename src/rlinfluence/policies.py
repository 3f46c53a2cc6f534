"""Actor-critic networks with categorical and diagonal-Gaussian heads.

The networks follow Stable-Baselines3's ``ActorCriticPolicy`` defaults, which the paper's
baseline used: separate 64-64 tanh MLPs for the actor and the critic, orthogonal init with gain
sqrt(2) for hidden layers, 0.01 for the action head and 1 for the value head, zero biases, and a
state-independent ``log_std`` (init 0) for continuous actions. For image observations
(MiniGrid) a small CNN encoder is *shared* by actor and critic, as in the authors' MiniGrid run.

Every policy exposes the contract that attribution relies on:

- ``log_prob(obs, actions) -> Tensor[N]``: log pi_theta(a|s), differentiable;
- ``policy_parameters()``: every parameter ``log_prob`` depends on (encoder, actor, action
  head, ``log_std``) and nothing that only the value function uses.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from rlinfluence.errors import UserError

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def orthogonal_init(module: nn.Module, gain: float) -> None:
    """Orthogonal weights with ``gain`` and zero biases for every Linear/Conv2d in ``module``."""
    for layer in module.modules():
        if isinstance(layer, (nn.Linear, nn.Conv2d)):
            nn.init.orthogonal_(layer.weight, gain=gain)
            nn.init.zeros_(layer.bias)


ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}
"""The hidden layers' activation of the actor and critic MLPs (``PPOConfig.activation``)."""


def mlp(in_dim: int, hidden_sizes: Sequence[int], activation: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    """``Linear -> activation`` blocks; an empty ``hidden_sizes`` gives the identity."""
    layers: list[nn.Module] = []
    for size in hidden_sizes:
        layers += [nn.Linear(in_dim, size), activation()]
        in_dim = size
    return nn.Sequential(*layers)


class FlattenEncoder(nn.Module):
    """Flattens vector observations to ``[N, prod(obs_shape)]`` floats (no parameters)."""

    def __init__(self, obs_shape: Sequence[int]):
        super().__init__()
        self.out_dim = int(np.prod(obs_shape))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.reshape(obs.shape[0], -1)
        return x if x.is_floating_point() else x.float()


class MiniGridCNN(nn.Module):
    """The authors' MiniGrid feature extractor for 7x7x3 (HWC, uint8) image observations.

    conv 3->16 k3, ReLU, conv 16->32 k3, ReLU, flatten, linear -> 64, ReLU. Inputs are divided
    by 255 and transposed to CHW, as SB3 preprocesses image spaces.
    """

    def __init__(self, obs_shape: Sequence[int], features_dim: int = 64):
        super().__init__()
        height, width, channels = obs_shape
        self.convs = nn.Sequential(
            nn.Conv2d(channels, 16, kernel_size=3), nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3), nn.ReLU(),
            nn.Flatten(),
        )
        n_flat = 32 * (height - 4) * (width - 4)
        self.linear = nn.Sequential(nn.Linear(n_flat, features_dim), nn.ReLU())
        self.out_dim = features_dim

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.to(self.linear[0].weight.dtype).permute(0, 3, 1, 2) / 255.0
        return self.linear(self.convs(x))


class NatureCNN(nn.Module):
    """SB3's ``NatureCNN`` (Mnih et al. 2015; ``CnnPolicy``'s extractor), the same layers in the
    same order: conv 32 k8 s4, conv 64 k4 s2, conv 64 k3 s1 (ReLU after each), flatten, linear ->
    ``features_dim``, ReLU. Images channels-first unless the space's smallest axis is its last (SB3's
    rule for the last axis; then transposed here, as SB3's ``VecTransposeImage`` does), divided by 255
    when uint8."""

    def __init__(self, observation_space: gym.spaces.Box, features_dim: int = 512):
        super().__init__()
        shape = tuple(observation_space.shape)
        self.channels_last = int(np.argmin(shape)) == 2
        channels, height, width = (shape[2], shape[0], shape[1]) if self.channels_last else shape
        self.scale = 255.0 if observation_space.dtype == np.uint8 else 1.0
        if min(height, width) < 36:  # its three convolutions (k8 s4, k4 s2, k3 s1) need 36 pixels
            raise UserError(f"the nature encoder needs images of at least 36 x 36 pixels, got {height} x {width}")
        self.cnn = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=8, stride=4), nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, kernel_size=3, stride=1), nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            n_flat = self.cnn(torch.zeros(1, channels, height, width)).shape[1]
        self.linear = nn.Sequential(nn.Linear(n_flat, features_dim), nn.ReLU())
        self.out_dim = features_dim

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.to(self.linear[0].weight.dtype) / self.scale
        return self.linear(self.cnn(x.permute(0, 3, 1, 2) if self.channels_last else x))


class CombinedEncoder(nn.Module):
    """SB3's ``CombinedExtractor`` on a flattened Dict observation (``PPOConfig.observation_parts``, in
    the Dict's key order): each image part through its own ``NatureCNN``, each flat part as it is,
    the results concatenated."""

    def __init__(self, parts: Sequence[str], features_dim: int, obs_dim: int):
        super().__init__()
        from rlinfluence.config import observation_part

        self.parts = [observation_part(part) for part in parts]
        sizes = [int(np.prod(shape)) for _, _, shape in self.parts]
        if sum(sizes) != obs_dim:
            raise UserError(f"observation parts {list(parts)} hold {sum(sizes)} numbers; the observation has {obs_dim}")
        self.extractors = nn.ModuleDict({key: NatureCNN(gym.spaces.Box(0, 255, shape, np.uint8), features_dim)
                                         for key, kind, shape in self.parts if kind == "image"})
        self.out_dim = sum(features_dim if kind == "image" else size for (_, kind, _), size in zip(self.parts, sizes, strict=True))
        self._sizes = sizes

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(obs.reshape(obs.shape[0], -1), self._sizes, dim=1)
        return torch.cat([self.extractors[key](piece.reshape(-1, *shape)) if kind == "image" else piece.float()
                          for (key, kind, shape), piece in zip(self.parts, pieces, strict=True)], dim=1)


class ActorCritic(nn.Module):
    """Actor-critic: ``encoder`` (shared) -> separate actor / critic MLPs -> heads.

    Discrete actions: logits = action_head(actor(h)), pi = softmax(logits).
    Continuous actions: mean = action_head(actor(h)), pi = N(mean, diag(exp(log_std))^2).
    """

    def __init__(
        self,
        observation_space: gym.spaces.Box,
        action_space: gym.spaces.Space,
        hidden_sizes: Sequence[int] = (64, 64),
        encoder: str = "flatten",
        critic_hidden_sizes: Sequence[int] | None = None,
        activation: str = "tanh",
        features_dim: int = 512,
        observation_parts: Sequence[str] = (),
    ):
        super().__init__()
        critic_sizes = hidden_sizes if critic_hidden_sizes is None else critic_hidden_sizes
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r} (expected {' or '.join(ACTIVATIONS)})")
        obs_shape = observation_space.shape
        if encoder == "cnn":
            self.encoder: nn.Module = MiniGridCNN(obs_shape)
        elif encoder == "flatten":
            self.encoder = FlattenEncoder(obs_shape)
        elif encoder == "nature" and observation_parts:
            self.encoder = CombinedEncoder(observation_parts, features_dim, int(np.prod(obs_shape)))
        elif encoder == "nature":
            self.encoder = NatureCNN(observation_space, features_dim)
        else:
            raise ValueError(f"unknown encoder {encoder!r} (expected 'flatten', 'cnn' or 'nature')")
        feat_dim = self.encoder.out_dim
        latent_dim = hidden_sizes[-1] if hidden_sizes else feat_dim
        self.actor = mlp(feat_dim, hidden_sizes, ACTIVATIONS[activation])
        self.critic = mlp(feat_dim, critic_sizes, ACTIVATIONS[activation])

        self.continuous = isinstance(action_space, gym.spaces.Box)
        if self.continuous:
            act_dim = int(np.prod(action_space.shape))
            self.action_head = nn.Linear(latent_dim, act_dim)
            self.log_std = nn.Parameter(torch.zeros(act_dim))
        elif isinstance(action_space, gym.spaces.Discrete):
            self.action_head = nn.Linear(latent_dim, int(action_space.n))
        else:
            raise ValueError(f"unsupported action space {action_space} (Discrete or Box only)")
        self.value_head = nn.Linear(critic_sizes[-1] if critic_sizes else feat_dim, 1)

        orthogonal_init(self.encoder, math.sqrt(2))
        orthogonal_init(self.actor, math.sqrt(2))
        orthogonal_init(self.critic, math.sqrt(2))
        orthogonal_init(self.action_head, 0.01)
        orthogonal_init(self.value_head, 1.0)

    # -- distribution -------------------------------------------------------------------
    def _dist_params(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features h, actor output): logits, or the Gaussian mean."""
        h = self.encoder(obs)
        return h, self.action_head(self.actor(h))

    def _log_prob(self, out: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        if self.continuous:
            # log N(a; mu, sigma) = sum_d [ -(a-mu)^2 / (2 sigma^2) - log sigma - log sqrt(2 pi) ]
            log_std = self.log_std.expand_as(out)
            z = (actions - out) * torch.exp(-log_std)
            return (-0.5 * z.pow(2) - log_std - LOG_SQRT_2PI).sum(-1)
        return torch.log_softmax(out, dim=-1).gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)

    def _entropy(self, out: torch.Tensor) -> torch.Tensor:
        if self.continuous:
            return (0.5 + LOG_SQRT_2PI + self.log_std).sum(-1).expand(out.shape[0])
        log_probs = torch.log_softmax(out, dim=-1)
        return -(log_probs.exp() * log_probs).sum(-1)

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """log pi_theta(a|s) for each row, shape [N]."""
        return self._log_prob(self._dist_params(obs)[1], actions)

    def action_log_probs(self, obs: torch.Tensor) -> torch.Tensor:
        """log pi(a|s) of every action of a Discrete space, shape [N, n_actions] (column a equals
        ``log_prob(obs, a)``)."""
        if self.continuous:
            raise ValueError("action_log_probs needs a Discrete action space; this policy's actions are a Box")
        return torch.log_softmax(self._dist_params(obs)[1], dim=-1)

    def evaluate_every_action(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log pi(a|s) of every Discrete action [N, n_actions], entropy of pi(.|s) [N], V(s) [N]),
        one encoder and one actor pass: ``evaluate_actions`` and ``action_log_probs`` at once."""
        if self.continuous:
            raise ValueError("evaluate_every_action needs a Discrete action space; this policy's actions are a Box")
        h, out = self._dist_params(obs)
        return torch.log_softmax(out, dim=-1), self._entropy(out), self.value_head(self.critic(h)).squeeze(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """V(s), shape [N]."""
        return self.value_head(self.critic(self.encoder(obs))).squeeze(-1)

    def evaluate_actions(
        self, obs: torch.Tensor, actions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log pi(a|s), entropy of pi(.|s), V(s)), each of shape [N], one encoder pass."""
        h, out = self._dist_params(obs)
        return self._log_prob(out, actions), self._entropy(out), self.value_head(self.critic(h)).squeeze(-1)

    def noise(self, batch_shape: tuple[int, ...], generator: torch.Generator | None = None) -> torch.Tensor:
        """The randomness of sampling: U(0,1) per row (categorical), N(0, I) per row (Gaussian)."""
        shape = batch_shape + (self.log_std.numel() if self.continuous else 1,)
        if self.continuous:
            return torch.randn(shape, generator=generator)
        return torch.rand(shape, generator=generator)

    @torch.no_grad()
    def act(
        self, obs: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample a ~ pi(.|s) with ``generator``; returns (actions, log pi(a|s), V(s))."""
        return self.act_with_noise(obs, self.noise(obs.shape[:1], generator))

    @torch.no_grad()
    def act_with_noise(
        self, obs: torch.Tensor, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sampling as a function of ``noise`` (see ``noise``): the Gaussian reparameterisation
        a = mu + sigma * eps, or the inverse CDF a = #{j : cdf_j < u} (cheaper than multinomial)."""
        h, out = self._dist_params(obs)
        if self.continuous:
            actions = out + noise * torch.exp(self.log_std)
        else:
            cdf = torch.softmax(out, dim=-1).cumsum(-1)
            actions = (cdf < noise).sum(-1).clamp_(max=cdf.shape[-1] - 1)
        return actions, self._log_prob(out, actions), self.value_head(self.critic(h)).squeeze(-1)

    def policy_parameters(self) -> list[nn.Parameter]:
        """Every parameter that ``log_prob`` depends on (value-only parameters excluded)."""
        params = [*self.encoder.parameters(), *self.actor.parameters(), *self.action_head.parameters()]
        if self.continuous:
            params.append(self.log_std)
        return params


def make_policy(
    observation_space: gym.spaces.Space,
    action_space: gym.spaces.Space,
    hidden_sizes: Sequence[int] = (64, 64),
    encoder: str = "auto",
    critic_hidden_sizes: Sequence[int] | None = None,
    activation: str = "tanh",
    features_dim: int = 512,
    observation_parts: Sequence[str] = (),
) -> ActorCritic:
    """Build the actor-critic for a space pair; ``encoder='auto'`` picks the CNN for HWC uint8 images.

    ``UserError`` for a space it cannot handle, listing the supported ones.
    """
    if not isinstance(observation_space, gym.spaces.Box):
        raise UserError(
            f"observation space {observation_space} is not supported; supported: Box (envs.make_env "
            f"flattens Discrete, MultiDiscrete, MultiBinary, Dict and Tuple into one; MiniGrid's dict to its image)"
        )
    if not isinstance(action_space, gym.spaces.Box | gym.spaces.Discrete):
        raise UserError(f"action space {action_space} is not supported; supported: Discrete, Box")
    if encoder == "auto":
        is_image = observation_space.dtype == np.uint8 and len(observation_space.shape) == 3
        encoder = "cnn" if is_image else "flatten"
    if encoder in ("cnn", "nature") and len(observation_space.shape) != 3 and not observation_parts:
        raise UserError(f"--encoder {encoder} needs an image observation (height x width x channels), got shape "
                        f"{observation_space.shape}: use --encoder flatten (or auto)")
    return ActorCritic(observation_space, action_space, hidden_sizes, encoder, critic_hidden_sizes, activation,
                       features_dim, observation_parts)


class NumpyActorCritic:
    """A frozen NumPy copy of an MLP ``ActorCritic`` for collection and evaluation.

    One environment step needs ~20 tiny tensor ops; NumPy's per-op overhead is several times
    lower than torch's, which makes rollouts about twice as fast. It computes exactly what
    ``ActorCritic.act_with_noise`` computes (float32, same noise), checked by the tests.
    Build a new one whenever the weights change (``from_policy`` returns None for networks it
    does not cover, e.g. the CNN; callers then use the torch path).
    """

    def __init__(self, actor: list, critic: list, head: tuple, value_head: tuple, log_std: np.ndarray | None):
        self.actor, self.critic, self.head, self.value_head, self.log_std = actor, critic, head, value_head, log_std

    @classmethod
    def from_policy(cls, policy: ActorCritic) -> NumpyActorCritic | None:
        if not isinstance(policy.encoder, FlattenEncoder):
            return None

        def linear(layer: nn.Linear) -> tuple[np.ndarray, np.ndarray]:
            return layer.weight.detach().cpu().numpy().T.copy(), layer.bias.detach().cpu().numpy().copy()

        def program(seq: nn.Sequential) -> list | None:
            ops = []
            for layer in seq:
                if isinstance(layer, nn.Linear):
                    ops.append(linear(layer))
                elif isinstance(layer, (nn.Tanh, nn.ReLU)):
                    ops.append(np.tanh if isinstance(layer, nn.Tanh) else _relu)
                else:
                    return None
            return ops

        actor, critic = program(policy.actor), program(policy.critic)
        if actor is None or critic is None:
            return None
        log_std = policy.log_std.detach().cpu().numpy().copy() if policy.continuous else None
        return cls(actor, critic, linear(policy.action_head), linear(policy.value_head), log_std)

    @staticmethod
    def _run(ops: list, x: np.ndarray) -> np.ndarray:
        for op in ops:
            x = x @ op[0] + op[1] if isinstance(op, tuple) else op(x)
        return x

    def act_with_noise(self, obs: np.ndarray, noise: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(actions, log pi(a|s), V(s)) for a batch of observations, given ``noise``."""
        x = obs.reshape(obs.shape[0], -1).astype(np.float32, copy=False)
        out = self._run(self.actor, x) @ self.head[0] + self.head[1]
        value = (self._run(self.critic, x) @ self.value_head[0] + self.value_head[1])[:, 0]
        if self.log_std is not None:
            actions = out + noise * np.exp(self.log_std)
            logp = (-0.5 * noise**2 - self.log_std - np.float32(LOG_SQRT_2PI)).sum(-1)
        else:
            shifted = out - out.max(-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
            cdf = np.exp(log_probs).cumsum(-1)
            actions = np.minimum((cdf < noise).sum(-1), cdf.shape[-1] - 1)
            logp = log_probs[np.arange(len(actions)), actions]  # take_along_axis's overhead is 10x this
        return actions, logp.astype(np.float32), value


def _relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


def tempered(policy: ActorCritic, temperature: float) -> ActorCritic:
    """A copy of ``policy`` that samples at ``temperature``: logits / T (the action head's weights
    and bias scaled by 1 / T), or a Gaussian's standard deviation x T (log_std + log T); its value
    head is the policy's."""
    out = copy.deepcopy(policy)
    with torch.no_grad():
        if out.continuous:
            out.log_std += math.log(temperature)
        else:
            out.action_head.weight /= temperature
            out.action_head.bias /= temperature
    return out


RolloutActor = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def rollout_actor(policy: ActorCritic) -> RolloutActor:
    """``act(obs, noise) -> (actions, log pi(a|s), V(s))`` on NumPy arrays with the policy's
    current weights: the NumPy copy when it covers the network, else the torch forward."""
    fast = NumpyActorCritic.from_policy(policy)
    if fast is not None:
        return fast.act_with_noise

    device = next(policy.parameters()).device

    def act(obs: np.ndarray, noise: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        out = policy.act_with_noise(torch.as_tensor(obs, device=device), torch.as_tensor(noise, device=device))
        return tuple(x.cpu().numpy() for x in out)

    return act
