"""The update's minibatch steps in NumPy with hand-derived gradients (``PPOConfig.update_engine``).

At PPO's minibatch size (64 records, two 64-64 MLPs) a torch step is per-operation overhead, not
arithmetic: about 30 forward and 60 autograd operations at several microseconds each. NumPy's
per-operation cost is a few times lower, so this engine computes the same loss (``rlinfluence.losses``)
and its gradient by the chain rule, written out, and takes the optimiser's step on one flat
parameter vector. Per record i of a minibatch of size b, with A_i the (normalised) advantage,
rho_i = exp(log pi(a_i|s_i) - log pi_old), and the loss mean_i ell_i:

    d ell / d log pi_i = -A_i rho_i [unclipped term is the min]
                         -A_i rho_i [clipped term is the min and 1 - eps <= rho_i <= 1 + eps]
                         (a tie splits the gradient in halves, as torch.minimum's backward)
    d ell / d V_i      = -2 c_vf (R_i - V_i)             (with clip_range_vf: V_i the clipped
                                                          value, 0 where the clip binds)
    d log pi_i / d logits = onehot(a_i) - pi_i,   d H_i / d logits = -pi_i (log pi_i + H_i)
    Gaussian: d log pi_i / d mu = z_i / sigma, d log pi_i / d log sigma = z_i^2 - 1, d H / d log sigma = 1

then back through each Linear (g_W = dz^T x, g_b = sum dz, dx = dz W) and tanh (1 - h^2) or
ReLU. SGD takes theta - lr g; Adam torch's update (bias-corrected moments, eps outside the
square root); ``max_grad_norm`` clips the global norm as ``torch.nn.utils.clip_grad_norm_``.
The values equal torch's to float32 rounding (the sums run in another order), checked against
autograd in the tests; runs are therefore not bit-identical to the torch engine's.

It covers MLP policies (flatten encoder, tanh or ReLU hidden layers, categorical or Gaussian
head) on the CPU, with SGD or Adam; the parameters and the optimiser's state are read from the
torch modules when an update begins and written back when it ends, so checkpoints, filters and
analyses see them as always.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
import torch
from torch import nn

from rlinfluence.config import PPOConfig
from rlinfluence.errors import UserError
from rlinfluence.influence.tracin import clip_coefficient
from rlinfluence.losses import PPOTerms
from rlinfluence.policies import LOG_SQRT_2PI, ActorCritic, FlattenEncoder


class NumpyUpdate:
    """Minibatch steps of the PPO loss on ``policy`` with ``optimizer`` (its SGD or Adam), in NumPy.

    Call ``begin()`` before an update's steps and ``end()`` after them; between the two the torch
    parameters are stale."""

    def __init__(self, policy: ActorCritic, optimizer: torch.optim.Optimizer, *, clip_range: float,
                 clip_range_vf: float | None, vf_coef: float, ent_coef: float, normalize_advantage: bool,
                 max_grad_norm: float | None):
        problem = _uncovered(policy, optimizer)
        if problem:
            raise UserError(f"update_engine numpy covers MLP policies on the CPU with SGD or Adam; {problem}: "
                            f"use --update-engine torch")
        self.policy, self.optimizer = policy, optimizer
        self.clip_range, self.clip_range_vf = clip_range, clip_range_vf
        self.vf_coef, self.ent_coef = np.float32(vf_coef), np.float32(ent_coef)
        self.normalize_advantage, self.max_grad_norm = normalize_advantage, max_grad_norm
        self.params = list(policy.parameters())
        sizes = [p.numel() for p in self.params]
        ends = np.cumsum(sizes)
        self.slices = [(p, int(end) - size, int(end)) for p, size, end in zip(self.params, sizes, ends, strict=True)]
        self.flat = np.zeros(int(ends[-1]), dtype=np.float32)
        self.grad = np.zeros_like(self.flat)
        self.view = {id(p): self.flat[a:b].reshape(p.shape) for p, a, b in self.slices}
        self.grad_view = {id(p): self.grad[a:b].reshape(p.shape) for p, a, b in self.slices}
        self.actor = _layers(policy.actor, self.view, self.grad_view)
        self.critic = _layers(policy.critic, self.view, self.grad_view)
        self.head = _linear(policy.action_head, self.view, self.grad_view)
        self.value_head = _linear(policy.value_head, self.view, self.grad_view)
        if policy.continuous:
            self.log_std, self.log_std_grad = self.view[id(policy.log_std)], self.grad_view[id(policy.log_std)]
        self.adam = isinstance(optimizer, torch.optim.Adam)
        if self.adam:
            self.exp_avg, self.exp_avg_sq = np.zeros_like(self.flat), np.zeros_like(self.flat)
            self.adam_step = 0

    # -- the torch side --------------------------------------------------------------------
    def begin(self) -> None:
        """Read the parameters (and Adam's moments and step count) from the torch side."""
        with torch.no_grad():
            for p in self.params:
                self.view[id(p)][...] = p.detach().numpy()
        if self.adam:
            state = [self.optimizer.state.get(p, {}) for p in self.params]
            self.adam_step = int(state[0]["step"]) if "step" in state[0] else 0
            for name, flat in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                for (_, a, b), entry in zip(self.slices, state, strict=True):
                    flat[a:b] = entry[name].detach().numpy().ravel() if name in entry else 0.0

    def end(self) -> None:
        """Write the parameters (and Adam's state, in torch's layout) back to the torch side."""
        with torch.no_grad():
            for p in self.params:
                p.copy_(torch.from_numpy(self.view[id(p)]))
            if self.adam and self.adam_step:
                for p, a, b in self.slices:
                    self.optimizer.state[p] = {
                        "step": torch.tensor(float(self.adam_step)),
                        "exp_avg": torch.from_numpy(self.exp_avg[a:b].reshape(p.shape).copy()),
                        "exp_avg_sq": torch.from_numpy(self.exp_avg_sq[a:b].reshape(p.shape).copy()),
                    }

    # -- one step ----------------------------------------------------------------------------
    def forward(self, obs: np.ndarray, actions: np.ndarray, old_logp: np.ndarray, advantages: np.ndarray,
                returns: np.ndarray, old_values: np.ndarray) -> PPOTerms:
        """The minibatch's terms (``rlinfluence.losses.ppo_terms``) as torch views of NumPy arrays;
        keeps what ``step`` needs for the gradient."""
        b = obs.shape[0]
        x = obs.reshape(b, -1).astype(np.float32, copy=False)
        actor_acts, critic_acts = _forward(self.actor, x), _forward(self.critic, x)
        h, g = actor_acts[-1], critic_acts[-1]
        out = h @ self.head[0].T + self.head[1]
        values = (g @ self.value_head[0].T + self.value_head[1])[:, 0]
        if self.policy.continuous:
            inv_std = np.exp(-self.log_std)
            z = (actions - out) * inv_std
            logp = (-0.5 * z * z - self.log_std - np.float32(LOG_SQRT_2PI)).sum(-1)
            entropy = np.broadcast_to((0.5 + np.float32(LOG_SQRT_2PI) + self.log_std).sum(-1), (b,))
            dist = (z, inv_std)
        else:
            shifted = out - out.max(-1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
            probs = np.exp(log_probs)
            act = actions.astype(np.int64, copy=False)
            logp = log_probs[np.arange(b), act]
            entropy = -(probs * log_probs).sum(-1)
            dist = (act, probs, log_probs, entropy)
        adv = advantages
        if self.normalize_advantage and b > 1:
            adv = (adv - adv.mean()) / (adv.std(ddof=1) + np.float32(1e-8))
        log_ratio = logp - old_logp
        ratio = np.exp(log_ratio)
        lo, hi = 1 - self.clip_range, 1 + self.clip_range
        unclipped, clipped = adv * ratio, adv * np.clip(ratio, lo, hi)
        pg = -np.minimum(unclipped, clipped)
        in_vf_clip = None
        if self.clip_range_vf is not None:
            delta = values - old_values
            in_vf_clip = (delta >= -self.clip_range_vf) & (delta <= self.clip_range_vf)
            values = old_values + np.clip(delta, -self.clip_range_vf, self.clip_range_vf)
        residual = returns - values
        vf = residual * residual
        per_record = pg + self.vf_coef * vf
        if self.ent_coef:
            per_record = per_record - self.ent_coef * entropy
        # d ell_i / d rho_i: torch.minimum's backward, a tie halved between both branches
        tie = (unclipped == clipped) * np.float32(0.5)
        through_clip = ((ratio >= lo) & (ratio <= hi)).astype(np.float32)
        d_ratio = -adv * ((unclipped < clipped) + tie + ((unclipped > clipped) + tie) * through_clip)
        d_logp = d_ratio * ratio / b
        d_value = (-2 * self.vf_coef / b) * residual
        if in_vf_clip is not None:
            d_value = d_value * in_vf_clip
        self._saved = (actor_acts, critic_acts, dist, d_logp, d_value)
        return PPOTerms(*(torch.from_numpy(np.ascontiguousarray(t, dtype=np.float32))
                          for t in (per_record, pg, vf, entropy, ratio, log_ratio)))

    def step(self, lr: float) -> None:
        """Backward through the networks from ``forward``'s minibatch, then the optimiser's step."""
        actor_acts, critic_acts, dist, d_logp, d_value = self._saved
        b = d_logp.shape[0]
        if self.policy.continuous:
            z, inv_std = dist
            d_out = d_logp[:, None] * z * inv_std
            # d/d log sigma of mean_i (pg_i - c_ent H): sum_i d_logp_i (z_i^2 - 1) - c_ent
            self.log_std_grad[...] = (d_logp[:, None] * (z * z - 1)).sum(0) - self.ent_coef
        else:
            act, probs, log_probs, entropy = dist
            d_out = -probs * d_logp[:, None]
            d_out[np.arange(b), act] += d_logp
            if self.ent_coef:
                d_out += (self.ent_coef / b) * probs * (log_probs + entropy[:, None])
        # the head's input gradient is needed only where a hidden layer lies below it
        d_h = _linear_backward(self.head, actor_acts[-1], d_out, d_input=bool(self.actor))
        d_g = _linear_backward(self.value_head, critic_acts[-1], d_value[:, None], d_input=bool(self.critic))
        _backward(self.actor, actor_acts, d_h)
        _backward(self.critic, critic_acts, d_g)
        if self.max_grad_norm is not None:
            coef = clip_coefficient(math.sqrt(float(np.dot(self.grad, self.grad))), self.max_grad_norm)
            if coef < 1:
                self.grad *= np.float32(coef)
        if self.adam:
            group = self.optimizer.param_groups[0]
            beta1, beta2 = group["betas"]
            self.adam_step += 1
            self.exp_avg += np.float32(1 - beta1) * (self.grad - self.exp_avg)
            self.exp_avg_sq *= np.float32(beta2)
            self.exp_avg_sq += np.float32(1 - beta2) * self.grad * self.grad
            step_size = lr / (1 - beta1 ** self.adam_step)
            denom = np.sqrt(self.exp_avg_sq) / np.float32(math.sqrt(1 - beta2 ** self.adam_step)) + np.float32(group["eps"])
            self.flat -= np.float32(step_size) * self.exp_avg / denom
        else:
            self.grad *= np.float32(lr)
            self.flat -= self.grad


Layer = tuple  # ("linear", W, b, gW, gb) or ("tanh",) or ("relu",)


def resolve_update_engine(config: PPOConfig, policy: ActorCritic, optimizer: torch.optim.Optimizer) -> PPOConfig:
    """``config`` with ``update_engine`` auto resolved, said once on stderr (with ``progress``): numpy
    wherever this engine covers the run, torch wherever it does not (another encoder, a GPU, AdamW,
    ``tracin`` or ``compile``, which record or compile the torch update). The run's config.json
    records the engine chosen, so its re-runs take the same arithmetic."""
    problem = "tracin and compile need the torch update" if config.tracin or config.compile else \
        _uncovered(policy, optimizer)
    resolved = dataclasses.replace(config, update_engine="torch" if problem else "numpy")
    if config.progress:
        print(f"{config.env}: the {resolved.update_engine} update (update_engine auto: "
              f"{problem or 'it covers this MLP policy and optimiser'})", file=sys.stderr)
    return resolved


def _uncovered(policy: ActorCritic, optimizer: torch.optim.Optimizer) -> str | None:
    """Why this engine cannot run ``policy`` with ``optimizer`` (None: it can)."""
    if not isinstance(policy.encoder, FlattenEncoder):
        return f"this policy's encoder is {type(policy.encoder).__name__}"
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in policy.parameters()):
        return "the policy is not float32 on the CPU"
    if not all(isinstance(layer, (nn.Linear, nn.Tanh, nn.ReLU)) for seq in (policy.actor, policy.critic)
               for layer in seq):
        return "its hidden layers are not Linear + tanh/ReLU"
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam) or len(optimizer.param_groups) != 1:
        return f"the optimiser is {type(optimizer).__name__}"
    group = optimizer.param_groups[0]
    if group.get("weight_decay") or group.get("momentum") or group.get("amsgrad") or group.get("maximize"):
        return "the optimiser has weight decay, momentum, amsgrad or maximize"
    return None


def _linear(layer: nn.Linear, view: dict, grad_view: dict) -> tuple:
    return view[id(layer.weight)], view[id(layer.bias)], grad_view[id(layer.weight)], grad_view[id(layer.bias)]


def _layers(seq: nn.Sequential, view: dict, grad_view: dict) -> list[Layer]:
    return [("linear", *_linear(layer, view, grad_view)) if isinstance(layer, nn.Linear)
            else ("tanh",) if isinstance(layer, nn.Tanh) else ("relu",) for layer in seq]


def _forward(layers: list[Layer], x: np.ndarray) -> list[np.ndarray]:
    """Every layer's input and the network's output: [x_0, ..., x_n], x_{i+1} = layer_i(x_i)."""
    acts = [x]
    for layer in layers:
        if layer[0] == "linear":
            x = x @ layer[1].T + layer[2]
        elif layer[0] == "tanh":
            x = np.tanh(x)
        else:
            x = np.maximum(x, 0)
        acts.append(x)
    return acts


def _linear_backward(linear: tuple, x: np.ndarray, d_out: np.ndarray, d_input: bool = True) -> np.ndarray | None:
    """Write g_W = d_out^T x and g_b = sum d_out into the layer's gradient views; return d_out W
    (None when ``d_input`` is False: nothing below needs it)."""
    weight, _, grad_weight, grad_bias = linear
    np.matmul(d_out.T, x, out=grad_weight)
    d_out.sum(0, out=grad_bias)
    return d_out @ weight if d_input else None


def _backward(layers: list[Layer], acts: list[np.ndarray], d_x: np.ndarray) -> None:
    """Back through ``layers`` from the gradient ``d_x`` of their output (``acts`` from ``_forward``);
    the observation's gradient is not formed."""
    for i in reversed(range(len(layers))):
        layer, out = layers[i], acts[i + 1]
        if layer[0] == "linear":
            d_x = _linear_backward(layer[1:], acts[i], d_x, d_input=i > 0)
        elif layer[0] == "tanh":
            d_x = d_x * (1 - out * out)
        else:
            d_x = d_x * (out > 0)
