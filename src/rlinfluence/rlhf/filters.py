"""The field's rollout filters for GRPO, beside IIF: which of a round's completions the update
trains on. Each is a function of the round's rewards, groups and advantages returning a keep
mask ``[N]`` (groups are ``group_size`` consecutive completions of one prompt):

- ``advantage_sign``: keep A_i >= 0, i.e. drop the completions the update would push down
  (does IIF do more than this sign?);
- ``pods``: max-variance down-sampling (PODS, arXiv 2504.13818): of each group's n completions
  keep the m whose rewards have the largest variance. The optimum is always the k highest and the
  m - k lowest for some k (their Theorem), so m + 1 candidates per group are compared;
- ``random_subset``: a uniformly random subset of a given kept fraction (the control of "which");
- ``zero_variance_groups``: the groups whose rewards are all equal (their advantages are all 0,
  they carry no gradient): what DAPO's dynamic sampling drops;
- ``gold_agreement``: the ceiling of a gold task, which no practitioner has: keep the completions
  the update moves the way the gold reward would.

DTV (``rlinfluence.rlhf.influence.sequence_influence(target="mean")``) and IIF score the
completions by gradients instead; the trainer drops their negatives alike.
"""

from __future__ import annotations

import torch


def _groups(values: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or len(values) % group_size:
        raise ValueError(f"{len(values)} completions do not form groups of {group_size}")
    return values.reshape(-1, group_size)


def advantage_sign(sequence_advantages: torch.Tensor) -> torch.Tensor:
    """keep_i = A_i >= 0 (a group of equal rewards has A = 0 everywhere and is kept)."""
    return sequence_advantages >= 0


def gold_agreement(sequence_advantages: torch.Tensor, gold: torch.Tensor, group_size: int) -> torch.Tensor:
    """keep_i = A_i (g_i - mean_{j in i's group} g_j) >= 0: drop a completion when the update
    pushes it the opposite way to its gold advantage (raises a completion the gold reward ranks
    below its group's mean, or lowers one it ranks above). What a perfect scorer of each
    completion's effect on the gold reward could do: the ceiling of a gold-targeted filter."""
    grouped = _groups(gold.double(), group_size)
    centred = (grouped - grouped.mean(1, keepdim=True)).flatten()
    return sequence_advantages.double().cpu() * centred >= 0


def zero_variance_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] bool: the completion's group has all rewards equal."""
    grouped = _groups(scores, group_size)
    flat = (grouped == grouped[:, :1]).all(1)
    return flat.repeat_interleave(group_size)


def pods(scores: torch.Tensor, group_size: int, keep: int = 0) -> torch.Tensor:
    """Per group, keep the ``keep`` completions (0 = half the group, rounded up) whose rewards have
    the largest (population) variance: the best of {top k} + {bottom keep - k}, k = 0..keep
    (ties: the smallest k). Returns the keep mask ``[N]``."""
    keep = keep or -(-group_size // 2)
    if not 1 <= keep <= group_size:
        raise ValueError(f"pods keeps 1..{group_size} completions per group, got {keep}")
    grouped = _groups(scores.double(), group_size)
    order = grouped.argsort(dim=1, descending=True, stable=True)  # best first
    sorted_scores = grouped.gather(1, order)
    mask = torch.zeros_like(grouped, dtype=torch.bool)
    for g in range(len(grouped)):
        best, best_var = 0, -1.0
        for k in range(keep + 1):
            chosen = torch.cat([sorted_scores[g, :k], sorted_scores[g, group_size - (keep - k):]])
            var = float(chosen.var(unbiased=False))
            if var > best_var + 1e-12:
                best, best_var = k, var
        picked = torch.cat([order[g, :best], order[g, group_size - (keep - best):]])
        mask[g, picked] = True
    return mask.flatten()


def random_subset(n: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """A uniformly random subset of round(fraction * n) of n completions (at least one)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the kept fraction must be in (0, 1], got {fraction}")
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.randperm(n, generator=generator)[: max(1, round(fraction * n))]] = True
    return mask
