"""The PPO loss, shared by the trainer and by attribution (full TracIn replays it).

Stable-Baselines3 semantics, per record i of a minibatch of size b:

    rho_i   = exp(log pi_theta(a_i|s_i) - log pi_old(a_i|s_i))
    A_i     = (A_hat_i - mean_b A_hat) / (std_b A_hat + 1e-8)         (if normalize_advantage, b > 1)
    pg_i    = -min(rho_i A_i, clip(rho_i, 1 - eps, 1 + eps) A_i)
    V_i     = V_theta(s_i)  (or V_old_i + clip(V_theta(s_i) - V_old_i, -eps_vf, eps_vf))
    ell_i   = pg_i + c_vf (R_i - V_i)^2 - c_ent H[pi_theta(.|s_i)]

and the minibatch loss is mean_i ell_i. ``reduction="none"`` returns the vector ell, whose
mean is the minibatch loss: record i's share of the loss is ell_i / b.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rlinfluence.policies import ActorCritic

MINIBATCH_FIELDS = ("obs", "actions", "logp", "advantages", "returns", "values")
"""A minibatch's per-record tensors, in the order ``ppo_terms`` takes them after (log pi, entropy, V)."""


def normalize_advantages(advantages: torch.Tensor, eps: float = 1e-8, dim: int | None = None) -> torch.Tensor:
    """(A - mean A) / (std A + eps), unbiased std as SB3, over all entries or along ``dim`` (each
    row normalised on its own); a single record is left unchanged."""
    if (advantages.numel() if dim is None else advantages.shape[dim]) <= 1:
        return advantages
    if dim is None:
        return (advantages - advantages.mean()) / (advantages.std() + eps)
    return (advantages - advantages.mean(dim, keepdim=True)) / (advantages.std(dim, keepdim=True) + eps)


@dataclass
class PPOLoss:
    """A minibatch's PPO loss and its diagnostics (diagnostics are detached floats)."""

    loss: torch.Tensor
    policy_loss: float
    value_loss: float
    entropy: float
    approx_kl: float
    clip_fraction: float


@dataclass
class PPOTerms:
    """A minibatch's per-record PPO terms, as tensors (no host sync: a batched re-run maps over them)."""

    per_record: torch.Tensor
    pg: torch.Tensor
    vf: torch.Tensor
    entropy: torch.Tensor
    ratio: torch.Tensor
    log_ratio: torch.Tensor

    def approx_kl(self) -> torch.Tensor:
        """SB3's estimator of KL(old || new): E[(rho - 1) - log rho]."""
        return ((self.ratio - 1) - self.log_ratio).mean()


def ppo_terms(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    values: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    *,
    clip_range: float,
    clip_range_vf: float | None = None,
    vf_coef: float = 0.5,
    ent_coef: float = 0.0,
    normalize_advantage: bool = True,
) -> PPOTerms:
    """The terms of the module docstring's loss from the policy's outputs (log pi, entropy, V)."""
    adv = normalize_advantages(advantages) if normalize_advantage else advantages
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    pg = -torch.min(adv * ratio, adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    if clip_range_vf is not None:
        values = old_values + torch.clamp(values - old_values, -clip_range_vf, clip_range_vf)
    vf = (returns - values).pow(2)
    # without an entropy bonus its term stays out of the graph: 0 x H adds exactly nothing to the
    # loss or its gradient, and backward skips the entropy's branch
    per_record = pg + vf_coef * vf if ent_coef == 0 else pg + vf_coef * vf - ent_coef * entropy
    return PPOTerms(per_record, pg, vf, entropy, ratio, log_ratio)


def ppo_loss(
    policy: torch.nn.Module,
    obs: torch.Tensor,
    actions: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    *,
    clip_range: float,
    clip_range_vf: float | None = None,
    vf_coef: float = 0.5,
    ent_coef: float = 0.0,
    normalize_advantage: bool = True,
    reduction: str = "mean",
) -> PPOLoss:
    """Clipped-surrogate PPO loss of one minibatch (see the module docstring for the formula)."""
    terms = ppo_terms(*policy.evaluate_actions(obs, actions), old_logp, advantages, returns, old_values,
                      clip_range=clip_range, clip_range_vf=clip_range_vf, vf_coef=vf_coef, ent_coef=ent_coef,
                      normalize_advantage=normalize_advantage)
    loss = terms.per_record if reduction == "none" else terms.per_record.mean()
    with torch.no_grad():
        return PPOLoss(
            loss=loss,
            policy_loss=terms.pg.mean().item(),
            value_loss=terms.vf.mean().item(),
            entropy=terms.entropy.mean().item(),
            approx_kl=terms.approx_kl().item(),
            clip_fraction=((terms.ratio - 1).abs() > clip_range).float().mean().item(),
        )


DIAGNOSTICS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction")


def update_diagnostics(steps: Sequence[PPOTerms], clip_range: float) -> dict[str, float]:
    """The mean over an update's optimiser steps (minibatches of one size) of each step's
    policy_loss (mean pg_i), value_loss (mean (R_i - V_i)^2), entropy (mean H), approx_kl (mean
    (rho_i - 1) - log rho_i) and clip_fraction (share of |rho_i - 1| > clip_range); 0 for an update
    of no step. Read once from the steps' detached terms, after the update, not once per step."""
    if not steps:
        return dict.fromkeys(DIAGNOSTICS, 0.0)
    with torch.no_grad():
        ratio, log_ratio = torch.stack([s.ratio for s in steps]), torch.stack([s.log_ratio for s in steps])
        per_step = {
            "policy_loss": torch.stack([s.pg for s in steps]).mean(1),
            "value_loss": torch.stack([s.vf for s in steps]).mean(1),
            "entropy": torch.stack([s.entropy for s in steps]).mean(1),
            "approx_kl": ((ratio - 1) - log_ratio).mean(1),
            "clip_fraction": ((ratio - 1).abs() > clip_range).float().mean(1),
        }
        return {name: per_step[name].double().mean().item() for name in DIAGNOSTICS}


def policy_terms(policy: ActorCritic, obs: torch.Tensor, actions: torch.Tensor, *rest: torch.Tensor,
                 **loss_kwargs: Any) -> PPOTerms:
    """``ppo_terms`` of ``policy``'s outputs on (obs, actions); ``rest`` = old log-probs,
    advantages, returns, old values (the function ``PPOConfig.compile`` compiles)."""
    return ppo_terms(*policy.evaluate_actions(obs, actions), *rest, **loss_kwargs)
