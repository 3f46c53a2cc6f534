"""Record filters: what the trainer calls between "compute advantages" and "optimise".

A filter is any callable ``filter(buffer, context) -> keep`` returning a boolean mask of shape
``[len(buffer)]`` in the buffer's flat (env-major) order; the update then trains only on kept
records. A filter may instead (or also) set ``context.sample_weights``: the update then draws
its minibatches from the kept records with probability proportional to the weights. Filters own
their random state (``state_dict`` for resume) and report per-round statistics by writing
numbers into ``context.stats`` (logged to metrics.csv and TensorBoard under ``filter/``).

Filters here: ``none`` (standard PPO), ``iif`` (the paper's influence-based filtering, docs/method.md, section 5),
the baselines of section 8.3: ``random``, ``advantage`` (H1/H2), ``td-error``,
``reward-extremes``; and ``quarantine``, which drops whole sources the audit's test flags.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import torch

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.config import AUTO, FILTER_NAMES, check_drop_pct  # noqa: F401  (importable from here)
from rlinfluence.consistency import (
    CALIBRATED,
    CHECKS,
    RAW_SCALE,
    STATISTICS,
    TWO_SIDED,
    action_count,
    consistency_scores,
    statistic_scores,
)
from rlinfluence.errors import UserError
from rlinfluence.influence import (
    DEFAULT_ADVANTAGE_NORM,
    ReturnTarget,
    ZeroTargetGradient,
    adam_inverse_preconditioner,
    gradient_alignment,
    snapshot_influence,
    unchanged,
)
from rlinfluence.sources import (
    MIN_EPISODES,
    calibration_p_values,
    episode_floor,
    episode_starts,
    group_means,
    normal_scores,
    verdict,
)


@dataclass
class FilterContext:
    """What a filter may look at besides the buffer, and where it reports."""

    policy: torch.nn.Module
    """The policy theta(k) that collected the buffer (not yet updated)."""
    round: int
    batch_size: int
    gamma: float = 0.99
    stats: dict[str, float] = field(default_factory=dict)
    sample_weights: torch.Tensor | None = None
    """Optional [N] non-negative minibatch sampling weights (set by prioritising filters)."""
    validation: RolloutBuffer | None = None
    """A separate rollout of pi_theta(k) (advantages computed) for filters with ``uses_validation``
    when the trainer is asked for one; None = score against the buffer itself."""
    optimizer: torch.optim.Optimizer | None = None
    """The trainer's optimiser, in its state before this round's update (for preconditioned scores)."""
    lookahead: Callable[[torch.Tensor, torch.Tensor], float] | None = None
    """``lookahead(train, held_out)``: the gain of one epoch of the round's update on the records
    ``train`` (flat indices), run on a copy of theta(k), measured on the records ``held_out`` as
    the PPO surrogate mean_j A_norm_j (pi'(a_j|s_j) / pi(a_j|s_j) - 1) (for ``drop_pct="auto"``)."""
    scores: torch.Tensor | None = None
    """The [N] influence scores a scoring filter computed this round (logged as a histogram)."""
    ent_coef: float = 0.0
    """The trainer's entropy coefficient: the training loss's entropy bonus enters the scores too."""
    trusted: torch.Tensor | None = None
    """[N] bool, flat order: the records of a trusted source (``PPOConfig.trusted_envs``). Scoring
    filters then judge every record against a return target computed on these records only, so
    that corrupted records are not part of the target they are judged by."""


class Filter(Protocol):
    name: str

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class KeepAll:
    """Standard PPO: keep every record."""

    name = "ppo"

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        return torch.ones(len(buffer), dtype=torch.bool)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


AUTO_DROP_GRID = (0.0, 6.25, 12.5, 25.0, 50.0, 100.0)
"""The p (%) ``drop_pct="auto"`` chooses from each round (0 = keep every record)."""


def drop_lowest(scores: torch.Tensor, n_drop: int) -> torch.Tensor:
    """Keep mask dropping exactly the ``n_drop`` lowest scores (stable sort: ties by index)."""
    keep = torch.ones(len(scores), dtype=torch.bool)
    keep[torch.sort(scores, stable=True).indices[:n_drop]] = False
    return keep


def guard_minibatch(keep: torch.Tensor, scores: torch.Tensor, context: FilterContext) -> torch.Tensor:
    """Keep at least one full minibatch: if fewer survive, keep the ``batch_size`` best scores."""
    guarded = int(keep.sum()) < context.batch_size
    context.stats["minibatch_guard"] = float(guarded)
    if guarded:
        keep = torch.zeros_like(keep)
        keep[torch.sort(scores, descending=True, stable=True).indices[: context.batch_size]] = True
    return keep


class _Seeded:
    """A filter's own random stream (saved with checkpoints so resumed runs stay reproducible)."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])


GATE_SPLITS = 8


class InfluenceScorer(_Seeded):
    """Snapshot ``return`` influence of every record at theta(k) (docs/method.md, section 4.2).

    ``advantage_norm="chunk"`` normalises advantages within chunks of ``batch_size`` records
    formed by a random permutation (the authors' first-epoch minibatches); ``"batch"`` over the
    whole buffer; ``"none"`` uses raw advantages. The target is ``ReturnTarget()`` over the
    buffer itself, over ``context.validation`` when the trainer collected one, or over the records
    of a trusted source (``context.trusted``).

    A round whose target has no signal (grad f = 0, e.g. every advantage exactly 0) is not an
    error: ``scores`` returns None, sets ``context.stats["skipped"] = 1`` (0 on scored rounds) and
    warns with the reason; the filters then keep every record of that round.

    ``gate="split-half"`` estimates whether the target has signal this round: the buffer's
    episodes are split into two random halves A and B, and the round is filtered only if the
    return target's gradients on the two halves agree,

        gate_reliability = mean over GATE_SPLITS random splits of cos(g_A, g_B) >= gate_threshold,
        g_S = grad (1/|S|) sum_{j in S} A_j log pi(a_j|s_j)

    (split-half reliability: with g_S = signal + independent noise, cos estimates the share of
    the signal; one split is noisy with few episodes, hence the mean over splits). When every episode ends the same way the target is value noise, the halves
    disagree, and ``scores`` returns None with ``context.stats["gated"] = 1`` (every record kept).
    Scores are <training gradient_i, g>, so halves whose gradients agree rank records alike.

    ``precondition="adam"`` scores <grad l_i, P^-1 grad f> with P the diagonal preconditioner of
    the trainer's Adam (``context.optimizer``) as it stands before the round's update
    (``rlinfluence.influence.adam_inverse_preconditioner``), so that records are ranked by the
    change Adam's step would make rather than an SGD step's (TracIn's assumption).
    """

    name = "influence"

    uses_validation = True

    def __init__(self, advantage_norm: Literal["chunk", "batch", "none"] = DEFAULT_ADVANTAGE_NORM, seed: int = 0,
                 gate: Literal["none", "split-half"] = "none", gate_threshold: float = 0.3,
                 precondition: Literal["none", "adam"] = "none"):
        super().__init__(seed)
        if gate not in ("none", "split-half"):
            raise UserError(f"unknown gate {gate!r} (none or split-half)")
        if precondition not in ("none", "adam"):
            raise UserError(f"unknown precondition {precondition!r} (none or adam)")
        self.advantage_norm, self.gate, self.gate_threshold = advantage_norm, gate, gate_threshold
        self.precondition = precondition

    def _snapshot(self, context: FilterContext, obs: torch.Tensor, actions: torch.Tensor,
                  advantages: torch.Tensor, target: ReturnTarget) -> torch.Tensor:
        inverse = None
        if self.precondition == "adam":
            if not isinstance(context.optimizer, torch.optim.Adam):
                raise UserError("precondition adam needs the trainer's Adam optimiser (--optimizer adam)")
            inverse = adam_inverse_preconditioner(context.optimizer)
        return snapshot_influence(context.policy, obs, actions, advantages, target=target,
                                  advantage_norm=self.advantage_norm, chunk_size=context.batch_size,
                                  ent_coef=context.ent_coef, inverse_preconditioner=inverse)

    def split_half_reliability(self, context: FilterContext, obs: torch.Tensor, actions: torch.Tensor,
                               advantages: torch.Tensor, episode_ids: torch.Tensor) -> float:
        """Mean over ``GATE_SPLITS`` random splits of cos(g_A, g_B), the return target's
        gradients on two halves of the episodes (of the records' time order when there are fewer
        than 4 episodes: then one split); NaN if a half has no gradient."""
        episodes = torch.unique(episode_ids)
        params = [p for p in context.policy.parameters() if p.requires_grad]
        cosines = []
        for _ in range(GATE_SPLITS if len(episodes) >= 4 else 1):
            if len(episodes) >= 4:
                half = episodes[torch.randperm(len(episodes), generator=self.generator)[: len(episodes) // 2]]
                in_a = torch.isin(episode_ids, half)
            else:
                in_a = torch.arange(len(obs)) < len(obs) // 2
            grads = []
            with torch.enable_grad(), unchanged(context.policy):
                for mask in (in_a, ~in_a):
                    f = (advantages[mask] * context.policy.log_prob(obs[mask], actions[mask])).mean()
                    parts = torch.autograd.grad(f, params, allow_unused=True)
                    grads.append(torch.cat([g.flatten() for g in parts if g is not None]))
            norms = grads[0].norm() * grads[1].norm()
            if not norms > 0:
                return math.nan
            cosines.append(float(grads[0] @ grads[1] / norms))
        return sum(cosines) / len(cosines)

    def scores(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor | None:
        start = time.perf_counter()
        order = torch.randperm(len(buffer), generator=self.generator)
        obs, actions, advantages = (buffer.flat(name)[order] for name in ("obs", "actions", "advantages"))
        validation = context.validation
        if validation is not None:
            target = ReturnTarget(*(validation.flat(k) for k in ("obs", "actions", "advantages")))
        elif context.trusted is not None:
            target = ReturnTarget(*(buffer.flat(k)[context.trusted] for k in ("obs", "actions", "advantages")))
        else:
            target = ReturnTarget()
        if self.gate == "split-half":
            reliability = self.split_half_reliability(context, obs, actions, advantages,
                                                      buffer.flat("episode_ids")[order])
            gated = not reliability >= self.gate_threshold  # NaN (no signal at all) is gated too
            context.stats.update(gate_reliability=reliability, gated=float(gated))
            if gated:
                context.stats.update(skipped=0.0, scoring_seconds=time.perf_counter() - start)
                return None
        try:
            shuffled = self._snapshot(context, obs, actions, advantages, target)
        except ZeroTargetGradient as exc:
            context.stats.update(skipped=1.0, scoring_seconds=time.perf_counter() - start)
            warnings.warn(f"round {context.round}: {self.name} kept every record (skipped=1): {exc}",
                          RuntimeWarning, stacklevel=2)
            return None
        scores = torch.empty_like(shuffled)
        scores[order] = shuffled
        context.stats.update(
            skipped=0.0, n_negative=float((scores < 0).sum()), score_mean=float(scores.mean()),
            score_std=float(scores.std()), scoring_seconds=time.perf_counter() - start,
        )
        context.scores = scores
        return scores


DropMode = Literal["neg-bottom", "bottom", "neg"]


def iif_drop_count(scores: torch.Tensor, drop_pct: float, drop_mode: DropMode) -> int:
    """How many records IIF drops: floor(p * N_neg) (neg-bottom), floor(p * N) (bottom), N_neg (neg)."""
    n_negative = int((scores < 0).sum())
    if drop_mode == "neg-bottom":
        return math.floor(drop_pct / 100 * n_negative)
    if drop_mode == "bottom":
        return math.floor(drop_pct / 100 * len(scores))
    if drop_mode == "neg":
        return n_negative
    raise UserError(f"unknown drop_mode {drop_mode!r} (neg-bottom, bottom or neg)")


class IIFFilter(InfluenceScorer):
    """Iterative influence-based filtering (docs/method.md, section 5.1): drop the most harmful records.

    ``neg-bottom`` (default) drops the floor(p * N_neg) lowest-scoring records, all of them
    negative; ``bottom`` the lowest p% of all records; ``neg`` every negative record.

    ``drop_pct="auto"`` chooses p each round from ``AUTO_DROP_GRID`` by cross-fitting with a
    lookahead (``choose_drop_pct``), logged as ``drop_pct``.
    """

    name = "iif"

    def __init__(self, drop_pct: float | str, drop_mode: DropMode = "neg-bottom",
                 advantage_norm: Literal["chunk", "batch", "none"] = DEFAULT_ADVANTAGE_NORM, seed: int = 0,
                 gate: Literal["none", "split-half"] = "none", gate_threshold: float = 0.3,
                 precondition: Literal["none", "adam"] = "none"):
        check_drop_pct(drop_pct, auto=True)
        iif_drop_count(torch.zeros(1), 50.0, drop_mode)  # validates drop_mode
        if drop_pct == AUTO and drop_mode == "neg":
            raise UserError("drop_pct auto chooses p, but drop_mode neg drops every negative record whatever p is")
        super().__init__(advantage_norm, seed, gate, gate_threshold, precondition)
        self.drop_pct, self.drop_mode = drop_pct, drop_mode

    def choose_drop_pct(self, buffer: RolloutBuffer, context: FilterContext) -> float:
        """The p of ``AUTO_DROP_GRID`` whose update helps held-out episodes most.

        The buffer's episodes are split at random into halves A and B (time halves with fewer
        than 2 episodes). A's records are scored against A's own return target, as IIF scores a
        buffer; for each p, one epoch of the update on A's records kept at p runs on a copy of
        theta(k) (``context.lookahead``), and its gain is the surrogate measured on B, which
        neither scored nor trained. The lookahead measures the update itself, so it sees the
        non-additivity of dropping many records at once, which a sum of scores does not.
        p = argmax gain (ties: the smaller p); 0 if A's target has no gradient.
        """
        if context.lookahead is None:
            raise UserError("drop_pct auto needs the trainer's lookahead (FilterContext.lookahead)")
        episode_ids = buffer.flat("episode_ids")
        episodes = torch.unique(episode_ids)
        if len(episodes) >= 2:
            half = episodes[torch.randperm(len(episodes), generator=self.generator)[: len(episodes) // 2]]
            in_a = torch.isin(episode_ids, half)
        else:
            in_a = buffer.flatten(torch.arange(buffer.n_steps)[:, None].expand(-1, buffer.n_envs)) < buffer.n_steps // 2
        a_records = in_a.nonzero().squeeze(1)
        a_records = a_records[torch.randperm(len(a_records), generator=self.generator)]
        b_records = (~in_a).nonzero().squeeze(1)
        try:
            scores_a = self._snapshot(context, *(buffer.flat(k)[a_records] for k in ("obs", "actions", "advantages")),
                                      ReturnTarget())
        except ZeroTargetGradient:
            return 0.0
        best_pct, best_gain, base_gain = 0.0, -math.inf, math.nan
        for pct in AUTO_DROP_GRID:
            keep = (torch.ones(len(a_records), dtype=torch.bool) if pct == 0
                    else drop_lowest(scores_a, iif_drop_count(scores_a, pct, self.drop_mode)))
            if int(keep.sum()) < context.batch_size:
                continue
            gain = context.lookahead(a_records[keep], b_records)
            if pct == 0:
                base_gain = gain
            if gain > best_gain:
                best_pct, best_gain = pct, gain
        context.stats["auto_gain_over_p0"] = best_gain - base_gain
        return best_pct

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        scores = self.scores(buffer, context)
        drop_pct = self.drop_pct
        if scores is not None and drop_pct == AUTO:
            drop_pct = self.choose_drop_pct(buffer, context)
            context.stats["drop_pct"] = drop_pct
        if scores is None or drop_pct == 0:  # no attribution signal (skipped or gated), or p = 0
            context.stats["minibatch_guard"] = 0.0
            return torch.ones(len(buffer), dtype=torch.bool)
        keep = drop_lowest(scores, iif_drop_count(scores, drop_pct, self.drop_mode))
        return guard_minibatch(keep, scores, context)


class RandomFilter(InfluenceScorer):
    """Control: drop a uniformly random subset, of exactly IIF's size (``match="iif"``: the
    scores are computed only to count) or of floor(p * N) records (``match="pct"``)."""

    name = "random"

    def __init__(self, drop_pct: float, match: Literal["iif", "pct"] = "iif",
                 drop_mode: DropMode = "neg-bottom", advantage_norm: Literal["chunk", "batch", "none"] = DEFAULT_ADVANTAGE_NORM,
                 seed: int = 0, gate: Literal["none", "split-half"] = "none", gate_threshold: float = 0.3,
                 precondition: Literal["none", "adam"] = "none"):
        check_drop_pct(drop_pct)
        super().__init__(advantage_norm, seed, gate, gate_threshold, precondition)
        self.drop_pct, self.match, self.drop_mode = drop_pct, match, drop_mode

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        if self.match == "iif":  # as many as IIF drops: none in a round IIF skips
            scores = self.scores(buffer, context)
            n_drop = 0 if scores is None else iif_drop_count(scores, self.drop_pct, self.drop_mode)
        else:
            n_drop = math.floor(self.drop_pct / 100 * len(buffer))
        random_scores = torch.rand(len(buffer), generator=self.generator)
        return guard_minibatch(drop_lowest(random_scores, n_drop), random_scores, context)


class AdvantageFilter(_Seeded):
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


class TDErrorFilter(_Seeded):
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


class RewardExtremesFilter(_Seeded):
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


class _DropsLowestScores(_Seeded):
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


class DTVFilter(_DropsLowestScores):
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


class AdvantageSignFilter(_DropsLowestScores):
    """Drops negative-advantage records, the sign filter practitioners try first: the
    floor(p N_neg) records of lowest raw advantage A_i among the N_neg with A_i < 0 in ``neg-bottom``
    mode (p = 100: every one), as IIF drops by influence, so the two drop the same share."""

    name = "advantage-sign"

    def scores(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        return buffer.flat("advantages").double()


class OracleFilter(_Seeded):
    """Drops exactly the records a corruption changed (``RolloutBuffer.corrupted``): the ceiling a
    detector of bad data can reach. Only for runs trained with ``--corrupt``; logs ``dropped_corrupted``."""

    name = "oracle"

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        if not buffer.corrupted.numel():
            raise UserError("the oracle filter drops the corrupted records: train with --corrupt")
        corrupted = buffer.flat("corrupted")
        context.stats["dropped_corrupted"] = float(corrupted.sum())
        return guard_minibatch(~corrupted, (~corrupted).float(), context)




def _units(scores: np.ndarray, families: Sequence[str]) -> np.ndarray:
    """[N, families] each column as normal scores within the round (``rlinfluence.sources.normal_scores``;
    the ``RAW_SCALE`` checks as they are): computed once when a round is recorded, as they never change."""
    return np.column_stack([scores[:, j] if family in RAW_SCALE else normal_scores(np.zeros(len(scores)), scores[:, j])
                            for j, family in enumerate(families)])


class QuarantineFilter:
    """Drops every record of the sources (training envs) that the audit's test flags over the last
    ``window`` rounds, until they test clean again: the verdict of ``rlinfluence.sources`` each round
    on the cheap families (the consistency checks and the reward, value and advantage statistics of
    ``rlinfluence.consistency``; with ``attribution``, influence and dtv too): the exact test of
    each source's units (the mean normal score of its records whose episode started in round k;
    the ``RAW_SCALE`` checks as they are), once every source has ``MIN_EPISODES`` episodes in the
    window the outlier test of its means beside it, and the calibration test of its
    ``action-calibration``, adjusted across sources x families at ``alpha``. The last ``trusted_envs`` envs are never
    tested nor quarantined. Logs ``quarantined`` (how many sources) and ``quarantined_sources``
    (their ids, space-separated)."""

    name = "quarantine"
    PERMUTATIONS = 2000
    """maxT's shuffles each round: its p-values resolve to 1/2001, far below alpha / 0.8 at 0.01, at a
    fifth of the 10,000 an audit draws (docs/results/hidden-faults.md: the same auc, less CPU)"""
    CHEAP = (*STATISTICS, *CHECKS)
    ATTRIBUTION = ("influence", "dtv")

    def __init__(self, window: int = 6, alpha: float = 0.01, attribution: bool = False, trusted_envs: int = 0):
        self.window, self.alpha, self.attribution, self.trusted_envs = window, alpha, attribution, trusted_envs
        self.families = [*self.CHEAP, *(self.ATTRIBUTION if attribution else ())]
        # the records of the last rounds (round -> source, episode, start round, normal scores [N, families])
        # and the round each running episode started in
        self.records: dict[int, dict[str, torch.Tensor]] = {}
        self.first_seen: dict[tuple[int, int], int] = {}

    def _scores(self, buffer: RolloutBuffer, context: FilterContext) -> np.ndarray:
        scores = {**statistic_scores(buffer, context.gamma),
                  **consistency_scores(context.policy, buffer, action_count(context.policy))}
        if self.attribution:
            obs, actions, advantages = (buffer.flat(k) for k in ("obs", "actions", "advantages"))
            influence = InfluenceScorer(advantage_norm="batch").scores(buffer, context)
            scores["influence"] = -influence.double().numpy() if influence is not None else np.full(len(buffer), np.nan)
            try:
                scores["dtv"] = -gradient_alignment(context.policy, obs, actions, advantages).double().numpy()
            except ZeroTargetGradient:
                scores["dtv"] = np.full(len(buffer), np.nan)
        return np.column_stack([scores[f] for f in self.families])

    def __call__(self, buffer: RolloutBuffer, context: FilterContext) -> torch.Tensor:
        n_sources = buffer.n_envs - self.trusted_envs
        ids = buffer.record_ids()
        source, episode = ids[:, 1].numpy(), buffer.flat("episode_ids").numpy()
        running = set(zip(source.tolist(), episode.tolist(), strict=True))
        self.first_seen = {key: k for key, k in self.first_seen.items() if key in running}  # ended episodes
        start = episode_starts(np.full(len(source), buffer.round), source, episode, self.first_seen)
        untrusted = source < n_sources
        self.records[buffer.round] = {"source": torch.from_numpy(source[untrusted]),
                                      "episode": torch.from_numpy(episode[untrusted]),
                                      "start": torch.from_numpy(start[untrusted]),
                                      "units": torch.from_numpy(_units(self._scores(buffer, context)[untrusted], self.families))}
        oldest = buffer.round - self.window + 1
        self.records = {k: r for k, r in self.records.items() if k >= oldest}
        kept = list(self.records.values())
        starts = torch.cat([r["start"] for r in kept]).numpy()
        sources = torch.cat([r["source"] for r in kept]).numpy()
        episodes = torch.cat([r["episode"] for r in kept]).numpy()
        z = torch.cat([r["units"] for r in kept]).numpy()  # the units of every test
        in_window = starts >= oldest
        means = {family: group_means(starts[in_window], sources[in_window], z[in_window, j], range(n_sources))[1]
                 for j, family in enumerate(self.families)}
        outlier_means, floors = None, {}
        per_source = np.bincount(np.unique(np.stack([sources, episodes]), axis=1)[0], minlength=n_sources)
        if (per_source[:n_sources] >= MIN_EPISODES).all():
            collected = np.concatenate([np.full(len(r["source"]), k) for k, r in enumerate(kept)])
            outlier_means = {family: group_means(collected, sources, z[:, j], range(n_sources))[1]
                             for j, family in enumerate(self.families)}
            floors = {family: episode_floor(sources, episodes, z[:, j], range(n_sources))
                      for j, family in enumerate(self.families)}
        calibrated = {family: calibration_p_values(sources, z[:, j], range(n_sources), CALIBRATED[family])
                      for j, family in enumerate(self.families) if family in CALIBRATED}
        flagged = verdict(means, range(n_sources), TWO_SIDED, self.alpha, outlier_means, floors, self.PERMUTATIONS,
                          calibrated)
        quarantined = [int(s) for s in flagged.loc[flagged["flagged"], "source"]]
        context.stats["quarantined"] = float(len(quarantined))
        context.stats["quarantined_sources"] = " ".join(map(str, quarantined))
        keep = ~torch.isin(ids[:, 1], torch.tensor(quarantined, dtype=torch.int64))
        return guard_minibatch(keep, keep.float(), context)

    def state_dict(self) -> dict[str, Any]:
        seen = torch.tensor([[s, e, k] for (s, e), k in self.first_seen.items()], dtype=torch.int64).reshape(-1, 3)
        return {"records": {int(k): dict(r) for k, r in self.records.items()}, "first_seen": seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = {int(k): dict(r) for k, r in state.get("records", {}).items()}
        if any("units" not in r or r["units"].shape[1] != len(self.families) for r in self.records.values()):
            raise UserError("this checkpoint's quarantine window holds the scores of another set of checks (written "
                            "by an older rlinfluence): resume it with the version that wrote it, or train again")
        seen = state.get("first_seen", torch.zeros(0, 3, dtype=torch.int64))
        self.first_seen = {(int(s), int(e)): int(k) for s, e, k in seen.tolist()}


def make_filter(
    name: str,
    *,
    drop_pct: float | str = 50.0,
    seed: int = 0,
    drop_mode: DropMode = "neg-bottom",
    advantage_norm: Literal["chunk", "batch", "none"] = DEFAULT_ADVANTAGE_NORM,
    random_match: Literal["iif", "pct"] = "iif",
    heuristic: Literal["H1", "H2"] = "H1",
    gate: Literal["none", "split-half"] = "none",
    gate_threshold: float = 0.3,
    precondition: Literal["none", "adam"] = "none",
    quarantine: tuple[int, float, bool, int] = (6, 0.01, False, 0),
) -> Filter:
    """Build a filter by name (``none`` = standard PPO), passing each the options it uses
    (``quarantine``: the quarantine filter's window, alpha, attribution and trusted_envs)."""
    if name != "iif":
        check_drop_pct(drop_pct)  # auto is IIF's alone; a filter without p ignores a number
    if name == "none":
        return KeepAll()
    if name == "iif":
        return IIFFilter(drop_pct, drop_mode, advantage_norm, seed, gate, gate_threshold, precondition)
    if name == "random":
        return RandomFilter(drop_pct, random_match, drop_mode, advantage_norm, seed, gate, gate_threshold,
                            precondition)
    if name == "advantage":
        return AdvantageFilter(drop_pct, heuristic, seed)
    if name == "td-error":
        return TDErrorFilter(seed=seed)
    if name == "reward-extremes":
        return RewardExtremesFilter(drop_pct, seed)
    if name == "dtv":
        return DTVFilter(drop_pct, drop_mode, seed)
    if name == "advantage-sign":
        return AdvantageSignFilter(drop_pct, drop_mode, seed)
    if name == "oracle":
        return OracleFilter(seed)
    if name == "quarantine":
        return QuarantineFilter(*quarantine)
    raise UserError(f"unknown filter {name!r} (choose from {', '.join(FILTER_NAMES)})")
