"""The field's rule-based filters: the paper's baselines (advantage heuristics H1/H2, TD-error
prioritised minibatches, reward extremes), DTV, the advantage sign, and the oracle of a corrupted run."""

from __future__ import annotations

import math
from typing import Literal

import torch

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.config import check_drop_pct
from rlinfluence.errors import UserError
from rlinfluence.filters.base import (
    DropMode,
    FilterContext,
    Seeded,
    drop_lowest,
    guard_minibatch,
    iif_drop_count,
)
from rlinfluence.influence import (
    ZeroTargetGradient,
    gradient_alignment,
)


class AdvantageFilter(Seeded):
    """Monte-Carlo advantage heuristics (docs/method.md, section 8.3; discrete small state spaces).

    Among records whose estimated advantage A_hat and Monte-Carlo advantage A_bar disagree in
    sign, drop p% of them: ``H1`` those with the largest |A_bar - A_hat|, ``H2`` those with the
    smallest A_bar * A_hat.
    """

    name = "advantage"

    def __init__(self, drop_pct: float, heuristic: Literal["H1", "H2"] = "H1", seed: int = 0):
        check_drop_pct(drop_pct)
        if heuristic not in ("H1", "H2"):
            raise UserError(f"unknown heuristic {heuristic!r} (H1 or H2)")
        super().__init__(seed)
        self.drop_pct, self.heuristic = drop_pct, heuristic

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        a_hat = buffer.flat("advantages").double()
        a_bar = buffer.monte_carlo_advantages(context.gamma)
        mismatched = torch.isfinite(a_bar) & (torch.sign(a_bar) != torch.sign(a_hat))
        # badness: higher = dropped first; records that are not mismatched are never dropped
        badness = (a_bar - a_hat).abs() if self.heuristic == "H1" else -(a_bar * a_hat)
        badness = torch.where(mismatched, badness, torch.tensor(-math.inf, dtype=torch.float64))
        n_drop = math.floor(self.drop_pct / 100 * int(mismatched.sum()))
        context.stats.update(n_mismatched=float(mismatched.sum()), mc_coverage=float(torch.isfinite(a_bar).float().mean()))
        return guard_minibatch(drop_lowest(-badness, n_drop), -badness, context)


class TDErrorFilter(Seeded):
    """TD-error prioritisation (docs/method.md, section 8.3): keep every record, sample minibatches with weights
    P_i^alpha / sum_j P_j^alpha, P_i = 1 / rank(|delta_i|), delta_i = r_i + gamma V(s'_i) - V(s_i)."""

    name = "td-error"

    def __init__(self, alpha: float = 0.6, seed: int = 0):
        super().__init__(seed)
        self.alpha = alpha

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        delta = buffer.flatten(buffer.td_errors(context.gamma))
        rank = torch.empty(len(delta))
        rank[torch.sort(delta.abs(), descending=True, stable=True).indices] = torch.arange(1, len(delta) + 1, dtype=torch.float32)
        weights = rank.reciprocal().pow(self.alpha)
        context.sample_weights = weights / weights.sum()
        context.stats["td_abs_mean"] = float(delta.abs().mean())
        return torch.ones(len(buffer), dtype=torch.bool)


class RewardExtremesFilter(Seeded):
    """Difficulty heuristic (docs/method.md, section 8.3): drop the p/2 % highest- and p/2 % lowest-reward records."""

    name = "reward-extremes"

    def __init__(self, drop_pct: float, seed: int = 0):
        check_drop_pct(drop_pct)
        super().__init__(seed)
        self.drop_pct = drop_pct

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        rewards = buffer.flat("rewards")
        n_side = math.floor(self.drop_pct / 200 * len(rewards))
        keep = drop_lowest(rewards, n_side) & drop_lowest(-rewards, n_side)
        return guard_minibatch(keep, torch.zeros(len(rewards)), context)


class DropsLowestScores(Seeded):
    """Drops the records of lowest ``scores`` as IIF drops by influence: floor(p N_neg) of the N_neg
    negative ones in ``neg-bottom`` mode (``iif_drop_count``). ``scores`` None keeps every record."""

    def __init__(self, drop_pct: float, drop_mode: DropMode = "neg-bottom", seed: int = 0):
        super().__init__(seed)
        iif_drop_count(torch.zeros(1), 50.0, drop_mode)  # validates drop_mode
        self.drop_pct, self.drop_mode = drop_pct, drop_mode

    def scores(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor | None:
        raise NotImplementedError

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        scores = self.scores(buffer, context)
        if scores is None:
            return torch.ones(len(buffer), dtype=torch.bool)
        context.stats["n_negative"] = float((scores < 0).sum())
        keep = drop_lowest(scores, iif_drop_count(scores, self.drop_pct, self.drop_mode))
        return guard_minibatch(keep, scores, context)


class DTVFilter(DropsLowestScores):
    """Drops the records whose policy gradient points against the buffer's mean one
    (``gradient_alignment``: g_i . mean_j g_j, the DTV rule; no target): floor(p * N_neg) lowest
    in ``neg-bottom`` mode, as IIF drops by influence. A round without gradient keeps every record."""

    name = "dtv"

    def scores(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor | None:
        try:
            scores = gradient_alignment(context.policy, *(buffer.flat(k) for k in ("obs", "actions", "advantages")))
        except ZeroTargetGradient:
            context.stats["skipped"] = 1.0
            return None
        context.stats["skipped"] = 0.0
        context.scores = scores
        return scores


class AdvantageSignFilter(DropsLowestScores):
    """Drops negative-advantage records, the sign filter practitioners try first: the
    floor(p N_neg) records of lowest raw advantage A_i among the N_neg with A_i < 0 in ``neg-bottom``
    mode (p = 100: every one), as IIF drops by influence, so the two drop the same share."""

    name = "advantage-sign"

    def scores(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        return buffer.flat("advantages").double()


class OracleFilter(Seeded):
    """Drops exactly the records a corruption changed (``RolloutBuffer.corrupted``): the ceiling a
    detector of bad data can reach. Only for runs trained with ``--corrupt``; logs ``dropped_corrupted``."""

    name = "oracle"

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        if not buffer.corrupted.numel():
            raise UserError("the oracle filter drops the corrupted records: train with --corrupt")
        corrupted = buffer.flat("corrupted")
        context.stats["dropped_corrupted"] = float(corrupted.sum())
        return guard_minibatch(~corrupted, (~corrupted).float(), context)
