"""Influence-scored filters: IIF (docs/method.md, section 5.1) and the random filter that drops as many
records as IIF would; both score every record's snapshot influence at theta(k)."""

from __future__ import annotations

import math
import time
import warnings
from typing import Literal

import torch

from rlinfluence.buffer import RolloutBuffer
from rlinfluence.config import AUTO, check_drop_pct
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
    DEFAULT_ADVANTAGE_NORM,
    ReturnTarget,
    ZeroTargetGradient,
    adam_inverse_preconditioner,
    snapshot_influence,
    unchanged,
)

AUTO_DROP_GRID = (0.0, 6.25, 12.5, 25.0, 50.0, 100.0)
"""The p (%) ``drop_pct="auto"`` chooses from each round (0 = keep every record)."""


GATE_SPLITS = 8


class InfluenceScorer(Seeded):
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
