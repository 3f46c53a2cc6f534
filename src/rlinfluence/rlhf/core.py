"""The RLHF algebra, as pure tensor functions: KL control, GAE, whitening, advantages, losses.

Shapes: ``[N, R]`` = N sequences (records) x R response positions; ``mask [N, R]`` is 1 on the
response tokens of each sequence (up to and including its first end-of-sequence token) and 0
on the padding after it. Every per-token quantity is zero-padded under ``mask == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlinfluence.errors import UserError


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask), over ``dim`` (default: everything)."""
    if dim is None:
        return (x * mask).sum() / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim)


def mean_response_logp(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean per-token log-probability over its response tokens, [N] (0 for an
    empty response)."""
    return (logp * mask).sum(1) / mask.sum(1).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the unmasked entries (unbiased var, as TRL); 0 under the mask."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = ((x - mean) ** 2 * mask).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient beta (Ziegler et al. 2019; TRL ``AdaptiveKLController``):

        e    = clip(KL / target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n / horizon)

    with KL the round's mean summed per-sequence KL and n the number of sequences of the round.
    ``target=None`` keeps beta fixed.
    """

    value: float = 0.04
    target: float | None = 0.1
    horizon: float = 10_000

    def update(self, kl: float, n_sequences: int) -> float:
        """Apply one round's measured ``kl``; returns the new beta."""
        if self.target is not None:
            error = min(max(kl / self.target - 1, -0.2), 0.2)
            self.value *= 1 + error * n_sequences / self.horizon
        return self.value


def token_rewards(
    scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO rewards and the per-token KL estimate (TRL's ``kl`` penalty):

        kl_t = log pi(y_t) - log pi_ref(y_t),   r_t = -beta kl_t + [t = last] * score

    ``scores [N]`` is the reward model's score of each response. Returns ``(rewards, kl)``.
    """
    kl = (logp - ref_logp) * mask
    rewards = -beta * kl
    last = mask.sum(1).long() - 1
    rewards[torch.arange(len(scores), device=rewards.device), last] += scores.to(rewards)
    return rewards, kl


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the response tokens, V = 0 after the last token:

        delta_t = r_t + gamma V_{t+1} - V_t,   A_t = delta_t + gamma lambda A_{t+1},   R_t = A_t + V_t

    Returns ``(advantages, returns)``, zero under the mask.
    """
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def group_advantages(scores: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's group-relative advantage of each sequence, ``scores`` ordered group by group:

        A_i = (r_i - mean_{group(i)} r) / (std_{group(i)} r + eps)      (unbiased std)
    """
    if group_size < 2 or len(scores) % group_size:
        raise UserError(f"GRPO needs groups of >= 2 responses; got {len(scores)} scores, group_size {group_size}")
    grouped = scores.view(-1, group_size)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + eps)).flatten()


def ppo_losses(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    clip_range_value: float,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """TRL's clipped PPO losses, token-masked means over the minibatch:

        rho_t = exp(log pi(y_t) - log pi_old(y_t))
        L_pg  = mean_t max(-A_t rho_t, -A_t clip(rho_t, 1 - eps, 1 + eps))
        L_vf  = 1/2 mean_t max((V_t - R_t)^2, (clip(V_t, V_old - eps_v, V_old + eps_v) - R_t)^2)

    Returns ``(L_pg, L_vf, stats)``.
    """
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    pg = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    clipped = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
    vf = 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    with torch.no_grad():
        stats = {
            "approx_kl": float(masked_mean((ratio - 1) - log_ratio, mask)),
            "clip_fraction": float(masked_mean(((ratio - 1).abs() > clip_range).float(), mask)),
        }
    return masked_mean(pg, mask), masked_mean(vf, mask), stats


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO (Shao et al. 2024): clipped surrogate with the sequence advantage on every token, plus
    beta times the k3 KL estimator to the reference, token mean per sequence, mean over sequences:

        k3_t = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1
        L    = mean_i mean_{t in i} [ max(-A_i rho_t, -A_i clip(rho_t, 1 - eps, 1 + eps)) + beta k3_t ]

    ``advantages [N]``. Returns ``(L, stats)``.
    """
    log_ratio = (logp - old_logp) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    pg = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range))
    diff = (ref_logp - logp) * mask
    k3 = torch.exp(diff) - diff - 1
    loss = masked_mean(pg + beta * k3, mask, dim=1).mean()
    with torch.no_grad():
        stats = {
            "approx_kl": float(masked_mean((ratio - 1) - log_ratio, mask)),
            "clip_fraction": float(masked_mean(((ratio - 1).abs() > clip_range).float(), mask)),
        }
    return loss, stats
