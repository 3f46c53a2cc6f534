"""The harm table of a round: one row per record, one column per scorer and consistency check,
each giving every record a *harm* score (higher = more harmful):

    influence           -<grad l_i, grad f>, f the return target on the whole buffer (IIF's scores)
    influence-trusted   the same with f on the trusted envs' records only (``trusted_envs``)
    tracin              -I_i, full local TracIn over the round's recorded optimiser steps
                        (the return target): as recorded in training (``train --tracin``), or
                        by a replay of the round (``rlinfluence.influence.tracin_influence``)
    dtv                 -g_i . mean_j g_j, g_i = A_i grad log pi(a_i|s_i) (A batch-normalised): the
                        gradient alignment of "Not All Rollouts Are Worth Learning", no target needed
    negative-advantage  -A_i
    abs-advantage       |A_i|
    td-error            |delta_i|, delta_i = r_i + gamma V(s'_i) (1 - done_i) - V(s_i)
    reward-extremes     |r_i - mean_j r_j|, the distance of the reward from the round's mean
    influence-chunk     the same with advantages normalised in random chunks of batch_size (the
                        permutation seeded by the round): the normalisation IIF itself uses
    random              a uniform draw (the chance line), seeded by the round and the buffer

and the consistency checks of ``rlinfluence.consistency`` (logp-gap, value-gap, action-surprise,
obs-shift, dynamics, reward-model, termination), which ask whether a record agrees with the policy
that collected it and with the other sources' data rather than how it moved the update.

A round is scored into a *harm table*, one row per record: ``round``, ``source`` (the training env,
or for a user's own records any id: worker, annotator), ``episode`` (unique within its source),
``step``, ``trusted``, ``corrupted`` (where the truth is known) and one column per scorer.
``harm_table`` builds it from a run's saved round; the Stable-Baselines3 adapter writes the same
table per rollout (``rlinfluence.integrations.sb3_audit.AuditCallback``), as may any user, to
``RUN_DIR/audit/scores/round_K.parquet``; the audit (``rlinfluence.analysis.audit``) reads only that table.

Families that share their work are scored together (``GROUPS``): the gradient families from one
pass, the statistics, and the consistency checks.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from rlinfluence.consistency import (
    CHECKS,
    STATISTICS,
    action_count,
    consistency_scores,
    statistic_scores,
)
from rlinfluence.filters import FilterContext, InfluenceScorer
from rlinfluence.influence import ReturnTarget, ZeroTargetGradient, return_and_alignment_scores
from rlinfluence.seeding import derived_seed

if TYPE_CHECKING:
    from rlinfluence.checkpoint import SavedRound

Scorer = Callable[["SavedRound"], np.ndarray]
GRADIENT_FAMILIES = ("influence", "influence-chunk", "dtv")
"""The families scored from one gradient pass (``_gradient_families``)."""
ATTRIBUTION_FAMILIES = ("influence", "influence-trusted", "influence-chunk", "tracin", "dtv")
"""The families scored from the policy's gradients. The verdict (version 4 on) scores and tests them
only where asked (``audit --gradient-families``): on version 3's held-out runs none flagged a broken
worker that another family missed, and on an image policy they were half the audit's cost."""


def _trusted(saved: SavedRound) -> torch.Tensor:
    """[N] bool, flat order: the records of the run's trusted envs (the last ``trusted_envs``)."""
    env = saved.buffer.record_ids()[:, 1]
    return env >= saved.buffer.n_envs - saved.trainer.config.trusted_envs


def _influence_trusted(saved: SavedRound) -> np.ndarray:
    """influence with f on the trusted envs' records only."""
    buffer = saved.buffer
    context = FilterContext(saved.trainer.policy, buffer.round, saved.trainer.config.batch_size, trusted=_trusted(saved))
    scores = InfluenceScorer(advantage_norm="batch", seed=derived_seed(buffer.round, 0, 7)).scores(buffer, context)
    return -scores.double().numpy() if scores is not None else np.zeros(len(buffer))


def _gradient_families(saved: SavedRound) -> dict[str, np.ndarray]:
    """influence, influence-chunk and dtv from one pass (``return_and_alignment_scores``), the records
    in the order IIF's scorer draws for the round (``InfluenceScorer`` seeded by it), so that
    influence-chunk's chunks are IIF's; a family whose target has no gradient scores 0."""
    buffer = saved.buffer
    order = torch.randperm(len(buffer), generator=torch.Generator().manual_seed(derived_seed(buffer.round, 0, 7)))
    obs, actions, advantages = (buffer.flat(k)[order] for k in ("obs", "actions", "advantages"))
    scores = return_and_alignment_scores(saved.trainer.policy, obs, actions, advantages, saved.trainer.config.batch_size)
    harm = {}
    for family, name in (("influence", "batch"), ("influence-chunk", "chunk"), ("dtv", "alignment")):
        harm[family] = np.zeros(len(buffer))
        if scores[name] is not None:
            harm[family][order.numpy()] = -scores[name].double().numpy()
    return harm


def _tracin(saved: SavedRound) -> np.ndarray:
    from rlinfluence.analysis.validation import score_round

    if saved.tracin is not None:  # recorded inside the round's update: the same sum, no replay
        return -saved.tracin.double().numpy()
    try:
        return -score_round(saved, ReturnTarget(), "full", 0).double().numpy()
    except ZeroTargetGradient:
        return np.zeros(len(saved.buffer))


def _random(saved: SavedRound) -> np.ndarray:
    """Uniform draws, seeded by the round and a checksum of the buffer's actions: reproducible,
    and different for every run and round (a seed of the round alone would repeat across runs)."""
    buffer = saved.buffer
    checksum = zlib.crc32(buffer.flat("actions").numpy().tobytes())
    return np.random.default_rng([buffer.round, checksum]).random(len(buffer))


GROUPS: dict[tuple[str, ...], Callable[[SavedRound], dict[str, np.ndarray]]] = {
    GRADIENT_FAMILIES: _gradient_families,
    STATISTICS: lambda saved: statistic_scores(saved.buffer, saved.trainer.config.gamma),
    CHECKS: lambda saved: consistency_scores(saved.trainer.policy, saved.buffer, action_count(saved.trainer.policy)),
}
"""Families scored together, from work they share (one gradient pass; one forward and the fits of the checks)."""


def _member(group: tuple[str, ...], name: str) -> Scorer:
    return lambda saved: GROUPS[group](saved)[name]


SCORERS: dict[str, Scorer] = {
    "influence": _member(GRADIENT_FAMILIES, "influence"),
    "influence-trusted": _influence_trusted,
    "influence-chunk": _member(GRADIENT_FAMILIES, "influence-chunk"),
    "tracin": _tracin,
    "dtv": _member(GRADIENT_FAMILIES, "dtv"),
    **{name: _member(STATISTICS, name) for name in STATISTICS},
    "random": _random,
}


def scorers_of(trusted_envs: int) -> list[str]:
    """The scorers a run can use (influence-trusted needs trusted envs), the consistency checks included."""
    return [s for s in SCORERS if trusted_envs or s != "influence-trusted"] + list(CHECKS)


def harm_table(saved: SavedRound, scorers: Sequence[str]) -> pd.DataFrame:
    """One row per record of a saved round (module docstring), a column per scorer or check; the
    families of a ``GROUPS`` entry scored once for all of them."""
    buffer = saved.buffer
    grouped = {name: scores for group, score in GROUPS.items() if set(scorers) & set(group)
               for name, scores in score(saved).items()}
    ids = buffer.record_ids().numpy()
    table = pd.DataFrame({"round": ids[:, 0], "source": ids[:, 1], "episode": buffer.flat("episode_ids").numpy(),
                          "step": ids[:, 2], "trusted": _trusted(saved).numpy()})
    if saved.trainer.config.corrupt:
        table["corrupted"] = buffer.flat("corrupted").numpy()
    for name in scorers:
        table[name] = grouped[name] if name in grouped else SCORERS[name](saved)
    return table
