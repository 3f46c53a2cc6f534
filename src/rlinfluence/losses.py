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

from dataclasses import dataclass

import torch


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
    logp, entropy, values = policy.evaluate_actions(obs, actions)
    adv = normalize_advantages(advantages) if normalize_advantage else advantages
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    pg = -torch.min(adv * ratio, adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    if clip_range_vf is not None:
        values = old_values + torch.clamp(values - old_values, -clip_range_vf, clip_range_vf)
    vf = (returns - values).pow(2)
    per_record = pg + vf_coef * vf - ent_coef * entropy
    loss = per_record if reduction == "none" else per_record.mean()
    with torch.no_grad():
        return PPOLoss(
            loss=loss,
            policy_loss=pg.mean().item(),
            value_loss=vf.mean().item(),
            entropy=entropy.mean().item(),
            # SB3's estimator of KL(old || new): E[(rho - 1) - log rho]
            approx_kl=((ratio - 1) - log_ratio).mean().item(),
            clip_fraction=((ratio - 1).abs() > clip_range).float().mean().item(),
        )
